"""Parameter checks for combinator declarations: each raises ValueError saying what is allowed."""

from __future__ import annotations

import math
from typing import Any

from .static_values import shown


def _finite_number(value: Any) -> bool:
    """An int (of any size: ``math.isfinite`` would overflow on 10**400) or a finite float; not a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def finite_number_or_none(value: Any) -> None:
    if value is not None and not _finite_number(value):
        raise ValueError(f"must be None or a finite number, got {shown(value)}")


def positive_number(value: Any) -> None:
    if not (_finite_number(value) and value > 0):
        raise ValueError(f"must be a finite number > 0, got {shown(value)}")


def non_negative_int(value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"must be an int >= 0, got {shown(value)}")
