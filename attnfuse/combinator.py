"""What a plugin declares about one combinator: semantics, reference, and the Triton fragment for its slot.

A combinator is one building block of the DSL. Its declaration is a frozen record; the compiler never
imports plugin code beyond it. Fragments are Triton source with ``$name`` placeholders (``string.Template``):

* ``$<param>`` for a static parameter is replaced by its value (a literal baked into the kernel);
* ``$<tensor>`` and ``$<tensor>_s0`` ... ``$<tensor>_s<rank-1>`` for a tensor the plugin's ``prepare``
  returns: its pointer and strides, as kernel arguments;
* ``$<scalar>`` for a number ``prepare`` returns: a kernel argument;
* ``$self``: a prefix unique to this application, for names a prologue defines and a body reads;
* ``$acc_dtype``: the accumulation type (``tl.float32``, ``tl.float64`` for float64 inputs).

The fragment records of each role are in ``attnfuse.fragments`` (and importable from here).

Fragments may also read the template's variables, documented in docs/writing-a-combinator.md:
``b``, ``h``, ``hk`` (batch, query head, key/value head), ``q_idx``, ``q_pos`` (BLOCK_M,),
``k_idx``, ``k_pos`` (BLOCK_N,: the keys' indices in k, and their positions), ``in_bounds`` (BLOCK_M,
BLOCK_N), ``Nq``, ``Nk``, ``d`` (BLOCK_D,), ``D``,
``s`` (the score tile, float32), ``acc``, ``p``.
"""

from __future__ import annotations

import enum
import inspect
import keyword
from typing import Any, Callable

from attrs import field, frozen

from .errors import DeclarationError, deprecated
from .fragments import (
    ACCUMULATOR,
    HALVES,
    BlockList,
    MaskFragment,
    NormaliserFragment,
    QKTransformFragment,
    Range,
    ScoreModFragment,
    ScoreSourceFragment,
)

__all__ = [
    "ACCUMULATOR",
    "HALVES",
    "INPUT",
    "PLACEHOLDERS",
    "REQUIRED",
    "BlockList",
    "Combinator",
    "MaskFragment",
    "NormaliserFragment",
    "Param",
    "QKTransformFragment",
    "Range",
    "Role",
    "ScalarArg",
    "ScoreModFragment",
    "ScoreSourceFragment",
    "TensorArg",
]


class Role(enum.Enum):
    """The slot of the kernel template a combinator fills."""

    QK_TRANSFORM = "qk transform"
    SCORE_SOURCE = "score source"
    SCORE_MOD = "score modification"
    MASK = "mask"
    NORMALISER = "normaliser"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of a parameter that has none."""


class _Input:
    def __repr__(self) -> str:
        return "INPUT"


INPUT: Any = _Input()
"""What a fragment function receives for a runtime input that was given (its value comes at each call)."""


def _identifier(_, attribute, value: str) -> None:
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        raise DeclarationError(f"{attribute.name} must be a Python identifier, got {value!r}")


@frozen(kw_only=True)
class Param:
    """One parameter of a combinator, after the score (or q, k) it takes.

    ``runtime=False``: a static value (number, bool, None) baked into the kernel; a new value compiles a new
    kernel. ``runtime=True``: a runtime input (a tensor or a BlockMask) that must be an argument of the
    decorated function, so it is passed at every call. ``check`` raises ValueError naming what is allowed.
    ``recorded_at_default=False`` (a static parameter with a default): while it holds its default, the traced
    program leaves it out of its IR, so the signature and generated kernels stay those of the combinator
    before the parameter existed (a parameter added to a combinator already in use); its functions still
    get the default.
    """

    name: str = field(validator=_identifier)
    runtime: bool = False
    default: Any = REQUIRED
    check: Callable[[Any], None] | None = None
    doc: str = ""
    recorded_at_default: bool = field(default=True)

    @recorded_at_default.validator
    def _check_recorded(self, _, value) -> None:
        if not isinstance(value, bool):
            raise DeclarationError(f"parameter {self.name!r}: recorded_at_default must be True or False, got {value!r}")
        if not value and (self.runtime or self.default is REQUIRED):
            raise DeclarationError(
                f"parameter {self.name!r}: recorded_at_default=False needs a static parameter with a default"
            )


@frozen(kw_only=True)
class TensorArg:
    """A tensor the fragment reads: ``prepare`` returns it with exactly ``rank`` dimensions."""

    name: str = field(validator=_identifier)
    rank: int


@frozen(kw_only=True)
class ScalarArg:
    """A number the fragment reads as a kernel argument; ``prepare`` returns it."""

    name: str = field(validator=_identifier)


_TRANSFORM_PLACEHOLDERS = frozenset({"self", ACCUMULATOR, "x1", "x2", "pos", "ok", "tmp", "g1", "g2", "col1", "col2"})
PLACEHOLDERS = {
    Role.QK_TRANSFORM: _TRANSFORM_PLACEHOLDERS,
    Role.SCORE_SOURCE: _TRANSFORM_PLACEHOLDERS,
    Role.SCORE_MOD: frozenset({"self", ACCUMULATOR, "s_in", "s_out"}),
    Role.MASK: frozenset({"self", ACCUMULATOR, "q_lo", "q_hi", "k_lo", "k_hi", "block", "i", "slot"}),
    Role.NORMALISER: frozenset({"self", ACCUMULATOR, "factor"}),
}
"""The template's own ``$placeholders`` by role; no parameter, tensor or scalar may take these names."""

