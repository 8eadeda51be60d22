"""The Hopper templates' launcher: TMA descriptors of the tensors, then one launch of a Gluon kernel (the
forward, or the backward's dK/dV)."""

from __future__ import annotations

import torch

from ..kernels.descriptors import describable, describe, descriptor
from ..triton_compat import TensorDescriptor, gl
from ..launch_spec import CONSTEXPR, INT, SCALAR, TENSOR, LaunchSpec, params
from ..plan import HopperPlan
from .hopper_dkdv_kernel import hopper_dkdv_kernel
from .hopper_kernel import hopper_forward_kernel
from .launcher import Launcher, cdiv, multiprocessors
from .template_rows import padded_rows, template_rows

_ROWS = 128  # query rows (forward) or keys (dK/dV) per program: two consumer warpgroups of 64
DKDV_BLOCK_M = 64  # query rows per step of the dK/dV kernel
DKDV_STAGES = 2  # its Q and dO stages in shared memory
DKDV_SPLIT_WAVES = 1.0  # a GQA grid of fewer key-block programs than this many per multiprocessor splits
DKDV_SPLIT_FILL = 1.5  # its groups' query heads, over the fewest programs that give this many per multiprocessor
_ROW_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)  # lse and delta rows

FORWARD = LaunchSpec(
    "hopper_forward_kernel",
    params(TENSOR, "q_desc", "k_desc", "v_desc", "o_desc", "q", "k", "v", "out", "lse")
    + params(INT, "n_q", "n_k", "heads_q", "group")
    + params(SCALAR, "qk_scale")
    + params(CONSTEXPR, "BLOCK_N", "STAGES", "CAUSAL", "SAVE_LSE"),
    tiles=(),
)
DKDV = LaunchSpec(
    "hopper_dkdv_kernel",
    params(
        TENSOR,
        "q_desc",
        "do_desc",
        "k_desc",
        "v_desc",
        "lse_desc",
        "delta_desc",
        "dk",
        "dv",
        "dq_desc",
        "dk_part",
        "dv_part",
    )
    + params(INT, "part_size")
    + params(TENSOR, "counts")
    + params(
        INT,
        "stride_dkb",
        "stride_dkh",
        "stride_dkn",
        "stride_dvb",
        "stride_dvh",
        "stride_dvn",
        "n_q",
        "n_k",
        "heads_q",
        "group",
        "heads",
        "row_stride",
    )
    + params(SCALAR, "qk_scale", "scale")
    + params(CONSTEXPR, "BLOCK_M", "STAGES", "CAUSAL", "GROUP_SUM", "FUSE_DQ"),
    tiles=(),
)


