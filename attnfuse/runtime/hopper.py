"""How the dK/dV template's instances (``attnfuse/kernels/launch.py``) address their row statistics and sum a GQA
group's query heads on Hopper: whether lse's rows fit int32 TMA coordinates, the rows' descriptors, and how many
programs share a group."""

from __future__ import annotations

import torch

from ..kernels.descriptors import descriptor
from ..triton_compat import TensorDescriptor, gl
from .launcher import cdiv, multiprocessors
from .template_rows import padded_rows

_ROWS = 128  # keys per dK/dV program: two consumer warpgroups of 64
DKDV_BLOCK_M = 64  # query rows per step of the dK/dV template
DKDV_SPLIT_WAVES = 1.0  # a GQA grid of fewer key-block programs than this many per multiprocessor splits
DKDV_SPLIT_FILL = 1.5  # its groups' query heads, over the fewest programs that give this many per multiprocessor
_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)  # lse and delta rows


def lse_rows_fit(lse: torch.Tensor) -> bool:
    """Whether the dK/dV template can address lse's (B, Hq, Nq) rows, padded to whole query blocks
    (``template_rows``), with int32 TMA coordinates (else the caller runs the generated dK/dV kernel)."""
    B, Hq, Nq = lse.shape
    return B * Hq * padded_rows(Nq, DKDV_BLOCK_M) < 2**31


def describe_rows(rows: torch.Tensor) -> TensorDescriptor:
    """The flat float32 rows of ``rows`` read in [DKDV_BLOCK_M] tiles."""
    return descriptor(rows, [rows.numel()], [1], [DKDV_BLOCK_M], _ROW_LAYOUT)


def group_split(
    q: torch.Tensor, k: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a dK/dV template launch (programs of 128 keys) of q (B, Hq, Nq, D) and k (B, Hkv, Nk, D) sums a GQA
    group's query heads: (parts, GROUP_SUM, dk_part, dv_part, counts). ``parts`` programs share a group
    (``_group_parts``); with one, GROUP_SUM is "none" and the buffers are dk and dv; with two or under
    ``torch.use_deterministic_algorithms``, "last": each part's float32 shares (parts, B, Hkv, Nk, D) and zeroed
    counters, one per 64-key tile; else "atomic": float32 zeros (B, Hkv, Nk, D) to add into, which the caller
    copies to dk and dv after the launch."""
    B, Hq, _, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group, blocks = Hq // Hkv, cdiv(Nk, _ROWS)
    parts = _group_parts(B * Hkv * blocks, group, q.device)
    if parts == 1:
        return parts, "none", dk, dv, dk  # counts: unused unless the last part sums
    if parts == 2 or torch.are_deterministic_algorithms_enabled():
        dk_part, dv_part = torch.empty((2, parts, B, Hkv, Nk, D), dtype=torch.float32, device=q.device)
        counts = torch.zeros(B * Hkv * 2 * blocks, dtype=torch.int32, device=q.device)
        return parts, "last", dk_part, dv_part, counts
    dk_part, dv_part = torch.zeros((2, B, Hkv, Nk, D), dtype=torch.float32, device=q.device)
    return parts, "atomic", dk_part, dv_part, dk


def _group_parts(programs: int, group: int, device: torch.device) -> int:
    """Over how many programs the dK/dV template splits each GQA group's query heads (a divisor of
    ``group``), given ``programs``, its grid with whole groups: 1 when that grid fills the GPU
    DKDV_SPLIT_WAVES times, else the fewest parts that fill it DKDV_SPLIT_FILL times (or one per head)."""
    wave = multiprocessors(device)
    if programs >= DKDV_SPLIT_WAVES * wave:
        return 1
    return next(
        p for p in range(1, group + 1) if group % p == 0 and (programs * p >= DKDV_SPLIT_FILL * wave or p == group)
    )
