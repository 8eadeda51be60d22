"""BlockMask: the CSR form against a brute-force loop, broadcasting, ragged N, validation, memory."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse import InputError
from attnfuse.block_mask import BlockMask, create_block_mask_from_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_csr(mask: BlockMask) -> None:
    """kv_* and q_* against a plain Python loop over ``mask.active``."""
    active = mask.active
    Bm, Hm, QB, KB = active.shape
    assert mask.kv_num_blocks.shape == (Bm, Hm, QB) and mask.kv_indices.shape == (Bm, Hm, QB, KB)
    assert mask.q_num_blocks.shape == (Bm, Hm, KB) and mask.q_indices.shape == (Bm, Hm, KB, QB)
    for t in (mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices):
        assert t.dtype == torch.int32
    grid = active.tolist()
    kv_num, kv_idx = mask.kv_num_blocks.tolist(), mask.kv_indices.tolist()
    q_num, q_idx = mask.q_num_blocks.tolist(), mask.q_indices.tolist()
    for b in range(Bm):
        for h in range(Hm):
            for i in range(QB):
                cols = [j for j in range(KB) if grid[b][h][i][j]]
                assert kv_num[b][h][i] == len(cols), (b, h, i)
                assert kv_idx[b][h][i][: len(cols)] == cols, (b, h, i)
            for j in range(KB):
                rows = [i for i in range(QB) if grid[b][h][i][j]]
                assert q_num[b][h][j] == len(rows), (b, h, j)
                assert q_idx[b][h][j][: len(rows)] == rows, (b, h, j)
    for order, counts in ((mask.q_block_order, mask.kv_num_blocks), (mask.kv_block_order, mask.q_num_blocks)):
        totals = counts.sum(dim=(0, 1)).tolist()
        assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(totals)))  # a permutation
        expected = sorted(range(len(totals)), key=lambda i: (-totals[i], i))  # heaviest first, ties in order
        assert order.tolist() == expected
    totals = mask.q_num_blocks.sum(dim=(0, 1)).tolist()
    assert mask.kv_heavy_blocks == sum(1 for t in totals if t > 0 and t >= 2 * sum(totals) / len(totals))


@pytest.mark.parametrize("seed", range(6))
def test_csr_matches_brute_force_on_random_grids(seed):
    g = torch.Generator().manual_seed(seed)
    B, H = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
    QB, KB = (int(x) for x in torch.randint(1, 9, (2,), generator=g))
    density = float(torch.rand((), generator=g))
    active = torch.rand(B, H, QB, KB, generator=g) < density
    bs = 16
    mask = BlockMask.from_blocks(active, Nq=QB * bs, Nk=KB * bs, block_size=bs)
    assert torch.equal(mask.active, active)
    check_csr(mask)


@pytest.mark.parametrize("seed", range(4))
def test_create_block_mask_from_random_predicate(seed):
    B, H, Nq, Nk, bs = 2, 3, 100, 70, 16
    QB, KB = cdiv(Nq, bs), cdiv(Nk, bs)
    scores = torch.randn(B, H, QB, KB)
    threshold = float(torch.randn(()))
    mask = create_block_mask_from_blocks(
        lambda b, h, qb, kb: scores[b, h, qb, kb] > threshold, B, H, Nq, Nk, block_size=bs
    )
    assert mask.active.shape == (B, H, QB, KB)
    assert torch.equal(mask.active, scores > threshold)
    check_csr(mask)


def test_all_and_no_blocks_active():
    full = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= 0, None, None, 64, 48, block_size=16)
    assert full.kv_num_blocks.tolist() == [[[3] * 4]] and full.sparsity() == 0.0
    check_csr(full)
    empty = create_block_mask_from_blocks(lambda b, h, qb, kb: qb < 0, None, None, 64, 48, block_size=16)
    assert empty.kv_num_blocks.sum() == 0 and empty.q_num_blocks.sum() == 0 and empty.sparsity() == 1.0
    check_csr(empty)


def test_predicate_arguments():
    seen = {}

    def predicate(b, h, qb, kb):
        seen.update(b=b, h=h, qb=qb, kb=kb)
        return qb >= kb

    create_block_mask_from_blocks(predicate, 2, 3, 64, 32, block_size=16)
    assert seen["b"].shape == (2, 1, 1, 1) and seen["h"].shape == (1, 3, 1, 1)
    assert seen["qb"].shape == (1, 1, 4, 1) and seen["kb"].shape == (1, 1, 1, 2)
    assert seen["b"].flatten().tolist() == [0, 1] and seen["kb"].flatten().tolist() == [0, 1]
    for t in seen.values():
        assert t.dtype == torch.int64


@pytest.mark.parametrize("B, H, shape", [(None, None, (1, 1)), (2, None, (2, 1)), (None, 3, (1, 3)), (2, 3, (2, 3))])
def test_batch_and_head_broadcasting(B, H, shape):
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, B, H, 64, 64, block_size=16)
    assert mask.active.shape == (*shape, 4, 4)
    expected = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(mask.active, expected.expand(*shape, 4, 4))
    check_csr(mask)


def test_predicate_depending_on_batch_and_head():
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: (qb + kb + b + h) % 2 == 0, 2, 2, 48, 48, block_size=16)
    for b in range(2):
        for h in range(2):
            for i in range(3):
                for j in range(3):
                    assert mask.active[b, h, i, j].item() == ((i + j + b + h) % 2 == 0)
    check_csr(mask)


@pytest.mark.parametrize("Nq, Nk, bs", [(100, 37, 16), (33, 65, 32), (129, 1, 64), (1, 300, 128), (17, 17, 16)])
def test_n_not_a_multiple_of_block_size(Nq, Nk, bs):
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, Nq, Nk, block_size=bs)
    assert mask.active.shape == (1, 1, cdiv(Nq, bs), cdiv(Nk, bs))
    assert (mask.Nq, mask.Nk, mask.block_size) == (Nq, Nk, bs)
    check_csr(mask)
    assert mask.to_dense().shape == (1, 1, Nq, Nk)


@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_block_sizes(bs):
    Nq, Nk = 3 * bs + 5, 2 * bs
    active = torch.rand(2, 1, cdiv(Nq, bs), cdiv(Nk, bs)) < 0.5
    mask = BlockMask.from_blocks(active, Nq, Nk, block_size=bs)
    assert mask.block_size == bs
    check_csr(mask)
    dense = mask.to_dense()
    for i in range(0, Nq, 7):
        for j in range(0, Nk, 5):
            assert dense[:, :, i, j].tolist() == active[:, :, i // bs, j // bs].tolist()


@pytest.mark.parametrize("Nq, Nk, bs", [(40, 23, 16), (64, 64, 32), (5, 70, 64)])
def test_to_dense_matches_definition(Nq, Nk, bs):
    active = torch.rand(2, 3, cdiv(Nq, bs), cdiv(Nk, bs)) < 0.4
    mask = BlockMask.from_blocks(active, Nq, Nk, block_size=bs)
    dense = mask.to_dense()
    assert dense.shape == (2, 3, Nq, Nk) and dense.dtype == torch.bool
    expected = torch.empty(2, 3, Nq, Nk, dtype=torch.bool)
    for i in range(Nq):
        for j in range(Nk):
            expected[:, :, i, j] = active[:, :, i // bs, j // bs]
    assert torch.equal(dense, expected)


@pytest.mark.parametrize(
    "grid_shape, expected", [((2, 3), (1, 1, 2, 3)), ((4, 2, 3), (1, 4, 2, 3)), ((2, 4, 2, 3), (2, 4, 2, 3))]
)
def test_from_blocks_ranks(grid_shape, expected):
    active = torch.rand(grid_shape) < 0.5
    mask = BlockMask.from_blocks(active, Nq=20, Nk=40, block_size=16)
    assert mask.active.shape == expected
    check_csr(mask)


def test_from_blocks_wrong_grid_shape():
    with pytest.raises(
        InputError,
        match=r"active must end in \(ceil\(Nq/block_size\), ceil\(Nk/block_size\)\) = "
        r"\(2, 3\), got \(3, 3\)",
    ):
        BlockMask.from_blocks(torch.ones(3, 3, dtype=torch.bool), Nq=20, Nk=40, block_size=16)


@pytest.mark.parametrize(
    "active",
    [torch.ones(2, 3), torch.ones(3, dtype=torch.bool), torch.ones(1, 1, 1, 2, 3, dtype=torch.bool), [[True] * 3] * 2],
    ids=["float", "1-D", "5-D", "list"],
)
def test_from_blocks_bad_grid(active):
    with pytest.raises(
        InputError,
        match=r"active must be a bool tensor \(QB, KB\), \(H, QB, KB\) or "
        r"\(B, H, QB, KB\)",
    ):
        BlockMask.from_blocks(active, Nq=20, Nk=40, block_size=16)


@pytest.mark.parametrize(
    "result",
    [
        lambda qb, kb: qb - kb,
        lambda qb, kb: (qb >= kb).float(),
        lambda qb, kb: (qb >= kb).to(torch.uint8),
        lambda qb, kb: 1,
    ],
    ids=["int64", "float", "uint8", "python int"],
)
def test_predicate_must_return_bool(result):
    with pytest.raises(InputError, match=r"the block predicate must return a bool tensor, got torch\.\w+"):
        create_block_mask_from_blocks(lambda b, h, qb, kb: result(qb, kb), None, None, 64, 64, block_size=16)


def test_predicate_may_return_a_python_bool():
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: True, 2, None, 40, 40, block_size=16)
    assert mask.active.shape == (2, 1, 3, 3) and bool(mask.active.all())
    check_csr(mask)


@pytest.mark.parametrize("bs", [0, 8, 15, 24, 48, 100, -16, 16.0, "16", None, True])
def test_bad_block_size(bs):
    match = r"block_size must be a power of two >= 16, got " + repr(bs).replace(".", r"\.")
    with pytest.raises(InputError, match=match):
        create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 64, 64, block_size=bs)
    with pytest.raises(InputError, match=match):
        BlockMask.from_blocks(torch.ones(4, 4, dtype=torch.bool), 64, 64, block_size=bs)


@pytest.mark.parametrize("Nq, Nk", [(0, 64), (64, 0), (-1, 64), (64.0, 64)])
def test_bad_lengths(Nq, Nk):
    with pytest.raises(InputError, match=r"N[qk] must be a positive int, got "):
        create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, Nq, Nk, block_size=16)


def test_repr_and_sparsity():
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 64, 64, block_size=16)
    assert mask.sparsity() == pytest.approx(6 / 16)
    assert repr(mask) == (
        "BlockMask(Nq=64, Nk=64, block_size=16, shape=(1, 1, 4, 4), sparsity=37.5%, partial_blocks=0)"
    )


def test_is_a_runtime_input():
    assert BlockMask.__attnfuse_runtime_input__ is True


def test_memory_of_a_128k_mask():
    N, bs = 131072, 128
    mask = create_block_mask_from_blocks(
        lambda b, h, qb, kb: (qb >= kb) & (qb - kb < 64), None, None, N, N, block_size=bs
    )
    assert mask.active.shape == (1, 1, N // bs, N // bs)
    parts = (mask.active, mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices)
    total = sum(t.numel() * t.element_size() for t in parts)
    assert total < 16 * 2**20, f"{total / 2**20:.1f} MiB"
    # spot-check the CSR of a few rows of the 1024 x 1024 grid
    for i in (0, 1, 63, 64, 500, 1023):
        cols = list(range(max(0, i - 63), i + 1))
        assert mask.kv_num_blocks[0, 0, i].item() == len(cols)
        assert mask.kv_indices[0, 0, i, : len(cols)].tolist() == cols


# --- the mask in a program --------------------------------------------------------------------------------


@af.attention
def sparse_causal(q, k, v, block_mask):
    s = af.scaled_dot_product(q, k)
    s = af.block_sparse(s, block_mask)
    return af.softmax(s) @ v


@pytest.mark.parametrize("B, H", [(None, None), (2, None), (2, 2)])
def test_block_sparse_program_matches_reference(B, H):
    Nq, Nk, bs = 40, 36, 16
    scores = torch.randn(B or 1, H or 1, cdiv(Nq, bs), cdiv(Nk, bs))
    mask = create_block_mask_from_blocks(
        lambda b, h, qb, kb: (scores[b, h, qb, kb] > 0) | (qb == kb), B, H, Nq, Nk, block_size=bs
    )
    q, k, v = torch.randn(2, 2, Nq, 16), torch.randn(2, 2, Nk, 16), torch.randn(2, 2, Nk, 16)
    out = sparse_causal(q, k, v, mask)
    ref = sparse_causal.reference(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dense = mask.to_dense().expand(2, 2, Nq, Nk)
    s = (q.double() @ k.double().transpose(-1, -2)) * 16**-0.5
    weights = torch.softmax(s.masked_fill(~dense, float("-inf")), dim=-1)
    torch.testing.assert_close(ref, weights @ v.double())