# Reference arguments before the parameters, by role.
_REFERENCE_ARGS = {
    Role.QK_TRANSFORM: ("q", "k", "ctx"),
    Role.SCORE_SOURCE: ("q", "k", "ctx"),
    Role.SCORE_MOD: ("s", "ctx"),
    Role.MASK: ("ctx",),
    Role.NORMALISER: ("s", "keep", "ctx"),
}


def _role(value: Any) -> "Role":
    """A Role, or its value or name as a string ("mask", "score_mod", "score modification")."""
    if isinstance(value, Role):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        for role in Role:
            if key in (role.value, role.name.lower(), role.value.replace(" ", "_")):
                return role
    allowed = ", ".join(f"Role.{r.name} ({r.name.lower()!r})" for r in Role)
    raise DeclarationError(f"role must be one of {allowed}, got {value!r}")


_FRAGMENT_TYPES = {
    Role.QK_TRANSFORM: QKTransformFragment,
    Role.SCORE_SOURCE: ScoreSourceFragment,
    Role.SCORE_MOD: ScoreModFragment,
    Role.MASK: MaskFragment,
    Role.NORMALISER: NormaliserFragment,
}


def _fragment_matches_role(instance: "Combinator", _, fragment) -> None:
    expected = _FRAGMENT_TYPES[instance.role]
    if callable(fragment) and not isinstance(fragment, expected):
        return  # a function of the static parameters; checked when called
    if not isinstance(fragment, expected):
        raise DeclarationError(
            f"combinator {instance.name!r} has role {instance.role.value!r}, so its fragment must be a "
            f"{expected.__name__}, got {type(fragment).__name__}"
        )


