"""Positions near the largest the calls allow (2**31 - 1): masks' facts and ``keep`` add window sides to
positions, which would overflow int32 there. Calls whose positions reach 2**30 compute them in int64;
forward and gradients match the float64 reference at those positions, and smaller calls keep int32 kernels."""

import pytest
import torch

import attnfuse as af
from attnfuse.runtime.inputs import MAX_POSITION, WIDE_POSITION, LaunchContext
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call


@af.attention
def window_alibi(q, k, v):
    return af.softmax(af.alibi(af.sliding_window(af.scaled_dot_product(q, k), 7, 3))) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def wide_left_window(q, k, v):  # the widest bounded side: k_hi + left + 1 passes int32 near the end
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 2**30 - 1, 4)) @ v


# (Nq, Nk, q_offset, k_offset, seq_len), lengths off the interpreter's 32-row blocks, the last query at the last
# position: keys ending there too; ending a little before; ending before the windows' reach, with seq_len given
CASES = [
    (20, 37, MAX_POSITION - 20, MAX_POSITION - 37, None),
    (33, 40, MAX_POSITION - 33, MAX_POSITION - 42, None),
    (20, 45, MAX_POSITION - 20, MAX_POSITION - 85, MAX_POSITION),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "Nq{}_Nk{}_q{}_k{}_seq{}".format(*c))
@pytest.mark.parametrize("program", [window_alibi, causal, wide_left_window], ids=lambda p: p.fn.__name__)
def test_positions_near_the_limit_match_the_float64_reference(program, case):
    Nq, Nk, q_offset, k_offset, seq_len = case
    at = dict(q_offset=q_offset, k_offset=k_offset, seq_len=seq_len)
    q = torch.randn(1, 4, Nq, 16, requires_grad=True)
    k, v = (torch.randn(1, 2, Nk, 16, requires_grad=True) for _ in range(2))
    out = program(q, k, v, **at)
    want = program.reference(q, k, v, **at)
    in_dtype = program.reference(q, k, v, **at, dtype=torch.float32)
    assert_matches_reference(out, want, in_dtype, torch.float32)
    dout = torch.randn(out.shape)
    for name, g, w, b in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout.double()),
        torch.autograd.grad(in_dtype, (q, k, v), dout),
    ):
        assert_matches_reference(g, w, b, torch.float32, what=f"d{name}")


def test_only_calls_reaching_wide_positions_widen_them():
    """Positions below 2**30 keep the int32 kernels; from there the forward, dQ and dK/dV widen them."""
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 30, 16), torch.randn(1, 1, 30, 16)
    narrow = window_alibi.source(q, k, v, q_offset=5, seq_len=WIDE_POSITION)
    assert "tl.int64) + Q_OFFSET" not in narrow and "(q_idx + Q_OFFSET).to(tl.int64)" not in narrow
    for kernel in ("forward", "dq", "dkdv"):
        source = window_alibi.source(q, k, v, q_offset=5, seq_len=WIDE_POSITION + 1, kernel=kernel)
        assert "(q_idx + Q_OFFSET).to(tl.int64)" in source


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


