"""``passes/codegen/philox.uniform``, the Philox text that the generated kernels and the Hopper templates draw
attention dropout's numbers from, against Triton's own ``tl.rand``: the same float32 bits for random seeds and
counters, run in one small kernel under Triton's interpreter."""

import pytest
import torch

import attnfuse as af
from attnfuse.passes.codegen.philox import uniform
from attnfuse.runtime.dropout import OFFSET_LIMIT
from attnfuse.runtime.interpreter import InterpretedKernel
from attnfuse.runtime.source_cache import load_function, write_source

NAME = "attnfuse_test_philox"
BLOCK = 64


def _kernel() -> InterpretedKernel:
    """A kernel writing, for each of BLOCK counters, ``tl.rand`` and ``uniform``'s number from one seed."""
    body = (
        "seed = tl.load(Seed)\ncounter = tl.load(Counters + tl.arange(0, BLOCK))\n"
        + uniform("seed", "counter", "ours")
        + "tl.store(Ours + tl.arange(0, BLOCK), ours)\n"
        "tl.store(Theirs + tl.arange(0, BLOCK), tl.rand(seed, counter))\n"
    )
    lines = "".join(f"    {line}\n" for line in body.splitlines())
    source = (
        "import triton\nimport triton.language as tl\n\n\n"
        f"def {NAME}(Seed, Counters, Ours, Theirs, BLOCK: tl.constexpr):\n{lines}"
    )
    return InterpretedKernel(load_function(source, NAME, write_source(NAME, source)))


def _draw(seed: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ours, theirs = torch.empty(BLOCK), torch.empty(BLOCK)
    _kernel().launch((1,), (seed, counters, ours, theirs), {"BLOCK": BLOCK}, device=seed.device)
    return ours, theirs


def _counters() -> torch.Tensor:
    """BLOCK int64 counters as the kernels form them (below OFFSET_LIMIT + an element's index): spread over the
    whole int64 range, and across the 32-bit word boundaries the generator splits them at."""
    spread = torch.randint(0, 2**63 - 1, (BLOCK // 2,), dtype=torch.int64)
    words = torch.randint(1, 2**30, (BLOCK // 4,), dtype=torch.int64) * 2**32 + torch.randint(-3, 3, (BLOCK // 4,))
    low = torch.randint(0, 2**32, (BLOCK // 4,), dtype=torch.int64)
    return torch.cat([spread, words, low])


@pytest.mark.parametrize("draw", range(8))
def test_uniform_is_triton_rand_bit_for_bit(draw):
    seed = torch.randint(0, OFFSET_LIMIT, (1,), dtype=torch.int64)
    ours, theirs = _draw(seed, _counters())
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), (ours, theirs)
    assert ((0 <= ours) & (ours < 1)).all()


def test_dropout_keep_is_triton_rand_at_each_weights_counter():
    """The replayed mask (``af.dropout_keep``, the generated kernels' text) keeps weight (b, h, i, j) exactly
    where ``tl.rand(seed, ((b * Hq + h) * Nq + i) * Nk + j + offset) >= p``: the layout of the numbers and the
    numbers are Triton's."""
    B, Hq, Nq, Nk, p = 2, 3, 5, 7, 0.4
    state = af.dropout_state("cpu")
    keep = af.dropout_keep(state, p, (B, Hq, Nq, Nk))
    n = keep.numel()
    counters = torch.arange(-(-n // BLOCK) * BLOCK, dtype=torch.int64) + state[1]
    rand = torch.cat([_draw(state[:1], chunk)[1] for chunk in counters.split(BLOCK)])[:n]
    assert torch.equal(keep.flatten(), rand >= torch.tensor(p, dtype=torch.float32))
