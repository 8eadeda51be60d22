"""Decoding with a KV cache: the split-KV path, per-sequence lengths, paged caches, pre-rotated keys."""

import pytest
import torch

import attnfuse as af
from attnfuse.reference import gather_pages
from attnfuse.runtime.launch import run_attention
from attnfuse.testing import assert_matches_reference


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def mistral(q, k, v):
    return af.softmax(af.sliding_window(af.rope(q, k), 40)) @ v


@af.attention
def alibi_relu(q, k, v, bias):
    return af.relu_attention(af.additive_bias(af.alibi(af.causal(af.scaled_dot_product(q, k))), bias)) @ v


@af.attention
def cached_rope(q, k, v):
    return af.softmax(af.causal(af.rope(q, k, rotate_keys=False))) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v


def _cache(B, Hq, Hkv, Nq, N, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Nq, D, generator=g).to(dtype),
        torch.randn(B, Hkv, N, D, generator=g).to(dtype),
        torch.randn(B, Hkv, N, D, generator=g).to(dtype),
    )


def _check(out, ref, ref_lowp, dtype):
    assert_matches_reference(out, ref, ref_lowp, dtype)


@pytest.mark.parametrize("Nq", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("program", [llama, mistral], ids=lambda p: p.__name__)
def test_split_kv_matches_reference(program, group, Nq):
    q, k, v = _cache(2, 2 * group, 2, Nq, 130, 32, seed=Nq + group)
    lens = torch.tensor([130, 57], dtype=torch.int32)
    out, lse = run_attention(program.graph(), q, k, v, return_lse=True, kv_lens=lens, split_kv=True)
    ref, ref_lse = program.reference(q, k, v, kv_lens=lens, return_lse=True)
    lowp, lowp_lse = program.reference(q, k, v, kv_lens=lens, return_lse=True, dtype=torch.float32)
    _check(out, ref, lowp, torch.float32)
    _check(lse, ref_lse, lowp_lse, torch.float32)


def test_split_kv_is_the_default_for_few_queries_and_agrees_with_the_regular_kernel():
    q, k, v = _cache(2, 8, 2, 3, 100, 32, seed=1)
    assert torch.allclose(llama(q, k, v), run_attention(llama.graph(), q, k, v, split_kv=False), atol=1e-6)
    from attnfuse.runtime import launch
    from conftest import last_call

    launch.clear_cache()
    llama(q, k, v)
    call = last_call()
    assert call.decode is not None and call.forward is None and call.backward is None


def test_split_kv_with_an_unnormalised_normaliser_and_bias():
    q, k, v = _cache(2, 4, 1, 2, 90, 16, seed=2)
    bias = torch.randn(2, 1, 2, 90)
    out = run_attention(alibi_relu.graph(bias), q, k, v, {"bias": bias}, split_kv=True)
    _check(
        out,
        alibi_relu.reference(q, k, v, bias),
        alibi_relu.reference(q, k, v, bias, dtype=torch.float32),
        torch.float32,
    )


def test_split_kv_float16_and_block_sparse():
    q, k, v = _cache(1, 4, 2, 5, 120, 32, torch.float16, seed=3)
    bm = af.create_block_mask_from_blocks(lambda b, h, qb, kb: (kb % 2 == 0) | (kb == qb), 1, 4, 5, 120, block_size=16)
    out = run_attention(sparse.graph(bm), q, k, v, {"block_mask": bm}, split_kv=True)
    _check(out, sparse.reference(q, k, v, bm), sparse.reference(q, k, v, bm, dtype=torch.float16), torch.float16)


def test_kv_lens_equal_separate_calls_per_sequence():
    q, k, v = _cache(3, 4, 2, 6, 80, 32, seed=4)
    lens = torch.tensor([80, 31, 6], dtype=torch.int32)
    for split_kv in (True, False):
        out = run_attention(llama.graph(), q, k, v, kv_lens=lens, split_kv=split_kv)
        for b, n in enumerate(lens.tolist()):
            alone = llama(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
            torch.testing.assert_close(out[b : b + 1], alone, atol=2e-6, rtol=0)


def test_kv_lens_in_prefill_and_training():
    q, k, v = (t.requires_grad_(True) for t in _cache(2, 4, 2, 40, 70, 32, seed=5))
    lens = torch.tensor([70, 45], dtype=torch.int32)
    out = llama(q, k, v, kv_lens=lens)
    ref = llama.reference(q, k, v, kv_lens=lens)
    _check(out, ref, llama.reference(q, k, v, kv_lens=lens, dtype=torch.float32), torch.float32)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)
    assert torch.equal(got[1][1, :, 45:], torch.zeros_like(got[1][1, :, 45:]))  # keys past a length: no gradient


@pytest.mark.parametrize("split_kv", [True, False])
def test_paged_cache_matches_contiguous(split_kv):
    B, Hq, Hkv, Nq, D, page, pages = 3, 8, 2, 4, 32, 16, 6
    g = torch.Generator().manual_seed(6)
    pool_k, pool_v = (torch.randn(B * pages + 5, page, Hkv, D, generator=g) for _ in range(2))
    table = torch.randperm(B * pages + 5, generator=g)[: B * pages].view(B, pages).to(torch.int32)
    lens = torch.tensor([96, 50, 17], dtype=torch.int32)
    q = torch.randn(B, Hq, Nq, D, generator=g)
    out = run_attention(llama.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, split_kv=split_kv)
    contiguous = llama(q, gather_pages(pool_k, table), gather_pages(pool_v, table), kv_lens=lens)
    torch.testing.assert_close(out, contiguous, atol=2e-6, rtol=0)
    _check(
        out,
        llama.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table),
        llama.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table, dtype=torch.float32),
        torch.float32,
    )


