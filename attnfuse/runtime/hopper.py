"""The Hopper forward's launcher: TMA descriptors of q, k, v and out, then one launch of the Gluon kernel."""
from __future__ import annotations

import torch
import triton
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..passes.hopper import HopperForward
from .hopper_kernel import hopper_forward_kernel

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

    def __init__(self, spec: HopperForward):
        self.spec = spec

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """Whether TMA can address every one of ``tensors`` (else the caller runs the generated kernel)."""
        return all(_describable(t) for t in tensors)

    @staticmethod
    def _describe(t: torch.Tensor, rows: int) -> TensorDescriptor:
        """``t`` (4-d) read and written in [1, 1, rows, D] tiles."""
        block = [1, 1, rows, t.shape[3]]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
        return TensorDescriptor(t, list(t.shape), _tma_strides(t), block, layout)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor | None) -> None:
        """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 -> out (B, Hq, Nq, D) and, if given,
        lse (B, Hq, Nq) float32 contiguous, written in place."""
        B, Hq, Nq, _ = q.shape
        spec = self.spec
        with torch.cuda.device(q.device):
            hopper_forward_kernel[(triton.cdiv(Nq, _ROWS), B * Hq)](
                self._describe(q, _ROWS // 2), self._describe(k, spec.block_n), self._describe(v, spec.block_n),
                self._describe(out, _ROWS // 2), q, k, v, out, out if lse is None else lse, Nq, k.shape[2], Hq,
                Hq // k.shape[1], spec.qk_scale, BLOCK_N=spec.block_n, STAGES=spec.stages, CAUSAL=spec.causal,
                SAVE_LSE=lse is not None, num_warps=4, maxnreg=168)
