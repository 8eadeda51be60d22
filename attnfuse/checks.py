"""Parameter checks for combinator declarations: each raises ValueError saying what is allowed."""
from __future__ import annotations

import math
from typing import Any


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_number_or_none(value: Any) -> None:
    if value is not None and not (_is_number(value) and math.isfinite(value)):
        raise ValueError(f"must be None or a finite number, got {value!r}")


def positive_number(value: Any) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"must be a finite number > 0, got {value!r}")


def non_negative_int(value: Any) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"must be an int >= 0, got {value!r}")
