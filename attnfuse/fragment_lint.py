"""The fragment contract, checked when a plugin registers: which template names each slot may read and write.

A fragment is Triton text spliced into the kernel template, so it shares the template's namespace. The
linter parses each fragment field with ``ast`` (placeholders replaced by marker names) and refuses:

* syntax errors;
* writes to names the template owns (``k_pos``, ``acc``, ``lo`` ...) other than the slot's outputs;
* temporaries of a score modification, mask or qk transform not named ``${self}_<name>`` (``${tmp}_``
  for a transform), which could collide with another application's;
* reads of names the slot does not provide (``q_base``, a normaliser's ``m_i`` from a score modification);
* a slot that must write its output and does not (an update that never sets ``p``).

Each refusal is a ``PluginError`` naming the combinator, its distribution, the fragment field and the
offending lines. Nothing in the kernel text changes: the check only reads it.

A fragment that spells the accumulation type ``tl.float32`` instead of ``$acc_dtype`` (the contract of
2026-11-30) is accepted with a DeprecationWarning, once per combinator: it computes in float32 as before,
and ``refuse_old_accumulator`` refuses a float64 call of it, which it would silently compute in float32.
"""

from __future__ import annotations

import ast
import re
import string
import textwrap
from typing import Any, Iterator

import attrs
from attrs import frozen

from .combinator import (
    ACCUMULATOR,
    BlockList,
    Combinator,
    MaskFragment,
    NormaliserFragment,
    QKTransformFragment,
    Range,
    ScoreModFragment,
    ScoreSourceFragment,
)
from .errors import InputError, PluginError, deprecated
from .parsing import parse

BUILTINS = frozenset({"float", "int", "range", "min", "max", "abs", "True", "False", "None", "tl", "triton"})
COMMON = BUILTINS | {
    "b",
    "h",
    "hk",
    "Nq",
    "Nk",
    "N_K",
    "HQ",
    "GROUP",
    "D",
    "DV",
    "HALF",
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_D",
    "BLOCK_DV",
    "BLOCK_H",
    "d",
    "dv",
    "dh",
    "q_idx",
    "q_pos",
    "q_ok",
}
"""What every statement fragment may read (the prologue runs before the key loop)."""
TILE = COMMON | {"k_idx", "k_pos", "k_ok", "in_bounds"}
"""What fragments inside the key loop may read besides."""
TEMPLATE_NAMES = TILE | {
    "pid",
    "pid_m",
    "pid_n",
    "pid_bh",
    "pid_r",
    "pid_s",
    "q_head",
    "r",
    "rows",
    "part",
    "q_programs",
    "blocks",
    "lo",
    "hi",
    "full_lo",
    "full_hi",
    "start",
    "full_start",
    "full_end",
    "start_n",
    "start_m",
    "w_lo",
    "w_hi",
    "steps",
    "t",
    "i",
    "g",
    "g_lo",
    "g_hi",
    "one_head",
    "slot",
    "split_slots",
    "light",
    "share",
    "rows_n",
    "count",
    "last",
    "j",
    "run_tiles",
    "list_size",
    "row_blocks",
    "head_lo",
    "group_heads",
    "list_tiles",
    "list_block",
    "list_t",
    "page",
    "HKV",
    "SPLIT",
    "NUM_SPLITS",
    "EVEN_K",
    "EVEN_M",
    "q",
    "k",
    "v",
    "q1",
    "q2",
    "k1",
    "k2",
    "q1f",
    "q2f",
    "k1f",
    "k2f",
    "q_ptrs",
    "k_ptrs",
    "k_in",
    "part_row",
    "q_base",
    "k_base",
    "v_base",
    "do_base",
    "k_off",
    "v_off",
    "o_ptrs",
    "qo_ptrs",
    "ko_ptrs",
    "s",
    "sT",
    "s_nat",
    "keep",
    "p",
    "acc",
    "out",
    "lse",
    "o",
    "do",
    "dp",
    "ds",
    "delta",
    "dq",
    "dk",
    "dq1",
    "dq2",
    "dk1",
    "dk2",
    "dv_acc",
    "q_lo",
    "q_hi",
    "k_lo",
    "k_hi",
    "v_finite",
    "key_bad",
    "row_bad",
    "col_bad",
}
"""Names the kernel templates define (tests/test_fragment_lint.py checks generated kernels against it)."""
_TEMPLATE_PATTERN = re.compile(r"^(s_\d+|[qk]_in\d+_[12]|stride_\w+|[A-Z]\w*)$")