@frozen(kw_only=True)
class Combinator:
    """A DSL building block.

    ``reference`` is the naive PyTorch meaning, by role (``ctx`` is a ``attnfuse.reference.Context``):
      qk transform  ``(q, k, ctx, **params) -> (q, k)``        q (B, Hq, Nq, D), k (B, Hq, Nk, D)
      score source  ``(q, k, ctx, **params) -> s``             s (B, Hq, Nq, Nk)
      score mod     ``(s, ctx, **params) -> s``
      mask          ``(ctx, **params) -> keep``                bool, broadcastable to (B, Hq, Nq, Nk), or None
      normaliser    ``(s, keep, ctx, **params) -> (weights, lse)``   lse (B, Hq, Nq) or None
    ``prepare(ctx, **params) -> {name: tensor or number}`` gives the kernel the ``tensors`` and ``scalars``
    its fragment reads (``ctx`` is a ``attnfuse.runtime.inputs.LaunchContext``).
    ``examples(draw, shape) -> {param: value}`` draws valid parameters for the conformance fuzzer.
    ``fragment`` may also be a function of the parameters returning the fragment (static values, and
    ``INPUT`` for a runtime input that was given): a specialisation chosen at compile time (rope picks its
    table layout this way).
    ``takes_offsets``: calls that give ``q_offset``/``k_offset`` (a chunk of a longer sequence) may run a
    combinator with a ``prepare`` only if it declares True: its fragments index its tensors by ``k_idx``,
    ``q_idx`` or heads (a table read at a position covers every position below ``LaunchContext.seq_len``),
    and its ``prepare`` takes the sequence's length from ``seq_len`` where it means the sequence's. A
    combinator without ``prepare`` reads no memory of its own and needs no declaration. Default False:
    such calls raise an InputError naming it.
    ``runs_on_fp8``: a combinator whose fragment reads q or k values itself (a qk transform, or a score
    source with a transform) runs in float8 calls only if it declares True: there its fragment gets the
    quantised values as stored (float32, before ``q_descale``/``k_descale``, which multiply the product
    after it), and its result is rounded to bfloat16 for the product, so it must commute with a positive
    per-head factor (a rotation does; a normalisation does not). Default False: such calls raise an
    UnsupportedError naming it. Other combinators see float32 scores and need no declaration.
    ``packed_rows``: a packed call (``cu_seqlens_q``/``cu_seqlens_k``) runs a score modification, mask or
    normaliser whose fragments read ``q_idx`` or ``k_idx`` only if it declares True: there they are rows of the
    packed q and k, indexing tensors that span the packed row ((1, H, total_q, total_k) for a score-shaped one),
    while positions and ``Nq``, ``Nk`` stay the document's, so its fragments must not compare the indices with
    the sizes. Default False: such calls raise an UnsupportedError naming it.
    """

    name: str = field(validator=_identifier)
    role: Role = field(converter=_role)
    doc: str
    reference: Callable[..., Any]
    fragment: Any = field(validator=_fragment_matches_role)
    params: tuple[Param, ...] = field(default=(), converter=tuple)
    tensors: tuple[TensorArg, ...] = field(default=(), converter=tuple)
    scalars: tuple[ScalarArg, ...] = field(default=(), converter=tuple)
    prepare: Callable[..., dict[str, Any]] | None = field(default=None)
    examples: Callable[..., dict[str, Any]] | None = field(default=None)
    takes_offsets: bool = field(default=False)
    runs_on_fp8: bool = field(default=False)
    packed_rows: bool = field(default=False)

    @params.validator
    def _check_params(self, _, params) -> None:
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            raise DeclarationError(f"combinator {self.name!r} declares a parameter twice: {names}")
        if self.role in (Role.SCORE_SOURCE,) and "scale" not in names:
            raise DeclarationError(f"score source {self.name!r} must declare a 'scale' parameter")
        static = {p.name for p in params if not p.runtime}
        kernel = [a.name for a in (*self.tensors, *self.scalars)]
        reserved = PLACEHOLDERS[self.role]
        for name in [*names, *kernel]:
            if name in reserved:
                raise DeclarationError(
                    f"combinator {self.name!r}: the name {name!r} is a placeholder of the {self.role.value} "
                    f"slot (${name}); rename the parameter, tensor or scalar (reserved there: "
                    f"{', '.join(sorted(reserved))})"
                )
        strides = {f"{t.name}_s{i}" for t in self.tensors for i in range(t.rank)}
        clash = (static & set(kernel)) | ((set(names) | set(kernel)) & strides)
        if clash or len(set(kernel)) != len(kernel):
            raise DeclarationError(
                f"combinator {self.name!r}: {sorted(clash) or kernel} name two things a "
                f"fragment's $placeholders would confuse; rename one"
            )

    @prepare.validator
    def _check_prepare(self, _, prepare) -> None:
        if (self.tensors or self.scalars) and prepare is None:
            raise DeclarationError(f"combinator {self.name!r} declares kernel tensors or scalars but no prepare()")
        if prepare is not None and not callable(prepare):
            raise DeclarationError(
                f"combinator {self.name!r}: prepare must be a function (ctx, **params), got {type(prepare).__name__}"
            )

    @takes_offsets.validator
    def _check_takes_offsets(self, _, value) -> None:
        if not isinstance(value, bool):
            raise DeclarationError(f"combinator {self.name!r}: takes_offsets must be True or False, got {value!r}")

    @packed_rows.validator
    def _check_packed_rows(self, _, value) -> None:
        if not isinstance(value, bool):
            raise DeclarationError(f"combinator {self.name!r}: packed_rows must be True or False, got {value!r}")

    @runs_on_fp8.validator
    def _check_runs_on_fp8(self, _, value) -> None:
        if not isinstance(value, bool):
            raise DeclarationError(f"combinator {self.name!r}: runs_on_fp8 must be True or False, got {value!r}")

    def __attrs_post_init__(self) -> None:
        self._check_reference(self.reference)

    def _check_reference(self, reference) -> None:
        """After the field validators: a wrong fragment type is the clearer error."""
        args = _REFERENCE_ARGS[self.role]
        shape = f"({', '.join(args)}, {', '.join(f'{p.name}=' for p in self.params) or '**params'})"
        if not callable(reference):
            raise DeclarationError(
                f"combinator {self.name!r}: reference must be a function {shape}, got {type(reference).__name__}"
            )
        try:
            inspect.signature(reference).bind(*args, **{p.name: None for p in self.params})
        except TypeError as exc:
            raise DeclarationError(
                f"combinator {self.name!r} ({self.role.value}): reference must take {shape}: {exc}"
            ) from None
        except ValueError:
            pass  # no signature to inspect (a builtin): trust it

    @examples.validator
    def _check_examples(self, _, examples) -> None:
        required = [p.name for p in self.params if p.default is REQUIRED]
        if examples is None and required:  # allowed by the contract of 2026-11-30
            deprecated(
                ("examples", self.name),
                f"combinator {self.name!r}: parameters {required} have no "
                f"default and it declares no examples, so the conformance kit cannot draw them; deprecated "
                f"since 2026-12-01, an error in a future release: declare examples(draw, shape) -> "
                f"{{param: value}}",
                stacklevel=3,
            )
        if examples is not None and not callable(examples):
            raise DeclarationError(
                f"combinator {self.name!r}: examples must be a function (draw, shape), got {type(examples).__name__}"
            )

    def fragment_for(self, params: dict[str, Any]) -> Any:
        """The fragment for these parameters: static values, and ``INPUT`` for each runtime input given
        (``fragment`` may be a function of them)."""
        fragment = self.fragment
        if callable(fragment) and not isinstance(fragment, _FRAGMENT_TYPES[self.role]):
            fragment = fragment(**params)
            _fragment_matches_role(self, None, fragment)
        return fragment

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Match a DSL call's parameters to the declaration; fill defaults; run the checks."""
        if len(args) > len(self.params):
            raise TypeError(
                f"{self.name}() takes {len(self.params)} parameter(s) after its inputs, "
                f"got {len(args)}: {[p.name for p in self.params]}"
            )
        values = {p.name: a for p, a in zip(self.params, args)}
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{self.name}() got parameter {name!r} twice")
            if not any(p.name == name for p in self.params):
                allowed = ", ".join(p.name for p in self.params) or "none"
                raise TypeError(f"{self.name}() got an unknown parameter {name!r}; allowed: {allowed}")
            values[name] = value
        for p in self.params:
            if p.name not in values:
                if p.default is REQUIRED:
                    raise TypeError(f"{self.name}() is missing its parameter {p.name!r}")
                values[p.name] = p.default
        return values
