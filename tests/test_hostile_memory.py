"""Memory safety under hostile cache inputs: block_table entries outside the pool, kv_lens past the cache's
capacity, past int32 or negative, and offsets past 2**31 - 1 elements (the int64 kernels, forced on small CPU problems).

The interpreter bounds-checks every load and store (an address outside the kernel's tensors raises
IndexError), so a call that returns proves that nothing outside the pool was read.
"""

import math

import pytest
import torch

import attnfuse as af
from attnfuse.runtime import hoisted, launch, offsets
from attnfuse.runtime.inputs import KVCache, _rows_fit

from conftest import hoisted_last_call

P, PAGE, HKV, D = 6, 16, 2, 32  # pool pages, page size, kv heads, head dim
HOSTILE = [(P, torch.int32), (-1, torch.int32), (10**6, torch.int32), (-(2**31), torch.int32), (2**32 + 3, torch.int64)]


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


def _paged(seed=0, Hq=4, Nq=3, dtype=torch.float64):
    """q (2, Hq, Nq, D), pools (P, PAGE, HKV, D), a table using 3 + 2 of the pages, lens (2,)."""
    g = torch.Generator().manual_seed(seed)
    pool_k, pool_v = (torch.randn(P, PAGE, HKV, D, generator=g, dtype=dtype) for _ in range(2))
    q = torch.randn(2, Hq, Nq, D, generator=g, dtype=dtype)
    table = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
    return q, pool_k, pool_v, table, torch.tensor([40, 30], dtype=torch.int32)


def _causal_without(q, pool_k, pool_v, table, lens, absent):
    """float64 causal softmax attention of a paged cache by hand, with the keys of the (sequence, slot)
    pairs in ``absent`` dropped (their positions stay: later keys keep theirs)."""
    B, Hq, Nq, _ = q.shape
    out = torch.empty(B, Hq, Nq, D, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        slots = [(j // PAGE, j % PAGE) for j in range(n)]
        present = torch.tensor([(b, s) not in absent for s, _ in slots])
        safe = [min(max(int(table[b, s]), 0), P - 1) for s, _ in slots]
        k = torch.stack([pool_k[p, r] for p, (_, r) in zip(safe, slots)]).double()  # (n, HKV, D)
        v = torch.stack([pool_v[p, r] for p, (_, r) in zip(safe, slots)]).double()
        for h in range(Hq):
            hk = h // (Hq // HKV)
            s = q[b, h].double() @ k[:, hk].T / math.sqrt(D)  # (Nq, n)
            keep = present[None, :] & (torch.arange(n)[None, :] <= torch.arange(Nq)[:, None] + n - Nq)
            out[b, h] = torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1) @ v[:, hk]
    return out


def test_hand_reference_equals_the_program_reference():
    q, pool_k, pool_v, table, lens = _paged(seed=1)
    torch.testing.assert_close(
        _causal_without(q, pool_k, pool_v, table, lens, set()),
        causal.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table),
        atol=1e-12,
        rtol=0,
    )


@pytest.mark.parametrize("value, dtype", HOSTILE, ids=lambda x: str(x))
def test_a_used_entry_outside_the_pool_is_rejected(value, dtype):
    q, pool_k, pool_v, table, lens = _paged(seed=2)
    table = table.to(dtype)
    table[0, 2] = value  # slot 2 of sequence 0 holds keys 32..39 of its 40
    with pytest.raises(
        af.InputError,
        match=rf"block_table\[0, 2\] = {value} is not a page of the pool: the 3 "
        rf"entries sequence 0 uses .* must each be in \[0, {P}\)",
    ):
        causal(q, pool_k, pool_v, kv_lens=lens, block_table=table)


@pytest.mark.parametrize("split_kv", [True, False])
def test_unused_entries_may_hold_anything(split_kv):
    q, pool_k, pool_v, table, lens = _paged(seed=3)
    padded = torch.cat((table, torch.full((2, 2), -1, dtype=torch.int32)), dim=1)
    padded[1, 2] = -1  # sequence 1 has 30 keys: slots 0 and 1
    padded[0, 4] = 10**6
    out = launch.run_attention(causal.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=padded, split_kv=split_kv)
    torch.testing.assert_close(out, _causal_without(q, pool_k, pool_v, table, lens, set()), atol=1e-10, rtol=0)


@pytest.mark.parametrize("length", [2**32 + 5, 3 * PAGE + 1, -1])
def test_kv_lens_past_the_capacity_or_negative_are_rejected(length):
    """The table's 3 pages of PAGE keys hold 48 keys per sequence, as the contiguous cache's Nk."""
    q, pool_k, pool_v, table, lens = _paged(seed=4)
    lens = lens.to(torch.int64)
    lens[1] = length
    with pytest.raises(
        af.InputError,
        match=rf"kv_lens\[1\] = {length}: a sequence's key count must be in "
        rf"\[0, 48\], the capacity of its paged cache: block_table's 3 pages "
        rf"x page_size {PAGE}",
    ):
        causal(q, pool_k, pool_v, kv_lens=lens, block_table=table)
    k, v = (
        torch.randn(2, HKV, 48, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) for _ in range(2)
    )
    with pytest.raises(
        af.InputError,
        match=rf"kv_lens\[1\] = {length}: a sequence's key count must be in "
        rf"\[0, 48\], the capacity of the contiguous cache: Nk = 48",
    ):
        causal(q, k, v, kv_lens=lens)


@pytest.mark.parametrize("split_kv", [True, False])
@pytest.mark.parametrize("value, dtype", HOSTILE, ids=lambda x: str(x))
def test_without_validation_keys_on_a_bad_page_are_absent(value, dtype, split_kv):
    q, pool_k, pool_v, table, lens = _paged(seed=6)
    table = table.to(dtype)
    table[0, 1] = value  # keys 16..31 of sequence 0: between good pages, so later keys keep their positions
    table[1, 1] = value  # keys 16..29 of sequence 1: its last page, partly used
    out = launch.run_attention(
        causal.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, split_kv=split_kv, validate=False
    )
    want = _causal_without(q, pool_k, pool_v, table, lens, {(0, 1), (1, 1)})
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_without_validation_lengths_count_as_the_nearest_bound(dtype):
    """Past the capacity (by one key, by most of int32, or past int32: never wrapped): no key outside the
    table's pages is read (the interpreter would raise), and the length counts as the capacity."""
    q, pool_k, pool_v, table, _ = _paged(seed=7)
    for hostile, counted in (
        ([3 * PAGE + 1, 30], [3 * PAGE, 30]),
        ([30, 2**31 - 1], [30, 3 * PAGE]),
        ([2**32 + 5, 30], [3 * PAGE, 30]),
    ):
        if dtype == torch.int32 and max(hostile) > 2**31 - 1:
            continue
        out = causal(q, pool_k, pool_v, kv_lens=torch.tensor(hostile, dtype=dtype), block_table=table, validate=False)
        want = _causal_without(q, pool_k, pool_v, table, torch.tensor(counted), set())
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


def test_validate_is_reserved_for_the_call():
    with pytest.raises(af.ProgramError, match=r"argument name\(s\) \['validate'\] are reserved"):

        @af.attention
        def checked(q, k, v, validate):
            return af.softmax(af.scaled_dot_product(q, k)) @ v


@pytest.fixture
def wide():
    """Every kernel compiled while the fixture holds takes 64-bit offsets (the limit lowered to 0)."""
    launch.clear_cache()
    limit, offsets.OFFSET_LIMIT = offsets.OFFSET_LIMIT, 0
    yield
    offsets.OFFSET_LIMIT = limit
    launch.clear_cache()


def _qkv(B, Hq, Hkv, Nq, Nk, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Nq, D, generator=g, dtype=torch.float64),
        *(torch.randn(B, Hkv, Nk, D, generator=g, dtype=torch.float64) for _ in range(2)),
    )


