"""How the generated kernels' programs map to (block, batch x head).

The forward and dQ kernels walk their heads in groups of HEAD_GROUP (``launcher.head_group``): on CPU
tensors groups of 3, here every size. The dK/dV and decode kernels put more (batch, head) programs than a
CUDA grid holds along y (65535) over the grid's y and z; the interpreter has no such limit, so these tests
lower it (``GRID_YZ_LIMIT``) to run the split layout on small inputs; tests/test_gpu.py runs it past the
real one."""

import pytest
import torch

import attnfuse as af
from attnfuse.errors import InputError
from attnfuse.runtime import launch, launcher
from attnfuse.runtime.launcher import head_grid
from attnfuse.testing import assert_matches_reference
from conftest import last_call


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


def test_head_grid_splits_heads_over_y_and_z():
    assert head_grid(65535, "B x Hq") == (65535, 1)
    assert head_grid(65536, "B x Hq") == (32768, 2)
    assert head_grid(4096 * 32, "B x Hq") == (65536 // 2, 4)
    for heads in (65535 * 3, 70000, 65535 * 8, 65535 * 65535):
        y, z = head_grid(heads, "B x Hq")
        assert y * z == heads and y <= 65535 and z <= 65535


def test_head_grid_names_a_count_it_cannot_split():
    with pytest.raises(InputError, match=r"B x Hkv = 196611 programs .* at most 65535 sequences a call"):
        head_grid(65537 * 3, "B x Hkv")  # 65537 sequences (a prime count), 3 heads


def _check_training(B, Hq, Hkv, Nq, Nk, D=16):
    """Causal forward and gradients of random inputs against the float64 reference."""
    leaves = [torch.randn(B, h, n, D, requires_grad=True) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk))]
    dout = torch.randn(B, Hq, Nq, D)
    out = causal(*leaves)
    assert_matches_reference(
        out, causal.reference(*leaves), causal.reference(*leaves, dtype=torch.float32), torch.float32
    )
    grads = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(causal.reference(*leaves), leaves, dout.double())
    lowp = torch.autograd.grad(causal.reference(*leaves, dtype=torch.float32), leaves, dout)
    for got, ref, ref_lowp, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, ref, ref_lowp, torch.float32, what=f"d{name}")


@pytest.mark.parametrize("group", [1, 2, 5, 12])
def test_forward_and_dq_walk_heads_in_groups(monkeypatch, group):
    """12 query heads (3 sequences x 4, GQA 2) of 3 query blocks each, in groups of 1, 2, 5 (the last group
    of 2) and all 12: every program takes one (block, head) pair, and the results match float64."""
    monkeypatch.setattr(launcher, "INTERPRETER_HEAD_GROUP", group)
    _check_training(3, 4, 2, 40, 40)


def test_head_group_is_all_heads_while_their_keys_fit_in_l2(monkeypatch):
    """On a GPU with a 60 MiB L2 cache: all heads together up to L2_SHARE of it, else one at a time."""
    monkeypatch.setattr(launcher, "l2_bytes", lambda device: 60 * 2**20)
    cuda = torch.device("cuda")
    assert launcher.head_group(48, 25_165_824, cuda) == 48  # GPT-2 at N 2048: 4 x 12 heads' K and V
    assert launcher.head_group(32, 33_554_432, cuda) == 32  # Llama-3-8B at N 8192: 8 kv heads
    assert launcher.head_group(48, 100_663_296, cuda) == 1  # GPT-2 at N 8192
    assert launcher.head_group(7, int(launcher.L2_SHARE * 60 * 2**20), cuda) == 7
    assert launcher.head_group(7, int(launcher.L2_SHARE * 60 * 2**20) + 1, cuda) == 1


@pytest.fixture
def small_grid_limit(monkeypatch):
    """A grid limit of 4 along y and z, with no plan cached under the real one."""
    monkeypatch.setattr(launcher, "GRID_YZ_LIMIT", 4)
    launch.clear_cache()
    yield
    launch.clear_cache()


@pytest.mark.parametrize("Nq,Nk", [(40, 40), (80, 16)], ids=["square", "one-split-key-block"])
def test_training_past_the_grid_limit_matches_float64(small_grid_limit, Nq, Nk):
    """The dK/dV kernel's 6 kv-head programs on a grid of at most 4 along y: (blocks, 3, 2). With one key
    block that 80 queries see, the kernel splits it over the group's query heads (``split_blocks``: under
    the interpreter, grids under 8 programs)."""
    _check_training(3, 4, 2, Nq, Nk)


def test_split_kv_decoding_past_the_grid_limit_matches_float64(small_grid_limit):
    """Split-KV decoding with 6 kv-head programs, each with two blocks of query rows (a group of 8 heads
    of 16 queries): grid (splits, 3, 2 x 2)."""
    B, Hq, Hkv, Nq, N, D = 3, 16, 2, 16, 70, 16
    q = torch.randn(B, Hq, Nq, D)
    k, v = (torch.randn(B, Hkv, N, D) for _ in range(2))
    lens = torch.tensor([70, 33, 52], dtype=torch.int32)
    out = launch.run_attention(causal.graph(), q, k, v, kv_lens=lens, split_kv=True)
    assert last_call().decode is not None
    assert_matches_reference(
        out,
        causal.reference(q, k, v, kv_lens=lens),
        causal.reference(q, k, v, kv_lens=lens, dtype=torch.float32),
        torch.float32,
    )