def _rotated64(x: torch.Tensor, first: int, theta: float = 10000.0) -> torch.Tensor:
    """x (B, H, N, D) rotated in float64 at positions first .. first + N - 1 (NeoX/Llama halves)."""
    D = x.shape[-1]
    positions = torch.arange(first, first + x.shape[2], dtype=torch.float64)
    freqs = positions[:, None] * theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    x = x.double()
    return x * cos + torch.cat((-x[..., D // 2 :], x[..., : D // 2]), -1) * sin


def _causal_attention(q, k, v, q_offset, k_offset, dtype):
    """softmax(q kᵀ / √D, key position <= query position) v, in ``dtype``; k, v (B, 1, Nk, D) broadcast."""
    keep = (torch.arange(k.shape[2]) + k_offset)[None, :] <= (torch.arange(q.shape[2]) + q_offset)[:, None]
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v.to(dtype)


def _check_rope_causal(out, q, k, v, q_offset, k_offset):
    """``out`` (B, Hq, Nq, D) of rope + causal at these offsets, and its q, k, v gradients, against causal
    attention on q and k rotated in float64 at their positions."""
    want, in_dtype = (
        _causal_attention(
            _rotated64(q, q_offset).to(dtype), _rotated64(k, k_offset).to(dtype), v, q_offset, k_offset, dtype
        )
        for dtype in (torch.float64, torch.float32)
    )
    assert_matches_reference(out, want, in_dtype, torch.float32)
    dout = torch.randn(out.shape)
    for name, g, w, b in zip(
        "qkv",
        torch.autograd.grad(out, (q, k, v), dout),
        torch.autograd.grad(want, (q, k, v), dout.double()),
        torch.autograd.grad(in_dtype, (q, k, v), dout),
    ):
        assert_matches_reference(g, w, b, torch.float32, what=f"d{name}")


@pytest.mark.parametrize(
    "q_offset,k_offset",
    [(2**20, 2**20 - 9), (2**30, 2**30 - 9), (2**30, 5)],
    ids=["near_2_20", "near_2_30", "queries_far_after_keys"],
)
def test_rope_tables_cover_the_chunk_only(q_offset, k_offset):
    """rope's theta tables at a large offset hold the chunk's rows only (not one for every position from 0),
    and the chunk's out and gradients match a float64 rotation at those positions."""
    B, Nq, Nk, D = 1, 4, 13, 8
    rope = af.combinators()["rope"].combinator
    ctx = LaunchContext(
        B=B,
        Hq=2,
        Hkv=1,
        Nq=Nq,
        Nk=Nk,
        D=D,
        DV=D,
        device=torch.device("cpu"),
        dtype=torch.float32,
        q_offset=q_offset,
        k_offset=k_offset,
        seq_len=max(q_offset + Nq, k_offset + Nk),
    )
    tables = rope.prepare(ctx, theta=10000.0, scale=None, cos=None, sin=None, rotate_keys=True)
    assert (
        sum(t.untyped_storage().nbytes() for t in tables.values() if isinstance(t, torch.Tensor))
        <= 2 * (Nq + Nk) * D // 2 * 4
    )
    q = torch.randn(B, 2, Nq, D, requires_grad=True)
    k, v = (torch.randn(B, 1, Nk, D, requires_grad=True) for _ in range(2))
    out = llama(q, k, v, q_offset=q_offset, k_offset=k_offset)
    _check_rope_causal(out, q, k, v, q_offset, k_offset)


@af.attention
def lookback(q, k, v):  # 7 keys back, every key after: q_pos + right passes int32 for any position past 2**30
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 7, 2**30 - 1)) @ v


@pytest.mark.parametrize("Nq", [3, 20], ids=["split_kv", "forward"])
def test_a_paged_cache_of_nearly_2_31_keys(Nq):
    """A paged cache's capacity (pages x page size) can pass 2**30 with little memory: every table entry on
    one 2**16-row page. The last Nq of 2**31 - 2**16 - 3 keys (the split-KV kernel for 3 queries, the forward
    for 20) match the float64 reference on those keys, placed at their positions."""
    P, pages, D = 2**16, 2**15 - 1, 8
    pool_k, pool_v = torch.randn(1, P, 1, D), torch.randn(1, P, 1, D)
    table = torch.zeros(1, pages, dtype=torch.int32)
    n = pages * P - 3
    q = torch.randn(1, 2, Nq, D)
    out = lookback(q, pool_k, pool_v, kv_lens=torch.tensor([n], dtype=torch.int32), block_table=table)
    first = n - Nq - 7  # the first key any query keeps
    rows = torch.arange(first, n) % P
    k, v = (pool[0, rows].transpose(0, 1)[None] for pool in (pool_k, pool_v))
    at = dict(q_offset=n - Nq, k_offset=first, seq_len=n)
    assert_matches_reference(
        out, lookback.reference(q, k, v, **at), lookback.reference(q, k, v, **at, dtype=torch.float32), torch.float32
    )


def test_hoisted_rope_at_the_limit():
    """Enough query blocks hoist RoPE into transform passes, which rotate at positions near 2**31 - 1 too
    (int64 there): out and gradients against a float64 rotation at those positions."""
    Nq, Nk, D = 130, 140, 16
    q_offset, k_offset = MAX_POSITION - Nq, MAX_POSITION - Nk
    q = torch.randn(1, 2, Nq, D, requires_grad=True)
    k, v = (torch.randn(1, 1, Nk, D, requires_grad=True) for _ in range(2))
    out = llama(q, k, v, q_offset=q_offset, k_offset=k_offset)
    assert hoisted_last_call()
    _check_rope_causal(out, q, k, v, q_offset, k_offset)