def test_pre_rotated_keys():
    """rotate_keys=False: keys were rotated when cached; the result equals fusing the rotation."""
    q, k, v = _cache(2, 4, 2, 3, 64, 32, seed=7)
    lens = torch.tensor([64, 20], dtype=torch.int32)
    pos = torch.arange(64, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1)
    k1, k2 = k.double().chunk(2, dim=-1)
    rotated = (k.double() * emb.cos() + torch.cat((-k2, k1), dim=-1) * emb.sin()).float()
    torch.testing.assert_close(
        cached_rope(q, rotated, v, kv_lens=lens), llama(q, k, v, kv_lens=lens), atol=2e-6, rtol=0
    )


def test_bad_cache_inputs():
    q, k, v = _cache(2, 4, 2, 1, 32, 16)
    with pytest.raises(af.InputError, match=r"kv_lens must be an int32 \(or int64\) tensor of shape \(B,\) = \(2,\)"):
        llama(q, k, v, kv_lens=torch.tensor([3], dtype=torch.int32))
    with pytest.raises(af.InputError, match=r"a paged cache \(block_table given\) needs kv_lens"):
        llama(q, k.transpose(1, 2), v.transpose(1, 2), block_table=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(
        af.InputError, match=r"block_table must be an int32 \(or int64\) tensor of shape \(B, max_pages\)"
    ):
        llama(
            q,
            k.transpose(1, 2),
            v.transpose(1, 2),
            kv_lens=torch.tensor([1, 1], dtype=torch.int32),
            block_table=torch.zeros(3, 1, dtype=torch.int32),
        )
    with pytest.raises(af.InputError, match=r"the split-KV path has no backward"):
        run_attention(llama.graph(), q.requires_grad_(True), k, v, split_kv=True)


def test_rope_tables_need_every_sequence_to_hold_its_queries():
    @af.attention
    def tables(q, k, v, cos, sin):
        return af.softmax(af.rope(q, k, cos=cos, sin=sin)) @ v

    q, k, v = _cache(2, 2, 1, 4, 20, 16)
    cos, sin = torch.rand(20, 16), torch.rand(20, 16)
    with pytest.raises(af.InputError, match=r"every sequence needs at least Nq=4 keys \(kv_lens=\[20, 3\]\)"):
        tables(q, k, v, cos, sin, kv_lens=torch.tensor([20, 3], dtype=torch.int32))
