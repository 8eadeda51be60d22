"""af.create_block_mask with flex_attention's meaning: a token-level predicate cut by the block grid. Blocks
with no kept pair are skipped, blocks kept in full run unmasked, and partial blocks keep exactly their kept
pairs (their token masks, read by the kernels). Compared with a float64 dense attention of the same
token-level mask, computed here from the predicate; the block-level builder keeps the old meaning."""

import math
import pickle
import warnings

import pytest
import torch

import attnfuse as af
from attnfuse import InputError, block_mask as block_mask_module, errors
from attnfuse.block_mask import BlockMask
from attnfuse.testing import assert_matches_reference


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


def token_mask(predicate, B, H, Nq, Nk, block_size):
    """create_block_mask, its one-release notice silenced (``test_deprecation_notice_once`` checks it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return af.create_block_mask(predicate, B, H, Nq, Nk, block_size=block_size)


def dense_keep(predicate, B, H, Nq, Nk) -> torch.Tensor:
    """The predicate on every (b, h, q, kv) at once: (B, H, Nq, Nk) bool."""
    idx = (
        torch.arange(B).view(-1, 1, 1, 1),
        torch.arange(H).view(1, -1, 1, 1),
        torch.arange(Nq).view(1, 1, -1, 1),
        torch.arange(Nk).view(1, 1, 1, -1),
    )
    return torch.broadcast_to(predicate(*idx), (B, H, Nq, Nk))


def dense_attention(q, k, v, keep):
    """softmax(q·kᵀ/√D, masked by keep (B, H, Nq, Nk)) · v; a row keeping nothing gives 0."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    weights = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights @ v


def _check_against(out, ref64, ref_in_dtype, q, k, v):
    assert_matches_reference(out, ref64, ref_in_dtype, q.dtype)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref64, (q, k, v), dout.double())):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=0)


def _qkv(B, H, Nq, Nk, D=16):
    return (
        torch.randn(B, H, Nq, D, requires_grad=True),
        *(torch.randn(B, H, Nk, D, requires_grad=True) for _ in range(2)),
    )


@pytest.mark.parametrize("N, block_size", [(48, 16), (50, 16), (64, 32)])
def test_causal_predicate_equals_causal(N, block_size):
    """flex's causal mask_mod gives causal attention (not block-causal), forward and gradients."""
    q, k, v = _qkv(2, 2, N, N)
    mask = token_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, N, N, block_size)
    out = sparse(q, k, v, mask)
    _check_against(
        out, causal.reference(q, k, v, dtype=torch.float64), causal.reference(q, k, v, dtype=q.dtype), q, k, v
    )


def _predicates(B, H, Nq, Nk):
    """Flex-style mask_mods (prefix-LM, sliding window, documents, random) over (B, H, Nq, Nk)."""
    docs = torch.randint(0, 4, (B, max(Nq, Nk))).sort(dim=-1).values  # document ids per batch, ascending
    table = torch.rand(B, H, Nq, Nk) > 0.6
    return {
        "sliding_window": lambda b, h, q, kv: (q - kv >= 0) & (q - kv <= 10),
        "prefix_lm": lambda b, h, q, kv: (kv <= q) | (kv < 11),
        "documents": lambda b, h, q, kv: (docs[b, q] == docs[b, kv]) & (kv <= q),
        "random": lambda b, h, q, kv: table[b, h, q, kv] | (q == kv),
        "head_dependent": lambda b, h, q, kv: (q - kv).abs() <= 3 + 7 * h,
    }


@pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "documents", "random", "head_dependent"])
@pytest.mark.parametrize("Nq, Nk, block_size", [(48, 48, 16), (37, 60, 16), (64, 64, 32)])
def test_flex_predicates_match_the_dense_reference(name, Nq, Nk, block_size):
    B, H = 2, 2
    predicate = _predicates(B, H, Nq, Nk)[name]
    q, k, v = _qkv(B, H, Nq, Nk)
    mask = token_mask(predicate, B, H, Nq, Nk, block_size)
    keep = dense_keep(predicate, B, H, Nq, Nk)
    out = sparse(q, k, v, mask)
    _check_against(
        out, dense_attention(q.double(), k.double(), v.double(), keep), dense_attention(q, k, v, keep), q, k, v
    )


@pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "documents", "random", "head_dependent"])
@pytest.mark.parametrize("Nq, Nk, block_size", [(48, 48, 16), (37, 60, 16), (100, 70, 32)])
def test_block_facts(name, Nq, Nk, block_size):
    """Active blocks hold a kept pair; partial blocks (with a token mask) are the active ones that drop a pair
    that exists (inside Nq x Nk); the element mask is the predicate's; the lists name the active blocks."""
    B, H, bs = 2, 2, block_size
    predicate = _predicates(B, H, Nq, Nk)[name]
    mask = token_mask(predicate, B, H, Nq, Nk, bs)
    keep = dense_keep(predicate, B, H, Nq, Nk)
    QB, KB = -(-Nq // bs), -(-Nk // bs)
    padded = torch.zeros(B, H, QB * bs, KB * bs, dtype=torch.bool)
    padded[..., :Nq, :Nk] = keep
    exists = torch.zeros(QB * bs, KB * bs, dtype=torch.bool)
    exists[:Nq, :Nk] = True
    per_block = lambda t: t.view(*t.shape[:-2], QB, bs, KB, bs).sum(dim=(-3, -1))  # noqa: E731
    kept, present = per_block(padded), per_block(exists)
    assert torch.equal(mask.active, kept > 0)
    assert torch.equal(mask.partial_index >= 0, (kept > 0) & (kept < present))
    assert torch.equal(mask.to_dense(), keep)
    assert torch.equal(mask.kv_num_blocks, (kept > 0).sum(-1, dtype=torch.int32))
    assert mask.partial_blocks() == int(((kept > 0) & (kept < present)).sum())


def test_identical_token_masks_are_stored_once():
    mask = token_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, 16)
    assert mask.partial_blocks() == 16 and mask.partial_masks.shape == (1, 16, 16)
    assert torch.equal(mask.partial_masks[0], torch.ones(16, 16, dtype=torch.bool).tril())


