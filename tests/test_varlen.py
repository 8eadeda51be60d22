"""Packed sequences (cu_seqlens_q, cu_seqlens_k) through the generated kernels: each document attends within
itself at local positions, checked against every document run on its own through ``program.reference`` in
float64 (forward and dq, dk, dv); bad offsets and unsupported combinations get errors naming the argument."""

import json
import warnings

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.examples import alibi, gpt2, llama, relu
from attnfuse.runtime import kernel as kernel_module


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def window(q, k, v):
    s = af.sliding_window(af.scaled_dot_product(q, k), left=3, right=2)
    return af.softmax(s) @ v


@af.attention
def rope_dense(q, k, v):
    return af.softmax(af.rope(q, k)) @ v


@af.attention
def sinks(q, k, v, sinks):
    return af.softmax_with_sinks(af.causal(af.scaled_dot_product(q, k)), sinks) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def offsets(lengths, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def packed(lq, lk, Hq=2, Hkv=2, D=16, dtype=torch.float32, cu_dtype=torch.int32):
    """q (1, Hq, sum(lq), D), k, v (1, Hkv, sum(lk), D) requiring grad, and their offsets."""
    q = torch.randn(1, Hq, sum(lq), D, dtype=dtype, requires_grad=True)
    k = torch.randn(1, Hkv, sum(lk), D, dtype=dtype, requires_grad=True)
    v = torch.randn(1, Hkv, sum(lk), D, dtype=dtype, requires_grad=True)
    return q, k, v, offsets(lq, cu_dtype), offsets(lk, cu_dtype)


def reference(program, q, k, v, cu_q, cu_k, *extra):
    """Each document through ``program.reference`` on its own (float64), concatenated along the rows; a
    document with no keys gives zeros, as a call with no keys does."""
    outs = []
    for i in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if keys.stop == keys.start:
            outs.append(torch.zeros_like(q[:, :, rows], dtype=torch.float64) * v.sum())
        elif rows.stop > rows.start:
            outs.append(program.reference(q[:, :, rows], k[:, :, keys], v[:, :, keys], *extra))
    return torch.cat(outs, 2)


MIXED = ([5, 0, 1, 17, 9, 2], [5, 3, 1, 20, 4, 0])  # lengths 0 and 1, Nq_i > Nk_i and Nq_i < Nk_i


def check(program, lq, lk, *extra, Hq=2, Hkv=2, cu_dtype=torch.int32, grads=True):
    q, k, v, cu_q, cu_k = packed(lq, lk, Hq, Hkv, cu_dtype=cu_dtype)
    out = program(q, k, v, *extra, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    expected = reference(program, q, k, v, cu_q, cu_k, *extra)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    if grads:
        assert_gradients_match(out, expected, (q, k, v), torch.randn_like(out))


def assert_gradients_match(out, expected, leaves, dout) -> None:
    """The gradients of ``out`` for ``leaves`` (q, k, v) against ``expected``'s (float64), for ``dout``."""
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(expected, leaves, dout.double())
    for name, g, w in zip("qkv", got, want):
        message = lambda m, name=name: f"d{name}: {m}"  # noqa: E731
        torch.testing.assert_close(g.double(), w.double(), atol=5e-5, rtol=5e-5, msg=message)


@pytest.mark.parametrize("program", [gpt2, dense, window, alibi, relu, llama, rope_dense], ids=lambda p: p.fn.__name__)
def test_forward_and_gradients_match_each_document_alone(program):
    check(program, *MIXED)


def test_gqa_and_int64_offsets():
    check(gpt2, *MIXED, Hq=4, Hkv=2, cu_dtype=torch.int64)
    check(llama, [7, 1, 12], [9, 1, 12], Hq=4, Hkv=1)


def test_per_head_tensors_of_a_plugin():
    check(sinks, *MIXED, torch.randn(2))


def test_lengths_across_block_boundaries():
    """Documents longer than a tile and not multiples of it, so blocks of the grid straddle documents."""
    check(gpt2, [33, 31, 2], [40, 31, 1], grads=False)


def test_flash_attention_layout_reaches_the_kernel_without_a_copy(monkeypatch):
    """FlashAttention's (total, H, D) tensors, viewed as (1, H, total, D), are read through their strides."""
    lq, lk = [4, 9, 3], [6, 9, 2]
    qf, kf, vf = (torch.randn(sum(n), 2, 16) for n in (lq, lk, lk))
    views = [t.transpose(0, 1)[None] for t in (qf, kf, vf)]
    launched = []
    real = kernel_module.CompiledKernel.launch

    def spy(self, grid, args, *rest, **kwargs):
        launched.append(args)
        return real(self, grid, args, *rest, **kwargs)

    monkeypatch.setattr(kernel_module.CompiledKernel, "launch", spy)
    cu_q, cu_k = offsets(lq), offsets(lk)
    out = gpt2(*views, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    pointers = {a.data_ptr() for args in launched for a in args if isinstance(a, torch.Tensor)}
    assert {t.data_ptr() for t in (qf, kf, vf)} <= pointers
    torch.testing.assert_close(out.double(), reference(gpt2, *views, cu_q, cu_k), atol=2e-5, rtol=2e-5)


def good_case():
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 6])
    return q.detach(), k.detach(), v.detach(), cu_q, cu_k


@pytest.mark.parametrize(
    "bad_q, bad_k, match",
    [
        (torch.tensor([0, 3, 8], dtype=torch.int16), None, r"cu_seqlens_q must be a 1-D int32"),
        (torch.tensor([0.0, 3.0, 8.0]), None, r"cu_seqlens_q must be a 1-D int32"),
        (torch.tensor([1, 3, 8], dtype=torch.int32), None, r"cu_seqlens_q\[0\] = 1: .*start at 0"),
        (None, torch.tensor([0, 7, 6], dtype=torch.int32), r"cu_seqlens_k\[2\] = 6 \(after 7\)"),
        (torch.tensor([0, 5, 3, 8], dtype=torch.int32), torch.tensor([0, 2, 4, 10]), r"cu_seqlens_q\[2\] = 3"),
        (torch.tensor([0, 3, 7], dtype=torch.int32), None, r"cu_seqlens_q\[2\] = 7 \(after 3\): .*end at .* of q, 8"),
        (None, torch.tensor([0, -2, 10], dtype=torch.int64), r"cu_seqlens_k\[1\] = -2"),
        (torch.tensor([0, 8], dtype=torch.int32), None, r"cu_seqlens_q and cu_seqlens_k must count the same"),
    ],
)
def test_bad_offsets_are_input_errors_naming_them(bad_q, bad_k, match):
    q, k, v, cu_q, cu_k = good_case()
    with pytest.raises(af.InputError, match=match):
        gpt2(q, k, v, cu_seqlens_q=cu_q if bad_q is None else bad_q, cu_seqlens_k=cu_k if bad_k is None else bad_k)


def test_max_seqlen_below_a_length_and_other_bad_calls():
    q, k, v, cu_q, cu_k = good_case()
    with pytest.raises(af.InputError, match=r"max_seqlen_q = 4 is below the length of document 1"):
        gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=6)
    with pytest.raises(af.InputError, match=r"max_seqlen_k = 5 is below"):
        gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=5)
    out = gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)
    torch.testing.assert_close(out.double(), reference(gpt2, q, k, v, cu_q, cu_k), atol=2e-5, rtol=2e-5)
    with pytest.raises(af.InputError, match=r"max_seqlen_q must be a non-negative int"):
        gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=-1)
    with pytest.raises(af.InputError, match=r"cu_seqlens_k is missing"):
        gpt2(q, k, v, cu_seqlens_q=cu_q)
    with pytest.raises(af.InputError, match=r"cu_seqlens_q: .*batch size 1"):
        two = [t.expand(2, -1, -1, -1) for t in (q, k, v)]
        gpt2(*two, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_hostile_offsets_unchecked_stay_inside_the_tensors():
    """validate=False: offsets are clamped to [0, total] as the kernels load them, so hostile values read and
    write nothing outside the tensors: the result is the call's with the clamped offsets."""
    q, k, v, _, _ = good_case()
    hostile_q = torch.tensor([-4, 3, 2**40], dtype=torch.int64)
    hostile_k = torch.tensor([0, 2**31 - 1, -7], dtype=torch.int64)
    out = gpt2(q, k, v, cu_seqlens_q=hostile_q, cu_seqlens_k=hostile_k, validate=False)
    clamped_q, clamped_k = hostile_q.clamp(0, q.shape[2]), hostile_k.clamp(0, k.shape[2])
    expected = gpt2(q, k, v, cu_seqlens_q=clamped_q, cu_seqlens_k=clamped_k, validate=False)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    first = gpt2.reference(q[:, :, :3], k, v)  # document 0 as clamped: queries 0..2, every key
    torch.testing.assert_close(out[:, :, :3].double(), first, atol=2e-5, rtol=2e-5)
    assert not out[:, :, 3:].any()  # document 1 as clamped has no keys
    bias = torch.randn(1, q.shape[1], q.shape[2], k.shape[2])  # read at packed rows, inside the tensor too
    out = biased(q, k, v, bias, cu_seqlens_q=hostile_q, cu_seqlens_k=hostile_k, validate=False)
    expected = biased(q, k, v, bias, cu_seqlens_q=clamped_q, cu_seqlens_k=clamped_k, validate=False)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    first = biased.reference(q[:, :, :3], k, v, bias[:, :, :3])
    torch.testing.assert_close(out[:, :, :3].double(), first, atol=2e-5, rtol=2e-5)


def test_unsupported_combinations_name_the_argument():
    q, k, v, cu_q, cu_k = good_case()
    packed_args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for extra, match in (
        (dict(kv_lens=torch.tensor([3], dtype=torch.int32)), "kv_lens cannot be combined"),
        (dict(q_offset=2), "q_offset cannot be combined"),
        (dict(split_kv=True), r"split_kv=True \(decoding\) cannot"),
    ):
        with pytest.raises(af.UnsupportedError, match=match):
            af.run_attention(gpt2._trace(()), q, k, v, **extra, **packed_args)
    with pytest.raises(af.UnsupportedError, match="block_table cannot be combined"):
        gpt2(q, k, v, block_table=torch.zeros(1, 1, dtype=torch.int32), **packed_args)
    with pytest.raises(af.UnsupportedError, match=r"kv_lens cannot be combined"):
        gpt2.reference(q, k, v, kv_lens=torch.tensor([3], dtype=torch.int32), **packed_args)
    slopes = torch.rand(2, requires_grad=True)
    with pytest.raises(af.UnsupportedError, match=r"gradients of runtime inputs \(sinks\)"):
        sinks(q.requires_grad_(), k, v, slopes, **packed_args)


@pytest.mark.parametrize("program", [gpt2, window, alibi, relu, llama, rope_dense], ids=lambda p: p.fn.__name__)
def test_the_reference_of_a_packed_call_is_each_document_alone(program):
    """``program.reference`` with cu_seqlens (the whole packed row, pairs kept within a document, positions
    restarting in each) equals each document run on its own, empty documents included."""
    q, k, v, cu_q, cu_k = packed(*MIXED, Hq=4, Hkv=2)
    whole = program.reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(whole, reference(program, q, k, v, cu_q, cu_k), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("heads", [4, 1], ids=["per-head", "broadcast"])
def test_a_tensor_indexed_by_query_and_key_is_indexed_by_packed_rows(heads):
    """additive_bias's bias over the packed row, (1, heads, total_q, total_k): each document reads its own
    block of it. Forward and gradients against each document alone with its block of the bias (float64), which
    the packed call's reference (the whole row) equals; the bias's gradient against that reference's."""
    lq, lk = MIXED
    q, k, v, cu_q, cu_k = packed(lq, lk, Hq=4, Hkv=2)
    bias = torch.randn(1, heads, sum(lq), sum(lk))
    out = biased(q, k, v, bias, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    blocks = []
    for i in range(len(lq)):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if keys.stop == keys.start:
            blocks.append(torch.zeros_like(q[:, :, rows], dtype=torch.float64) * v.sum())
        elif rows.stop > rows.start:
            blocks.append(biased.reference(q[:, :, rows], k[:, :, keys], v[:, :, keys], bias[:, :, rows, keys]))
    expected = torch.cat(blocks, 2)
    whole = biased.reference(q, k, v, bias, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(whole, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    dout = torch.randn_like(out)
    assert_gradients_match(out, expected, (q, k, v), dout)
    bias.requires_grad_(True)  # its score-shaped gradient, written at packed rows (0 across documents)
    out = biased(q, k, v, bias, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (got,) = torch.autograd.grad(out, bias, dout)
    whole = biased.reference(q, k, v, bias, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    (want,) = torch.autograd.grad(whole, bias, dout.double())
    assert got.shape == bias.shape
    torch.testing.assert_close(got.double(), want.double(), atol=5e-5, rtol=5e-5)


def keep_of_each_document(keep: torch.Tensor, q, k, v, cu_q, cu_k) -> torch.Tensor:
    """Softmax attention (float64) of each document alone, keeping the pairs of its block of ``keep`` (1, H,
    total_q, total_k): written out here, independent of the program's reference; a row keeping nothing gives 0."""
    group = q.shape[1] // k.shape[1]
    rows_out = []
    for i in range(cu_q.shape[0] - 1):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        qd = q[0, :, rows].double()
        kd, vd = (t[0, :, keys].double().repeat_interleave(group, 0) for t in (k, v))
        s = (qd @ kd.transpose(-1, -2)) / q.shape[-1] ** 0.5
        kept = keep[0, :, rows, keys].expand_as(s)
        w = torch.softmax(s.masked_fill(~kept, float("-inf")), -1).nan_to_num(0.0)
        rows_out.append(w @ vd)
    return torch.cat(rows_out, 1)[None]


@pytest.mark.parametrize("partial", [False, True], ids=["blocks", "token-masks"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_a_block_mask_over_the_packed_row(block_size, partial):
    """block_sparse with a BlockMask over the packed row (1, H, total_q, total_k), as flex_attention's document
    masks are built: each document keeps the pairs of its block of it (its lists' blocks straddle documents,
    so the kernels apply it element by element). Forward and gradients against each document alone (float64,
    written out), which the packed call's reference equals."""
    lq, lk = [5, 0, 1, 37, 9, 2], [5, 3, 1, 40, 14, 0]
    q, k, v, cu_q, cu_k = packed(lq, lk, Hq=4, Hkv=2)
    Nq, Nk = sum(lq), sum(lk)
    if partial:
        scores = torch.rand(1, 4, Nq, Nk)
        with warnings.catch_warnings():  # create_block_mask's one-release notice of its token-level meaning
            warnings.simplefilter("ignore", DeprecationWarning)
            mask = af.create_block_mask(lambda b, h, q, k: scores[b, h, q, k] > 0.3, 1, 4, Nq, Nk, block_size)
    else:
        grid = torch.rand(1, 4, -(-Nq // block_size), -(-Nk // block_size)) > 0.4
        mask = af.BlockMask.from_blocks(grid, Nq, Nk, block_size=block_size)
    out = sparse(q, k, v, mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    expected = keep_of_each_document(mask.to_dense(), q, k, v, cu_q, cu_k)
    whole = sparse.reference(q, k, v, mask, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(whole, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    dout = torch.randn_like(out)
    assert_gradients_match(out, expected, (q, k, v), dout)


def test_the_reference_checks_packed_offsets_as_a_call_does():
    q, k, v, cu_q, cu_k = packed([3, 2], [4, 1])
    with pytest.raises(af.InputError, match="cu_seqlens_k"):
        gpt2.reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 6, 5], dtype=torch.int32))
    with pytest.raises(af.InputError, match="cu_seqlens_q and cu_seqlens_k must count the same documents"):
        gpt2.reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=torch.tensor([0, 5], dtype=torch.int32))


def offsets_by_loop(starts: list[bool]) -> list[int]:
    """The reference offsets: a document at each start (and at token 0), then the total."""
    return [i for i, s in enumerate(starts) if s or i == 0] + [len(starts)]


@pytest.mark.parametrize("total", [0, 1, 23])
def test_offsets_from_document_ids_and_position_ids(total):
    lengths = torch.randint(1, 5, (total,)).tolist()
    position_ids = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(0, dtype=torch.long)])[:total]
    document_ids = torch.randint(0, 3, (total,))
    by_position = af.cu_seqlens_from_position_ids(position_ids[None])
    by_document = af.cu_seqlens_from_document_ids(document_ids)
    assert by_position.dtype == by_document.dtype == torch.int32
    assert by_position.tolist() == offsets_by_loop((position_ids == 0).tolist())
    changes = [i > 0 and document_ids[i] != document_ids[i - 1] for i in range(total)]
    assert by_document.tolist() == offsets_by_loop(changes)


def test_offsets_from_position_ids_run_a_packed_call():
    """HF's flattening: position ids restarting at 0 per example give the documents a packed call attends in."""
    lengths = [4, 1, 7]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = af.cu_seqlens_from_position_ids(position_ids)
    q, k, v, _, _ = packed(lengths, lengths)
    out = llama(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    torch.testing.assert_close(out.double(), reference(llama, q, k, v, cu, cu), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("bad", [torch.zeros(2, 3, dtype=torch.long), torch.zeros(3), torch.zeros(3, dtype=torch.bool)])
def test_offsets_from_bad_ids_are_input_errors(bad):
    with pytest.raises(af.InputError, match="position_ids must be an integer tensor"):
        af.cu_seqlens_from_position_ids(bad)
    with pytest.raises(af.InputError, match="document_ids must be an integer tensor"):
        af.cu_seqlens_from_document_ids(bad)


def test_lse_of_each_document():
    q, k, v, cu_q, cu_k = packed([6, 1, 9], [6, 4, 12])
    out, lse = gpt2(q, k, v, return_lse=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    want = [
        gpt2.reference(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], return_lse=True)[1]
        for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
    ]
    torch.testing.assert_close(lse.double(), torch.cat(want, 2), atol=2e-5, rtol=2e-5)


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


def test_rope_tables_at_local_positions():
    """cos/sin tables are read at each document's own positions; a document with more queries than keys
    would read below row 0, which the call refuses as the reference does."""
    lq, lk = [3, 8, 5], [4, 8, 6]
    angles = torch.randn(sum(lk), 8)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    check(rope_tables, lq, lk, cos, sin)
    q, k, v, cu_q, cu_k = packed([5, 2], [4, 9])
    with pytest.raises(af.InputError, match="every packed document needs at least as many keys as queries"):
        rope_tables(q, k, v, cos[:13], sin[:13], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_rope_tables_need_rows_for_the_longest_document_only():
    """A packed call's positions restart in every document, so tables of the longest document's rows serve
    any pack of documents (as FlashAttention-style callers build them); fewer rows are an InputError."""
    lq, lk = [3, 8, 5], [4, 8, 6]
    angles = torch.randn(max(lk), 8)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    check(rope_tables, lq, lk, cos, sin)
    q, k, v, cu_q, cu_k = packed(lq, lk)
    with pytest.raises(af.InputError, match=r"cos must have shape \(longest document, D\).* = \(8, 16\)"):
        rope_tables(q, k, v, cos[:7], sin[:7], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_all_three_templates_take_packed_calls(capsys, monkeypatch):
    """The forward, dQ and dK/dV templates' instances of a packed call run where chosen (here: opted in), and
    ``attnfuse show --json --varlen`` reports them."""
    from attnfuse.cli import main
    from attnfuse.kernels.verified import record_key
    from attnfuse.plan import KernelConfig
    from attnfuse.runtime.compiled import compiled

    config = KernelConfig(
        arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=1, save_lse=True, fp32_precision="ieee"
    )
    plan = compiled(gpt2.graph(), attrs.evolve(config, varlen=True)).plan
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    assert {"forward", "dkdv", "dq"} <= set(plan.templates.kernels)
    assert main(["show", "gpt2", "--json", "--arch", "sm90", "--varlen", "--lse"]) == 0
    report = json.loads(capsys.readouterr().out)
    for kind in ("forward", "dkdv", "dq"):
        entry = report["kernels"][kind]
        assert entry["engine"] == "template" and entry["template_available"] is True and entry["reason"] is None
        assert entry["instance"] == record_key(plan.templates.kernels[kind], "bfloat16", 128)


def test_under_torch_compile():
    """Under torch.compile a packed call runs eagerly (a graph break), forward and backward."""
    q, k, v, cu_q, cu_k = packed([4, 6], [5, 6])
    step = torch.compile(lambda q, k, v, cu_q, cu_k: gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k))
    out = step(q, k, v, cu_q, cu_k)
    expected = reference(gpt2, q, k, v, cu_q, cu_k)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    dout = torch.randn_like(out)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(expected, (q, k, v), dout.double())):
        torch.testing.assert_close(g.double(), w.double(), atol=5e-5, rtol=5e-5)


def test_a_device_no_gpu_run_has_checked_refuses_packed_calls_unless_asked(monkeypatch):
    """A device whose architecture no run has checked the packed kernels on refuses them, naming the opt-in."""
    from attnfuse.runtime import packed as packed_module

    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4])
    monkeypatch.setattr(packed_module, "GATE", attrs.evolve(packed_module.GATE, checked=()))  # unchecked
    monkeypatch.delenv(packed_module.GATE.env, raising=False)
    with pytest.raises(af.UnsupportedError, match="no run has checked the kernels there.*ATTNFUSE_PACKED_ON_GPU=1"):
        gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    monkeypatch.setenv(packed_module.GATE.env, "1")
    out = gpt2(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    torch.testing.assert_close(out.double(), reference(gpt2, q, k, v, cu_q, cu_k), atol=2e-5, rtol=2e-5)


@pytest.fixture
def hoisted_passes(monkeypatch, transform_passes):
    """Calls hoist their qk transforms however short the pack; the list receives one item per pass run."""
    from attnfuse.runtime import hoisted

    monkeypatch.setattr(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1)
    return transform_passes


ONE_EACH = "not one transform pass (its copies kept for the backward) and one gradient pass"


@pytest.mark.parametrize("program", [llama, rope_dense], ids=lambda p: p.fn.__name__)
def test_hoisted_transforms_rotate_each_document_at_its_own_positions(hoisted_passes, program):
    """A packed call whose qk transforms are hoisted (a transform pass over q and k, kernels on the copies, a
    gradient pass back): each document's rows at its local positions, forward and gradients, with empty and
    one-row documents and blocks that straddle documents."""
    check(program, *MIXED, Hq=4, Hkv=2)
    assert len(hoisted_passes) == 2, ONE_EACH


def test_hoisted_rope_tables_at_local_positions(hoisted_passes):
    """As the fused kernels, the transform pass reads cos/sin tables at each document's own positions."""
    lq, lk = [3, 8, 5, 20], [4, 8, 6, 21]
    angles = torch.randn(max(lk), 8)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    check(rope_tables, lq, lk, cos, sin)
    assert len(hoisted_passes) == 2, ONE_EACH


def test_hostile_offsets_stay_inside_the_tensors_through_the_transform_passes(hoisted_passes):
    """validate=False with hostile offsets and hoisted RoPE: the passes clamp the offsets as the kernels do, so
    the call (forward and gradients) is the one with the clamped offsets, bit for bit."""
    q, k, v = (t.requires_grad_() for t in good_case()[:3])
    hostile_q = torch.tensor([-4, 3, 2**40], dtype=torch.int64)
    hostile_k = torch.tensor([0, 2**31 - 1, -7], dtype=torch.int64)
    clamped_q, clamped_k = hostile_q.clamp(0, q.shape[2]), hostile_k.clamp(0, k.shape[2])
    results = []
    for cu_q, cu_k in ((hostile_q, hostile_k), (clamped_q, clamped_k)):
        out = llama(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, validate=False)
        results.append((out, *torch.autograd.grad(out, (q, k, v), out)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert len(hoisted_passes) == 4, "not a transform and a gradient pass in each call"


def test_a_packed_call_reading_a_tensor_at_packed_rows_runs_the_templates():
    """On sm90 a packed additive_bias call (its bias read at packed rows, ``q_start + q_idx``) runs the forward
    template at each head dim (64 to 256) and the dQ and dK/dV templates at their own, the dK/dV template's
    modifications staged through shared memory (``dkdv_mods``)."""
    from attnfuse.kernels.verify import variant_plan

    for head_dim in (64, 128):
        plan = variant_plan("additive_bias", "bfloat16", head_dim, "varlen")
        assert {"forward", "dq", "dkdv"} <= set(plan.templates.kernels), plan.templates.reasons
        assert "(q_start + q_idx)" in plan.templates.kernels["forward"].source
        assert "_mods(s_tile" in plan.templates.kernels["dkdv"].source
    wide = variant_plan("additive_bias", "bfloat16", 256, "varlen")
    assert "(q_start + q_idx)" in wide.templates.kernels["forward"].source