@frozen
class Slot:
    """One fragment field: expression or statements, what it reads and writes besides its own names."""

    expression: bool
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()  # template names it may (re)write
    must_write: frozenset = frozenset()
    prefixed: bool = True  # its temporaries must be ${self}_ (or ${tmp}_) names


def _slots(fragment: Any, state: frozenset, rows_state: frozenset) -> dict[str, Slot]:
    """The slots of one fragment; ``state``/``rows_state``: the names a normaliser's init/backward_rows set."""
    f = frozenset
    if isinstance(fragment, ScoreModFragment):
        return {
            "body": Slot(False, TILE | {"s"}, f({"s"}), f({"s"})),
            "prologue": Slot(False, COMMON),
            "grad": Slot(False, TILE | {"s", "ds", "_s_in_", "_s_out_"}, f({"ds"}), f({"ds"})),
            "tensor_grads": Slot(True, TILE | {"s", "ds", "_s_in_", "_s_out_"}),
        }
    if isinstance(fragment, MaskFragment):
        facts = BUILTINS | {"b", "h", "hk", "Nq", "Nk", "N_K", "HQ", "GROUP"}
        return {
            "keep": Slot(True, TILE),
            "kv_range": Slot(True, facts | {"_q_lo_", "_q_hi_"}),
            "full_range": Slot(True, facts | {"_q_lo_", "_q_hi_"}),
            "q_range": Slot(True, facts | {"_k_lo_", "_k_hi_"}),
            "q_full_range": Slot(True, facts | {"_k_lo_", "_k_hi_"}),
        }
    if isinstance(fragment, BlockList):
        at = BUILTINS | {"b", "h", "hk", "Nq", "Nk", "N_K", "HQ", "GROUP", "_block_", "_i_", "_slot_"}
        return {
            name: Slot(True, at)
            for name in (
                "size",
                "count",
                "index",
                "q_count",
                "q_index",
                "order",
                "q_order",
                "q_split",
                "partial",
                "q_partial",
            )
        }
    if isinstance(fragment, QKTransformFragment):
        site = COMMON | {"_x1_", "_x2_", "_pos_", "_ok_", "_col1_", "_col2_"}
        grad = site | {"_g1_", "_g2_"}
        return {
            "q": Slot(False, site, f({"_x1_", "_x2_"})),
            "k": Slot(False, site, f({"_x1_", "_x2_"})),
            "q_grad": Slot(False, grad, f({"_g1_", "_g2_"})),
            "k_grad": Slot(False, grad, f({"_g1_", "_g2_"})),
            "columns": Slot(True, BUILTINS | {"dh", "HALF", "D"}),
            "q_tensor_grads": Slot(False, grad, f({"_d1_", "_d2_"}), f({"_d1_", "_d2_"})),
            "k_tensor_grads": Slot(False, grad, f({"_d1_", "_d2_"}), f({"_d1_", "_d2_"})),
        }
    if isinstance(fragment, NormaliserFragment):
        update = TILE | {"s", "acc"} | state
        lse = f({"lse"}) if fragment.has_lse else f()
        rows = COMMON | state | lse
        backward = TILE | {"s"} | rows_state | lse
        return {
            "init": Slot(False, COMMON, prefixed=False),
            "update": Slot(False, update, f({"p", "acc"}), f({"p"}), prefixed=False),
            "scaled_update": Slot(False, update | {"_factor_"}, f({"p", "acc"}), f({"p"}), prefixed=False),
            "finalize": Slot(False, COMMON | {"acc"} | state, f({"out", "lse"}), f({"out"}) | lse, prefixed=False),
            "backward_rows": Slot(False, rows, prefixed=False),
            "recompute": Slot(False, backward, f({"p"}), f({"p"}), prefixed=False),
            "grad": Slot(
                False,
                backward | {"p", "dp"} | (f({"delta"}) if fragment.needs_delta else f()),
                f({"ds"}),
                f({"ds"}),
                prefixed=False,
            ),
        }
    return {}


def _markers(comb: Combinator) -> dict[str, str]:
    """Placeholders -> identifiers, so that fragments parse: ``$self`` -> ``_self_``, ``$x1`` -> ``_x1_``..."""
    mapping = {p.name: f"_param_{p.name}" for p in comb.params}
    for t in comb.tensors:
        mapping[t.name] = f"_tensor_{t.name}"
        mapping.update({f"{t.name}_s{i}": f"_tensor_{t.name}_s{i}" for i in range(t.rank)})
    mapping.update({sc.name: f"_scalar_{sc.name}" for sc in comb.scalars})
    mapping[ACCUMULATOR] = "tl.float32"
    return mapping


