"""Whether a call needs kernels with 64-bit offsets (``KernelConfig.wide_offsets``).

The kernels compute batch, head and page offsets in int64 always, and the offsets of rows and columns
(``q_idx * stride_qm``, ``k_pos * stride_kn``, ``d * stride_qd``) in int32 unless the config is wide. A
call is wide when some tensor a kernel addresses has a row-and-column extent past ``OFFSET_LIMIT``
elements: q, k, v (a paged cache's pools too), the outputs and gradients the runtime allocates in their
memory orders, and any runtime input tensor (plugins address those; all of its dims count).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

OFFSET_LIMIT = 2**31 - 1  # the largest element offset an int32 kernel computes (tests lower it)


def extent(t: torch.Tensor, dims: Iterable[int] | None = None) -> int:
    """The largest element offset over ``dims`` (all by default): sum((size - 1) * |stride|)."""
    dims = range(t.dim()) if dims is None else dims
    return sum(max(t.shape[i] - 1, 0) * abs(t.stride(i)) for i in dims)


def rows_fit(t: torch.Tensor) -> bool:
    """Whether the row-and-column offsets of a 4-D (batch, head, row, dim) tensor fit an int32 kernel."""
    return extent(t, (2, 3)) <= OFFSET_LIMIT


def any_layout_fits(t: torch.Tensor, last_dim: int) -> bool:
    """Whether every dense tensor shaped like ``t`` but for its last dim (``last_dim``) fits an int32 kernel,
    whatever its memory order: its largest offset is below its element count."""
    return math.prod(t.shape[:-1]) * last_dim <= OFFSET_LIMIT + 1


def inputs_fit(inputs: dict[str, Any]) -> bool:
    """Whether every runtime input tensor's offsets, over all its dims, fit an int32 kernel."""
    return all(extent(t) <= OFFSET_LIMIT for t in inputs.values() if isinstance(t, torch.Tensor))
