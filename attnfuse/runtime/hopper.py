"""The Hopper forward's launcher: TMA descriptors of q, k, v and out, then one launch of the Gluon kernel."""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..passes.hopper import HopperForward
from .hopper_kernel import hopper_forward_kernel
from .launcher import Launcher, cdiv

_ROWS = 128  # query rows per program (two consumer warpgroups of 64)
_TMA_LIMIT = 1 << 40  # bytes: a TMA stride must stay below it


def _describable(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t`` (4-d): a unit last stride, a 16-byte aligned base, and along each other
    dim longer than 1 a stride that is a positive multiple of 16 bytes below 2**40 (not a broadcast)."""
    size = t.element_size()
    return t.stride(3) == 1 and t.data_ptr() % 16 == 0 and all(
        n == 1 or (s > 0 and (s * size) % 16 == 0 and s * size < _TMA_LIMIT) for n, s in zip(t.shape[:3], t.stride()))


def _tma_strides(t: torch.Tensor) -> list[int]:
    """``t``'s strides, with a dim of length 1 (never stepped along) given a valid 16-byte one."""
    return [s if n > 1 else 16 // t.element_size() for n, s in zip(t.shape[:3], t.stride())] + [1]


class HopperLauncher:
    """Launches the Hopper forward template for one program (``HopperForward``'s constants)."""

    _launcher = Launcher(hopper_forward_kernel)

    def __init__(self, spec: HopperForward):
        self.spec = spec
        self._constexprs = {"BLOCK_N": spec.block_n, "STAGES": spec.stages, "CAUSAL": spec.causal}

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """Whether TMA can address every one of ``tensors`` (else the caller runs the generated kernel)."""
        return all(_describable(t) for t in tensors)

    @staticmethod
    def _describe(t: torch.Tensor, rows: int) -> TensorDescriptor:
        """``t`` (4-d) read and written in [1, 1, rows, D] tiles."""
        block = [1, 1, rows, t.shape[3]]
        return TensorDescriptor(t, list(t.shape), _tma_strides(t), block, _layout(rows, t.shape[3], t.dtype))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None) -> None:
        """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 -> out (B, Hq, Nq, D) and, if given,
        lse (B, Hq, Nq) float32 contiguous, written in place."""
        B, Hq, Nq, _ = q.shape
        block_n = self.spec.block_n
        args = (self._describe(q, _ROWS // 2), self._describe(k, block_n), self._describe(v, block_n),
                self._describe(out, _ROWS // 2), q, k, v, out, out if lse is None else lse, Nq, k.shape[2], Hq,
                Hq // k.shape[1], self.spec.qk_scale)
        self._launcher.launch((cdiv(Nq, _ROWS), B * Hq), args, {**self._constexprs, "SAVE_LSE": lse is not None},
                              num_warps=4, device=q.device, maxnreg=168)


@functools.lru_cache(maxsize=None)
def _layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [1, 1, rows, head_dim] tile (TMA's and wgmma's)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim],
                                                gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
