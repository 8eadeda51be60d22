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
from ..ir import MaskOp, MatMulPV, applications, chain
from ..plan import MaskRange, Plan

INDEX_NAMES = frozenset({"q_idx", "k_idx", "Nq", "N_K"})
"""Template names that mean something else in a chunk than in the whole sequence."""


@frozen
class RingProgram:
    """What the ring needs of a program: its normaliser's combine rule (``"logsumexp"`` or ``"sum"``),
    whether its normaliser has a ``partial`` fragment, and its masks' key ranges (for the facts)."""

    name: str
    combine: str
    partial: bool
    masks: tuple[MaskRange, ...]


def ring_program(plan: Plan) -> RingProgram:
    """The ring's view of the program ``plan`` runs; ProgramError for what a ring cannot split."""
    name = plan.graph.weights.apply.combinator
    if plan.combine is None:
        raise ProgramError(
            f"context_parallel: the normaliser {name} declares no combine rule "
            f"(NormaliserFragment.combine: how results over disjoint keys merge), so the ring cannot "
            f"merge its shards' results; softmax ('logsumexp') and relu_attention ('sum') declare one"
        )
    if plan.combine == "logsumexp" and not plan.has_lse:
        raise ProgramError(
            f"context_parallel: the normaliser {name} combines by 'logsumexp' but has no lse "
            f"(NormaliserFragment.has_lse)"
        )
    for node in chain(plan.graph):
        if isinstance(node, MaskOp) and node.apply.fragment().block_list is not None:
            raise ProgramError(
                f"context_parallel: the mask {node.apply.combinator} lists blocks by their index in the "
                f"whole sequence (block sparsity), which a ring's chunks renumber; it is not supported "
                f"there: write the mask with positions (keep, kv_range) instead"
            )
    for app in applications(plan.graph):
        reads = sorted(template_reads(app.declaration, app.fragment()) & INDEX_NAMES)
        if reads:
            raise ProgramError(
                f"context_parallel: {app.combinator} reads {', '.join(reads)}: indices into the "
                f"call's tensors, or its sizes, which differ between a chunk and the whole sequence; a "
                f"ring splits only programs whose combinators read positions (q_pos, k_pos) and Nk"
            )
    return RingProgram(name=name, combine=plan.combine, partial=plan.partial, masks=plan.mask_ranges)


def check_takes_offsets(graph: MatMulPV) -> MatMulPV:
    """``graph``, or a ProgramError naming its first combinator that prepares kernel arguments but does not
    declare ``takes_offsets``: the ring runs every chunk at its position in the sequence (q_offset,
    k_offset), which such a combinator cannot take."""
    for app in applications(graph):
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


def keeps_any(masks: tuple[MaskRange, ...], queries: range, keys: range, names: dict[str, int]) -> bool:
    """Whether some query at positions ``queries`` may keep some key at positions ``keys``, by the masks'
    ``kv_range`` facts. ``names``: the template's sizes the facts may read (``Nk`` the sequence's length).
    A fact that reads anything else (the batch, the head, a plugin's argument) counts as keeping all."""
    for m in masks:
        lo, hi = (_value(e, names) for e in m.bounds(f"({queries.start})", f"({queries.stop - 1})"))
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
