"""Deterministic checks of a mask's declared facts against its float64 reference ``keep``.

A wrong fact is a silently wrong kernel: a key outside ``kv_range`` is never visited, a key inside
``full_range`` is never masked. A fuzzer hits the one block where a fact is off by one only by luck, so
these checks enumerate small problems instead (Nq < Nk, Nq = Nk, Nq > Nk, per-sequence ``kv_lens``,
several block sizes, the decode kernel's block of every query, the plugin's own ``examples`` for
parameters) and evaluate the fragment's expressions in plain torch (``attnfuse.host_eval``), block by block:

* ``keep`` equals the reference's keep, element by element;
* ``kv_range``: every key a query of the block keeps lies in it; ``full_range``: every query of the block
  keeps every (existing) key in it;
* ``q_range`` / ``q_full_range``: the same, transposed, for each key block;
* ``block_list``: every block holding a kept element is listed, for query blocks and for key blocks, and
  every listed block that ``partial`` (``q_partial``) does not mark partial keeps every element it has.

Positions as the kernels see them: query i of sequence b at ``i + Nk_b - Nq``, key j at ``j``, where
``Nk_b`` is the sequence's key count. A mask with no facts is valid (the kernel visits every block).
"""

from __future__ import annotations

import string
from typing import Any, Iterator

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ..combinator import INPUT, Combinator, MaskFragment, Role
from ..plugin_manager import combinators
from ..reference import make_context
from ..runtime.inputs import LaunchContext
from ..static_values import literal
from .strategies import Shape
from ..host_eval import Pointer, evaluate, integer

# (B, Hq, Hkv, Nq, Nk, kv_lens or None): Nq below, equal to and above Nk; sizes off the block multiples.
GRIDS: tuple[tuple[int, int, int, int, int, tuple[int, ...] | None], ...] = (
    (1, 1, 1, 1, 37, None),
    (1, 2, 1, 13, 64, None),
    (2, 2, 2, 40, 40, None),
    (1, 1, 1, 64, 64, None),
    (1, 2, 2, 50, 23, None),
    (2, 1, 1, 33, 70, None),
    (2, 2, 1, 7, 48, (48, 20)),
    (2, 1, 1, 16, 50, (31, 16)),
)
BLOCKS = (16, 32, 64)
MAX_REPORTED = 20


class MaskFactError(AssertionError):
    """A mask's keep or facts disagree with its reference; the message lists every violation found."""


def _param_sets(comb: Combinator, shape: Shape, count: int) -> list[dict[str, Any]]:
    """Parameters from the plugin's ``examples`` (derandomised, so each run checks the same ones)."""
    if comb.examples is None:
        return [{p.name: p.default for p in comb.params}]
    found: list[dict[str, Any]] = []

    @settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def draw(data):
        found.append(comb.examples(data.draw, shape))

    draw()
    return found[:count]


def _substitute(text: str, mapping: dict[str, str], site: dict[str, str]) -> str:
    """As lowering does: parameters, tensors and scalars first (``$$`` escapes a slot's placeholder), then
    the slot's own placeholders."""
    return string.Template(string.Template(text).safe_substitute(mapping)).substitute(site)


class _Evaluator:
    """One mask, one problem, one parameter set: its expressions compiled, its tensors prepared."""

    def __init__(self, comb: Combinator, params: dict[str, Any], grid: tuple, fragment: MaskFragment):
        B, Hq, Hkv, Nq, Nk, kv_lens = grid
        self.comb, self.params, self.fragment = comb, params, fragment
        self.names: dict[str, Any] = {}
        mapping = {p.name: literal(params[p.name]) for p in comb.params if not p.runtime}
        mapping["self"] = f"{comb.name}_0"
        lens = None if kv_lens is None else torch.tensor(kv_lens, dtype=torch.int32)
        prepared = (
            comb.prepare(
                LaunchContext(
                    B=B,
                    Hq=Hq,
                    Hkv=Hkv,
                    Nq=Nq,
                    Nk=Nk,
                    D=16,
                    DV=16,
                    device=torch.device("cpu"),
                    dtype=torch.float32,
                    kv_lens=lens,
                ),
                **params,
            )
            if comb.prepare
            else {}
        )
        for t in comb.tensors:
            value = prepared[t.name]
            var = f"_tensor_{t.name}"
            self.names[var] = Pointer(value.cpu())
            mapping[t.name] = var
            mapping.update({f"{t.name}_s{i}": str(value.stride(i)) for i in range(t.rank)})
        for sc in comb.scalars:
            var = f"_scalar_{sc.name}"
            self.names[var] = integer(prepared[sc.name]) if isinstance(prepared[sc.name], int) else prepared[sc.name]
            mapping[sc.name] = var
        self.mapping = mapping

    def code(self, text: str, **site: str):
        return compile(_substitute(text, self.mapping, site).strip(), f"<{self.comb.name}>", "eval")

    def value(self, code, **names: Any) -> Any:
        return evaluate(code, {**self.names, **names})


