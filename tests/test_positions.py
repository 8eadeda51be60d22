"""Explicit positions (``q_offset``, ``k_offset``, ``seq_len``): a call on a chunk of a longer sequence.

Forward and backward against the float64 reference with the same positions, on CPU tensors (Triton's
interpreter); one compiled kernel for every offset; the chunks of a chunked prefill against the whole
sequence; and the errors of bad positions.
"""

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.block_mask import create_block_mask_from_blocks
from attnfuse.runtime.launch import clear_cache
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def window_alibi(q, k, v):
    return af.softmax(af.alibi(af.sliding_window(af.scaled_dot_product(q, k), 7, 3))) @ v


@af.attention
def relu_causal(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sigmoid_causal(q, k, v):
    return af.sigmoid_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def biased_causal(q, k, v, bias):
    return af.softmax(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


@af.attention
def sparse_causal(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v


def _tables(seq_len: int, D: int) -> dict:
    angles = torch.rand(seq_len, D // 2) * 6
    angles = torch.cat((angles, angles), dim=-1)
    return {"cos": angles.cos(), "sin": angles.sin()}


def _extras(program, Nq: int, Nk: int, seq_len: int, D: int) -> dict:
    """Runtime inputs: tables indexed by position (seq_len rows), a bias and a block mask by the call's indices."""
    if program is rope_tables:
        return _tables(seq_len, D)
    if program is biased_causal:
        return {"bias": torch.randn(2, Nq, Nk)}
    if program is sparse_causal:
        return {
            "block_mask": create_block_mask_from_blocks(
                lambda b, h, qb, kb: (qb + kb) % 3 != 1, None, None, Nq, Nk, block_size=16
            )
        }
    return {}


# (Nq, Nk, q_offset, k_offset, seq_len): queries after the keys, before them (no key kept under causal),
# overlapping them, inside a longer sequence; lengths that are not multiples of a block
CASES = [(20, 24, 30, 10, None), (17, 40, 0, 20, None), (33, 45, 5, 0, 90), (40, 40, 13, 13, None)]
PROGRAMS = [causal, llama, rope_tables, window_alibi, relu_causal, sigmoid_causal, biased_causal, sparse_causal]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Nq{}_Nk{}_q{}_k{}_seq{}".format(*c))
@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.fn.__name__)
def test_offsets_match_the_float64_reference(program, case):
    """out and the gradients of q, k, v (GQA) at the given positions, against the reference at them."""
    Nq, Nk, q_offset, k_offset, seq_len = case
    D = 16
    at = dict(q_offset=q_offset, k_offset=k_offset, seq_len=seq_len)
    q = torch.randn(1, 2, Nq, D, requires_grad=True)
    k = torch.randn(1, 1, Nk, D, requires_grad=True)
    v = torch.randn(1, 1, Nk, D, requires_grad=True)
    extras = _extras(program, Nq, Nk, seq_len or max(q_offset + Nq, k_offset + Nk), D)
    out = program(q, k, v, **extras, **at)
    want = program.reference(q, k, v, **extras, **at)
    in_dtype = program.reference(q, k, v, **extras, **at, dtype=torch.float32)
    assert_matches_reference(out, want, in_dtype, torch.float32)
    dout = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v), dout)
    wanted = torch.autograd.grad(want, (q, k, v), dout.double())
    baseline = torch.autograd.grad(in_dtype, (q, k, v), dout)
    for name, g, w, b in zip("qkv", got, wanted, baseline):
        assert_matches_reference(g, w, b, torch.float32, what=f"d{name}")


def test_offsets_follow_positions_not_indices():
    """The same keys at another offset give another result under causal+RoPE; shifting queries and keys
    together gives the same scores (RoPE and causal depend on j - i) up to rounding."""
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
    base = llama(q, k, v, q_offset=10, k_offset=0)
    assert not torch.allclose(base, llama(q, k, v, q_offset=10, k_offset=5), atol=1e-3)
    torch.testing.assert_close(llama(q, k, v, q_offset=110, k_offset=100), base, atol=2e-5, rtol=0)


@pytest.mark.parametrize("program", [llama, rope_tables], ids=lambda p: p.fn.__name__)
def test_hoisted_transforms_rotate_at_the_offsets(program):
    """Enough query blocks hoist RoPE into transform passes (q and k rows rotated once): they rotate at the
    call's positions too, forward and backward."""
    Nq, Nk, at = 100, 50, dict(q_offset=40, k_offset=60, seq_len=150)
    q = torch.randn(1, 2, Nq, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, Nk, 16, requires_grad=True) for _ in range(2))
    extras = _extras(program, Nq, Nk, 150, 16)
    out = program(q, k, v, **extras, **at)
    assert hoisted_last_call()
    want = program.reference(q, k, v, **extras, **at)
    in_dtype = program.reference(q, k, v, **extras, **at, dtype=torch.float32)
    assert_matches_reference(out, want, in_dtype, torch.float32)
    dout = torch.randn(out.shape)
    for name, g, w, b in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout.double()),
        torch.autograd.grad(in_dtype, (q, k, v), dout),
    ):
        assert_matches_reference(g, w, b, torch.float32, what=f"d{name}")


