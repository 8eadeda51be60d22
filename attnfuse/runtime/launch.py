"""``run_attention``: check the inputs, find the program's compiled kernel by signature, launch it."""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import attrs
import torch
import triton
from attrs import frozen
from triton.runtime.errors import OutOfResources

from .. import ir
from ..errors import InputError, PluginError
from ..passes.codegen import generate
from ..passes.fuse import fuse
from ..passes.lower import KernelConfig, TiledKernel, lower
from ..passes.tile import TileConfig
from ..plugin_manager import lookup
from .interpreter import InterpretedKernel
from .source_cache import load_function, write_source

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
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


def check_inputs(q: Any, k: Any, v: Any) -> None:
    """Raise InputError unless q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) fit together."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D (B, H, N, D), got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise InputError(f"{name} has dtype {t.dtype}; allowed: float16, bfloat16, float32")
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


def _empty_in_layout_of(t: torch.Tensor, last_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor shaped like ``t`` but for its last dim, with ``t``'s memory order."""
    shape = (*t.shape[:-1], last_dim)
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    buffer = torch.empty([shape[i] for i in order], dtype=dtype, device=t.device)
    return buffer.permute(*sorted(range(t.dim()), key=order.__getitem__))


def smaller_tiles(tiles: TileConfig) -> TileConfig:
    """The next configuration to try when ``tiles`` needs more shared memory than the GPU has."""
    if tiles.num_stages > 1:
        return attrs.evolve(tiles, num_stages=tiles.num_stages - 1)
    if tiles.block_n > 16:
        return attrs.evolve(tiles, block_n=tiles.block_n // 2, num_stages=2)
    if tiles.block_m > 16:
        return attrs.evolve(tiles, block_m=tiles.block_m // 2, num_stages=2)
    raise InputError("no tile configuration fits this GPU's shared memory for these head dims")


class ForwardKernel:
    """One compiled forward kernel and its launcher."""

    def __init__(self, tiled: TiledKernel):
        self.tiled = tiled
        self.source = generate(tiled)
        self.path = write_source(tiled.name, self.source)
        fn = load_function(self.path, tiled.name)
        self._kernel = InterpretedKernel(fn) if tiled.config.arch == "interpreter" else triton.jit(fn)
        self._prepared = [(i, lookup(i.apply.combinator)) for i in tiled.instances() if i.args]
        self.tiles = tiled.tiles  # shrinks if the GPU lacks the shared memory the table assumed
        self._split = dict(HALF=tiled.config.head_dim // 2, BLOCK_H=tiled.block_h) if tiled.transforms else {}

    def _plugin_args(self, ctx: LaunchContext, inputs: dict[str, Any]) -> list:
        args: list = []
        for inst, comb in self._prepared:
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

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out (B, Hq, Nq, DV) in q's dtype and memory order; lse (B, Hq, Nq) float32 or None."""
        t = self.tiled
        B, Hq, Nq, D = q.shape
        Hkv, Nk, DV = k.shape[1], k.shape[2], v.shape[3]
        out = _empty_in_layout_of(q, DV, q.dtype)
        lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device) if t.config.save_lse else None
        if out.numel() == 0:
            return out, lse
        if Nk == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
            return out, lse
        ctx = LaunchContext(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, DV=DV, device=q.device, dtype=q.dtype)
        args = (q, k, v, out, out if lse is None else lse, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
                Hq, Nq, Nk, *self._plugin_args(ctx, inputs))
        while True:
            tiles = self.tiles
            try:
                with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
                    self._kernel[(triton.cdiv(Nq, tiles.block_m), B * Hq)](
                        *args, GROUP=t.config.group, D=D, DV=DV, BLOCK_D=t.block_d, BLOCK_DV=t.block_dv,
                        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, **self._split,
                        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
                return out, lse
            except OutOfResources:
                self.tiles = smaller_tiles(tiles)  # raises when nothing smaller is left


_compiled: dict[tuple[ir.MatMulPV, KernelConfig], ForwardKernel] = {}


def compile_forward(graph: ir.MatMulPV, config: KernelConfig) -> ForwardKernel:
    """The forward kernel of ``graph`` for ``config``, compiled on first use and cached."""
    key = (graph, config)
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = ForwardKernel(lower(fuse(graph), config, listing=ir.render(graph)))
    return kernel


def run_attention(graph: ir.MatMulPV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  inputs: dict[str, Any] | None = None, *, return_lse: bool = False):
    """Run a traced program on q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV).

    :param inputs: runtime inputs (bias, cos/sin tables, ...) by argument name of the traced function.
    :return: out (B, Hq, Nq, DV), or (out, lse) with lse (B, Hq, Nq) float32 when ``return_lse``.
    """
    check_inputs(q, k, v)
    if return_lse:
        norm = lookup(graph.weights.apply.combinator)
        if not norm.fragment.has_lse:
            raise InputError(f"return_lse=True needs a normaliser with a log-sum-exp; "
                             f"{norm.name} has none (softmax has)")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError("gradients through AttnFuse programs are not implemented yet")
    kernel = compile_forward(graph, kernel_config(q, k, v, save_lse=return_lse))
    out, lse = kernel(q, k, v, inputs or {})
    return (out, lse) if return_lse else out


def clear_cache() -> None:
    """Forget every compiled kernel, e.g. after registering a plugin with new tile rules."""
    _compiled.clear()
