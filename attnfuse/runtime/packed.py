"""Packed sequences (``cu_seqlens_q``, ``cu_seqlens_k``): checks with clear errors, the device-side check of
the offsets' values (no host sync), and the grids of the generated kernels (``passes/codegen/packed.py``).

q (1, Hq, total_q, D) and k, v (1, Hkv, total_k, D/DV) hold documents one after another: document i at rows
cu_seqlens_q[i] .. cu_seqlens_q[i + 1] of q and cu_seqlens_k[i] .. cu_seqlens_k[i + 1] of k and v. Each is
a sequence of its own: its queries see only its keys, at positions local to it (query i of a document of
Nq_i queries and Nk_i keys at i + Nk_i - Nq_i, as a call with those tensors alone places it).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..combinator import Role
from ..errors import InputError, UnsupportedError
from ..fragment_lint import indices_read
from ..ir import applications
from ..launch_spec import CONSTEXPR, INT, TENSOR, LaunchSpec, params
from ..plan import Plan
from . import error_record
from .gpu_gate import Gate
from .interpreter import InterpretedKernel
from .launcher import Launcher, cdiv, head_grid

NO_LIMIT = 2**62  # max_seqlen not given
GATE = Gate(
    "packed sequences (cu_seqlens_q/cu_seqlens_k)",
    "ATTNFUSE_PACKED_ON_GPU",
    "tests/test_gpu.py::test_packed_sequences_match_each_document_alone",
    checked=("interpreter", "sm90"),
)


class Packed(NamedTuple):
    """A packed call's document offsets, (docs + 1,) int32 or int64 contiguous on q's device, and ``docs``."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    docs: int


def _max_seqlen(name: str, value: Any) -> int:
    if value is None:
        return NO_LIMIT
    try:
        found = operator.index(value)
    except TypeError:
        raise InputError(f"{name} must be an int (the longest document's length) or None, got {value!r}") from None
    if isinstance(value, bool) or found < 0:
        raise InputError(f"{name} must be a non-negative int (the longest document's length) or None, got {value!r}")
    return found


def refuse_arguments(given: dict[str, bool]) -> None:
    """UnsupportedError naming the first call argument packed sequences do not take yet, of ``given`` (by
    name, True where the call gives it)."""
    for name, present in given.items():
        if present:
            raise UnsupportedError(
                f"{name} cannot be combined with cu_seqlens_q/cu_seqlens_k yet: packed sequences take "
                f"contiguous q, k, v with document offsets only"
            )


def check_packed(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any) -> Packed:
    """The call's ``Packed`` offsets (types, shapes, devices checked; values are checked on the device by
    ``check_values``), on a device where packed calls run (``GATE``). q, k passed ``inputs.check_inputs``."""
    GATE.check(q.device)
    return check_offsets(q, k, cu_seqlens_q, cu_seqlens_k)


def check_offsets(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any) -> Packed:
    """``check_packed`` on any device (the reference's)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise InputError(f"packed sequences need both cu_seqlens_q and cu_seqlens_k; {missing} is missing")
    if q.shape[0] != 1:
        raise InputError(
            f"cu_seqlens_q: packed sequences take q (1, Hq, total_q, D) and k, v (1, Hkv, total_k, D): batch "
            f"size 1 (documents one after another along the rows), got q's batch size {q.shape[0]}"
        )
    for name, t, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[2]), ("cu_seqlens_k", cu_seqlens_k, k.shape[2])):
        integers = isinstance(t, torch.Tensor) and t.dtype in (torch.int32, torch.int64)
        if not integers or t.dim() != 1 or t.shape[0] < 1:
            raise InputError(
                f"{name} must be a 1-D int32 (or int64) tensor of document offsets (docs + 1,), got "
                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            )
        if t.device != q.device:
            raise InputError(f"{name} is on {t.device}, q on {q.device}")
        if t.shape[0] == 1 and total:
            raise InputError(f"{name} holds no document (shape (1,)) but the packed length is {total}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise InputError(
            f"cu_seqlens_q and cu_seqlens_k must count the same documents: got {cu_seqlens_q.shape[0] - 1} "
            f"and {cu_seqlens_k.shape[0] - 1} (shapes {tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)})"
        )
    return Packed(cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), cu_seqlens_q.shape[0] - 1)


def reference_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    kv_lens: Any,
    block_table: Any,
    *positions: Any,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The reference's packed offsets (cu_seqlens_q, cu_seqlens_k), checked as a call checks them, values
    included (a host sync: an InputError here), or None when neither is given."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return None
    refuse_arguments(
        {
            "kv_lens": kv_lens is not None,
            "block_table": block_table is not None,
            "q_offset, k_offset, seq_len": any(p is not None for p in positions),
        }
    )
    packed = check_offsets(q, k, cu_seqlens_q, cu_seqlens_k)
    check_values(packed, q.shape[2], k.shape[2], None, None)
    error_record.record_for(q.device).wait()
    return packed.cu_q, packed.cu_k


def refuse_program(plan: Plan, wanted_grads: tuple[str, ...] | None) -> None:
    """UnsupportedError for what packed sequences do not run yet: a combinator reading the call's indices
    q_idx, k_idx unless it declares ``packed_rows`` (a score modification, mask or normaliser: it reads them as
    rows of the packed q and k, ``lower.packed_rows``; a mask listing blocks, such as block_sparse, is then
    applied element by element, ``lower._one_listing``), or gradients of runtime inputs (``wanted_grads``, their
    names) other than a qk transform's tensor's and a score modification's score-shaped one."""
    for app in applications(plan.graph):
        reads = indices_read(app)
        if reads and app.declaration.role in (Role.QK_TRANSFORM, Role.SCORE_SOURCE):
            raise UnsupportedError(
                f"{app.combinator} reads {', '.join(reads)} in a qk transform or score source: not supported "
                f"with cu_seqlens_q/cu_seqlens_k yet"
            )
        if reads and not app.declaration.packed_rows:
            raise UnsupportedError(
                f"{app.combinator} reads {', '.join(reads)}, which index a packed call's tensors by packed rows "
                f"only in a combinator that declares packed_rows=True (its tensors span the packed row, and its "
                f"fragments compare no index with Nq or Nk); not supported with cu_seqlens_q/cu_seqlens_k"
            )
    # a qk transform's tensor's (summed over rows) and a score modification's score-shaped one (written at
    # packed rows, ``codegen/backward.py``) are computed; any other is not yet
    computed = {g.argument for g in plan.input_gradients if g.sides or g.prefix is not None}
    others = [name for name in wanted_grads or () if name not in computed]
    if others:
        raise UnsupportedError(
            f"gradients of runtime inputs ({', '.join(others)}) are not computed with "
            f"cu_seqlens_q/cu_seqlens_k yet; pass them detached"
        )