_SITE = (
    "self",
    "tmp",
    "x1",
    "x2",
    "pos",
    "ok",
    "g1",
    "g2",
    "col1",
    "col2",
    "d1",
    "d2",
    "s_in",
    "s_out",
    "q_lo",
    "q_hi",
    "k_lo",
    "k_hi",
    "block",
    "i",
    "slot",
    "factor",
)


def _parse(text: str, expression: bool, mapping: dict[str, str]) -> ast.AST:
    code = string.Template(text).safe_substitute(mapping)
    code = string.Template(code).safe_substitute({n: f"_{n}_" for n in _SITE})  # a BlockList's $$block
    if "$" in code:
        raise SyntaxError(f"unknown placeholder {re.search(r'[$][{]?[A-Za-z_]*', code).group()}")
    code = textwrap.dedent(code).strip()
    return parse(f"({code})" if expression else code, mode="eval" if expression else "exec")


def _names(tree: ast.AST) -> tuple[dict[str, int], dict[str, int]]:
    """(written, read before written) names -> first line, in statement order."""
    written: dict[str, int] = {}
    read: dict[str, int] = {}
    body = tree.body if isinstance(tree, ast.Module) else [tree]
    for stmt in body:
        values = [stmt.value] if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and stmt.value else []
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
        for node in (ast.walk(v) for v in values) if values else [ast.walk(stmt)]:
            for n in node:
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in written:
                    read.setdefault(n.id, n.lineno)
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id not in written:
            read.setdefault(stmt.target.id, stmt.lineno)
        for target in targets:
            for n in ast.walk(target) if target is not None else ():
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                    written.setdefault(n.id, n.lineno)
    return written, read