@pytest.mark.parametrize("kernel", ["forward", "dq", "dkdv", "decode", "transform"])
def test_source_is_int64_only_when_offsets_need_it(kernel, request):
    q, k, v = _qkv(1, 2, 2, 8, 8, seed=8)
    rows = "stride_qn" if kernel == "transform" else "stride_qm"
    assert "tl.cast(" not in llama.source(q, k, v, kernel=kernel)
    request.getfixturevalue("wide")
    source = llama.source(q, k, v, kernel=kernel)
    for stride in (rows, "stride_kd", "rope_0_cos_s1"):
        assert f"    {stride} = tl.cast({stride}, tl.int64)\n" in source


def test_wide_forward_and_backward_match_the_reference(wide, monkeypatch):
    """rope + causal with its qk transforms hoisted into passes, and an additive bias with its gradient:
    every kernel of a training step, in int64."""
    monkeypatch.setattr(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1)
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 64, 64, seed=9))
    bias = torch.randn(
        1, 4, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(10), requires_grad=True
    )
    dout = torch.randn(1, 4, 64, D, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    for program, extra in ((llama, ()), (biased, (bias,))):
        out = program(q, k, v, *extra)
        assert hoisted_last_call() == (program is llama)
        assert all(call.compiled.config.wide_offsets for call in launch._calls.values())
        ref = program.reference(q, k, v, *extra)
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
        leaves = (q, k, v, *extra)
        for got, want in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, leaves, dout)):
            torch.testing.assert_close(got, want, atol=1e-9, rtol=0)


@pytest.mark.parametrize("split_kv", [True, False])
def test_wide_paged_decode_matches_the_reference(wide, split_kv):
    q, pool_k, pool_v, table, lens = _paged(seed=12, Hq=4, Nq=2)
    out = launch.run_attention(llama.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, split_kv=split_kv)
    assert all(call.compiled.config.wide_offsets for call in launch._calls.values())
    torch.testing.assert_close(
        out, llama.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table), atol=1e-10, rtol=0
    )


def _meta(shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_wide_offsets_are_decided_from_row_and_column_extents():
    qkv = _meta((1, 180_000, 3, 32, 128))  # packed: q's rows are 3 * 32 * 128 elements apart
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not _rows_fit(q, KVCache(k=k, v=v, capacity=180_000))
    bnhd = _meta((1, 2**20 + 256, 16, 128)).transpose(1, 2)  # 2**20 + 256 rows of 16 heads
    assert not _rows_fit(bnhd[:, :, :256], KVCache(k=bnhd, v=bnhd, capacity=2**20 + 256))
    many = _meta((64, 32, 8192, 128))  # 2**31 elements, but each (batch, head) spans 2**20
    assert _rows_fit(many, KVCache(k=many, v=many, capacity=8192))
    pool = _meta((2**20, 16, 8, 128)).permute(0, 2, 1, 3)  # a 2**34-element pool: pages are int64 anyway
    assert _rows_fit(_meta((8, 32, 1, 128)), KVCache(k=pool, v=pool, capacity=4096))
    assert offsets.inputs_fit({"bias": _meta((1, 1, 2**15, 2**15)).expand(64, 32, -1, -1), "n": 3})
    assert not offsets.inputs_fit({"bias": _meta((1, 1, 2**16, 2**16))})
