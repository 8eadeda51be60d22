"""Block-sparse attention: only listed blocks are visited, forward and backward; BigBird."""

import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def sparse_llama(q, k, v, block_mask):
    return af.softmax(af.alibi(af.block_sparse(af.causal(af.rope(q, k)), block_mask))) @ v


def bigbird(B, H, N, block_size, window=1, globals_=2, randoms=3, seed=0):
    """BigBird's block pattern: a band of ±window blocks, `globals_` global blocks, `randoms` random blocks
    per query block (per batch and head)."""
    blocks = -(-N // block_size)
    g = torch.Generator().manual_seed(seed)
    random = torch.zeros(B, H, blocks, blocks, dtype=torch.bool)
    random.scatter_(-1, torch.randint(0, blocks, (B, H, blocks, randoms), generator=g), True)

    def predicate(b, h, qb, kb):
        band = (qb - kb).abs() <= window
        glob = (qb < globals_) | (kb < globals_)
        return band | glob | random[b, h, qb, kb]

    return af.create_block_mask_from_blocks(predicate, B, H, N, N, block_size=block_size)


def _grads_match(program, q, k, v, *extra):
    out = program(q, k, v, *extra)
    ref = program.reference(q, k, v, *extra)
    assert_matches_reference(out, ref, program.reference(q, k, v, *extra, dtype=q.dtype), q.dtype)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout.double())):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("program", [sparse, sparse_llama], ids=lambda p: p.__name__)
def test_bigbird_forward_and_backward(program, block_size):
    # N not a multiple of blocks; at block_size 64, each listed block takes two of the interpreter's 32-row
    # programs, and the one past N returns at once
    q, k, v = (torch.randn(2, 4, 150, 32, requires_grad=True) for _ in range(3))
    _grads_match(program, q, k, v, bigbird(2, 4, 150, block_size, seed=block_size))


def test_gqa_and_broadcast_mask():
    q = torch.randn(1, 4, 100, 32, requires_grad=True)
    k, v = (torch.randn(1, 2, 100, 32, requires_grad=True) for _ in range(2))
    mask = af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: (qb + kb) % 3 != 0, None, None, 100, 100, block_size=32
    )
    _grads_match(sparse, q, k, v, mask)


def test_rows_with_no_active_block_are_zero():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    mask = af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: qb + kb > 100, None, None, 64, 64, block_size=32
    )  # none
    assert torch.equal(sparse(q, k, v, mask), torch.zeros(1, 2, 64, 16))


def test_inactive_blocks_are_never_visited():
    """NaN in every key block a query block does not list must not reach its rows: the forward's, and dQ
    of those rows (checked against float64 autograd through the reference on the clean values) and dK, dV of
    the keys only those rows list."""
    q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
    active = torch.eye(4, dtype=torch.bool)  # each query block sees its own key block only
    mask = af.BlockMask.from_blocks(active, 128, 128, block_size=32)
    poisoned = v.detach().clone()
    poisoned[:, :, 32:] = float("nan")
    poisoned.requires_grad_(True)
    out = sparse(q, k, poisoned, mask)
    torch.testing.assert_close(out[:, :, :32], sparse(q, k, v, mask)[:, :, :32], atol=0, rtol=0)
    assert torch.isnan(out[:, :, 32:]).all()
    dout = torch.zeros_like(out)
    dout[:, :, :32] = torch.randn(1, 2, 32, 16)  # only the first query block's rows (the others are NaN)
    dq, dk, dv = torch.autograd.grad(out, (q, k, poisoned), dout)
    ref = sparse.reference(q, k, v, mask)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    in_dtype = torch.autograd.grad(sparse.reference(q, k, v, mask, dtype=torch.float32), (q, k, v), dout)
    for name, got, w, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want, in_dtype):
        assert_matches_reference(got[:, :, :32], w[:, :, :32], b[:, :, :32], torch.float32, what=name)


def test_sparse_kernel_iterates_the_block_lists():
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    source = sparse.source(q, k, v, bigbird(1, 2, 64, 32))
    assert "visit only the blocks it lists" in source and "# full blocks" not in source
    assert "blocks heaviest first" in source


def test_block_sparse_programs_take_the_listed_tiles():
    """A program whose mask lists its blocks takes the tile table's "listed" rules (short loops)."""
    from attnfuse.passes.fuse import fuse
    from attnfuse.passes.lower import KernelConfig, lower
    from attnfuse.passes.tile import choose_tiles

    config = KernelConfig(
        arch="sm90", dtype="bfloat16", head_dim=128, head_dim_v=128, group=4, save_lse=False, fp32_precision="ieee"
    )
    lowered = lower(fuse(sparse.graph(bigbird(1, 2, 256, 128))), config)
    assert lowered.tiles["forward"] == choose_tiles("sm90", "listed", 128, "forward", "bfloat16")
    assert lowered.tiles["forward"] != choose_tiles("sm90", "dense", 128, "forward", "bfloat16")


def _heavy_last_column(B, H, N, block_size):
    """Diagonal blocks, plus a last key block (ragged: N not a multiple of the block) every query block
    lists."""

    def predicate(b, h, qb, kb):
        return (qb == kb) | (kb == -(-N // block_size) - 1)

    return af.create_block_mask_from_blocks(predicate, B, H, N, N, block_size=block_size)


@pytest.mark.parametrize(
    "program,Hkv,N,make_mask",
    [
        (sparse_llama, 2, 192, lambda H, N: bigbird(1, H, N, 16, globals_=1, randoms=1, seed=3)),
        (sparse, 1, 330, lambda H, N: _heavy_last_column(1, H, N, 64)),
    ],
    ids=["bigbird-gqa2", "ragged-heavy-block-mqa"],
)
def test_heavy_key_blocks_split_over_the_group_heads(program, Hkv, N, make_mask):
    """GQA with key blocks every query block lists: the dK/dV kernel spreads them over the group's query
    heads and sums the shares in the group's last program. Gradients match float64, and a second run is
    bitwise equal (the share counters are zero again after each launch)."""
    mask = make_mask(4, N)
    assert mask.kv_heavy_blocks > 0
    q = torch.randn(1, 4, N, 32, requires_grad=True)
    k, v = (torch.randn(1, Hkv, N, 32, requires_grad=True) for _ in range(2))
    _grads_match(program, q, k, v, mask)
    dout = torch.randn(1, 4, N, 32)
    first, second = (torch.autograd.grad(program(q, k, v, mask), (q, k, v), dout) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert "share of a heavy key block" in program.source(q, k, v, mask, kernel="dkdv")
