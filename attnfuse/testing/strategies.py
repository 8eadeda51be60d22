"""Hypothesis strategies: shapes, random tensors, and programs drawn from every registered combinator."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from attrs import field, frozen
from hypothesis import strategies as st

from ..combinator import REQUIRED, Combinator, Role
from ..examples_support import random_tensor  # noqa: F401 (attnfuse.testing exports it from here)
from ..plugin_manager import BUILTIN_DISTRIBUTION, combinators
from ..program import AttentionProgram


@frozen(kw_only=True)
class Shape:
    """Sizes of one problem: q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV)."""

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    DV: int


@st.composite
def shapes(
    draw,
    max_n: int = 80,
    head_dims: tuple[int, ...] = (16, 32, 64, 80, 128),
    max_batch: int = 2,
    max_kv_heads: int = 2,
    max_group: int = 3,
) -> Shape:
    """Shapes with GQA groups, Nq != Nk, N not a multiple of the block, sometimes DV != D, and often few
    queries (decoding: 1 to 16)."""
    D = draw(st.sampled_from(head_dims))
    Hkv = draw(st.integers(1, max_kv_heads))
    return Shape(
        B=draw(st.integers(1, max_batch)),
        Hq=Hkv * draw(st.integers(1, max_group)),
        Hkv=Hkv,
        Nq=draw(st.one_of(st.integers(1, 16), st.integers(1, max_n))),
        Nk=draw(st.integers(1, max_n)),
        D=D,
        DV=draw(st.sampled_from([D, D, draw(st.sampled_from(head_dims))])),
    )


@st.composite
def documents(draw, Nq: int, Nk: int, max_docs: int = 4) -> tuple[list[int], list[int]]:
    """A packed call's document lengths: queries (summing to Nq) and keys (summing to Nk >= Nq), each document
    with at least as many keys as queries (as a call of its rows alone with rope's tables needs); lengths 0 and 1
    included."""

    def split(total: int, parts: int) -> list[int]:
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
        return [b - a for a, b in zip([0, *cuts], [*cuts, total])]

    docs = draw(st.integers(1, max_docs))
    queries = split(Nq, docs)
    return queries, [n + extra for n, extra in zip(queries, split(Nk - Nq, docs))]


def describe(extras: dict[str, Any]) -> str:
    """Runtime inputs by name, tensors as their shape and dtype (a failure report never prints them whole)."""
    return ", ".join(
        f"{n}: {tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else f"{n}: {v!r}" for n, v in extras.items()
    )


@frozen(kw_only=True, eq=False)
class ProgramCase:
    """A drawn program, its shape and the extra arguments (runtime inputs) to call it with."""

    program: AttentionProgram
    text: str
    shape: Shape
    extras: dict[str, Any] = field(repr=lambda extras: f"{{{describe(extras)}}}")  # shapes, not whole tensors

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """How Hypothesis prints a failing draw: this repr, tensors as shapes."""
        printer.text(repr(self))

    def inputs(self, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, ...]:
        """Fresh random q, k, v (not contiguous when the seed is odd: a (B, N, H, D) layout, transposed)."""
        g = torch.Generator().manual_seed(seed)
        s = self.shape

        def make(h, n, d):
            if seed % 2:
                return torch.randn(s.B, n, h, d, generator=g).to(dtype).to(device).transpose(1, 2)
            return torch.randn(s.B, h, n, d, generator=g).to(dtype).to(device)

        return make(s.Hq, s.Nq, s.D), make(s.Hkv, s.Nk, s.D), make(s.Hkv, s.Nk, s.DV)

    def extras_on(self, device: str) -> dict[str, Any]:
        return {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in self.extras.items()}


def drawable(comb: Combinator) -> bool:
    """Whether the kit can draw the combinator's parameters: it declares ``examples``, or none is required."""
    return comb.examples is not None or all(p.default is not REQUIRED for p in comb.params)


def _params(draw, comb: Combinator, shape: Shape) -> dict[str, Any]:
    if comb.examples is not None:
        return comb.examples(draw, shape)
    return {p.name: p.default for p in comb.params}


def _compatible(comb: Combinator, shape: Shape) -> bool:
    """qk transforms split the head dim in halves, so they need an even D."""
    if shape.D % 2 == 0:
        return True
    if comb.role is Role.QK_TRANSFORM:
        return False
    if comb.role is Role.SCORE_SOURCE:
        fragment = comb.fragment_for({p.name: p.default for p in comb.params})
        return fragment.transform is None
    return True


def pool(include: str | None, installed: bool) -> tuple[str, ...]:
    """Names programs are drawn from: ``include`` and the built-ins, or every registered combinator
    (``installed``), so that by default another package's bug does not fail a plugin's own check."""
    return tuple(
        sorted(
            n
            for n, entry in combinators().items()
            if installed or n == include or entry.distribution == BUILTIN_DISTRIBUTION
        )
    )


@st.composite
def program_cases(
    draw,
    shape: Shape,
    include: str | None = None,
    max_mods: int = 2,
    max_masks: int = 2,
    names: tuple[str, ...] | None = None,
) -> ProgramCase:
    """A program drawn from the combinators ``names`` (default: every registered one; ``include`` forced
    in), with its runtime inputs."""
    by_role: dict[Role, list[Combinator]] = {role: [] for role in Role}
    for name, entry in combinators().items():
        if names is not None and name not in names and name != include:
            continue
        if drawable(entry.combinator) and _compatible(entry.combinator, shape):
            by_role[entry.combinator.role].append(entry.combinator)
    for role in by_role:
        by_role[role].sort(key=lambda c: c.name)

    def pick(role: Role, lo: int, hi: int) -> list[Combinator]:
        return [draw(st.sampled_from(by_role[role])) for _ in range(draw(st.integers(lo, hi)))] if by_role[role] else []

    chosen = {
        Role.QK_TRANSFORM: pick(Role.QK_TRANSFORM, 0, 1),
        Role.SCORE_SOURCE: pick(Role.SCORE_SOURCE, 1, 1),
        Role.SCORE_MOD: pick(Role.SCORE_MOD, 0, max_mods),
        Role.MASK: pick(Role.MASK, 0, max_masks),
        Role.NORMALISER: pick(Role.NORMALISER, 1, 1),
    }
    if include is not None:
        comb = combinators()[include].combinator
        if comb.role in (Role.SCORE_SOURCE, Role.NORMALISER):
            chosen[comb.role] = [comb]
        elif comb not in chosen[comb.role]:
            chosen[comb.role].append(comb)
    return case_of(draw, chosen, shape)


def case_of(draw, chosen: dict[Role, list[Combinator]], shape: Shape) -> ProgramCase:
    """The program applying the combinators ``chosen`` by role, in the order of the roles, with parameters
    drawn from their examples for ``shape`` (``draw``: a Hypothesis draw)."""
    steps, extras = [], {}
    for role in (Role.QK_TRANSFORM, Role.SCORE_SOURCE, Role.SCORE_MOD, Role.MASK, Role.NORMALISER):
        for comb in chosen.get(role, []):
            params = {}
            for name, value in _params(draw, comb, shape).items():
                if getattr(value, "__attnfuse_runtime_input__", False) or isinstance(value, torch.Tensor):
                    arg = f"{comb.name}_{len(steps)}_{name}"
                    extras[arg] = value
                    value = _Arg(arg)
                params[name] = value
            steps.append((comb, params))
    return ProgramCase(program=_build(steps, extras), text=_text(steps), shape=shape, extras=extras)


class _Arg(str):
    """Stands for an extra argument of the built program (a str, so the program's trace key can hold it)."""

    @property
    def name(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return self.name


def _text(steps: list) -> str:
    text = "q, k"
    for comb, params in steps:
        args = "".join(f", {n}={v!r}" for n, v in params.items())
        text = f"{comb.name}({text}{args})"
    return f"{text} @ v"


def _build(steps: list, extras: dict[str, Any]) -> AttentionProgram:
    import attnfuse as af

    def program(q, k, v, **inputs):
        x: Any = (q, k)
        for comb, params in steps:
            values = {n: inputs[p.name] if isinstance(p, _Arg) else p for n, p in params.items()}
            fn = getattr(af, comb.name)
            x = fn(*x, **values) if isinstance(x, tuple) else fn(x, **values)
        return x @ v

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    program.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ("q", "k", "v", *extras)])
    program.__name__ = program.__qualname__ = "drawn_program"
    return AttentionProgram(program)
