"""Shared fixtures: the device tests run on, and how many Hypothesis examples the fuzzers draw."""
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def fuzz_examples(cpu_default: int, gpu_default: int) -> int:
    """ATTNFUSE_FUZZ_EXAMPLES overrides; otherwise a small count under the interpreter, more on a GPU."""
    return int(os.environ.get("ATTNFUSE_FUZZ_EXAMPLES", gpu_default if CUDA else cpu_default))


def hoisted_last_call() -> bool:
    """Whether the latest new call signature was planned with its qk transforms hoisted into passes."""
    from attnfuse.runtime import hoisted, launch

    forward, _, _ = launch._plans[next(reversed(launch._plans))]
    return isinstance(forward, hoisted.HoistedForward)
