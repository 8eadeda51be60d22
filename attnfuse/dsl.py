"""Tracing: the DSL's symbolic values and the functions ``af.<combinator>`` that build IR from them.

While an ``@af.attention`` function is traced, its arguments are symbols. Combinators turn them into
IR nodes; anything else done to a symbol (arithmetic, a torch function, ``if s:``, ``s.shape``) is a ProgramError,
since it could not be fused.
"""

from __future__ import annotations

from typing import Any, Callable

from .combinator import REQUIRED, Combinator, Param, Role
from .errors import ProgramError
from .plugin_manager import Registered
from .ir import Apply, BiasOp, MaskOp, MatMulPV, NormOp, ScoreOp, TensorSym
from .static_values import STATIC_TYPES, exact, literal, typed

_NAMES = {"q": "the query tensor q", "k": "the key tensor k", "v": "the value tensor v"}


class NoTensorAttribute(ProgramError, AttributeError):
    """A tensor attribute or method asked of a traced value (``s.shape``). Also an AttributeError, so that
    ``getattr(symbol, name, default)`` and ``hasattr`` still answer."""


class Symbol:
    """A traced value. Only AttnFuse combinators may act on it."""

    __slots__ = ()
    what = "a traced value"

    def _refuse(self, operation: str):
        raise ProgramError(
            f"{operation} on {self.what} is not part of the AttnFuse DSL: a program may only apply "
            f"combinators (af.scaled_dot_product, af.rope, af.causal, af.softmax, ...) and end with `weights @ v`"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        symbol = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Symbol)), None)
        name = f"torch.{getattr(func, '__name__', func)}"
        if symbol is None:
            raise ProgramError(f"{name} on a traced value is not part of the AttnFuse DSL")
        symbol._refuse(name)

    def __getattr__(self, name: str):
        """Reached only for a name the symbol lacks: a tensor's attribute or method (``s.shape``, ``q.float()``)."""
        if name.startswith("__") and name.endswith("__") or name in type(self).__slots__:  # protocols, unset slots
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise NoTensorAttribute(
            f"the attribute {name!r} of {self.what}: inside an @af.attention program, q, k, v, the scores and "
            f"the weights are symbols, not tensors (a program is traced once for every shape, dtype and device), "
            f"so they have no shape, dtype, device or tensor methods. A program may only apply combinators to q, k, "
            f"v and the scores (af.scaled_dot_product, af.rope, af.causal, af.softmax, ...) and end with "
            f"`weights @ v`. Sizes are read where they are known: a combinator's reference and prepare get them "
            f"from ctx (ctx.Nq, ctx.Nk, ctx.D, ...) and its fragments read Nq, Nk and D; a value computed from a "
            f"tensor's shape (scale=1 / math.sqrt(q.shape[-1])) is computed outside and passed as an extra argument"
        )

    def __bool__(self):
        self._refuse("a truth test (if/while/and/or)")

    def __matmul__(self, other):
        self._refuse("@")

    def __rmatmul__(self, other):
        self._refuse("@")


def _refusing(op: str):
    return lambda self, *args: self._refuse(f"the operator {op}")


for _name, _op in [
    ("add", "+"),
    ("sub", "-"),
    ("mul", "*"),
    ("truediv", "/"),
    ("floordiv", "//"),
    ("pow", "**"),
    ("mod", "%"),
]:
    setattr(Symbol, f"__{_name}__", _refusing(_op))
    setattr(Symbol, f"__r{_name}__", _refusing(_op))
for _name, _op in [
    ("neg", "unary -"),
    ("pos", "unary +"),
    ("abs", "abs()"),
    ("getitem", "indexing"),
    ("lt", "<"),
    ("le", "<="),
    ("gt", ">"),
    ("ge", ">="),
]:
    setattr(Symbol, f"__{_name}__", _refusing(_op))


class TensorSymbol(Symbol):
    """q, k, v or a runtime input; q and k may carry qk transforms still to apply."""

    __slots__ = ("sym", "transforms")

    def __init__(self, sym: TensorSym, transforms: tuple[Apply, ...] = ()):
        self.sym = sym
        self.transforms = transforms

    @property
    def what(self) -> str:
        return _NAMES.get(self.sym.kind, f"the input {self.sym.name!r}")


