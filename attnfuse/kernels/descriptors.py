"""TMA descriptors of the templates' tensors: whether TMA can address a tensor, and its descriptor for a tile."""

from __future__ import annotations

import functools

import torch
from ..triton_compat import TensorDescriptor, gl

TMA_STRIDE_LIMIT = 1 << 40  # bytes: a TMA stride must stay below it
_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def describable(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t`` (4-d): a unit last stride, a 16-byte aligned base, and along each other
    dim longer than 1 a stride that is a positive multiple of 16 bytes below 2**40 (not a broadcast)."""
    strides, size = t.stride(), t.element_size()
    if strides[3] != 1 or t.data_ptr() % 16:
        return False
    for n, s in zip(t.shape[:3], strides):
        if n != 1 and not (0 < s * size < TMA_STRIDE_LIMIT and s * size % 16 == 0):
            return False
    return True


def descriptor(
    base: torch.Tensor, shape: list[int], strides: list[int], block_shape: list[int], layout: gl.NVMMASharedLayout
) -> TensorDescriptor:
    """``TensorDescriptor(base, shape, strides, block_shape, layout)`` without its constructor's checks (which
    take longer than the launch): ``describable`` checked the tensors' bases and strides, the templates' flat
    rows are fresh tensors padded to whole tiles, and the tiles are powers of two."""
    d = object.__new__(TensorDescriptor)
    d.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block_shape, layout=layout, padding="zero")
    return d


def describe(t: torch.Tensor, rows: int, columns: int | None = None) -> TensorDescriptor:
    """``t`` (4-d, ``describable``) read and written in [1, 1, rows, columns] tiles (columns: all of D by
    default)."""
    shape = list(t.shape)
    columns = columns or shape[3]
    unit = 16 // t.element_size()  # a dim of length 1 is never stepped along: any valid stride will do
    strides = [s if n > 1 else unit for n, s in zip(shape[:3], t.stride())] + [1]
    return descriptor(t, shape, strides, [1, 1, rows, columns], tile_layout(rows, columns, t.dtype))


@functools.lru_cache(maxsize=None)
def tile_layout(rows: int, columns: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [1, 1, rows, columns] tile (TMA's and wgmma's)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, columns], _GLUON_DTYPES[dtype])
