"""The table suites: forward, forward+backward, decoding, block-sparse and packed documents, one Row per case.

Every AttnFuse result is checked against a baseline on the same inputs (Row.err). AttnFuse and the
hand-written FA2 kernel (forward), and AttnFuse and flex (forward+backward), are timed in turns. RoPE
baselines attend with q and k pre-rotated by a compiled function, and that time is included.
"""

from __future__ import annotations

import contextlib
import itertools

import attrs
import torch

import attnfuse as af

from . import rows
from .baselines import (
    SDPA_BACKENDS,
    failure,
    flash3_fp8,
    flash_varlen,
    flex,
    flex_block_mask,
    flex_case,
    flex_document_mask,
    pre_rotate,
    sdpa,
    sdpa_dropout,
)
from .cases import (
    DECODE_MODELS,
    DROPOUT_NS,
    DROPOUT_P,
    FP8_CASES,
    FP8_KINDS,
    GEOMETRIES,
    PACKED_VARIANTS,
    PER_TILE,
    PROGRAMS,
    SPARSE_BLOCK,
    bigbird_blocks,
    bigbird_program,
    decode_program,
    packed_lengths,
    packed_rope_causal,
    rope_tables,
)
from .timing import bench, bench_graphed, paired_bench


def max_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return (ours.float() - theirs.float()).abs().max().item()


@contextlib.contextmanager
def keys_rotated_per_tile():
    """RoPE as the fused kernel alone does it: every key tile rotated in the key loop (no key pass)."""
    from attnfuse.runtime import hoisted, launch

    saved, hoisted.HOIST_MIN_QUERY_BLOCKS = hoisted.HOIST_MIN_QUERY_BLOCKS, 10**9
    launch.clear_cache()
    try:
        yield
    finally:
        hoisted.HOIST_MIN_QUERY_BLOCKS = saved
        launch.clear_cache()


def time_sdpa(row: rows.Row, reference: torch.Tensor, timer, fn_of_backend, pick=lambda out: out) -> None:
    """Time SDPA's cuDNN and FA2 backends into ``row``; a backend that refuses the case gets "n/a"."""
    for name in SDPA_BACKENDS:
        try:
            fn = fn_of_backend(name)
            row.err = max_diff(reference, pick(fn()))
            row.times[name] = timer(fn)
        except RuntimeError as exc:
            row.times[name] = failure(exc)


def forward_case(geometry: str, N: int, variant: str, q, k, v, cos, sin) -> rows.Row:
    """``variant``: a PROGRAMS name, or PER_TILE (rope_causal with no key pass)."""
    if variant == PER_TILE:
        with keys_rotated_per_tile():
            timed = forward_case(geometry, N, "rope_causal", q, k, v, cos, sin)
        return attrs.evolve(rows.forward_row(geometry, N, variant), times=timed.times, err=timed.err)
    _, Hq, _, _ = GEOMETRIES[geometry]
    program, rope = PROGRAMS[variant], variant == "rope_causal"

    def inputs():
        return pre_rotate(q, k, cos, sin) if rope else (q, k)

    out = program(q, k, v)
    row = rows.forward_row(geometry, N, variant)
    if variant in ("dense", "causal"):  # the hand-written kernel timed in turns with ours
        from .fa2_triton import fa2_forward

        fn = lambda: fa2_forward(q, k, v, variant == "causal")  # noqa: E731
        row.times.update(paired_bench({"attnfuse": lambda: program(q, k, v), "fa2_triton": fn}))
        row.err = max_diff(out, fn())
    else:
        row.times["attnfuse"] = bench(lambda: program(q, k, v))
    if variant in ("dense", "causal", "rope_causal"):
        time_sdpa(row, out, bench, lambda name: lambda: sdpa(name, *inputs(), v, variant != "dense"))
    score_mod, mask = flex_case(variant, Hq, N, "cuda")
    fn = lambda: flex(*inputs(), v, score_mod=score_mod, block_mask=mask, enable_gqa=True)  # noqa: E731
    if row.err is None:
        row.err = max_diff(out, fn())
    row.times["flex"] = bench(fn)
    return row


