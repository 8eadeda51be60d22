"""What a plugin declares about one combinator: semantics, reference, and the Triton fragment for its slot.

A combinator is one building block of the DSL. Its declaration is a frozen record; the compiler never
imports plugin code beyond it. Fragments are Triton source with ``$name`` placeholders (``string.Template``):

* ``$<param>`` for a static parameter is replaced by its value (a literal baked into the kernel);
* ``$<tensor>`` and ``$<tensor>_s0`` ... ``$<tensor>_s<rank-1>`` for a tensor the plugin's ``prepare``
  returns: its pointer and strides, as kernel arguments;
* ``$<scalar>`` for a number ``prepare`` returns: a kernel argument;
* ``$self``: a prefix unique to this application, for names a prologue defines and a body reads.

Fragments may also read the template's variables, documented in docs/writing-a-combinator.md:
``b``, ``h``, ``hk`` (batch, query head, key/value head), ``q_idx``, ``q_pos`` (BLOCK_M,),
``k_pos`` (BLOCK_N,), ``in_bounds`` (BLOCK_M, BLOCK_N), ``Nq``, ``Nk``, ``d`` (BLOCK_D,), ``D``,
``s`` (the score tile, float32), ``acc``, ``p``.
"""
from __future__ import annotations

import ast
import enum
import inspect
import keyword
from typing import Any, Callable

import attrs
from attrs import field, frozen