def search_steps(docs: int) -> int:
    """The binary search's steps that find a block's document among ``docs``."""
    return max(docs, 1).bit_length()


def launch_args(packed: Packed) -> dict[str, Any]:
    """The packed kernels' arguments (``codegen/packed.py: packed_params``)."""
    return {"CuQ": packed.cu_q, "CuK": packed.cu_k, "DOCS": packed.docs, "SEARCH_STEPS": search_steps(packed.docs)}


def query_grid(total: int, docs: int, heads: int) -> Callable[[Any], tuple[int, ...]]:
    """The grid of a packed query-block kernel (forward, dQ): total // BLOCK_M + docs blocks per head, an
    upper bound on the blocks the documents need (cdiv(len_i, BLOCK_M) each), known without a host sync."""
    return lambda tiles: ((total // tiles.block_m + docs) * heads,)


def key_grid(total: int, docs: int, heads: int) -> Callable[[Any], tuple[int, ...]]:
    """The grid of the packed dK/dV kernel: (total // BLOCK_N + docs key blocks, *heads)."""
    y, z = head_grid(heads, "Hkv")
    return lambda tiles: (total // tiles.block_n + docs, y, z)


def _check_kernel(Cu, Record, DOCS, TOTAL, MAX_LEN, SIDE, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i <= DOCS
    c = tl.load(Cu + i, mask=inside, other=0).to(tl.int64)
    prev = tl.load(Cu + i - 1, mask=inside & (i > 0), other=0).to(tl.int64)
    out_of_order = (c < 0) | (c > TOTAL) | ((i == 0) & (c != 0)) | ((i == DOCS) & (c != TOTAL)) | (c < prev)
    bad = inside & (out_of_order | ((i > 0) & (c - prev > MAX_LEN)))
    first = tl.min(tl.where(bad, i, DOCS + 1), 0)
    if first <= DOCS:
        value = tl.load(Cu + first).to(tl.int64)
        before = tl.load(Cu + tl.maximum(first - 1, 0)).to(tl.int64)
        misplaced = (value < 0) | (value > TOTAL) | ((first == 0) & (value != 0)) | (value < before)
        misplaced = misplaced | ((first == DOCS) & (value != TOTAL))
        kind = tl.where(misplaced, 3, 4).to(tl.int64)  # error_record.BAD_OFFSET, LONG_DOCUMENT
        if tl.atomic_cas(Record, kind * 0, kind) == 0:  # the first error recorded wins; the fields follow it
            tl.store(Record + 1, first.to(tl.int64))
            tl.store(Record + 2, kind * 0 + SIDE)
            tl.store(Record + 3, value)
            tl.store(Record + 4, before)
            tl.store(Record + 5, kind * 0 + TOTAL)
            tl.store(Record + 8, kind * 0 + MAX_LEN)


CHECK = LaunchSpec(
    "_check_kernel",
    params(TENSOR, "Cu", "Record") + params(INT, "DOCS", "TOTAL", "MAX_LEN", "SIDE") + params(CONSTEXPR, "BLOCK"),
    tiles=(),
)
_BLOCK = 128
_jitted = Launcher(triton.jit(_check_kernel))
_interpreted = InterpretedKernel(_check_kernel)


def check_values(
    packed: Packed, total_q: int, total_k: int, max_seqlen_q: Any, max_seqlen_k: Any, validate: bool = True
) -> None:
    """Check on the device, with no host sync, that each of cu_seqlens_q and cu_seqlens_k starts at 0, never
    decreases and ends at its packed length, and that no document is longer than max_seqlen_q or
    max_seqlen_k (when given): the first bad entry goes to the device's error record, whose InputError
    names it (at once on CPU; on CUDA at a later validated call or ``attnfuse.check_errors()``).
    ``validate=False`` checks nothing (the kernels still read and write only inside the tensors)."""
    limits = (_max_seqlen("max_seqlen_q", max_seqlen_q), _max_seqlen("max_seqlen_k", max_seqlen_k))
    device = packed.cu_q.device
    if not validate:
        error_record.report(device)
        return
    record = error_record.record_for(device)
    kernel = _interpreted if device.type == "cpu" else _jitted
    for side, (cu, total, limit) in enumerate(((packed.cu_q, total_q, limits[0]), (packed.cu_k, total_k, limits[1]))):
        args = {"Cu": cu, "DOCS": packed.docs, "TOTAL": total, "MAX_LEN": limit, "SIDE": side}

        def launch(values: torch.Tensor, args: dict = args) -> None:
            bound = CHECK.bind({**args, "Record": values})
            kernel.launch((cdiv(packed.docs + 1, _BLOCK),), bound, CHECK.constexprs({"BLOCK": _BLOCK}), device=device)

        record.run_check(launch)