class ScoreSymbol(Symbol):
    """Scores (B, Hq, Nq, Nk), before the normaliser."""

    __slots__ = ("node",)
    what = "the scores"

    def __init__(self, node):
        self.node = node

    def __matmul__(self, other):
        raise ProgramError("scores @ v with no normaliser: apply one first, e.g. af.softmax(s) @ v")


class WeightsSymbol(Symbol):
    """Weights after the normaliser; ``weights @ v`` ends the program."""

    __slots__ = ("node",)
    what = "the normalised weights"

    def __init__(self, node: NormOp):
        self.node = node

    def __matmul__(self, v):
        if not isinstance(v, TensorSymbol) or v.sym.kind != "v":
            got = v.what if isinstance(v, Symbol) else type(v).__name__
            raise ProgramError(
                f"weights @ v: the right operand must be the value tensor v "
                f"(the decorated function's third argument), got {got}"
            )
        if v.transforms:
            raise ProgramError("weights @ v: v must be the untransformed value tensor")
        return OutputSymbol(MatMulPV(weights=self.node, v=v.sym))


class OutputSymbol(Symbol):
    """The program's result."""

    __slots__ = ("node",)
    what = "the attention output"

    def __init__(self, node: MatMulPV):
        self.node = node


def _describe(value: Any) -> str:
    if isinstance(value, Symbol):
        return value.what
    return f"a {type(value).__module__}.{type(value).__name__}"


def _expect_qk(comb: Combinator, q: Any, k: Any) -> tuple[TensorSymbol, TensorSymbol]:
    for arg, kind, pos in ((q, "q", "first"), (k, "k", "second")):
        if not isinstance(arg, Symbol):
            raise ProgramError(
                f"af.{comb.name} must be called inside an @af.attention function on its "
                f"symbolic arguments; got {_describe(arg)}"
            )
        if not isinstance(arg, TensorSymbol) or arg.sym.kind != kind:
            extra = (
                " (a qk transform acts on queries and keys only)"
                if getattr(getattr(arg, "sym", None), "kind", None) == "v"
                else ""
            )
            raise ProgramError(
                f"{comb.name}(q, k): its {pos} argument must be {_NAMES[kind]}, got {_describe(arg)}{extra}"
            )
    if q.transforms != k.transforms:
        raise ProgramError(f"{comb.name}(q, k): q and k must come from the same qk transforms")
    return q, k


def _expect_score(comb: Combinator, s: Any) -> ScoreSymbol:
    if isinstance(s, ScoreSymbol):
        return s
    if isinstance(s, WeightsSymbol):
        if comb.role is Role.NORMALISER:
            raise ProgramError(
                f"two normalisers: {comb.name} applied to weights a normaliser already "
                f"produced; a program has exactly one normaliser"
            )
        kind = "masks" if comb.role is Role.MASK else "score modifications"
        raise ProgramError(
            f"{comb.name} applied after the normaliser: {kind} act on scores, so apply "
            f"{comb.name} before softmax/relu_attention"
        )
    if isinstance(s, TensorSymbol):
        raise ProgramError(
            f"{comb.name} takes scores, got {s.what}; make scores first with "
            f"af.scaled_dot_product(q, k) or af.rope(q, k)"
        )
    raise ProgramError(f"af.{comb.name} must be called inside an @af.attention function on scores; got {_describe(s)}")


def _apply(record: Registered, args: tuple, kwargs: dict) -> Apply:
    comb = record.combinator
    try:
        values = comb.bind(args, kwargs)
    except TypeError as exc:
        raise ProgramError(str(exc)) from None
    params = []
    for p in comb.params:
        value = values[p.name]
        if p.runtime and value is not None:
            if not isinstance(value, TensorSymbol) or value.sym.kind != "input":
                what = _describe(value) if isinstance(value, Symbol) else f"a concrete {type(value).__name__}"
                raise ProgramError(
                    f"{comb.name}: parameter {p.name!r} is a runtime input, so it must be an argument of the "
                    f"decorated function (passed at every call), got {what}"
                )
            value = value.sym
        else:
            if isinstance(value, Symbol):
                raise ProgramError(
                    f"{comb.name}: parameter {p.name!r} is static (a number or flag baked "
                    f"into the kernel), got {value.what}"
                )
            value = exact(value)  # a subclass's repr is its own to choose: keep only the value it holds
            if type(value) not in STATIC_TYPES:
                raise ProgramError(
                    f"{comb.name}: parameter {p.name!r} must be None, bool, int, float or str, "
                    f"got {type(value).__name__}"
                )
            _check_static(comb, p, value)
            if not p.recorded_at_default and typed(value) == typed(p.default):
                continue  # left out of the IR: programs keep the signature they had before the parameter
        params.append((p.name, value))
    return Apply(combinator=comb.name, params=tuple(params), record=record)


