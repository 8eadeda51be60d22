"""The fragment records a combinator declares, one type per role: Triton text with ``$placeholders`` (see
``attnfuse.combinator``) for the slots of the kernel templates, and a mask's block facts."""

from __future__ import annotations

import ast
from typing import Any

import attrs
from attrs import field, frozen

from .errors import DeclarationError
from .parsing import parse


HALVES = ("dh", "dh + HALF")
"""The default column map of a qk transform's halves: ``$x1`` holds columns [0, D/2), ``$x2`` [D/2, D)."""


@frozen(kw_only=True)
class QKTransformFragment:
    """Rewrites the q tile once before the key loop and each k tile inside it.

    The tile arrives as its two halves, float32 (rows, BLOCK_H): ``$x1`` holds columns [0, D/2) and ``$x2``
    columns [D/2, D) (or those of the program's column map, below); the fragment rewrites both in place.
    ``$pos`` are the rows' positions (rows,), ``$ok`` the (rows, BLOCK_H) mask of real elements; ``dh`` is
    ``tl.arange(0, BLOCK_H)`` and ``HALF`` is D/2. Name temporaries ``${tmp}_<name>``: ``$tmp`` differs between
    the q site (before the loop) and the k site (inside it), whose tiles differ in shape. An empty string leaves
    that operand unchanged.

    Backward: ``q_grad``/``k_grad`` rewrite the gradient halves ``$g1``, ``$g2`` (gradient with respect
    to the transform's output) into the gradient with respect to its input ``$x1``, ``$x2`` (a
    vector-Jacobian product; for a rotation, the transposed rotation). ``None``: no backward.

    ``columns`` (optional): the column map, a pair of expressions of ``dh`` (and ``HALF``): the head-dim
    columns of ``$x1[:, dh]`` and ``$x2[:, dh]``, for dh < HALF a bijection onto [0, D). ``None`` is
    ``HALVES``, (``dh``, ``dh + HALF``). The score is the same whatever the order of the columns, so the
    kernels then load q and k (and store their gradients) by this map: a transform that pairs columns
    otherwise (interleaved RoPE: ``2 * dh``, ``2 * dh + 1``) gets its pairs as the two halves. A program's
    transforms share one map: two that declare different ones are refused. Every transform reads the map
    as ``$col1``, ``$col2`` (the columns of its halves, (BLOCK_H,)): one that loads per-column data of its
    own (qk_norm's weights) loads it there; one that reads ``dh`` and neither placeholder is refused
    alongside a map other than ``HALVES``.
    ``q_tensor_grads``/``k_tensor_grads``: (runtime tensor parameter, statements) pairs giving the gradient
    of a (D,) tensor of the head dim's columns (qk_norm's weights) from that side's rows. The statements
    run before ``q_grad``/``k_grad`` and may read what they read (``$g1``, ``$g2``, ``$x1``, ``$x2``,
    ``$pos``, ``$ok``, ``${tmp}_`` names); they write ``$d1`` and ``$d2`` (rows, BLOCK_H), each row's
    contribution to the gradient of the halves' columns (``$col1``, ``$col2``). The kernels sum them over the rows of
    each program (rows outside the tensors count 0) and the runtime over the programs: over batch, heads
    and rows. Default none: the parameter has no gradient (one that requires grad is refused).
    """

    q: str = ""
    k: str = ""
    q_grad: str | None = None
    k_grad: str | None = None
    columns: tuple[str, str] | None = field(default=None)
    q_tensor_grads: tuple[tuple[str, str], ...] = field(default=(), converter=tuple)
    k_tensor_grads: tuple[tuple[str, str], ...] = field(default=(), converter=tuple)

    @columns.validator
    def _check_columns(self, _, columns) -> None:
        if columns is not None and not (
            isinstance(columns, tuple) and len(columns) == 2 and all(isinstance(c, str) and c.strip() for c in columns)
        ):
            raise DeclarationError(
                f"QKTransformFragment: columns must be None or a pair of expression strings of dh (the columns "
                f"of $x1[:, dh] and $x2[:, dh]), got {columns!r}"
            )

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
    other masks; the listing mask's own ``keep`` is then implied and skipped, unless ``partial`` says the
    block is partial.

    ``partial`` (optional): for the ``$i``-th key block listed for query block ``$block``, whether some
    pair of it is not kept (a token-level mask cut by the block grid): the kernels then apply the mask's
    ``keep`` inside it, and skip it in the other listed blocks. ``q_partial`` the same for the ``$i``-th
    query block listed for key block ``$block`` (dK/dV). Both or neither; None: every listed block is
    kept in full.

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
    partial: str | None = None
    q_partial: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.partial is None) != (self.q_partial is None):
            raise DeclarationError(
                "BlockList: give both partial and q_partial (the row and the column lists' partial blocks) or neither"
            )


def _is_zero(text: str) -> bool:
    """Whether a fact's expression is the constant 0 (``"0"``, ``"(0)"``, ``" 0 "``): parsed, not compared."""
    try:
        node = parse(text.strip(), mode="eval").body
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
    ``k_pos[None, :]``, ``q_idx``, ``k_idx``, ``b``, ``h``. ``None`` keeps every key.
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

    ``partial`` (optional, with ``combine``): the fragment of a partial result, over some of a row's keys,
    for a normaliser whose result also holds a term that depends on no key (a sink's logit in the
    denominator). It leaves that term out; a merge of one whole result (this fragment) with partial ones
    (``partial``) by ``combine`` then counts it once. Without it, every result over some keys is merged as
    is. Context parallelism (``attnfuse.distributed``) uses it; the split-KV path does not take such
    normalisers.

    ``smooth=False``: the weights' derivative jumps (relu at 0), so rounding a score across the jump
    changes a gradient by a whole term; the conformance suite then compares gradients only in float32
    and float64, where that is rare.

    ``unit_weights=True``: every weight ``p`` that ``update`` (and ``scaled_update``) writes is at most 1 in
    magnitude, or NaN, whatever the scores (softmax's ``exp2(s - running max)``; relu_attention divides by a
    running maximum). A float8 call's P·V rounds its weights to e4m3, whose range ends near them: the Hopper
    template runs float8 calls only for normalisers that declare it (the generated float8 kernel takes the
    others). Checked wherever device assertions run (Triton's interpreter: every CPU call, and the conformance
    kit's own check on large scores): a weight beyond 1 raises ``DeclarationViolation``.
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
    partial: NormaliserFragment | None = field(default=None)
    smooth: bool = True
    unit_weights: bool = False

    @partial.validator
    def _check_partial(self, _, partial) -> None:
        if partial is None:
            return
        if not isinstance(partial, NormaliserFragment) or partial.partial is not None:
            raise DeclarationError(
                f"a normaliser's partial must be a NormaliserFragment without a partial of its own, got {partial!r}"
            )
        if self.combine is None or partial.combine != self.combine or partial.has_lse != self.has_lse:
            raise DeclarationError(
                f"a normaliser's partial results are merged by its combine rule: it needs one, "
                f"and its partial the same combine and has_lse (combine {self.combine!r} / "
                f"{partial.combine!r}, has_lse {self.has_lse} / {partial.has_lse})"
            )


ACCUMULATOR = "acc_dtype"
"""``$acc_dtype``: the accumulation type, ``tl.float32`` (``tl.float64`` for float64 inputs), in any fragment."""