def test_predicate_is_evaluated_per_chunk_of_block_rows(monkeypatch):
    """With a small budget, each call sees a few block rows of queries (never the whole Nq x Nk), and the mask
    is the one a single call gives."""
    B, H, Nq, Nk, bs = 2, 2, 100, 70, 16
    predicate = _predicates(B, H, Nq, Nk)["documents"]
    whole = token_mask(predicate, B, H, Nq, Nk, bs)
    rows = []

    def recording(b, h, q, kv):
        rows.append(q.numel())
        return predicate(b, h, q, kv)

    monkeypatch.setattr(block_mask_module, "CHUNK_ELEMENTS", B * H * 2 * bs * Nk)
    chunked = token_mask(recording, B, H, Nq, Nk, bs)
    assert rows == [32, 32, 32, 4]  # two block rows a call, the last one ragged
    for name in ("active", "kv_indices", "q_indices", "partial_index"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert torch.equal(chunked.to_dense(), whole.to_dense())


def test_flex_keyword_names():
    predicate = lambda b, h, q, kv: (q - kv).abs() < 5  # noqa: E731
    ours = token_mask(predicate, 2, None, 40, 50, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        flex = af.create_block_mask(predicate, 2, None, Q_LEN=40, KV_LEN=50, BLOCK_SIZE=16)
        pair = af.create_block_mask(predicate, 2, None, Q_LEN=40, KV_LEN=50, BLOCK_SIZE=(16, 16))
        default = af.create_block_mask(predicate, 2, None, Q_LEN=40, KV_LEN=50)
        for mask in (flex, pair):
            assert mask.block_size == 16 and torch.equal(mask.to_dense(), ours.to_dense())
        assert default.block_size == 128 and torch.equal(default.to_dense(), ours.to_dense())
        with pytest.raises(InputError, match=r"give Nq or Q_LEN \(flex_attention's name for it\), not both"):
            af.create_block_mask(predicate, 2, None, 40, 50, Q_LEN=40)
        with pytest.raises(InputError, match=r"BLOCK_SIZE must be an int or a \(q, kv\) pair of equal sizes"):
            af.create_block_mask(predicate, 2, None, 40, 50, BLOCK_SIZE=(16, 32))


@pytest.mark.parametrize(
    "result, message",
    [
        (lambda q, kv: (q >= kv).int(), r"must return a bool tensor broadcastable to .* got torch.int32"),
        (lambda q, kv: True, r"must return a bool tensor broadcastable to .* got bool"),
        (lambda q, kv: torch.ones(3, 5, dtype=torch.bool), r"got shape \(3, 5\)"),
    ],
)
def test_bad_predicate_results(result, message):
    with pytest.raises(InputError, match=message):
        token_mask(lambda b, h, q, kv: result(q, kv), None, None, 32, 32, 16)


def test_block_level_builder_keeps_the_old_meaning():
    """create_block_mask_from_blocks reads block indices: ``qb >= kb`` is block-causal, every active block
    kept in full."""
    N, bs = 48, 16
    mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, 2, N, N, block_size=bs)
    grid = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(mask.active, grid.expand(1, 2, 3, 3)) and mask.partial_blocks() == 0
    keep = grid.repeat_interleave(bs, 0).repeat_interleave(bs, 1).expand(1, 2, N, N)
    q, k, v = _qkv(1, 2, N, N)
    out = sparse(q, k, v, mask)
    _check_against(
        out, dense_attention(q.double(), k.double(), v.double(), keep), dense_attention(q, k, v, keep), q, k, v
    )


def test_deprecation_notice_once(monkeypatch):
    """create_block_mask says once per process that its predicate is now per token and where the block-level
    builder went; the block-level builder says nothing."""
    monkeypatch.setattr(errors, "_deprecations_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 32, 32, block_size=16)
    with pytest.warns(
        DeprecationWarning,
        match=r"af.create_block_mask now evaluates its predicate per token, .*"
        r"call af.create_block_mask_from_blocks\(predicate, B, H, Nq, Nk",
    ):
        af.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, block_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, block_size=16)


def test_decoding_few_queries_with_kv_lens():
    """The split-KV path applies the token masks element by element (no lists)."""
    B, H, Nq, Nk = 2, 2, 3, 90
    q = torch.randn(B, H, Nq, 16)
    k, v = (torch.randn(B, H, Nk, 16) for _ in range(2))
    lens = torch.tensor([90, 57], dtype=torch.int32)
    mask = token_mask(lambda b, h, qi, kv: (kv % 7 != qi) & (kv < 70 + 5 * qi), None, None, Nq, Nk, 16)
    assert mask.partial_blocks() > 0
    out = sparse(q, k, v, mask, kv_lens=lens)
    assert_matches_reference(
        out,
        sparse.reference(q, k, v, mask, kv_lens=lens, dtype=torch.float64),
        sparse.reference(q, k, v, mask, kv_lens=lens, dtype=q.dtype),
        q.dtype,
    )


def _fields(mask: BlockMask) -> dict:
    return {
        "Nq": mask.Nq,
        "Nk": mask.Nk,
        "block_size": mask.block_size,
        "kv_heavy_blocks": mask.kv_heavy_blocks,
        **{name: t.clone() for name, t in zip(block_mask_module.TENSORS, mask.tensors())},
    }


def test_hand_built_partial_blocks_are_checked():
    mask = token_mask(lambda b, h, q, kv: q >= kv, None, None, 48, 48, 16)
    assert torch.equal(BlockMask(**_fields(mask)).to_dense(), mask.to_dense())
    bad = _fields(mask)
    bad["partial_index"][0, 0, 1, 1] = 5
    with pytest.raises(InputError, match=r"block_mask.partial_index\[0, 0, 1, 1\] = 5 is outside \[-1, 1\)"):
        BlockMask(**bad)
    bad = _fields(mask)
    bad["partial_index"][0, 0, 0, 2] = 0
    with pytest.raises(
        InputError,
        match=r"block_mask.partial_index\[0, 0, 0, 2\] = 0 names a token mask for a "
        r"block that block_mask.active\[0, 0, 0, 2\] marks inactive",
    ):
        BlockMask(**bad)
    bad = _fields(mask)
    bad["partial_masks"] = bad["partial_masks"][:, :8]
    with pytest.raises(
        InputError,
        match=r"block_mask.partial_masks must be a torch.bool tensor \(P, block_size, "
        r"block_size\) = \(1, 16, 16\)",
    ):
        BlockMask(**bad)
    bad = _fields(mask)
    del bad["partial_masks"]
    with pytest.raises(InputError, match="give partial_index and partial_masks together, or neither"):
        BlockMask(**bad)


def test_copies_keep_the_token_masks():
    mask = token_mask(lambda b, h, q, kv: (q - kv).abs() < 9, None, None, 48, 48, 16)
    copy = pickle.loads(pickle.dumps(mask))
    assert copy.partial_blocks() == mask.partial_blocks() > 0
    assert torch.equal(copy.to_dense(), mask.to_dense())
