"""Decoding from a packed prefill: ``af.packed_to_cache`` and ``af.packed_to_pages`` give each document of a packed
call a cache of its own, and a decoding step from it equals the float64 reference run on that document's whole
sequence (its prefill and the new token), RoPE positions included, with GQA and documents of 0 and 1 tokens."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.examples import llama
from attnfuse.testing.tolerances import assert_matches_reference

LENGTHS = [5, 0, 9, 1]
Hq, Hkv, D = 4, 2, 16


def _prefill():
    total = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(1, h, total, D) for h in (Hq, Hkv, Hkv))
    return cu, q, k, v


def _new_token():
    docs = len(LENGTHS)
    return torch.randn(docs, Hq, 1, D), torch.randn(docs, Hkv, 1, D), torch.randn(docs, Hkv, 1, D)


def _check_step(out, cu, q, k, v, q_new, k_new, v_new):
    """Each document's decoding output against the reference of its whole sequence (the last query's row)."""
    for d, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        seq = [
            torch.cat((t[:, :, start:end], new[d : d + 1]), dim=2) for t, new in ((q, q_new), (k, k_new), (v, v_new))
        ]
        want64 = llama.reference(*seq)[:, :, -1:]
        want32 = llama.reference(*seq, dtype=torch.float32)[:, :, -1:]
        assert_matches_reference(out[d : d + 1], want64, want32, torch.float32, what=f"document {d}")


def test_decoding_from_a_contiguous_cache_of_a_packed_prefill():
    cu, q, k, v = _prefill()
    packed_out = llama(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)  # the prefill itself, packed
    cache = af.packed_to_cache(k, v, cu, capacity=max(LENGTHS) + 2)
    assert cache.k.shape == (len(LENGTHS), Hkv, max(LENGTHS) + 2, D) and cache.block_table is None
    assert cache.kv_lens.tolist() == LENGTHS and cache.kv_lens.dtype == torch.int32
    for d, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        assert torch.equal(cache.k[d, :, : end - start], k[0, :, start:end])
        assert torch.equal(cache.v[d, :, : end - start], v[0, :, start:end])
    q_new, k_new, v_new = _new_token()
    rows = torch.arange(len(LENGTHS))
    cache.k[rows, :, cache.kv_lens.long()] = k_new[:, :, 0]  # decoding appends each document's new key
    cache.v[rows, :, cache.kv_lens.long()] = v_new[:, :, 0]
    out = llama(q_new, cache.k, cache.v, kv_lens=cache.kv_lens + 1)
    _check_step(out, cu, q, k, v, q_new, k_new, v_new)
    assert packed_out.shape == q.shape


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decoding_from_pages_of_a_packed_prefill(page_size):
    cu, q, k, v = _prefill()
    cache = af.packed_to_pages(k, v, cu, page_size=page_size, spare_pages=1)
    pages = [-(-n // page_size) + 1 for n in LENGTHS]
    assert cache.k.shape == (sum(pages), page_size, Hkv, D) and cache.block_table.shape == (len(LENGTHS), max(pages))
    q_new, k_new, v_new = _new_token()
    lens = cache.kv_lens.long()
    page = cache.block_table.long()[torch.arange(len(LENGTHS)), lens // page_size]
    cache.k[page, lens % page_size] = k_new[:, :, 0]
    cache.v[page, lens % page_size] = v_new[:, :, 0]
    out = llama(q_new, cache.k, cache.v, kv_lens=cache.kv_lens + 1, block_table=cache.block_table, kv_layout="NHD")
    _check_step(out, cu, q, k, v, q_new, k_new, v_new)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k, v, cu: af.packed_to_cache(k, v, cu.flip(0)), "cu_seqlens must rise from 0 to the packed length 15"),
        (lambda k, v, cu: af.packed_to_cache(k, v, cu[:-1]), "cu_seqlens must rise from 0 to the packed length 15"),
        (lambda k, v, cu: af.packed_to_cache(k, v, cu.float()), "cu_seqlens must be a"),
        (lambda k, v, cu: af.packed_to_cache(k, v, cu, capacity=8), "capacity must be an int of at least the longest"),
        (lambda k, v, cu: af.packed_to_cache(k[0], v, cu), "k must be a packed"),
        (lambda k, v, cu: af.packed_to_cache(k, v[:, :1], cu), "k and v must have the same heads and rows"),
        (lambda k, v, cu: af.packed_to_pages(k, v, cu, page_size=0), "page_size must be a positive int"),
        (lambda k, v, cu: af.packed_to_pages(k, v, cu, 4, spare_pages=-1), "spare_pages must be an int >= 0"),
    ],
)
def test_bad_input_names_the_argument(call, message):
    cu, _, k, v = _prefill()
    with pytest.raises(af.InputError, match=message):
        call(k, v, cu)
