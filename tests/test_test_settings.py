"""conftest.py's per-test seed and per-session kernel cache, which must hold on every pytest-xdist worker."""

from __future__ import annotations

import os
import random
import tempfile
import zlib
from pathlib import Path

import torch

from attnfuse.runtime.source_cache import CACHE_ENV, cache_dir


def test_seed_is_the_crc32_of_the_test_id(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    assert torch.initial_seed() == seed
    assert random.getstate() == random.Random(seed).getstate()
    assert dict(request.node.user_properties)["seed"] == seed


def test_kernel_cache_is_this_workers_own_temporary_directory():
    cache = Path(os.environ[CACHE_ENV])
    assert cache == cache_dir()
    assert cache.is_dir()
    assert cache.parent == Path(tempfile.gettempdir())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")  # gw0, gw1, ... under pytest-xdist
    assert cache.name.startswith(f"attnfuse-test-kernels-{worker}-")
