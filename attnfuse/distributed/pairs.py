"""Which programs a ring can split, and which (query chunk, key chunk) pairs of a step it must run.

A ring runs the program on chunks of the sequence at their global positions (``q_offset``, ``k_offset``),
so its combinators must depend on positions, not on indices into the call's tensors: a fragment that
reads ``q_idx``, ``k_idx``, ``Nq`` or ``N_K`` would see a chunk's instead of the sequence's. Pairs whose
keys a mask keeps none of (its ``kv_range`` fact, evaluated on the host for the chunks' positions) are
skipped without a launch.
"""

from __future__ import annotations

import torch
from attrs import frozen

from ..errors import ProgramError
from ..fragment_lint import template_reads
from ..host_eval import evaluate, integer
from ..ir import MatMulPV
from ..passes.fuse import fuse
from ..passes.lower import Instance, LoweredProgram

INDEX_NAMES = frozenset({"q_idx", "k_idx", "Nq", "N_K"})
"""Template names that mean something else in a chunk than in the whole sequence."""


@frozen
class RingProgram:
    """What the ring needs of a program: its normaliser's combine rule (``"logsumexp"`` or ``"sum"``),
    whether its normaliser has a ``partial`` fragment, and its masks (for the facts)."""

    name: str
    combine: str
    partial: bool
    masks: tuple[Instance, ...]


def ring_program(lowered: LoweredProgram) -> RingProgram:
    """The ring's view of ``lowered``; ProgramError for what a ring cannot split."""
    norm = lowered.normaliser
    name = norm.apply.combinator
    if norm.fragment.combine is None:
        raise ProgramError(
            f"context_parallel: the normaliser {name} declares no combine rule "
            f"(NormaliserFragment.combine: how results over disjoint keys merge), so the ring cannot "
            f"merge its shards' results; softmax ('logsumexp') and relu_attention ('sum') declare one"
        )
    if norm.fragment.combine == "logsumexp" and not norm.fragment.has_lse:
        raise ProgramError(
            f"context_parallel: the normaliser {name} combines by 'logsumexp' but has no lse "
            f"(NormaliserFragment.has_lse)"
        )
    for m in lowered.masks:
        if m.fragment.block_list is not None:
            raise ProgramError(
                f"context_parallel: the mask {m.apply.combinator} lists blocks by their index in the "
                f"whole sequence (block sparsity), which a ring's chunks renumber; it is not supported "
                f"there: write the mask with positions (keep, kv_range) instead"
            )
    for inst in lowered.instances():
        reads = sorted(template_reads(inst.apply.declaration, inst.apply.fragment()) & INDEX_NAMES)
        if reads:
            raise ProgramError(
                f"context_parallel: {inst.apply.combinator} reads {', '.join(reads)}: indices into the "
                f"call's tensors, or its sizes, which differ between a chunk and the whole sequence; a "
                f"ring splits only programs whose combinators read positions (q_pos, k_pos) and Nk"
            )
    return RingProgram(
        name=name,
        combine=norm.fragment.combine,
        partial=norm.fragment.partial is not None,
        masks=tuple(m for m in lowered.masks if m.fragment.keep is not None),
    )


def check_takes_offsets(graph: MatMulPV) -> MatMulPV:
    """``graph``, or a ProgramError naming its first combinator that prepares kernel arguments but does not
    declare ``takes_offsets``: the ring runs every chunk at its position in the sequence (q_offset,
    k_offset), which such a combinator cannot take."""
    for app in fuse(graph).applications():
        comb = app.declaration
        if comb.prepare is not None and not comb.takes_offsets:
            raise ProgramError(
                f"context_parallel: {app.combinator} cannot take position offsets: it prepares "
                f"kernel arguments but does not declare takes_offsets=True, and the ring runs every "
                f"shard but the first at an offset into the sequence (q_offset, k_offset). Its "
                f"author declares Combinator(..., takes_offsets=True) once its prepare and fragments "
                f"are right for a chunk of a longer sequence (docs/writing-a-combinator.md, "
                f"section 2: takes_offsets)"
            )
    return graph


def keeps_any(masks: tuple[Instance, ...], queries: range, keys: range, names: dict[str, int]) -> bool:
    """Whether some query at positions ``queries`` may keep some key at positions ``keys``, by the masks'
    ``kv_range`` facts. ``names``: the template's sizes the facts may read (``Nk`` the sequence's length).
    A fact that reads anything else (the batch, the head, a plugin's argument) counts as keeping all."""
    for m in masks:
        if m.fragment.kv_range is None:
            continue
        lo, hi = (
            _value(m.code(e, q_lo=f"({queries.start})", q_hi=f"({queries.stop - 1})"), names)
            for e in m.fragment.kv_range
        )
        if lo is not None and hi is not None and min(hi, keys.stop) <= max(lo, keys.start):
            return False
    return True


def _value(expression: str, names: dict[str, int]) -> int | None:
    """The integer value of a fact's expression, or None when it reads something the host does not know."""
    try:
        value = evaluate(expression, {name: integer(v) for name, v in names.items()})
    except (NameError, AttributeError, TypeError, ValueError, ArithmeticError, RuntimeError):
        return None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