def test_chunked_prefill_equals_the_whole_sequence():
    """Queries in chunks, each at its offset against the keys up to its end, give the whole causal
    RoPE program's rows; the key chunk that starts later (k_offset) gives its own rows' out for a
    sliding window that never reaches the keys before it."""
    N = 70
    q, k, v = torch.randn(1, 2, N, 16), torch.randn(1, 1, N, 16), torch.randn(1, 1, N, 16)
    whole = llama(q, k, v)
    for lo, hi in ((0, 20), (20, 45), (45, 70)):
        chunk = llama(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], q_offset=lo)
        torch.testing.assert_close(chunk, whole[:, :, lo:hi], atol=2e-6, rtol=0)
    windowed = window_alibi(q, k, v)
    chunk = window_alibi(q[:, :, 40:], k[:, :, 30:], v[:, :, 30:], q_offset=40, k_offset=30)
    torch.testing.assert_close(chunk, windowed[:, :, 40:], atol=2e-6, rtol=0)


def test_one_kernel_serves_every_offset(monkeypatch):
    """Offsets are runtime arguments: new values compile nothing. Calls without offsets compile kernels with
    no offset arguments (as before offsets existed)."""
    from attnfuse.passes import compiler
    from attnfuse.runtime import launch

    launch.clear_cache()
    built = []
    original = compiler.compile
    monkeypatch.setattr(compiler, "compile", lambda graph, config: built.append(config) or original(graph, config))
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 30, 16), torch.randn(1, 1, 30, 16)
    for q_offset, k_offset in ((0, 0), (50, 3), (7, 90)):
        out = window_alibi(q, k, v, q_offset=q_offset, k_offset=k_offset)
        assert_matches_reference(
            out,
            window_alibi.reference(q, k, v, q_offset=q_offset, k_offset=k_offset),
            window_alibi.reference(q, k, v, q_offset=q_offset, k_offset=k_offset, dtype=torch.float32),
            torch.float32,
        )
    assert [c.positions for c in built] == [True]
    assert "Q_OFFSET" in window_alibi.source(q, k, v, q_offset=1)
    assert "Q_OFFSET" not in window_alibi.source(q, k, v) and "N_SEQ" not in window_alibi.source(q, k, v)


def test_few_queries_with_offsets_take_the_regular_kernel(monkeypatch):
    """The split-KV path places queries bottom-right, so a call with offsets never takes it (even with at
    most 16 queries); forcing it is an InputError."""
    from attnfuse.runtime import decode

    def refuse(*args, **kwargs):
        raise AssertionError("the split-KV kernel ran")

    monkeypatch.setattr(decode.DecodeKernel, "__call__", refuse)
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    out = causal(q, k, v, q_offset=12)
    assert_matches_reference(
        out,
        causal.reference(q, k, v, q_offset=12),
        causal.reference(q, k, v, q_offset=12, dtype=torch.float32),
        torch.float32,
    )
    with pytest.raises(af.InputError, match="takes no q_offset or k_offset"):
        af.run_attention(causal.graph(), q, k, v, split_kv=True, q_offset=12)


