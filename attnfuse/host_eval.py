"""Evaluate a fragment's Triton expressions (a mask's ``keep``, its facts, its block lists) on the host, in
plain torch, without compiling a kernel.

The mask-fact checks (``attnfuse.testing.mask_facts``) run them over many small grids; a context-parallel
ring (``attnfuse.distributed.pairs``) evaluates ``kv_range`` facts for its chunks' positions. The
expressions use a small part of ``triton.language``: pointer arithmetic on a plugin's tensors, ``tl.load``
(with ``mask`` and ``other``), ``tl.minimum``/``tl.maximum``/``tl.where`` and casts. ``TL`` provides those
on torch tensors; integer values are int64 tensors, pointers are ``Pointer`` objects.
"""

from __future__ import annotations

import types
from typing import Any

import torch


class Pointer:
    """A pointer into a tensor's storage, counted in elements, as Triton's ``$tensor + offsets`` is."""

    def __init__(self, tensor: torch.Tensor, offset: Any = 0):
        self.tensor = tensor
        self.offset = offset

    def __add__(self, offset: Any) -> "Pointer":
        return Pointer(self.tensor, self.offset + offset)

    __radd__ = __add__

    def load(self, mask: Any = None, other: Any = 0) -> torch.Tensor:
        t = self.tensor
        size = t.untyped_storage().nbytes() // t.element_size()
        flat = torch.as_strided(t, (size,), (1,), 0)
        offset = torch.as_tensor(self.offset, dtype=torch.int64)
        if mask is None:
            return flat[offset]
        mask = torch.as_tensor(mask, dtype=torch.bool)
        offset, mask = torch.broadcast_tensors(offset, mask)
        if size == 0 and not mask.any():  # an empty tensor, every lane masked off: nothing is read
            return torch.full(mask.shape, other, dtype=flat.dtype)
        safe = torch.where(mask, offset, torch.zeros_like(offset)).clamp(0, size - 1)
        return torch.where(mask, flat[safe], torch.as_tensor(other, dtype=flat.dtype))


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _load(pointer: Pointer, mask: Any = None, other: Any = 0, **_: Any) -> torch.Tensor:
    return pointer.load(mask, other)


TL = types.SimpleNamespace(
    load=_load,
    minimum=lambda a, b: torch.minimum(_tensor(a), _tensor(b)),
    maximum=lambda a, b: torch.maximum(_tensor(a), _tensor(b)),
    where=lambda c, a, b: torch.where(_tensor(c).bool(), _tensor(a), _tensor(b)),
    cdiv=lambda a, b: -(-_tensor(a) // b),
    arange=lambda lo, hi: torch.arange(lo, hi),
    abs=lambda x: _tensor(x).abs(),
    int1=torch.bool,
    int8=torch.int8,
    int16=torch.int16,
    int32=torch.int64,
    int64=torch.int64,
    uint8=torch.uint8,
    float16=torch.float64,
    bfloat16=torch.float64,
    float32=torch.float64,
    float64=torch.float64,
)
"""The part of ``triton.language`` mask expressions use, on torch tensors (integers widened to int64, so
that intermediate products do not overflow as they might not in the kernel either)."""


def integer(value: int) -> torch.Tensor:
    """A scalar template variable (``b``, ``h``, ``Nk``, ``q_lo`` ...) as Triton sees it: it has ``.to``."""
    return torch.tensor(int(value), dtype=torch.int64)


def evaluate(code: Any, names: dict[str, Any]) -> Any:
    """Evaluate a compiled expression with the template's names and ``tl``."""
    return eval(
        code,
        {
            "__builtins__": {"float": float, "int": int, "min": min, "max": max},
            "tl": TL,
            "triton": types.SimpleNamespace(language=TL),
            **names,
        },
    )
