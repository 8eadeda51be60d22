"""``passes/codegen/philox.words``, the Philox text that the generated kernels and the Hopper templates draw
attention dropout's numbers from, against Triton's own ``tl.randint4x``: the same words for random seeds and
counters, run in small kernels under Triton's interpreter; and dropout's mask (``passes/codegen/dropout.keep``),
drawn a group of eight weights at a time, against ``tl.randint4x`` at each group's counter."""

import pytest
import torch

import attnfuse as af
from attnfuse.passes.codegen.dropout import SETUP, keep, replayed_keep
from attnfuse.passes.codegen.philox import words
from attnfuse.runtime.dropout import OFFSET_LIMIT
from attnfuse.runtime.interpreter import InterpretedKernel
from attnfuse.runtime.source_cache import load_function, write_source

BLOCK = 64


def _interpreted(name: str, parameters: str, body: str) -> InterpretedKernel:
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    source = f"import triton\nimport triton.language as tl\n\n\ndef {name}({parameters}):\n{lines}"
    return InterpretedKernel(load_function(source, name, write_source(name, source)))


def _draw(seed: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, theirs) (4, BLOCK) int64: ``words``' and ``tl.randint4x``'s words of each counter, from one seed."""
    rows = "tl.arange(0, 4)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]"
    body = (
        "seed = tl.load(Seed)\ncounter = tl.load(Counters + tl.arange(0, BLOCK))\n"
        + words("seed", "counter", ("u0", "u1", "u2", "u3"))
        + f"tl.store(Ours + {rows}, tl.join(tl.join(u0, u2), tl.join(u1, u3)).reshape(BLOCK, 4).trans())\n"
        "r0, r1, r2, r3 = tl.randint4x(seed, counter)\n"
        f"tl.store(Theirs + {rows}, tl.join(tl.join(r0, r2), tl.join(r1, r3)).reshape(BLOCK, 4).trans())\n"
    )
    kernel = _interpreted("attnfuse_test_philox", "Seed, Counters, Ours, Theirs, BLOCK: tl.constexpr", body)
    ours, theirs = torch.empty(4, BLOCK, dtype=torch.int64), torch.empty(4, BLOCK, dtype=torch.int64)
    kernel.launch((1,), (seed, counters, ours, theirs), {"BLOCK": BLOCK}, device=seed.device)
    return ours, theirs


def _counters() -> torch.Tensor:
    """BLOCK int64 counters as the kernels form them (below OFFSET_LIMIT + an element's index): spread over the
    whole int64 range, and across the 32-bit word boundaries the generator splits them at."""
    spread = torch.randint(0, 2**63 - 1, (BLOCK // 2,), dtype=torch.int64)
    words = torch.randint(1, 2**30, (BLOCK // 4,), dtype=torch.int64) * 2**32 + torch.randint(-3, 3, (BLOCK // 4,))
    low = torch.randint(0, 2**32, (BLOCK // 4,), dtype=torch.int64)
    return torch.cat([spread, words, low])


@pytest.mark.parametrize("draw", range(8))
def test_words_are_triton_randint4x_bit_for_bit(draw):
    seed = torch.randint(0, OFFSET_LIMIT, (1,), dtype=torch.int64)
    ours, theirs = _draw(seed, _counters())
    assert torch.equal(ours, theirs), (ours, theirs)
    assert ((0 <= ours) & (ours < 2**32)).all() and ours.unique().numel() > 4 * BLOCK - 4


@pytest.mark.parametrize("p", [0.4, 0.1 + 2**-17, 3 * 2**-16])
def test_dropout_keep_is_triton_randint4x_at_each_groups_counter(p):
    """The replayed mask (``af.dropout_keep``) keeps weight (b, h, i, j) exactly where half (bit 0 of j) of word
    2 * (bit 3 of i) + (bit 3 of j) of ``tl.randint4x(seed, ((b * Hq + h) * Nq + i0) * Nk + j0 + offset)``,
    divided by 2**16, is at least p, i0 being i with bit 3 cleared and j0 j with bits 0 and 3 cleared: the
    groups, their counters and the numbers are Triton's; p off the 2**-16 grid and on it."""
    B, Hq, Nq, Nk = 2, 3, 19, 35
    state = af.dropout_state("cpu")
    kept = af.dropout_keep(state, p, (B, Hq, Nq, Nk))
    bh, i, j = torch.arange(B * Hq)[:, None, None], torch.arange(Nq)[:, None], torch.arange(Nk)
    counters = ((bh * Nq + (i & ~8)) * Nk + (j & ~9) + state[1]).flatten()
    word = ((i >> 3 & 1) * 2 + (j >> 3 & 1)).expand(B * Hq, Nq, Nk).flatten()
    half = (j & 1).expand(B * Hq, Nq, Nk).flatten()
    padded = torch.cat([counters, counters[: -len(counters) % BLOCK]])
    drawn = torch.cat([_draw(state[:1], chunk)[1] for chunk in padded.split(BLOCK)], dim=1)[:, : len(counters)]
    number = drawn.gather(0, word[None])[0] >> (16 * half) & 0xFFFF
    assert torch.equal(kept.flatten(), number.double() / 2**16 >= torch.tensor(p, dtype=torch.float32).double())


@pytest.mark.parametrize("tile", [(16, 16), (32, 64), (64, 32)])
def test_a_tile_s_grouped_draws_are_the_replay_s_numbers(tile):
    """``keep``'s text on a tile with sides multiples of 16 (a draw a group, its numbers split and joined back)
    keeps the same weights as ``replayed_keep``'s (a draw a weight), for tiles at random multiples of their
    sides. (A packed call's documents draw a weight at a time: ``keep`` is the replay's text there.)"""
    block_m, block_n = tile
    store = "tl.store({} + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], drop_keep)\n"
    body = (
        SETUP
        + "q_idx = M0 + tl.arange(0, BLOCK_M)\nk_idx = N0 + tl.arange(0, BLOCK_N)\n"
        + keep()
        + store.format("Grouped")
        + replayed_keep()
        + store.format("Each")
    )
    parameters = (
        "DropoutState, Grouped, Each, b, h, HQ, Nq, N_K, M0, N0, DROPOUT_P, BLOCK_M: tl.constexpr, "
        "BLOCK_N: tl.constexpr"
    )
    kernel = _interpreted("attnfuse_test_keep", parameters, body)
    for _ in range(3):
        state = af.dropout_state("cpu")
        grouped, each = torch.zeros(block_m, block_n, dtype=torch.bool), torch.ones(block_m, block_n, dtype=torch.bool)
        m0, n0 = (int(torch.randint(0, 8, ())) * side for side in tile)
        b, h, hq = 1, int(torch.randint(0, 4, ())), 4
        arguments = (state, grouped, each, b, h, hq, 200, 300, m0, n0, 0.5)
        kernel.launch((1,), arguments, {"BLOCK_M": block_m, "BLOCK_N": block_n}, device=state.device)
        assert torch.equal(grouped, each), (tile, m0, n0)
        assert 0 < grouped.sum() < grouped.numel()
