"""Float8 calls: q, k, v in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` with FlashAttention-3's descales.

The call computes with the dequantised inputs: q · q_descale, k · k_descale, v · v_descale, each descale a
float32 tensor of shape (1,) (per tensor) or (B, Hkv) (per batch and kv head; q's heads take their kv
group's, as in FlashAttention-3). Scores, score modifications, masks and the normaliser are float32 as for
other dtypes; ``out`` is bfloat16, or the ``out_dtype`` the call names (float16, bfloat16, float32).

The generated forward kernel runs float8 (``passes/codegen/fp8.py``), and on sm90 the forward template's e4m3
instance (``kernels/forward_fp8.py``) where it is chosen: the split-KV decoding kernel and the backward refuse it
by name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton.language as tl

from ..errors import InputError, UnsupportedError
from .gpu_gate import Gate

FP8_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DESCALES = ("q_descale", "k_descale", "v_descale")
FP8_ARGUMENTS = (*DESCALES, "out_dtype")  # a program call's arguments for float8 inputs
MIN_ARCH = (8, 9)  # float8 products: Ada (sm89) and later
GATE = Gate("float8 calls", "ATTNFUSE_FP8_ON_GPU", "tests/test_fp8.py::test_on_a_gpu", checked=("interpreter", "sm90"))


class Fp8(NamedTuple):
    """A float8 call's descales as the kernel reads them, (B, Hkv) float32 views each (a per-tensor one
    broadcast with stride 0), and the dtype of its ``out``."""

    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    out_dtype: torch.dtype


def is_fp8(t: Any) -> bool:
    return getattr(t, "dtype", None) in FP8_DTYPES


def check_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descales: dict[str, Any],
    out_dtype: Any,
    kv_heads: int,
) -> Fp8 | None:
    """The call's ``Fp8`` when q, k, v are float8 (None otherwise); q, k, v already checked
    (``inputs.check_inputs``: one dtype, one device), ``kv_heads`` their Hkv. An InputError naming the
    argument for a descale missing, of the wrong dtype, shape or device, or given to a call that is not
    float8; for an ``out_dtype`` not allowed, or given to a call that is not float8."""
    given = [name for name, d in descales.items() if d is not None]
    if not is_fp8(q):
        if given or out_dtype is not None:
            named = [*given, *(["out_dtype"] if out_dtype is not None else [])]
            raise InputError(
                f"{', '.join(named)} apply to float8 q, k, v (torch.float8_e4m3fn, torch.float8_e5m2) only; "
                f"this call's are {q.dtype}"
            )
        return None
    missing = [name for name in DESCALES if descales.get(name) is None]
    if missing:
        raise InputError(
            f"float8 q, k, v ({q.dtype}) need {', '.join(missing)}: float32 tensors of shape (1,) or "
            f"(B, Hkv), the factors that dequantise them (FlashAttention-3's q_descale, k_descale, v_descale)"
        )
    B = q.shape[0]
    views = [_descale(name, descales[name], B, kv_heads, q.device) for name in DESCALES]
    if out_dtype is None:
        out_dtype = torch.bfloat16
    if out_dtype not in OUT_DTYPES:
        raise InputError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32, got {out_dtype!r}")
    GATE.check(q.device)
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < MIN_ARCH:
        major, minor = torch.cuda.get_device_capability(q.device)
        raise UnsupportedError(f"float8 calls need a GPU of compute capability 8.9 or later, got {major}.{minor}")
    return Fp8(*views, out_dtype)


def _descale(name: str, d: Any, B: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """``d`` as a (B, Hkv) view, after checking it."""
    if not isinstance(d, torch.Tensor) or d.dtype != torch.float32 or tuple(d.shape) not in ((1,), (B, kv_heads)):
        raise InputError(
            f"{name} must be a float32 tensor of shape (1,) (per tensor) or (B, Hkv) = ({B}, {kv_heads}) (per "
            f"batch and kv head), got {getattr(d, 'dtype', type(d).__name__)} {tuple(getattr(d, 'shape', ()))}"
        )
    if d.device != device:
        raise InputError(f"{name} is on {d.device}, q on {device}")
    return d.expand(B, kv_heads)


def refuse(what: str) -> None:
    """The UnsupportedError of a float8 call on a path that does not take float8, ``what`` naming it."""
    raise UnsupportedError(f"float8 calls run the generated forward kernel only; {what} does not take float8 yet")


def upcast_dtype(interpreted: bool) -> Any:
    """``UPCAST_DTYPE`` of a float8 forward kernel (``passes/codegen/fp8.py``): bfloat16 on a GPU; float16 on
    CPU tensors, since Triton 3.6's interpreter multiplies bfloat16 operands as integers."""
    return tl.float16 if interpreted else tl.bfloat16


def dequantised(t: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` (B, H, N, D) in ``dtype``, times its descale (1,) or (B, Hkv) (each of the H heads taking its
    kv group's): what a float8 call computes with (the reference)."""
    scale = descale.to(device=t.device, dtype=dtype)
    if scale.dim() == 2:
        scale = scale.repeat_interleave(t.shape[1] // scale.shape[1], dim=1)[:, :, None, None]
    return t.to(dtype) * scale