class HopperLauncher:
    """Launches the Hopper templates for one program (``HopperPlan``'s constants)."""

    _launcher = Launcher(hopper_forward_kernel)
    _dkdv = Launcher(hopper_dkdv_kernel)

    def __init__(self, spec: HopperPlan):
        self.spec = spec
        self._constexprs = {"BLOCK_N": spec.block_n, "STAGES": spec.stages, "CAUSAL": spec.causal}

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """Whether TMA can address every one of ``tensors`` (else the caller runs the generated kernel)."""
        return all(describable(t) for t in tensors)

    @staticmethod
    def rows_fit(lse: torch.Tensor) -> bool:
        """Whether the dK/dV template can address lse's (B, Hq, Nq) rows, padded to whole query blocks
        (``rows``), with int32 TMA coordinates (else the caller runs the generated dK/dV kernel)."""
        B, Hq, Nq = lse.shape
        return B * Hq * padded_rows(Nq, DKDV_BLOCK_M) < 2**31

    @staticmethod
    def rows(lse: torch.Tensor, **delta_from) -> tuple[torch.Tensor, torch.Tensor]:
        """The dK/dV template's lse and delta rows (``template_rows.template_rows``, whose keyword arguments
        say where delta comes from) for its query blocks."""
        return template_rows(lse, DKDV_BLOCK_M, **delta_from)

    @staticmethod
    def _describe_rows(rows: torch.Tensor) -> TensorDescriptor:
        """The flat float32 rows of ``rows`` read in [DKDV_BLOCK_M] tiles."""
        return descriptor(rows, [rows.numel()], [1], [DKDV_BLOCK_M], _ROW_LAYOUT)

    @staticmethod
    def _describe(t: torch.Tensor, rows: int, columns: int | None = None) -> TensorDescriptor:
        """``t`` (4-d) read and written in [1, 1, rows, columns] tiles (columns: all of D by default)."""
        return describe(t, rows, columns)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None
    ) -> None:
        """q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1 -> out (B, Hq, Nq, D) and, if given,
        lse (B, Hq, Nq) float32 contiguous, written in place."""
        B, Hq, Nq, _ = q.shape
        block_n = self.spec.block_n
        args = FORWARD.bind(
            {
                "q_desc": self._describe(q, _ROWS // 2),
                "k_desc": self._describe(k, block_n),
                "v_desc": self._describe(v, block_n),
                "o_desc": self._describe(out, _ROWS // 2),
                "q": q,
                "k": k,
                "v": v,
                "out": out,
                "lse": out if lse is None else lse,
                "n_q": Nq,
                "n_k": k.shape[2],
                "heads_q": Hq,
                "group": Hq // k.shape[1],
                "qk_scale": self.spec.qk_scale,
            }
        )
        self._launcher.launch(
            (B * Hq, cdiv(Nq, _ROWS)),
            args,
            FORWARD.constexprs({**self._constexprs, "SAVE_LSE": lse is not None}),
            num_warps=4,
            device=q.device,
            maxnreg=168,
        )

    def dkdv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dout: torch.Tensor,
        rows: tuple[torch.Tensor, torch.Tensor],
        dk: torch.Tensor,
        dv: torch.Tensor,
        dq: torch.Tensor | None = None,
    ) -> None:
        """q and dout (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Nq, Nk >= 1, ``rows``: the rows' lse and delta
        from ``rows`` (``rows_fit``) -> dk, dv (k's and v's shapes, unit last strides, any float dtype), written in
        place, and, if ``dq`` (B, Hq, Nq, D) float32 zeros (dense, any order of its dims, a unit last stride) is
        given, dQ added into it (TMA's float32 reduce-adds of each program's share of each tile: the order of the
        sum, so its last bits, vary from run to run). When the grid of key blocks would not fill the GPU once, a GQA
        group's query heads are split over ``_group_parts`` programs, whose float32 shares of dK and dV are summed
        in order by the last of them when there are two parts or under ``torch.use_deterministic_algorithms``, else
        added up atomically."""
        B, Hq, Nq, D = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        group, blocks = Hq // Hkv, cdiv(Nk, _ROWS)
        parts, group_sum, dk_part, dv_part, counts = group_split(q, k, dk, dv)
        dq_tiles = None if dq is None else self._describe(dq, DKDV_BLOCK_M, D // 2)
        lse_rows, delta_rows = rows
        args = DKDV.bind(
            {
                "q_desc": self._describe(q, DKDV_BLOCK_M),
                "do_desc": self._describe(dout, DKDV_BLOCK_M),
                "k_desc": self._describe(k, _ROWS // 2),
                "v_desc": self._describe(v, _ROWS // 2),
                "lse_desc": self._describe_rows(lse_rows),
                "delta_desc": self._describe_rows(delta_rows),
                "dk": dk,
                "dv": dv,
                "dq_desc": dq_tiles,
                "dk_part": dk_part,
                "dv_part": dv_part,
                "part_size": B * Hkv * Nk * D,
                "counts": counts,
                **dict(zip(("stride_dkb", "stride_dkh", "stride_dkn"), dk.stride())),
                **dict(zip(("stride_dvb", "stride_dvh", "stride_dvn"), dv.stride())),
                "n_q": Nq,
                "n_k": Nk,
                "heads_q": Hq,
                "group": group,
                "heads": group // parts,
                "row_stride": padded_rows(Nq, DKDV_BLOCK_M),
                "qk_scale": self.spec.qk_scale,
                "scale": self.spec.scale,
            }
        )
        self._dkdv.launch(
            (B * Hq // (group // parts), blocks),
            args,
            DKDV.constexprs(
                {
                    "BLOCK_M": DKDV_BLOCK_M,
                    "STAGES": DKDV_STAGES,
                    "CAUSAL": self.spec.causal,
                    "GROUP_SUM": group_sum,
                    "FUSE_DQ": dq is not None,
                }
            ),
            num_warps=4,
            device=q.device,
            maxnreg=168,
        )
        if group_sum == "atomic":
            dk.copy_(dk_part)
            dv.copy_(dv_part)


def group_split(
    q: torch.Tensor, k: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
) -> tuple[int, str, torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a dK/dV launch on Hopper (the hand-written kernel's or the template's: programs of 128 keys) of q
    (B, Hq, Nq, D) and k (B, Hkv, Nk, D) sums a GQA group's query heads: (parts, GROUP_SUM, dk_part, dv_part,
    counts). ``parts`` programs share a group (``_group_parts``); with one, GROUP_SUM is "none" and the
    buffers are dk and dv; with two or under ``torch.use_deterministic_algorithms``, "last": each part's
    float32 shares (parts, B, Hkv, Nk, D) and zeroed counters, one per 64-key tile; else "atomic": float32
    zeros (B, Hkv, Nk, D) to add into, which the caller copies to dk and dv after the launch."""
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