def _problems(text: str, slot: Slot, mapping: dict[str, str], own: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    try:
        tree = _parse(text, slot.expression, mapping)
    except SyntaxError as exc:
        yield f"syntax error: {exc.msg}", max((exc.lineno or 1) - (1 if slot.expression else 0), 1)
        return
    written, read = _names(tree)
    plugin_names = set(mapping.values())
    for name, line in written.items():
        if name in slot.writes:
            continue
        if name in TEMPLATE_NAMES or _TEMPLATE_PATTERN.match(name) or name in plugin_names:
            yield (
                f"writes {_show(name)}, which the kernel template owns (this slot may write "
                f"{', '.join(sorted(map(_show, slot.writes))) or 'only its own temporaries'})",
                line,
            )
        elif slot.prefixed and not name.startswith(own):
            yield (
                f"writes {name!r}: name temporaries {' or '.join(_show(o) + '<name>' for o in own)}, so that "
                f"they cannot collide with the template's or another combinator's",
                line,
            )
    for name, line in read.items():
        if name in slot.reads or name in plugin_names or name.startswith(own):
            continue
        yield f"reads {_show(name)}, which this slot does not provide", line
    for name in sorted(slot.must_write - set(written)):
        yield f"never writes {_show(name)}, its output", 1


def _show(name: str) -> str:
    for n in _SITE:
        if name == f"_{n}_":
            return f"${n}"
    return "${self}_" if name == "_self__" else ("${tmp}_" if name == "_tmp__" else repr(name))


def _fields(fragment: Any) -> Iterator[tuple[str, str, Any]]:
    """(field path, text, record) for every string of a fragment, recursively."""
    for f in attrs.fields(type(fragment)):
        value = getattr(fragment, f.name)
        if isinstance(value, str):
            yield f.name, value, fragment
        elif isinstance(value, (tuple, Range)):
            for i, item in enumerate(value):
                if isinstance(item, str):
                    yield f"{f.name}[{i}]", item, fragment
                elif isinstance(item, tuple):
                    yield from ((f"{f.name}[{i}][{j}]", x, fragment) for j, x in enumerate(item[1:], 1))
        elif attrs.has(type(value)):
            yield from ((f"{f.name}.{path}", text, rec) for path, text, rec in _fields(value))


_OLD_ACCUMULATOR = re.compile(r"\btl\.float32\b")  # the spelling $acc_dtype replaced on 2026-12-01


def lint(comb: Combinator, fragment: Any, distribution: str) -> None:
    """Raise PluginError for the first fragment field of ``comb`` that breaks its slot's contract."""
    mapping = _markers(comb)
    if isinstance(fragment, ScoreSourceFragment):
        fragment = fragment.transform
        if fragment is None:
            return
    state = rows_state = frozenset()
    if isinstance(fragment, NormaliserFragment):
        if fragment.partial is not None:  # its own state: linted as a normaliser of its own
            lint(comb, fragment.partial, distribution)
        state = frozenset(_defined(fragment.init, mapping))
        rows_state = frozenset(_defined(fragment.backward_rows, mapping))
    own = ("_self__", "_tmp__") if isinstance(fragment, QKTransformFragment) else ("_self__",)
    for path, text, record in _fields(fragment):
        slot = _slots(record, state, rows_state).get(path.split(".")[-1].split("[")[0])
        if slot is None or not text.strip() or path.startswith("partial."):
            continue
        found = list(_problems(text, slot, mapping, own))
        if found:
            message, line = found[0]
            raise PluginError(
                f"combinator {comb.name!r} of distribution {distribution!r}, fragment field "
                f"{path!r}: {message}\n{_excerpt(text, line)}"
            )
    old = old_accumulator_fields(fragment)
    if old:
        deprecated(
            ("tl.float32", distribution, comb.name),
            f"{_where(comb, distribution, old)}: spells the "
            f"accumulation type tl.float32, as the plugin contract of 2026-11-30 did; deprecated since "
            f"2026-12-01, refused in a future release: write $acc_dtype instead (tl.float32, or tl.float64 "
            f"for float64 inputs). Until then it computes in float32 as before, and float64 calls are refused",
        )


def indices_read(app: Any) -> list[str]:
    """The call's indices (``q_idx``, ``k_idx``: a tensor indexed by query and key) that the fragments of
    ``app`` (an ``ir.Apply``) read, sorted."""
    return sorted(template_reads(app.declaration, app.fragment()) & {"q_idx", "k_idx"})


def template_reads(comb: Combinator, fragment: Any) -> frozenset[str]:
    """The kernel template's names (``q_idx``, ``k_pos``, ``Nq`` ...) that the fields of ``comb``'s
    ``fragment`` (as declared, placeholders unresolved) read."""
    if isinstance(fragment, ScoreSourceFragment):
        fragment = fragment.transform
        if fragment is None:
            return frozenset()
    mapping = _markers(comb)
    found: set[str] = set()
    for path, text, record in _fields(fragment):
        slot = _slots(record, frozenset(), frozenset()).get(path.split(".")[-1].split("[")[0])
        if slot is None or not text.strip():
            continue
        try:
            found |= _names(_parse(text, slot.expression, mapping))[1].keys() & TEMPLATE_NAMES
        except SyntaxError:  # lint reports it
            continue
    return frozenset(found)


def old_accumulator_fields(fragment: Any) -> list[str]:
    """The fields of ``fragment`` (paths, as ``lint`` names them) that spell the accumulation type
    ``tl.float32`` where ``$acc_dtype`` belongs: the deprecated contract of 2026-11-30."""
    if isinstance(fragment, ScoreSourceFragment):
        fragment = fragment.transform
    return [] if fragment is None else [path for path, text, _ in _fields(fragment) if _OLD_ACCUMULATOR.search(text)]


def refuse_old_accumulator(comb: Combinator, fragment: Any, distribution: str, accumulator: str) -> None:
    """Raise InputError when ``fragment`` spells tl.float32 and the call accumulates in dtype ``accumulator``
    ("float64" for float64 inputs): it would silently compute in float32."""
    old = old_accumulator_fields(fragment)
    if old and accumulator != "float32":
        raise InputError(
            f"{_where(comb, distribution, old)}: spells the accumulation type tl.float32 (the "
            f"deprecated contract of 2026-11-30), so it would compute in float32 for these "
            f"{accumulator} inputs; call it with float32, float16 or bfloat16 inputs, or write "
            f"$acc_dtype in that fragment (tl.float32, or tl.float64 for float64 inputs)"
        )


def _where(comb: Combinator, distribution: str, fields: list[str]) -> str:
    names = ", ".join(map(repr, fields))
    return f"combinator {comb.name!r} of distribution {distribution!r}, fragment field{'s' * (len(fields) > 1)} {names}"


def _defined(text: str, mapping: dict[str, str]) -> set[str]:
    try:
        return set(_names(_parse(text, False, mapping))[0])
    except SyntaxError:
        return set()  # reported with its own field


def _excerpt(text: str, line: int) -> str:
    lines = textwrap.dedent(text).strip().splitlines()
    lo = max(line - 2, 0)
    return "\n".join(
        f"{'>' if i + 1 == line else ' '} {i + 1:3} | {lines[i]}" for i in range(lo, min(line + 1, len(lines)))
    )