def _reference_keep(comb: Combinator, params: dict[str, Any], grid: tuple) -> torch.Tensor:
    B, Hq, Hkv, Nq, Nk, kv_lens = grid
    q = torch.zeros(B, Hq, Nq, 1, dtype=torch.float64)
    k = torch.zeros(B, Hkv, Nk, 1, dtype=torch.float64)
    lens = None if kv_lens is None else torch.tensor(kv_lens, dtype=torch.int32)
    ctx = make_context(q, k, k, torch.float64, lens)
    values = {
        n: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for n, v in params.items()
    }
    keep = comb.reference(ctx, **values)
    if keep is None:
        return torch.ones(B, Hq, Nq, Nk, dtype=torch.bool)
    return torch.broadcast_to(keep.bool(), (B, Hq, Nq, Nk)).cpu()


def violations(name: str, examples: int = 8) -> list[str]:
    """Every disagreement between mask ``name``'s fragment (keep, facts, block lists) and its reference, each
    message once (the first ``MAX_REPORTED``)."""
    comb = combinators()[name].combinator
    if comb.role is not Role.MASK:
        return []
    found: list[str] = []
    for grid in GRIDS:
        B, Hq, Hkv, Nq, Nk, kv_lens = grid
        shape = Shape(B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, D=16, DV=16)
        for params in _param_sets(comb, shape, examples):
            fragment = comb.fragment_for(
                {p.name: INPUT if p.runtime and params[p.name] is not None else params[p.name] for p in comb.params}
            )
            ev = _Evaluator(comb, params, grid, fragment)
            keep = _reference_keep(comb, params, grid)
            where = f"B={B}, Hq={Hq}, Nq={Nq}, Nk={Nk}, kv_lens={kv_lens}, params={_show(params)}"
            for problem in _check(ev, keep, grid):
                message = f"combinator {name!r}: {problem} ({where})"
                if message not in found:  # block sizes that give the same blocks find the same violation
                    found.append(message)
                if len(found) >= MAX_REPORTED:
                    return found
    return found


def check_mask_facts(name: str, examples: int = 8) -> None:
    """Raise ``MaskFactError`` naming the combinator, fact, parameters and block of each violation."""
    found = violations(name, examples)
    if found:
        more = " (first ones)" if len(found) >= MAX_REPORTED else ""
        raise MaskFactError(
            f"mask {name!r} declares keep or facts its reference contradicts{more}:\n  " + "\n  ".join(found)
        )


def _show(params: dict[str, Any]) -> str:
    def one(v):
        return f"tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v)

    return "{" + ", ".join(f"{n}={one(v)}" for n, v in params.items()) + "}"


