"""Settings the runtime plans calls by, changed for a block of code: for tests and the conformance kit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any


@contextlib.contextmanager
def plan_setting(module: ModuleType, name: str, value: Any) -> Iterator[None]:
    """``module.name = value`` inside the block (a setting the runtime plans calls by, e.g.
    ``hoisted.HOIST_MIN_QUERY_BLOCKS``), with no plan outliving the change either way: the calls and kernels
    cached before are forgotten on entry, those planned under it on exit (``launch.clear_cache``)."""
    from ..runtime import launch

    before = getattr(module, name)
    setattr(module, name, value)
    launch.clear_cache()
    try:
        yield
    finally:
        setattr(module, name, before)
        launch.clear_cache()


def transforms_hoisted() -> contextlib.AbstractContextManager[None]:
    """Calls inside the block hoist their qk transforms into passes however few query blocks they have (as
    calls of ``hoisted.HOIST_MIN_QUERY_BLOCKS`` or more do), so that small shapes check the passes too."""
    from ..runtime import hoisted

    return plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1)