def backward_case(geometry: str, N: int, variant: str, leaves, dout, cos, sin) -> rows.Row:
    """Forward + backward (dq, dk, dv); the dq checked against a baseline's on the same inputs."""
    _, Hq, _, _ = GEOMETRIES[geometry]
    q, k, v = leaves
    program, rope = PROGRAMS[variant], variant == "rope_causal"

    def train(attend):
        return lambda: torch.autograd.grad(attend(), leaves, dout)

    def inputs():
        return pre_rotate(q, k, cos, sin) if rope else (q, k)

    ours = train(lambda: program(q, k, v))
    dq = ours()[0]
    row = rows.backward_row(geometry, N, variant)
    if variant in ("causal", "rope_causal"):
        time_sdpa(row, dq, bench, lambda name: train(lambda: sdpa(name, *inputs(), v, True)), lambda g: g[0])
    score_mod, mask = flex_case(variant, Hq, N, "cuda")
    fn = train(lambda: flex(*inputs(), v, score_mod=score_mod, block_mask=mask, enable_gqa=True))
    if row.err is None:
        row.err = max_diff(dq, fn()[0])
    row.times.update(paired_bench({"attnfuse": ours, "flex": fn}))  # in turns: small steps measure the host too
    return row


def forward_cases(Ns: list[int], geometries: list[str], variants: list[str]):
    for geometry in geometries:
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        for N in Ns:
            q, k, v = (torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
            cos, sin = rope_tables(N, D, "cuda")
            for variant in variants:
                yield forward_case, (geometry, N, variant, q, k, v, cos, sin)


def backward_cases(Ns: list[int], geometries: list[str], variants: list[str]):
    for geometry in geometries:
        B, Hq, Hkv, D = GEOMETRIES[geometry]
        for N in Ns:
            leaves = [
                torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)
            ]
            dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
            cos, sin = rope_tables(N, D, "cuda")
            for variant in variants:
                yield backward_case, (geometry, N, variant, leaves, dout, cos, sin)


def decode_case(model: str, B: int, graphed: bool) -> rows.Row:
    """``graphed``: every contender replayed from a CUDA graph (no host time); else eager calls, host
    time included wherever it exceeds the GPU's."""
    Hq, Hkv, D, N = DECODE_MODELS[model]
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = decode_program(q, k, v)
    timer = bench_graphed if graphed else bench
    row = rows.decode_row(model, B, graphed)
    row.times["attnfuse"] = timer(lambda: decode_program(q, k, v))
    time_sdpa(row, out, timer, lambda name: lambda: sdpa(name, q, k, v, False))
    fn = lambda: flex(q, k, v, enable_gqa=True)  # noqa: E731
    if row.err is None:
        row.err = max_diff(out, fn())
    try:
        row.times["flex"] = timer(fn)
    except Exception as exc:  # compiled flex may refuse graph capture
        row.times["flex"] = failure(exc)
    return row


def decode_cases(batches: tuple[int, ...] = (1, 8)):
    for graphed in (False, True):
        for model in DECODE_MODELS:
            for B in batches:
                yield decode_case, (model, B, graphed)