def _check(ev: _Evaluator, keep: torch.Tensor, grid: tuple) -> Iterator[str]:
    B, Hq, Hkv, Nq, Nk, kv_lens = grid
    f = ev.fragment
    for b in range(B):
        nk = Nk if kv_lens is None else min(kv_lens[b], Nk)
        offset = nk - Nq
        for h in range(Hq):
            kept = keep[b, h, :, :nk]
            base = {
                "b": integer(b),
                "h": integer(h),
                "hk": integer(h // (Hq // Hkv)),
                "Nq": integer(Nq),
                "Nk": integer(nk),
                "N_K": integer(Nk),
            }
            if f.keep is not None:
                yield from _check_keep(ev, kept, base, offset, nk, b, h)
            for rows in _row_blocks(Nq):
                yield from _check_rows(ev, kept, base, rows, offset, nk, b, h)
            for size in BLOCKS:
                for k_lo in range(0, nk, size):
                    yield from _check_keys(ev, kept, base, range(k_lo, min(k_lo + size, nk)), offset, size, b, h)
            if f.block_list is not None:
                yield from _check_lists(ev, kept, base, nk, b, h)


def _row_blocks(Nq: int) -> Iterator[range]:
    yield range(0, Nq)  # the decode kernel's: every query
    for size in BLOCKS:
        for lo in range(0, Nq, size):
            yield range(lo, min(lo + size, Nq))


def _check_keep(ev, kept, base, offset, nk, b, h) -> Iterator[str]:
    Nq = kept.shape[0]
    q_idx, k_pos = torch.arange(Nq), torch.arange(nk)
    names = {
        **base,
        "q_idx": q_idx,
        "q_pos": q_idx + offset,
        "k_pos": k_pos,
        "k_idx": k_pos,
        "q_ok": torch.ones(Nq, dtype=torch.bool),
        "k_ok": torch.ones(nk, dtype=torch.bool),
        "in_bounds": torch.ones(Nq, nk, dtype=torch.bool),
    }
    got = torch.broadcast_to(torch.as_tensor(ev.value(ev.code(ev.fragment.keep), **names)).bool(), (Nq, nk))
    wrong = (got != kept).nonzero()
    if len(wrong):
        i, j = wrong[0].tolist()
        yield (
            f"keep gives {bool(got[i, j])} for query {i} (position {i + offset}) and key {j}, its reference "
            f"{bool(kept[i, j])} ({len(wrong)} elements differ; b={b}, h={h})"
        )


def _range(ev, fact: str, site: dict[str, str], names: dict[str, Any]) -> tuple[int, int, str]:
    lo_text, hi_text = getattr(ev.fragment, fact)
    lo, hi = (int(ev.value(ev.code(t, **site), **names)) for t in (lo_text, hi_text))
    return lo, hi, f"{fact}=({lo_text!r}, {hi_text!r})"


def _check_rows(ev, kept, base, rows: range, offset, nk, b, h) -> Iterator[str]:
    f = ev.fragment
    q_lo, q_hi = rows.start + offset, rows.stop - 1 + offset
    names = {**base, "q_lo": integer(q_lo), "q_hi": integer(q_hi)}
    site = {"q_lo": "q_lo", "q_hi": "q_hi"}
    block = f"query block of positions {q_lo}..{q_hi} (rows {rows.start}..{rows.stop - 1}, b={b}, h={h})"
    tile = kept[rows.start : rows.stop]
    if f.kv_range is not None:
        lo, hi, fact = _range(ev, "kv_range", site, names)
        keys = tile.any(0).nonzero().flatten().tolist()
        outside = [j for j in keys if not lo <= j < hi]
        if outside:
            yield f"{fact} is [{lo}, {hi}) for the {block}, which keeps key {outside[0]} outside it"
    if f.full_range is not None:
        lo, hi, fact = _range(ev, "full_range", site, names)
        lo, hi = max(lo, 0), min(hi, nk)
        if lo < hi and not tile[:, lo:hi].all():
            i, j = (~tile[:, lo:hi]).nonzero()[0].tolist()
            yield (
                f"{fact} is [{lo}, {hi}) for the {block}, but query position {rows.start + i + offset} "
                f"drops key {lo + j}"
            )


def _check_keys(ev, kept, base, keys: range, offset, size, b, h) -> Iterator[str]:
    f = ev.fragment
    if f.q_range is None and f.q_full_range is None:
        return
    names = {**base, "k_lo": integer(keys.start), "k_hi": integer(keys.stop - 1)}
    site = {"k_lo": "k_lo", "k_hi": "k_hi"}
    block = f"key block {keys.start}..{keys.stop - 1} (BLOCK_N={size}, b={b}, h={h})"
    tile = kept[:, keys.start : keys.stop]
    Nq = kept.shape[0]
    if f.q_range is not None:
        lo, hi, fact = _range(ev, "q_range", site, names)
        positions = [i + offset for i in tile.any(1).nonzero().flatten().tolist()]
        outside = [p for p in positions if not lo <= p < hi]
        if outside:
            yield f"{fact} is [{lo}, {hi}) for the {block}, which query position {outside[0]} keeps"
    if f.q_full_range is not None:
        lo, hi, fact = _range(ev, "q_full_range", site, names)
        lo, hi = max(lo, offset), min(hi, Nq + offset)
        if lo < hi and not tile[lo - offset : hi - offset].all():
            i, j = (~tile[lo - offset : hi - offset]).nonzero()[0].tolist()
            yield f"{fact} is [{lo}, {hi}) for the {block}, but query position {lo + i} drops key {keys.start + j}"


def _check_lists(ev, kept, base, nk, b, h) -> Iterator[str]:
    bl = ev.fragment.block_list
    size = int(ev.value(ev.code(bl.size), **base))
    Nq = kept.shape[0]
    for what, count_text, index_text, partial_text, blocks, lines, tile in (
        (
            "query",
            bl.count,
            bl.index,
            bl.partial,
            -(-Nq // size),
            lambda i: kept[i * size : (i + 1) * size].any(0),
            lambda i, j: kept[i * size : (i + 1) * size, j * size : (j + 1) * size],
        ),
        (
            "key",
            bl.q_count,
            bl.q_index,
            bl.q_partial,
            -(-nk // size),
            lambda i: kept[:, i * size : (i + 1) * size].any(1),
            lambda i, j: kept[j * size : (j + 1) * size, i * size : (i + 1) * size],
        ),
    ):
        count_code, index_code = ev.code(count_text, block="_block"), ev.code(index_text, block="_block", i="_i")
        partial_code = None if partial_text is None else ev.code(partial_text, block="_block", i="_i")
        for block in range(blocks):
            names = {**base, "_block": integer(block)}
            n = int(ev.value(count_code, **names))
            listed = {int(ev.value(index_code, **names, _i=integer(i))) for i in range(n)}
            needed = set((lines(block).view(-1)).nonzero().flatten().div(size, rounding_mode="floor").tolist())
            missing = sorted(needed - listed)
            if missing:
                yield (
                    f"block_list omits block {missing[0]} from the list of {what} block {block} "
                    f"(size {size}, b={b}, h={h}), which keeps something in it"
                )
            for i in range(n if partial_code is not None else 0):
                other = int(ev.value(index_code, **names, _i=integer(i)))
                if not bool(ev.value(partial_code, **names, _i=integer(i))) and not tile(block, other).all():
                    yield (
                        f"block_list.{'q_' if what == 'key' else ''}partial calls block {other} of the list of "
                        f"{what} block {block} (size {size}, b={b}, h={h}) kept in full, but it drops an element"
                    )
