"""Call inputs: checks with clear errors, the configuration part of the cache key, plugin arguments."""
from __future__ import annotations

import functools
from typing import Any

import torch
from attrs import frozen

from ..errors import InputError, PluginError
from ..passes.lower import Instance, KernelConfig
from ..plugin_manager import lookup

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 inputs compute in float64 throughout (for gradcheck); the rest accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
MAX_HEAD_DIM = 256


@frozen(kw_only=True, eq=False)
class LaunchContext:
    """What a plugin's ``prepare`` may read: the call's sizes, device and dtype."""

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    DV: int
    device: torch.device
    dtype: torch.dtype


def launch_context(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> LaunchContext:
    B, Hq, Nq, D = q.shape
    return LaunchContext(B=B, Hq=Hq, Hkv=k.shape[1], Nq=Nq, Nk=k.shape[2], D=D, DV=v.shape[3], device=q.device,
                         dtype=q.dtype)


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Raise InputError unless q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise InputError(f"{name} has dtype {t.dtype}; allowed: float16, bfloat16, float32, float64")
    if not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if q.device.type not in ("cuda", "cpu"):
        raise InputError(f"tensors on {q.device.type} are not supported; use a CUDA device, or the CPU")
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        raise InputError("bfloat16 on the CPU would run through Triton's interpreter, which computes bfloat16 "
                         "wrongly; use float16 or float32 on the CPU, or a CUDA device")
    (B, Hq, Nq, D), (Bk, Hkv, Nk, Dk), (Bv, Hv, Nv, DV) = q.shape, k.shape, v.shape
    if not B == Bk == Bv:
        raise InputError(f"q, k and v must share the batch size, got {B}, {Bk}, {Bv}")
    if Hkv != Hv:
        raise InputError(f"k and v must have the same number of heads, got {Hkv} and {Hv}")
    if Hkv == 0 or Hq % Hkv:
        raise InputError(f"q's head count Hq={Hq} must be a multiple of k's and v's Hkv={Hkv} (GQA/MQA)")
    if D != Dk:
        raise InputError(f"q and k must have the same head dim, got {D} and {Dk}")
    if Nk != Nv:
        raise InputError(f"k and v must have the same sequence length, got {Nk} and {Nv}")
    for name, dim in (("q and k", D), ("v", DV)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise InputError(f"the head dim of {name} must be between 1 and {MAX_HEAD_DIM}, got {dim}")


@functools.lru_cache(maxsize=None)
def _arch(device: torch.device) -> str:
    if device.type == "cpu":
        return "interpreter"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def kernel_config(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, save_lse: bool) -> KernelConfig:
    """The configuration part of the kernel-cache key for these inputs."""
    tf32 = q.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return KernelConfig(arch=_arch(q.device), dtype=DTYPES[q.dtype], head_dim=q.shape[3],
                        head_dim_v=v.shape[3], group=q.shape[1] // k.shape[1], save_lse=save_lse,
                        fp32_precision="tf32" if tf32 else "ieee")


def empty_like_layout(t: torch.Tensor, last_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor shaped like ``t`` but for its last dim, with ``t``'s memory order."""
    shape = (*t.shape[:-1], last_dim)
    if t.is_contiguous():
        return torch.empty(shape, dtype=dtype, device=t.device)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    buffer = torch.empty([shape[i] for i in order], dtype=dtype, device=t.device)
    return buffer.permute(*sorted(range(t.dim()), key=order.__getitem__))


def plugin_args(instances: tuple[Instance, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                inputs: dict[str, Any]) -> list:
    """The kernel arguments plugins' ``prepare`` gives: each tensor with its strides, then each scalar."""
    args: list = []
    ctx = None
    for inst in instances:
        if not inst.args:
            continue
        ctx = ctx or launch_context(q, k, v)
        comb = lookup(inst.apply.combinator)
        prepared = comb.prepare(ctx, **inst.apply.values(inputs))
        for t in comb.tensors:
            tensor = prepared[t.name]
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != t.rank:
                raise PluginError(f"{comb.name}.prepare() must return {t.name!r} as a {t.rank}-D tensor, "
                                  f"got {getattr(tensor, 'shape', type(tensor).__name__)}")
            if tensor.device != ctx.device:
                raise InputError(f"{comb.name}: {t.name!r} is on {tensor.device}, the inputs on {ctx.device}")
            args += [tensor, *tensor.stride()]
        args += [prepared[sc.name] for sc in comb.scalars]
    return args
