"""device_cached: made once per key and device, kept in a bounded cache."""

import torch

from attnfuse import device_cache
from attnfuse.device_cache import device_cached


def test_made_once_per_key_and_kept_for_later_calls():
    made = []

    def make():
        made.append(1)
        return torch.randn(3)

    first = device_cached(("test", 1), make, torch.device("cpu"))
    again = device_cached(("test", 1), make, torch.device("cpu"))
    other = device_cached(("test", 2), make, torch.device("cpu"))
    assert again is first and other is not first and len(made) == 2


def test_least_recently_used_entries_are_dropped_past_the_limit():
    device_cache.clear_device_cache()
    keep = device_cached(("test", "keep"), lambda: torch.randn(1), "cpu")
    oldest = device_cached(("test", 0), lambda: torch.randn(1), "cpu")
    for i in range(1, device_cache.MAX_ENTRIES):
        device_cached(("test", i), lambda: torch.randn(1), "cpu")
        assert device_cached(("test", "keep"), lambda: torch.randn(1), "cpu") is keep  # used: stays
    assert len(device_cache._kept) == device_cache.MAX_ENTRIES
    assert device_cached(("test", 0), lambda: torch.randn(1), "cpu") is not oldest  # dropped, made again
    assert device_cached(("test", "keep"), lambda: torch.randn(1), "cpu") is keep
