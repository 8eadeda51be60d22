"""Launching the forward template's float8 instance (e4m3 or e5m2): q and k as they are, V copied transposed (float8
``wgmma`` reads both operands K-major: ``fp8_pipeline``), out in the call's ``out_dtype``, the descales among the
arguments (``runtime/forward.py``: ``fp8_args``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from ..launch_spec import CONSTEXPR, INT, TENSOR, LaunchSpec, params
from ..runtime.interpreter import InterpretedKernel
from ..runtime.launcher import Launcher, cdiv
from ..triton_compat import TensorDescriptor, gl
from .descriptors import descriptor
from .launch import TemplateForward
from .fp8_pipeline import KEY_CHUNK
from .pipeline import ROWS

TMA_ALIGNMENT = 16  # bytes: a TMA stride is a multiple of it
TRANSPOSE_ROWS = 64  # V's rows a program of the transpose moves


def _transpose_values(
    V, VT, N, N_PADDED, H, svb, svh, svn, stb, sth, std, DV: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr
):  # fmt: skip
    """VT[b, h, :, columns] = V[b, h, rows, :]ᵀ for ROWS rows of V (a unit last stride) a program, each CHUNK of
    rows permuted as ``fp8_pipeline.fp8_weights`` permutes P's columns (row 16·a1 + 8·a0 + 2·c + e of a chunk to
    column 16·a1 + 4·c + 2·a0 + e); columns of rows past N, up to N_PADDED, are zeros."""
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DV)
    tile = tl.load(V + b.to(tl.int64) * svb + h.to(tl.int64) * svh + n[:, None].to(tl.int64) * svn + d[None, :],
                   mask=n[:, None] < N, other=0.0)  # fmt: skip
    tile = tl.permute(tl.reshape(tile, [ROWS // CHUNK, 2, 2, 4, 2, DV]), (0, 1, 3, 2, 4, 5))
    tile = tl.reshape(tile, [ROWS, DV])
    tl.store(VT + b.to(tl.int64) * stb + h.to(tl.int64) * sth + d[:, None].to(tl.int64) * std + n[None, :],
             tl.trans(tile), mask=n[None, :] < N_PADDED)  # fmt: skip


TRANSPOSE = LaunchSpec(
    "_transpose_values",
    params(TENSOR, "V", "VT") + params(INT, "N", "N_PADDED", "H", "svb", "svh", "svn", "stb", "sth", "std")
    + params(CONSTEXPR, "DV", "ROWS", "CHUNK"),
    tiles=(),
)  # fmt: skip
_jitted = Launcher(triton.jit(_transpose_values))
_interpreted = InterpretedKernel(_transpose_values)


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """v (B, Hkv, Nk, DV) float8 with a unit last stride and DV a power of two -> the same values transposed,
    (B, Hkv, DV, Nk rounded up to KEY_CHUNK), a fresh tensor: key n in column ``fp8_pipeline.stored_key(n)``,
    the columns of no key zero. One Triton kernel: torch's strided copy moved 4 MB in 32 µs on an H100, an
    eighth of the attention at 4096 keys."""
    B, H, N, DV = v.shape
    transposed = torch.empty(B, H, DV, cdiv(N, KEY_CHUNK.value) * KEY_CHUNK.value, dtype=v.dtype, device=v.device)
    strides = dict(zip(("svb", "svh", "svn", "stb", "sth", "std"), (*v.stride()[:3], *transposed.stride()[:3])))
    (_jitted if v.is_cuda else _interpreted).launch(
        (cdiv(transposed.shape[3], TRANSPOSE_ROWS), B * H),
        TRANSPOSE.bind({"V": v, "VT": transposed, "N": N, "N_PADDED": transposed.shape[3], "H": H, **strides}),
        TRANSPOSE.constexprs({"DV": DV, "ROWS": TRANSPOSE_ROWS, "CHUNK": KEY_CHUNK.value}),
        device=v.device,
    )
    return transposed


_GLUON_FP8 = {torch.float8_e4m3fn: gl.float8e4nv, torch.float8_e5m2: gl.float8e5}


@functools.lru_cache(maxsize=None)
def fp8_tile_layout(rows: int, columns: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a [1, 1, rows, columns] float8 tile (cached: a call needs three, and Gluon builds
    each anew, on the host's critical path)."""
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, columns], _GLUON_FP8[dtype])


def describe_fp8(t: torch.Tensor, rows: int, columns: int) -> TensorDescriptor:
    """``t`` (4-d float8, e4m3 or e5m2, ``describable``) read in [1, 1, rows, columns] tiles."""
    strides = [s if n > 1 else TMA_ALIGNMENT for n, s in zip(t.shape[:3], t.stride())] + [1]
    return descriptor(t, list(t.shape), strides, [1, 1, rows, columns], fp8_tile_layout(rows, columns, t.dtype))


class Fp8TemplateForward(TemplateForward):
    """The forward template's float8 instance: q, k and v float8 (e4m3 or e5m2), out in its own dtype;
    ``plugin_args`` hold the descales (QDescale, KDescale, VDescale: (B, Hkv) float32 views). Its launches count
    as ``TemplateForward``'s."""

    def operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
        """q's and k's descriptors and v's transposed copy's (``transposed_values``), and the tensors."""
        block_n = self.spec.tiles.block_n
        values = transposed_values(v)
        return {
            "q_desc": describe_fp8(q, ROWS.value, q.shape[3]),
            "k_desc": describe_fp8(k, block_n, k.shape[3]),
            "v_desc": describe_fp8(values, v.shape[3], block_n),
            "Q": q,
            "K": k,
            "V": values,
        }
