"""What a combinator's ``examples(draw, shape)`` may use to draw its runtime inputs for the conformance fuzzer.

A plugin module may import it (it imports nothing of AttnFuse); ``attnfuse.testing`` re-exports it.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st


def random_tensor(draw, *size: int) -> torch.Tensor:
    """A float32 CPU tensor of standard normal values, reproducible from a drawn seed."""
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.randn(size, generator=torch.Generator().manual_seed(seed))
