"""The high-level IR: frozen nodes, one graph per traced program, rooted at its ``MatMulPV``.

A graph is a chain: ``ScoreOp`` -> any ``BiasOp``/``MaskOp`` -> ``NormOp`` -> ``MatMulPV``. Its SHA-1
structural signature (over the nodes' canonical repr) names its kernels; the compiled-kernel caches are
keyed by the graph (equal structure, equal key) and the launch configuration.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Union

import attrs
from attrs import field, frozen
from attrs.validators import deep_iterable, in_, instance_of

from .combinator import INPUT
from .errors import ProgramError
from .static_values import literal, typed

if TYPE_CHECKING:
    from .combinator import Combinator
    from .plugin_manager import Registered

_STATIC_TYPES = (type(None), bool, int, float, str)


def _static_value(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_static_value(v) for v in value)
    return isinstance(value, _STATIC_TYPES)


@frozen(kw_only=True, cache_hash=True)
class TensorSym:
    """An argument of the traced function: ``q``, ``k``, ``v`` or a runtime ``input`` (bias, tables, ...)."""

    name: str = field(validator=instance_of(str))
    kind: str = field(validator=in_(("q", "k", "v", "input")))


def _check_params(apply: Apply, _, params: tuple) -> None:
    """Every static value must have a literal (``static_values.literal``): it is written into the source."""
    for name, value in params:
        if not isinstance(value, TensorSym):
            try:
                literal(value)
            except ValueError as exc:
                raise ProgramError(f"{apply.combinator}: parameter {name!r}: {exc}") from None


def _params_key(params: tuple[tuple[str, Any], ...]) -> tuple:
    """Parameters as they compare: a static value by ``typed`` (``True`` is not ``1``, ``-0.0`` not ``0.0``)."""
    return tuple((n, v if isinstance(v, TensorSym) else typed(v)) for n, v in params)


@frozen(kw_only=True, cache_hash=True)
class Apply:
    """One application of a combinator: its name and parameters, in declaration order.

    Static parameters hold their values, each one ``static_values.literal`` can write (else a ProgramError
    naming the combinator and parameter); runtime inputs hold the ``TensorSym`` they are read from.
    ``record``: the registered combinator the name resolved to when the program was traced, so no pass
    looks it up again; it takes no part in equality, hash or repr (the signature covers the name). Static
    values compare by type and literal, so applications of ``True`` and ``1`` are different graphs.
    """

    combinator: str
    params: tuple[tuple[str, Any], ...] = field(converter=tuple, validator=_check_params, eq=_params_key)
    record: Registered = field(eq=False, repr=False)

    @property
    def declaration(self) -> Combinator:
        """The combinator applied."""
        return self.record.combinator

    def all_params(self) -> tuple[tuple[str, Any], ...]:
        """Every parameter in declaration order: those recorded, and the defaults of those the IR leaves out
        (``Param.recorded_at_default=False``)."""
        recorded = dict(self.params)
        return tuple((p.name, recorded.get(p.name, p.default)) for p in self.declaration.params)

    def static(self) -> dict[str, Any]:
        return {n: v for n, v in self.all_params() if not isinstance(v, TensorSym)}

    def inputs(self) -> dict[str, TensorSym]:
        return {n: v for n, v in self.params if isinstance(v, TensorSym)}

    def values(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Every parameter's value, runtime inputs looked up by argument name in ``inputs``."""
        return {n: inputs[v.name] if isinstance(v, TensorSym) else v for n, v in self.all_params()}

    def fragment(self) -> Any:
        """The combinator's fragment for this application, before substitution (a fragment function gets
        the parameters: static values, and ``INPUT`` for each runtime input given)."""
        return self.declaration.fragment_for(
            {n: INPUT if isinstance(v, TensorSym) else v for n, v in self.all_params()}
        )

    def __str__(self) -> str:
        args = ", ".join(f"{n}={v.name if isinstance(v, TensorSym) else literal(v)}" for n, v in self.params)
        return f"{self.combinator}({args})"


@frozen(kw_only=True, cache_hash=True)
class ScoreOp:
    """s = (T(q)·T(k)ᵀ)·scale: the qk transforms T applied in order, then the source's own (rope's rotation)."""

    q: TensorSym = field(validator=instance_of(TensorSym))
    k: TensorSym = field(validator=instance_of(TensorSym))
    transforms: tuple[Apply, ...] = field(converter=tuple, validator=deep_iterable(instance_of(Apply)))
    source: Apply = field(validator=instance_of(Apply))


Score = Union[ScoreOp, "BiasOp", "MaskOp"]