def sparse_case(N: int, train: bool) -> rows.Row:
    """BigBird, Llama-3-8B geometry, against flex_attention with the same block grid."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    active = bigbird_blocks(B, Hq, N)
    ours_mask = af.BlockMask.from_blocks(active, N, N, block_size=SPARSE_BLOCK)
    theirs_mask = flex_block_mask(active)
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=train) for h in (Hq, Hkv, Hkv)]
    q, k, v = leaves
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)

    def run(attend):
        return (lambda: torch.autograd.grad(attend(), leaves, dout)[0]) if train else attend

    ours = run(lambda: bigbird_program(q, k, v, ours_mask))
    theirs = run(lambda: flex(q, k, v, block_mask=theirs_mask, enable_gqa=True))
    pairs_kept = int(active.sum().item()) * SPARSE_BLOCK**2 // (B * Hq)
    row = rows.sparse_row(N, train, 1 - active.float().mean().item(), pairs_kept)
    row.times.update(attnfuse=bench(ours), flex=bench(theirs))
    row.err = max_diff(ours(), theirs())
    return row


def sparse_cases(Ns: tuple[int, ...] = (4096, 16384)):
    for train in (False, True):
        for N in Ns:
            yield sparse_case, (N, train)


def packed_case(variant: str, train: bool) -> rows.Row:
    """One row of documents (``packed_lengths``) at Llama-3-8B geometry, causal within each document (RoPE at
    each document's own positions for rope_causal), against flex_attention's document mask and FlashAttention's
    varlen function (where installed) on the same inputs. A GPU other than sm90 runs packed calls only with
    ``ATTNFUSE_PACKED_ON_GPU=1`` (``runtime/packed.py``)."""
    _, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    lengths = packed_lengths()
    total, longest = sum(lengths), max(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
    starts = torch.repeat_interleave(cu[:-1], torch.tensor(lengths, device="cuda"), output_size=total)
    positions = torch.arange(total, device="cuda") - starts  # each document's own, from 0
    leaves = [
        torch.randn(1, h, total, D, device="cuda", dtype=torch.bfloat16, requires_grad=train) for h in (Hq, Hkv, Hkv)
    ]
    q, k, v = leaves
    dout = torch.randn(1, Hq, total, D, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_tables(total, D, "cuda")  # rows by position: a packed call needs total_k of them
    rope = variant == "rope_causal"
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)

    def inputs():
        return pre_rotate(q, k, cos[positions], sin[positions]) if rope else (q, k)

    def run(attend):
        return (lambda: torch.autograd.grad(attend(), leaves, dout)[0]) if train else attend

    def attend():
        return packed_rope_causal(q, k, v, cos, sin, **packed) if rope else PROGRAMS[variant](q, k, v, **packed)

    ours = run(attend)
    mask = flex_document_mask(cu)
    theirs = run(lambda: flex(*inputs(), v, block_mask=mask, enable_gqa=True))
    row = rows.packed_row(variant, train, lengths)
    row.times.update(paired_bench({"attnfuse": ours, "flex": theirs}))
    row.err = max_diff(ours(), theirs())
    varlen = flash_varlen()
    if varlen is None:
        row.times["fa_varlen"] = "n/a (flash_attn not installed)"
        return row

    def flash():  # FlashAttention's (total, heads, D) layout: views of the same rows
        rows_of = [t[0].transpose(0, 1) for t in (*inputs(), v)]
        out = varlen(*rows_of, cu, cu, longest, longest, causal=True)
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)[None]

    try:
        row.times["fa_varlen"] = bench(run(flash))
    except RuntimeError as exc:
        row.times["fa_varlen"] = failure(exc)
    return row


def packed_cases():
    for train in (False, True):
        for variant in PACKED_VARIANTS:
            yield packed_case, (variant, train)


def quantised(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fp8: torch.dtype = torch.float8_e4m3fn
) -> tuple[tuple, tuple, dict]:
    """q (B, Hq, N, D), k, v (B, Hkv, N, D) float32 -> their float8 values (``fp8``), those values dequantised
    to bfloat16, and the call's descales: ``q_descale``, ``k_descale``, ``v_descale`` (B, Hkv) float32, each the
    amax of its kv group's rows over ``fp8``'s largest value (a group's query heads share q's)."""
    B, Hq, N, D = q.shape
    Hkv = k.shape[1]
    grouped = (q.reshape(B, Hkv, Hq // Hkv * N, D), k, v)
    descales = [t.abs().amax((2, 3)) / torch.finfo(fp8).max for t in grouped]
    per_head = (descales[0].repeat_interleave(Hq // Hkv, 1), descales[1], descales[2])
    low = tuple((t / d[..., None, None]).to(fp8) for t, d in zip((q, k, v), per_head))
    dequantised = tuple((t.float() * d[..., None, None]).to(torch.bfloat16) for t, d in zip(low, per_head))
    return low, dequantised, dict(zip(("q_descale", "k_descale", "v_descale"), descales))


def fp8_case(variant: str, kind: str, N: int) -> rows.Row:
    """Llama-3-8B forward of ``variant`` (causal, dense) at N: AttnFuse on float8 q, k, v (``kind``: e4m3, e5m2)
    with per-(batch, kv head) descales, against SDPA (cuDNN, FA2) in bfloat16 on the same values dequantised, and
    FlashAttention-3's float8 forward where installed. A GPU other than sm90 runs float8 calls only with
    ``ATTNFUSE_FP8_ON_GPU=1`` (``runtime/fp8.py``)."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    raw = (torch.randn(B, h, N, D, device="cuda") for h in (Hq, Hkv, Hkv))
    (q8, k8, v8), (qd, kd, vd), scales = quantised(*raw, FP8_KINDS[kind])

    def ours():
        return PROGRAMS[variant](q8, k8, v8, **scales)

    causal = variant == "causal"
    out = ours()
    row = rows.fp8_row(variant, kind, N)
    row.times["attnfuse"] = bench(ours)
    time_sdpa(row, out, bench, lambda name: lambda: sdpa(name, qd, kd, vd, causal))
    flash = flash3_fp8()
    if flash is None:
        row.times["fa3_fp8"] = "n/a (flash_attn_interface not installed)"
        return row
    rows_first = [t.transpose(1, 2).contiguous() for t in (q8, k8, v8)]  # FlashAttention's (B, N, H, D)
    try:
        row.times["fa3_fp8"] = bench(lambda: flash(*rows_first, causal=causal, **scales))
    except RuntimeError as exc:
        row.times["fa3_fp8"] = failure(exc)
    return row


def fp8_cases():
    for case in FP8_CASES:
        yield fp8_case, case


def replayed_error(q, k, v, out, state, p: float) -> float:
    """The max abs difference of ``out``'s first (batch, head) from causal attention of its rows in float32 with
    the call's dropout mask replayed (``af.dropout_keep`` of ``state``: the first (batch, head)'s numbers are a
    (1, 1, N, N) call's)."""
    N, D = q.shape[2], q.shape[3]
    keep = af.dropout_keep(state, p, (1, 1, N, N))[0, 0]
    s = (q[0, 0].float() @ k[0, 0].float().T) * D**-0.5
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    want = (torch.softmax(s, -1) * keep / (1 - p)) @ v[0, 0].float()
    return max_diff(out[0, 0], want)


def dropout_case(N: int) -> rows.Row:
    """Llama-3-8B causal forward + backward at N with attention dropout, against SDPA's (cuDNN, FA2) on the same
    inputs (their masks are their own: the check is AttnFuse's output against its replayed mask, ``err``).
    A GPU other than sm90 runs dropout only with ``ATTNFUSE_DROPOUT_ON_GPU=1`` (``runtime/dropout.py``)."""
    B, Hq, Hkv, D = GEOMETRIES["llama3-8b"]
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    q, k, v = leaves
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    program = PROGRAMS["causal"]
    state = torch.cuda.get_rng_state()
    out = program(q, k, v, dropout_p=DROPOUT_P)
    torch.cuda.set_rng_state(state)
    row = rows.dropout_row(N, DROPOUT_P)
    row.err = replayed_error(q.detach(), k.detach(), v.detach(), out.detach(), af.dropout_state(q.device), DROPOUT_P)

    def train(attend):
        return lambda: torch.autograd.grad(attend(), leaves, dout)

    row.times["attnfuse"] = bench(train(lambda: program(q, k, v, dropout_p=DROPOUT_P)))
    for name in SDPA_BACKENDS:
        try:
            row.times[name] = bench(train(lambda name=name: sdpa_dropout(name, q, k, v, DROPOUT_P)))
        except RuntimeError as exc:
            row.times[name] = failure(exc)
    return row


def dropout_cases():
    for N in DROPOUT_NS:
        yield dropout_case, (N,)