def _check_static(comb: Combinator, p: Param, value: Any) -> None:
    """The plugin's check (what this parameter allows), then ``literal`` (what any value written into a
    kernel's source may be), here, before any source exists; either refusal is a ProgramError."""
    try:
        if p.check is not None:
            try:
                p.check(value)
            except ArithmeticError:  # a check computing with a number no kernel takes (10**400): say so
                literal(value)
                raise
        literal(value)
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ProgramError(f"{comb.name}: parameter {p.name!r}: {exc}") from None


def dsl_function(record: Registered) -> Callable:
    """The function ``af.<name>`` for a registered combinator, with the calling convention of its role; its
    applications carry ``record``."""
    comb = record.combinator
    if comb.role is Role.SCORE_SOURCE:

        def fn(q, k, *args, **kwargs):
            q, k = _expect_qk(comb, q, k)
            op = ScoreOp(q=q.sym, k=k.sym, transforms=q.transforms, source=_apply(record, args, kwargs))
            return ScoreSymbol(op)
    elif comb.role is Role.QK_TRANSFORM:

        def fn(q, k, *args, **kwargs):
            q, k = _expect_qk(comb, q, k)
            app = _apply(record, args, kwargs)
            return TensorSymbol(q.sym, q.transforms + (app,)), TensorSymbol(k.sym, k.transforms + (app,))
    elif comb.role is Role.NORMALISER:

        def fn(s, *args, **kwargs):
            s = _expect_score(comb, s)
            return WeightsSymbol(NormOp(input=s.node, apply=_apply(record, args, kwargs)))
    else:
        node_type = MaskOp if comb.role is Role.MASK else BiasOp

        def fn(s, *args, **kwargs):
            s = _expect_score(comb, s)
            return ScoreSymbol(node_type(input=s.node, apply=_apply(record, args, kwargs)))

    fn.__name__ = fn.__qualname__ = comb.name
    signature = ", ".join(p.name if p.default is REQUIRED else f"{p.name}={p.default!r}" for p in comb.params)
    inputs = "q, k" if comb.role in (Role.SCORE_SOURCE, Role.QK_TRANSFORM) else "s"
    fn.__doc__ = f"{comb.name}({inputs}{', ' if signature else ''}{signature})  [{comb.role.value}]\n\n{comb.doc}"
    return fn


def trace(fn: Callable, arg_names: tuple[str, ...], extras: dict[str, Any]) -> MatMulPV:
    """Run ``fn`` on symbols and return the graph it builds.

    ``arg_names`` names fn's q, k, v parameters; ``extras`` maps each further argument to ``RUNTIME``
    (a tensor or block mask, traced as a symbol) or to its static value.
    """
    q, k, v = (TensorSymbol(TensorSym(name=n, kind=kind)) for n, kind in zip(arg_names, ("q", "k", "v")))
    kwargs = {
        name: TensorSymbol(TensorSym(name=name, kind="input")) if value is RUNTIME else value
        for name, value in extras.items()
    }
    result = fn(q, k, v, **kwargs)
    if isinstance(result, OutputSymbol):
        return result.node
    if isinstance(result, WeightsSymbol):
        raise ProgramError("the program returns weights with no `@ v`: end it with `return af.softmax(s) @ v`")
    if isinstance(result, ScoreSymbol):
        raise ProgramError(
            "the program returns scores: it needs a normaliser and `@ v`, e.g. `return af.softmax(s) @ v`"
        )
    raise ProgramError(f"the program must return `weights @ v`, got {_describe(result)}")


class _Runtime:
    def __repr__(self) -> str:
        return "RUNTIME"


RUNTIME: Any = _Runtime()
"""Marks an extra argument that is a runtime input in a trace key."""