def _score_node(_, attribute, value) -> None:
    if not isinstance(value, (ScoreOp, BiasOp, MaskOp)):
        raise TypeError(f"{attribute.name} must be a score node (ScoreOp, BiasOp, MaskOp), got {type(value).__name__}")


@frozen(kw_only=True, cache_hash=True)
class BiasOp:
    """A score modification: s <- g(s, ...)."""

    input: Score = field(validator=_score_node)
    apply: Apply = field(validator=instance_of(Apply))


@frozen(kw_only=True, cache_hash=True)
class MaskOp:
    """A mask: keys it does not keep get weight 0, whatever comes after."""

    input: Score = field(validator=_score_node)
    apply: Apply = field(validator=instance_of(Apply))


@frozen(kw_only=True, cache_hash=True)
class NormOp:
    """The normaliser turning scores into weights."""

    input: Score = field(validator=_score_node)
    apply: Apply = field(validator=instance_of(Apply))


@frozen(kw_only=True, cache_hash=True)
class MatMulPV:
    """out = weights @ v: the root of every graph."""

    weights: NormOp = field(validator=instance_of(NormOp))
    v: TensorSym = field(validator=instance_of(TensorSym))

    @property
    def has_lse(self) -> bool:
        """Whether the program's normaliser keeps a log-sum-exp (``return_lse`` needs one; softmax has)."""
        return self.weights.apply.fragment().has_lse


_NODES = {cls.__name__: cls for cls in (TensorSym, Apply, ScoreOp, BiasOp, MaskOp, NormOp, MatMulPV)}


def to_data(value: Any) -> Any:
    """An IR node (or a static value) as plain data, JSON's types only: a node is ``{"node": <type>, <field>:
    <data>, ...}`` (an application without its resolved record), a tuple ``{"tuple": [...]}``."""
    if isinstance(value, tuple):
        return {"tuple": [to_data(v) for v in value]}
    if isinstance(value, tuple(_NODES.values())):
        return {
            "node": type(value).__name__,
            **{f.name: to_data(getattr(value, f.name)) for f in attrs.fields(type(value)) if f.eq},
        }
    return value


def from_data(data: Any, resolve: Callable[[str], Registered]) -> Any:
    """The node (or value) ``to_data`` gave ``data`` for, each application's combinator resolved by
    ``resolve(name)``; constructors only (their checks run), so no data can run code. A ``KeyError``,
    ``TypeError`` or ``ValueError`` for data no node gives."""
    if isinstance(data, list):
        raise TypeError("a list where a node, a tuple or a static value belongs")
    if not isinstance(data, dict):
        return data
    if data.keys() == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(from_data(v, resolve) for v in data["tuple"])
    cls = _NODES[data["node"]]
    fields = {name: from_data(value, resolve) for name, value in data.items() if name != "node"}
    if cls is Apply:
        fields["record"] = resolve(fields["combinator"])
    return cls(**fields)


def signature(graph: MatMulPV) -> str:
    """SHA-1 over the graph's structure and static parameters."""
    return hashlib.sha1(repr(graph).encode()).hexdigest()


def chain(graph: MatMulPV) -> list:
    """The graph's nodes from the ScoreOp to the MatMulPV."""
    nodes: list = [graph, graph.weights]
    node = graph.weights.input
    while not isinstance(node, ScoreOp):
        nodes.append(node)
        node = node.input
    nodes.append(node)
    return nodes[::-1]


def applications(graph: MatMulPV) -> tuple[Apply, ...]:
    """Every combinator application of the graph, in the order of its nodes (the score's transforms and
    source first, the normaliser last)."""
    return tuple(
        apply
        for node in chain(graph)
        for apply in (
            (*node.transforms, node.source)
            if isinstance(node, ScoreOp)
            else (() if isinstance(node, MatMulPV) else (node.apply,))
        )
    )


def input_names(graph: MatMulPV) -> tuple[str, ...]:
    """The argument names of the runtime inputs the graph reads, each once, in the order of its nodes."""
    return tuple(dict.fromkeys(sym.name for apply in applications(graph) for sym in apply.inputs().values()))


def render(graph: MatMulPV) -> str:
    """A readable listing of the graph, one node a line."""
    lines = []
    for i, node in enumerate(chain(graph)):
        if isinstance(node, ScoreOp):
            transforms = "".join(f" ∘ {t}" for t in node.transforms)
            lines.append(f"%0 = ScoreOp {node.source} on ({node.q.name}, {node.k.name}){transforms}")
        elif isinstance(node, MatMulPV):
            lines.append(f"%{i} = MatMulPV %{i - 1} @ {node.v.name}")
        else:
            lines.append(f"%{i} = {type(node).__name__} {node.apply} on %{i - 1}")
    lines.append(f"signature {signature(graph)}")
    return "\n".join(lines)