from .errors import DeclarationError


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
    """

    name: str = field(validator=_identifier)
    runtime: bool = False
    default: Any = REQUIRED
    check: Callable[[Any], None] | None = None
    doc: str = ""


@frozen(kw_only=True)
class TensorArg:
    """A tensor the fragment reads: ``prepare`` returns it with exactly ``rank`` dimensions."""

    name: str = field(validator=_identifier)
    rank: int


@frozen(kw_only=True)
class ScalarArg:
    """A number the fragment reads as a kernel argument; ``prepare`` returns it."""

    name: str = field(validator=_identifier)


@frozen(kw_only=True)
class QKTransformFragment:
    """Rewrites the q tile once before the key loop and each k tile inside it.

    The tile arrives as its two halves, float32 (rows, BLOCK_H): ``$x1`` holds columns [0, D/2) and
    ``$x2`` columns [D/2, D); the fragment rewrites both in place. ``$pos`` are the rows' positions (rows,),
    ``$ok`` the (rows, BLOCK_H) mask of real elements; ``dh`` is ``tl.arange(0, BLOCK_H)`` and ``HALF``
    is D/2. Name temporaries ``${tmp}_<name>``: ``$tmp`` differs between the q site (before the loop) and
    the k site (inside it), whose tiles differ in shape. An empty string leaves that operand unchanged.

    Backward: ``q_grad``/``k_grad`` rewrite the gradient halves ``$g1``, ``$g2`` (gradient with respect
    to the transform's output) into the gradient with respect to its input ``$x1``, ``$x2`` (a
    vector-Jacobian product; for a rotation, the transposed rotation). ``None``: no backward.
    """

    q: str = ""
    k: str = ""
    q_grad: str | None = None
    k_grad: str | None = None

    def differentiable(self) -> bool:
        return (not self.q or self.q_grad is not None) and (not self.k or self.k_grad is not None)


@frozen(kw_only=True)
class ScoreSourceFragment:
    """A score source computes (q·kᵀ)·scale after an optional transform of q and k."""

    transform: QKTransformFragment | None = None


@frozen(kw_only=True)
class ScoreModFragment:
    """Rewrites the score tile ``s`` (float32, (BLOCK_M, BLOCK_N), natural units) inside the key loop.

    Backward: ``grad`` rewrites ``ds``, the gradient with respect to this modification's output, into the
    gradient with respect to its input; it may read ``$s_in`` and ``$s_out``. ``""`` for a modification
    that adds something independent of ``s`` (its derivative is 1); ``None``: no backward.
    ``tensor_grads``: (runtime tensor parameter, expression of ``ds``, ``$s_in``, ``$s_out``) pairs giving,
    element by element over the score tile, the gradient of a parameter broadcastable to the scores
    (additive_bias: ``("bias", "ds")``); the runtime sums it over the dimensions the tensor broadcasts.
    """

    body: str
    prologue: str = ""
    grad: str | None = None
    tensor_grads: tuple[tuple[str, str], ...] = field(default=(), converter=tuple)


@frozen(kw_only=True)
class BlockList:
    """Lists of the blocks a mask keeps anything in, so the kernels visit only those (block sparsity).

    Blocks are ``size`` x ``size`` in index space (``size`` names a scalar the plugin's ``prepare``
    returns; kernel tiles shrink to at most it). ``count`` and ``index`` give, for query block ``$block``,
    how many key blocks are listed and the ``$i``-th of them; ``q_count`` and ``q_index`` the same for the
    query blocks of key block ``$block`` (the backward's dK/dV loop). Listed blocks still run the mask's
    other masks; the listing mask's own ``keep`` is then implied and skipped.

    ``order`` (optional): the query block to run ``$slot``-th, a permutation of them, heaviest first;
    ``q_order`` the same for key blocks (dK/dV). With an order the kernels run a block for every batch
    and head before the next block, so the longest lists start first and none runs alone at the end.
    ``q_split`` (optional, with ``q_order``): names a scalar, how many key blocks, first in ``q_order``,
    the dK/dV kernel splits over the query heads of a GQA group: each head's share runs as a program of
    its own, and the group's last to finish sums the shares in head order (deterministic). For blocks
    whose lists are much longer than the rest, as global tokens' are.
    """

    size: str
    count: str
    index: str
    q_count: str
    q_index: str
    order: str | None = None
    q_order: str | None = None
    q_split: str | None = None


def _is_zero(text: str) -> bool:
    """Whether a fact's expression is the constant 0 (``"0"``, ``"(0)"``, ``" 0 "``): parsed, not compared."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:  # placeholders not yet substituted: not a constant
        return False
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value == 0


@frozen
class Range:
    """A block fact: positions ``lo`` .. ``hi`` (expressions), parsed when declared (and when its
    placeholders are substituted): ``starts_at_zero`` when ``lo`` is the constant 0. Unpacks as (lo, hi)."""

    lo: str
    hi: str
    starts_at_zero: bool = field(init=False, default=attrs.Factory(lambda self: _is_zero(self.lo), takes_self=True))

    def __iter__(self):
        return iter((self.lo, self.hi))


def _range(value: Any) -> Range | None:
    """A fact as declared, (lo, hi) or a Range, or None (unknown)."""
    if value is None or isinstance(value, Range):
        return value
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise DeclarationError(f"a block fact must be a (lo, hi) pair of expression strings or None, got {value!r}")
    return Range(*value)


@frozen(kw_only=True)
class MaskFragment:
    """Which keys a query keeps, plus block facts the compiler uses to bound and split the key loops.

    ``keep``: a boolean expression broadcastable to (BLOCK_M, BLOCK_N), of ``q_pos[:, None]``,
    ``k_pos[None, :]``, ``q_idx``, ``b``, ``h``. ``None`` keeps every key.
    ``kv_range``: (lo, hi) key positions outside of which no query of a block with positions
    ``$q_lo`` ... ``$q_hi`` keeps anything; ``None`` when unknown. Blocks outside are never visited.
    ``full_range``: (lo, hi) key positions every query of such a block keeps; blocks inside run with no
    mask arithmetic. ``None`` when unknown (every visited block then evaluates ``keep``).
    ``q_range``, ``q_full_range``: the same facts transposed, for the backward's loop over query blocks:
    query positions that keep some / every key of a key block with positions ``$k_lo`` ... ``$k_hi``.
    Query positions never reach ``Nk``, so ``"Nk"`` serves as an upper bound meaning "no limit".
    ``block_list``: lists of the blocks kept at all, for block-sparse iteration (see ``BlockList``).
    """

    keep: str | None
    kv_range: Range | None = field(default=None, converter=_range)
    full_range: Range | None = field(default=None, converter=_range)
    q_range: Range | None = field(default=None, converter=_range)
    q_full_range: Range | None = field(default=None, converter=_range)
    block_list: BlockList | None = None


@frozen(kw_only=True)
class NormaliserFragment:
    """Turns scores into the weights ``p`` that multiply V, with its own running state.

    ``score_factor``: the template multiplies scores by it before ``update`` (log2(e) for an exp2 softmax).
    ``masked_score``: the value an excluded key's score takes before ``update``; it must give weight 0.
    ``init`` declares the state; ``update`` reads ``s`` and writes ``p`` (BLOCK_M, BLOCK_N) float32,
    rescaling ``acc`` if it must; ``finalize`` writes ``out`` from ``acc`` and, when ``has_lse``, ``lse``
    (BLOCK_M,) in natural log. ``scaled_update`` (optional): the same update reading unscaled ``s``,
    whose scores are ``s * $factor`` ($factor > 0, so masked scores stay ``masked_score``); the core uses
    it where no score modification needs the scores, folding the scale into the exponent.

    Backward (FlashAttention-2: weights are recomputed tile by tile): ``backward_rows`` runs once per
    query tile and may read ``lse`` (BLOCK_M,) when ``has_lse``; ``recompute`` writes ``p`` from ``s`` (as
    ``update`` saw it); ``grad`` writes ``ds``, the gradient with respect to the scores in natural units,
    from ``p``, ``s``, ``dp`` (= dO·Vᵀ) and, when ``needs_delta``, ``delta`` (BLOCK_M,) = rowsum(dO∘O)
    minus the gradient of lse. ``grad=None``: no backward.

    Split-KV decoding: ``combine`` says how results over disjoint key splits merge: ``"logsumexp"`` (each
    split's ``finalize`` gives its normalised ``out`` and ``lse``; softmax), ``"sum"`` (each gives its
    ``out``; an unnormalised normaliser such as relu_attention), or None (no split path; decoding runs the
    regular kernel).

    ``smooth=False``: the weights' derivative jumps (relu at 0), so rounding a score across the jump
    changes a gradient by a whole term; the conformance suite then compares gradients only in float32
    and float64, where that is rare.
    """

    init: str
    update: str
    finalize: str
    scaled_update: str = ""
    masked_score: str = 'float("-inf")'
    score_factor: float = 1.0
    has_lse: bool = False
    backward_rows: str = ""
    recompute: str = ""
    grad: str | None = None
    needs_delta: bool = False
    combine: str | None = field(default=None, validator=attrs.validators.in_((None, "logsumexp", "sum")))
    smooth: bool = True


ACCUMULATOR = "acc_dtype"
"""``$acc_dtype``: the accumulation type, ``tl.float32`` (``tl.float64`` for float64 inputs), in any fragment."""
_TRANSFORM_PLACEHOLDERS = frozenset({"self", ACCUMULATOR, "x1", "x2", "pos", "ok", "tmp", "g1", "g2"})
PLACEHOLDERS = {
    Role.QK_TRANSFORM: _TRANSFORM_PLACEHOLDERS, Role.SCORE_SOURCE: _TRANSFORM_PLACEHOLDERS,
    Role.SCORE_MOD: frozenset({"self", ACCUMULATOR, "s_in", "s_out"}),
    Role.MASK: frozenset({"self", ACCUMULATOR, "q_lo", "q_hi", "k_lo", "k_hi", "block", "i", "slot"}),
    Role.NORMALISER: frozenset({"self", ACCUMULATOR, "factor"}),
}
"""The template's own ``$placeholders`` by role; no parameter, tensor or scalar may take these names."""

# Reference arguments before the parameters, by role.
_REFERENCE_ARGS = {Role.QK_TRANSFORM: ("q", "k", "ctx"), Role.SCORE_SOURCE: ("q", "k", "ctx"),
                   Role.SCORE_MOD: ("s", "ctx"), Role.MASK: ("ctx",), Role.NORMALISER: ("s", "keep", "ctx")}


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
                    f"{', '.join(sorted(reserved))})")
        strides = {f"{t.name}_s{i}" for t in self.tensors for i in range(t.rank)}
        clash = (static & set(kernel)) | ((set(names) | set(kernel)) & strides)
        if clash or len(set(kernel)) != len(kernel):
            raise DeclarationError(f"combinator {self.name!r}: {sorted(clash) or kernel} name two things a "
                                   f"fragment's $placeholders would confuse; rename one")

    @prepare.validator
    def _check_prepare(self, _, prepare) -> None:
        if (self.tensors or self.scalars) and prepare is None:
            raise DeclarationError(f"combinator {self.name!r} declares kernel tensors or scalars but no prepare()")
        if prepare is not None and not callable(prepare):
            raise DeclarationError(f"combinator {self.name!r}: prepare must be a function (ctx, **params), "
                                   f"got {type(prepare).__name__}")

    def __attrs_post_init__(self) -> None:
        self._check_reference(self.reference)

    def _check_reference(self, reference) -> None:
        """After the field validators: a wrong fragment type is the clearer error."""
        args = _REFERENCE_ARGS[self.role]
        shape = f"({', '.join(args)}, {', '.join(f'{p.name}=' for p in self.params) or '**params'})"
        if not callable(reference):
            raise DeclarationError(f"combinator {self.name!r}: reference must be a function {shape}, "
                                   f"got {type(reference).__name__}")
        try:
            inspect.signature(reference).bind(*args, **{p.name: None for p in self.params})
        except TypeError as exc:
            raise DeclarationError(f"combinator {self.name!r} ({self.role.value}): reference must take "
                                   f"{shape}: {exc}") from None
        except ValueError:
            pass  # no signature to inspect (a builtin): trust it

    @examples.validator
    def _check_examples(self, _, examples) -> None:
        required = [p.name for p in self.params if p.default is REQUIRED]
        if examples is None and required:
            raise DeclarationError(f"combinator {self.name!r}: parameters {required} have no default, so it "
                                   f"must declare examples(draw, shape) -> {{param: value}} for the "
                                   f"conformance kit")
        if examples is not None and not callable(examples):
            raise DeclarationError(f"combinator {self.name!r}: examples must be a function (draw, shape), got "
                                   f"{type(examples).__name__}")

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
            raise TypeError(f"{self.name}() takes {len(self.params)} parameter(s) after its inputs, "
                            f"got {len(args)}: {[p.name for p in self.params]}")
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