@pytest.mark.parametrize(
    "at, says",
    [
        (dict(q_offset=-1), r"q_offset must be an int in \[0, 2147483647\], got -1"),
        (dict(k_offset=2.0), "k_offset must be an int, got float"),
        (dict(q_offset=True), r"q_offset must be an int in \[0, 2147483647\], got True"),
        (dict(q_offset=0, seq_len=39), r"seq_len must be at least the last position plus one, .* = 40"),
        (dict(k_offset=2**31 - 10), r"at most 2147483647"),
        (dict(seq_len=50), "seq_len=50 needs q_offset or k_offset"),
    ],
    ids=["negative", "float", "bool", "short", "past_int32", "seq_len_alone"],
)
def test_bad_positions_are_input_errors_naming_them(at, says):
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    with pytest.raises(af.InputError, match=says):
        causal(q, k, v, **at)
    with pytest.raises(af.InputError, match=says):
        causal.reference(q, k, v, **at)


def test_offsets_with_a_cache_are_refused():
    q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 40, 16), torch.randn(1, 1, 40, 16)
    with pytest.raises(af.InputError, match="cannot be combined with kv_lens or block_table"):
        causal(q, k, v, kv_lens=torch.tensor([30], dtype=torch.int32), q_offset=4)


class _Provides:
    def __init__(self, *combinators):
        self.combinators = combinators

    @af.hookimpl
    def attnfuse_combinators(self):
        return list(self.combinators)


@af.attention
def old_alibi_causal(q, k, v):
    return af.softmax(af.old_alibi(af.causal(af.scaled_dot_product(q, k)))) @ v


def test_a_plugin_with_prepare_must_declare_it_takes_offsets():
    """A combinator whose prepare gives the kernel tensors (alibi's slopes, here without its declaration)
    could read them at positions past the call's rows: calls with offsets refuse it, calls without run it."""
    alibi = af.combinators()["alibi"].combinator
    af.register_plugin(_Provides(attrs.evolve(alibi, name="old_alibi", takes_offsets=False)), name="old_alibi")
    try:
        q, k, v = torch.randn(1, 2, 8, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
        assert_matches_reference(
            old_alibi_causal(q, k, v),
            old_alibi_causal.reference(q, k, v),
            old_alibi_causal.reference(q, k, v, dtype=torch.float32),
            torch.float32,
        )
        with pytest.raises(
            af.InputError,
            match=r"q_offset/k_offset: old_alibi prepares kernel arguments but does "
            r"not declare takes_offsets=True",
        ):
            old_alibi_causal(q, k, v, q_offset=3)
    finally:
        af.unregister_plugin("old_alibi")
        clear_cache()
    with pytest.raises(af.PluginError, match="takes_offsets must be True or False, got 1"):
        attrs.evolve(alibi, takes_offsets=1)


def test_under_torch_compile_a_call_with_offsets_runs_eagerly():
    """Dynamo leaves a call with positions out of the graph (a graph break) and runs it eagerly: the same
    result and gradients as an eager call."""
    q, k, v = (torch.randn(1, h, n, 16, requires_grad=True) for h, n in ((2, 12), (1, 30), (1, 30)))
    step = torch.compile(lambda q, k, v: window_alibi(q, k, v, q_offset=9, k_offset=4) * 2, backend="eager")
    got = step(q, k, v)
    want = window_alibi(q, k, v, q_offset=9, k_offset=4) * 2
    assert torch.equal(got, want)
    dout = torch.randn(got.shape)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert torch.equal(g, w)


def test_offset_names_are_reserved():
    with pytest.raises(af.ProgramError, match=r"argument name\(s\) \['q_offset'\] are reserved"):

        @af.attention
        def takes_offset(q, k, v, q_offset):
            return af.softmax(af.scaled_dot_product(q, k)) @ v
