"""The one path from a program call to its launches, for eager calls and the op alike.

A call signature (the graph; shape, strides, dtype and device of q, k, v, kv_lens, block_table and every
runtime input; the gradients wanted; the call's flags, ``kv_layout`` among them) decides everything but
the tensors' values: the checks, the kernels, the path (split-KV decoding, a fused or hoisted forward, a
backward). ``planned`` decides it once per signature, as a ``Call``; a warm call is a lookup in one bounded
cache, then launches.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import torch

from .. import ir
from ..errors import InputError, UnsupportedError
from ..lru import LRUCache
from . import compiled
from .call import Call
from .decode import MAX_QUERIES
from . import fp8 as float8
from .gradients import check_differentiable, tensor_grads
from .hoisted import worth_hoisting
from .inputs import (
    Positions,
    check_cache,
    check_input_names,
    check_inputs,
    check_positions,
    kernel_config,
    kv_cache,
    wide_positions,
)
from .kv_layout import check_kv_layout, head_second
from .offsets import inputs_fit
from .dropout import call_dropout, check_dropout_p, refuse_dropout_with
from .packed import Packed, check_packed, check_values, refuse_arguments, refuse_program
from .plugin_args import check_takes_offsets
from .validate import check_call_values

# A model runs a few signatures per program (dtype, head dims, gradients, decoding) and one per sequence
# length: least recently used dropped first (``lru.py``). A call holds its program's kernels, which every
# call of that program and configuration shares (``compiled.compiled``): they live while one is cached.
MAX_CALLS = 4096
_calls: LRUCache[tuple, Call] = LRUCache(MAX_CALLS)


def clear_cache() -> None:
    """Forget every call and compiled kernel, e.g. after registering a plugin with new tile rules."""
    _calls.clear()
    compiled.forget()


def keeps_lse(graph: ir.MatMulPV, return_lse: bool) -> bool:
    """Whether the program's normaliser has a log-sum-exp; an InputError when ``return_lse`` asks for one
    it has not."""
    has_lse = graph.has_lse
    if return_lse and not has_lse:
        raise InputError(
            f"return_lse=True needs a normaliser with a log-sum-exp; "
            f"{graph.weights.apply.combinator} has none (softmax has)"
        )
    return has_lse


def wanted_grads(q: Any, k: Any, v: Any, inputs: dict[str, Any]) -> tuple[str, ...] | None:
    """None when autograd wants no gradient of a call; else the runtime inputs (by name) it wants them of."""
    if not (
        torch.is_grad_enabled()
        and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *inputs.values()))
    ):
        return None
    return tuple(n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad)


def run_attention(
    graph: ir.MatMulPV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inputs: dict[str, Any] | None = None,
    *,
    return_lse: bool = False,
    kv_lens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    split_kv: bool | None = None,
    validate: bool = True,
    q_offset: int | None = None,
    k_offset: int | None = None,
    seq_len: int | None = None,
    kv_layout: str | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
):
    """Run a traced program on q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV).

    Differentiable (q, k, v and declared tensor inputs) when autograd asks for gradients.

    :param inputs: runtime inputs (bias, cos/sin tables, ...) by argument name of the traced function: each
        one the graph reads (``ir.input_names``), else an InputError naming it; others are ignored.
    :param kv_lens: (B,) int32 (or int64) keys per sequence, each in [0, capacity] (Nk, or a paged cache's
        max_pages * page_size); query i of sequence b sits at position i + kv_lens[b] - Nq.
    :param block_table: (B, max_pages) int32 (or int64) page indices, for a paged cache: k, v are then
        pools in ``kv_layout`` and kv_lens is required.
    :param kv_layout: a paged cache's pool layout: "NHD", pools (pages, page_size, Hkv, D) (AttnFuse's), or
        "HND", pools (pages, Hkv, page_size, D) (FlashInfer's and vLLM's), read through strides with no
        copy. None (default) reads "NHD" but refuses, with an InputError, pools whose shape both layouts
        would read with a head count dividing Hq. Only with block_table.
    :param split_kv: run the split-KV decoding path (None: when Nq <= 16, no gradient is wanted and the
        normaliser can combine splits).
    :param validate: with ``kv_lens``, check their values (and a paged cache's table): every length in
        [0, capacity] (and at most 2**31 - 1), every block_table entry a sequence uses (its first
        ceil(kv_lens[b] / page_size)) a page of the pool; entries past those may hold anything. One small
        kernel in the call's stream records the first bad entry in the device's error record, with no host
        sync (so it also runs inside a CUDA graph capture, at every replay). The ``InputError`` naming it is
        raised by the call itself on CPU; on CUDA asynchronously, like CUDA's own errors: by a later call
        with ``kv_lens`` once the record's copy has reached the host, or by ``attnfuse.check_errors()``,
        which waits for it.
        ``validate=False`` skips the check (a server that checks upstream): lengths outside [0, capacity]
        then count as the nearest bound (no key past the capacity is ever read), and keys on a page
        outside the pool are absent (the kernels never read outside the pool, validated or not).
    :param q_offset: the position of query 0 (query i at q_offset + i) and ``k_offset`` that of key 0 (key
        j at k_offset + j): a chunk of a longer sequence (chunked prefill, a shard of context parallelism).
        Either given, the other defaults to 0; not with kv_lens or block_table. Masks, position biases and
        rotations follow these positions; tensors a plugin indexes by query and key (additive_bias's
        bias, a BlockMask) still follow the call's indices. None (default): key j at j, query i at
        i + Nk - Nq. Runtime values: a new offset compiles nothing.
    :param seq_len: with offsets, the sequence's length (default: the last position plus one), what
        fragments read as the number of keys (relu_attention divides by it).
    :param cu_seqlens_q: packed sequences (FlashAttention's varlen call): q (1, Hq, total_q, D), k and v (1,
        Hkv, total_k, D/DV) hold documents one after another, document i at rows cu_seqlens_q[i] ..
        cu_seqlens_q[i + 1] of q and cu_seqlens_k[i] .. cu_seqlens_k[i + 1] of k and v; both (docs + 1,)
        int32 or int64 on q's device, starting at 0, never decreasing, ending at total_q (total_k). Each
        document attends within itself, at positions local to it (its queries bottom-right aligned to its
        keys, as a call with its rows alone). Any strides (FlashAttention's (total, H, D) tensors as
        ``t.transpose(0, 1)[None]``, with no copy). The values are checked on the device as ``validate`` says
        for kv_lens. A tensor indexed by query and key (q_idx, k_idx in a fragment whose combinator declares
        packed_rows) is indexed by packed rows: (1, H, total_q, total_k). Not with kv_lens, block_table,
        q_offset/k_offset/seq_len or split_kv, nor for programs with block masks or another combinator reading
        q_idx or k_idx, nor with gradients of runtime inputs
        but a qk transform's tensor's and a score modification's score-shaped one (UnsupportedError).
    :param max_seqlen_q: with packed sequences, the longest document's query count (and ``max_seqlen_k``
        its key count), optional; a document longer than one given is an InputError (checked on the device).
    :param q_descale: with float8 q, k, v (torch.float8_e4m3fn or torch.float8_e5m2, all three alike): the
        float32 factors that dequantise q (and ``k_descale``, ``v_descale`` k and v), each of shape (1,) (per
        tensor) or (B, Hkv) (per batch and kv head; a query head takes its kv group's), FlashAttention-3's.
        The call computes as with q · q_descale, k · k_descale, v · v_descale: float32 scores, P·V with P
        rounded to bfloat16 (``fp8.py``). Required with float8 inputs, refused with others (InputError).
        Forward only: no gradient, split-KV decoding, paged cache or packed sequences (UnsupportedError).
    :param out_dtype: a float8 call's output dtype: torch.bfloat16 (default), torch.float16 or torch.float32.
    :param dropout_p: attention dropout, SDPA's meaning (``runtime/dropout.py``): each weight zeroed with
        probability p, the others scaled by 1 / (1 - p), after normalisation (lse is the undropped one's). A
        Python number in [0, 1), else an InputError. With p > 0 the call first draws its dropout state from
        the device's default generator (``torch.manual_seed`` repeats it); not with block_table, packed
        sequences or split_kv=True (UnsupportedError). 0 (default): no dropout, the kernels of a call without.
    :return: out (B, Hq, Nq, DV), or (out, lse) with lse (B, Hq, Nq) float32 when ``return_lse``.
    """
    inputs = inputs or {}
    positions = packed = fp8 = None
    dropping = check_dropout_p(dropout_p) > 0.0
    asked = q_descale is not None or k_descale is not None or v_descale is not None or out_dtype is not None
    if asked or float8.is_fp8(q):
        layout = check_inputs(q, k, v, paged=block_table is not None, kv_layout=kv_layout)
        kv_heads = k.shape[1] if block_table is None else head_second(k, layout).shape[1]
        descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
        fp8 = float8.check_fp8(q, k, v, descales, out_dtype, kv_heads)
    if any(a is not None for a in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)):
        refuse_arguments(
            {
                "kv_lens": kv_lens is not None,
                "block_table": block_table is not None,
                "q_offset": q_offset is not None,
                "k_offset": k_offset is not None,
                "seq_len": seq_len is not None,
                "split_kv=True (decoding)": bool(split_kv),
            }
        )
        check_inputs(q, k, v)
        packed = check_packed(q, k, cu_seqlens_q, cu_seqlens_k)
    if q_offset is not None or k_offset is not None or seq_len is not None:
        check_inputs(q, k, v, paged=block_table is not None, kv_layout=kv_layout)
        positions = check_positions(q_offset, k_offset, seq_len, q.shape[2], k.shape[2], kv_lens, block_table)
    call = planned(
        graph,
        q,
        k,
        v,
        inputs,
        kv_lens,
        block_table,
        return_lse=return_lse,
        grads=wanted_grads(q, k, v, inputs),
        split_kv=split_kv,
        positions=positions,
        kv_layout=kv_layout,
        packed=packed,
        fp8=fp8 is not None,
        dropout=dropping,
    )
    dropout = call_dropout(dropout_p, q.device)  # after every check: a refused call draws nothing
    check_call_values(k, kv_lens, block_table, kv_layout=call.kv_layout, validate=validate)
    if packed is not None:
        check_values(packed, q.shape[2], k.shape[2], max_seqlen_q, max_seqlen_k, validate)
    out, lse = call(q, k, v, inputs, kv_lens, block_table, positions, packed, fp8, dropout)
    return (out, lse) if return_lse else out


def planned(
    graph: ir.MatMulPV,
    q: Any,
    k: Any,
    v: Any,
    inputs: dict[str, Any],
    kv_lens: Any,
    block_table: Any,
    *,
    return_lse: bool,
    grads: tuple[str, ...] | None,
    split_kv: bool | None,
    positions: Positions | None = None,
    kv_layout: Any = None,
    packed: Packed | None = None,
    fp8: bool = False,
    dropout: bool = False,
) -> Call:
    """The call's ``Call``, decided once per call signature. ``grads``: None when no gradient is wanted,
    else the runtime inputs whose gradients are (``wanted_grads``). ``positions``: the call's, checked,
    whose presence matters here, and whether they need int64 kernels (the kernels take their values as runtime
    ints). ``kv_layout``: as the caller named it (``kv_layout.check_kv_layout``). ``packed``: the call's document
    offsets (checked), whose dtypes matter here. ``fp8``: the call gives float8 inputs' descales (checked:
    ``fp8.check_fp8``); float8 inputs without are refused. ``dropout``: the call has attention dropout (p > 0)."""
    check_kv_layout(kv_layout, block_table is not None)  # a valid key before the lookup
    placed = None if positions is None else wide_positions(0, 0, positions)
    signature = (
        graph,
        _meta(q),
        _meta(k),
        _meta(v),
        _meta(kv_lens),
        _meta(block_table),
        tuple([(name, _meta(value)) for name, value in inputs.items()]) if inputs else (),
        return_lse,
        grads,
        split_kv,
        torch.backends.cuda.matmul.allow_tf32,
        placed,
        kv_layout,
        None if packed is None else (packed.cu_q.dtype, packed.cu_k.dtype),
        fp8,
        dropout,
    )
    call = _calls.get(signature)
    if call is None:
        call = _calls.get_or_build(
            signature,
            lambda: _decide(
                graph,
                q,
                k,
                v,
                inputs,
                kv_lens,
                block_table,
                return_lse,
                grads,
                split_kv,
                positions,
                kv_layout,
                packed,
                fp8,
                dropout,
            ),
        )
    return call


class _Invalid:
    """Stands for an argument that is neither a tensor nor a runtime input (a ``BlockMask``) in a call
    signature: equal to no other, so its call is checked (and raises) every time."""


def _meta(t: Any) -> Any:
    """What a call signature keeps of an argument: a tensor's metadata, a runtime input's type."""
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return None if t is None else type(t) if getattr(t, "__attnfuse_runtime_input__", False) else _Invalid()


def _decide(
    graph: ir.MatMulPV,
    q: Any,
    k: Any,
    v: Any,
    inputs: dict[str, Any],
    kv_lens: Any,
    block_table: Any,
    return_lse: bool,
    grads: tuple[str, ...] | None,
    split_kv: bool | None,
    positions: Positions | None,
    kv_layout: str | None,
    packed: Packed | None = None,
    fp8: bool = False,
    dropout: bool = False,
) -> Call:
    """Check a new call signature and choose its kernels: the split-KV kernel if it takes that path, else
    its forward (hoisted when worth it) and, with gradients wanted, the backward writing them. A call that
    gives its positions never takes the split-KV path (its kernel places queries bottom-right), nor does a
    packed call, which is never hoisted either (the passes place rows by their index in the call). A call with
    ``dropout`` never takes the split-KV path (its kernel has no dropout) nor a paged cache or packed sequences."""
    kv = check_cache(q, k, v, kv_lens, block_table, kv_layout)._replace(positions=positions, packed=packed)
    check_input_names(graph, inputs)
    if dropout:
        refuse_dropout_with(paged=block_table is not None, split_kv=bool(split_kv))
    has_lse = keeps_lse(graph, return_lse)
    if grads is not None and block_table is not None:
        raise InputError("gradients through a paged cache are not supported; pass contiguous k and v to train")
    config = kernel_config(q, kv, return_lse or (grads is not None and has_lse), not inputs_fit(inputs), dropout)
    program = compiled.compiled(graph, config)
    plan = program.plan
    if positions is not None:
        check_takes_offsets(plan)
    if packed is not None:
        refuse_program(plan, grads)
    if float8.is_fp8(q):
        return _fp8_call(program, kv, grads, split_kv, fp8)
    can_split = grads is None and plan.combine is not None and not plan.partial and positions is None
    can_split = can_split and packed is None and not dropout
    if split_kv is None:
        split_kv = can_split and q.shape[2] <= MAX_QUERIES
    elif split_kv and not can_split:
        raise InputError(
            "the split-KV path has no backward, needs a normaliser that can combine splits (and "
            "declares no partial fragment), and takes no q_offset or k_offset"
        )
    if split_kv:
        return Call(program, decode=program.decode, kv_layout=kv.kv_layout)
    gradients = ()
    if grads is not None:
        check_differentiable(plan)
        gradients = tensor_grads(plan, inputs, grads, (*q.shape[:3], kv.capacity), q.shape[3]) if grads else ()
    if worth_hoisting(program.forward, q.shape[2]):
        return Call(
            program,
            forward=program.hoisted,
            grads=_names(gradients),
            kv_layout=kv.kv_layout,
            build_backward=partial(program.hoisted_backward, gradients) if grads is not None else None,
        )
    return Call(
        program,
        forward=program.forward,
        grads=_names(gradients),
        kv_layout=kv.kv_layout,
        build_backward=partial(program.backward, gradients) if grads is not None else None,
    )


def _fp8_call(program: compiled.Compiled, kv: Any, grads: Any, split_kv: bool | None, fp8: bool) -> Call:
    """A float8 call's ``Call``: the generated forward kernel, never hoisted (``fp8.py`` names what it refuses)."""
    if not fp8:
        raise InputError(
            "float8 q, k, v need q_descale, k_descale and v_descale, float32 tensors of shape (1,) or (B, Hkv), "
            "given to the program's call (attnfuse.run_attention); this path takes none"
        )
    if grads is not None:
        raise UnsupportedError(
            "float8 calls have no backward: compute them under torch.no_grad() (or with inputs that do not "
            "require grad), or train in bfloat16"
        )
    if split_kv:
        float8.refuse("the split-KV decoding path (split_kv=True)")
    refused = program.plan.refuses_fp8
    if refused is not None:
        raise UnsupportedError(
            f"{refused} reads q or k values in its fragment and does not declare runs_on_fp8=True, so float8 "
            f"calls refuse it (docs/writing-a-combinator.md: runs_on_fp8); dequantise q and k to bfloat16 for it"
        )
    return Call(program, forward=program.forward, kv_layout=kv.kv_layout)


def _names(gradients: tuple) -> tuple[str, ...]:
    """The runtime arguments of ``gradients`` (``InputGradient``), once each, in order."""
    return tuple(dict.fromkeys(g.argument for g in gradients))


def hoisted_sides(
    graph: ir.MatMulPV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lens: Any,
    save_lse: bool,
    inputs_wide: bool,
) -> tuple[str, ...]:
    """The sides ("q", "k") a differentiable call with a contiguous cache keeps transformed copies of (its
    qk transforms hoisted into passes), from its metadata alone (head dims specialised): for the op's
    outputs' metadata."""
    config = kernel_config(q, kv_cache(k, v, kv_lens, None), save_lse, inputs_wide)
    config = attrs.evolve(
        config, head_dim=int(config.head_dim), head_dim_v=int(config.head_dim_v), group=int(config.group)
    )
    program = compiled.compiled(graph, config)
    return program.plan.kernels["transform"].sides if worth_hoisting(program.forward, q.shape[2]) else ()
