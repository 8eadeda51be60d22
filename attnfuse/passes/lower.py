"""Pass 2, lower: a fused program plus a launch configuration -> a flat ``LoweredProgram`` record.

The record holds every constant codegen needs, each kernel's tiles among them (``tile.choose_tiles``, asked here
for every kernel of ``TILED_KERNELS``); fragments come out with their parameters substituted, leaving only the
template's own placeholders (``$x``, ``$pos``, ``$q_lo`` ...).
"""

from __future__ import annotations

import math
import re
import string
import warnings
from typing import Any, Callable

import attrs
from attrs import frozen

from .. import ir

from ..combinator import (
    ACCUMULATOR,
    HALVES,
    BlockList,
    MaskFragment,
    NormaliserFragment,
    QKTransformFragment,
    Role,
    ScoreModFragment,
)
from ..errors import InputError, ProgramError
from ..fragment_lint import lint, refuse_old_accumulator
from ..launch_spec import SCALAR, TENSOR, Param, indexed_strides
from ..plan import KernelConfig, TileConfig, accumulator_type
from ..static_values import literal
from .fuse import FusedProgram
from .tile import choose_tiles


@frozen(kw_only=True)
class Instance:
    """One combinator application, ready to splice: resolved fragment text and its kernel parameters
    (each tensor ``prepare`` gives, then its strides; then each scalar, in declaration order)."""

    prefix: str
    apply: ir.Apply
    role: Role
    fragment: Any
    args: tuple[Param, ...]

    def code(self, text: str, **site: str) -> str:
        """Fragment text with the template's placeholders for this site filled in."""
        try:
            return string.Template(text).substitute(site)
        except (KeyError, ValueError) as exc:
            raise ValueError(
                f"fragment of combinator {self.apply.combinator!r} uses an unknown placeholder "
                f"{exc}; it may use its parameters, tensors, scalars, $self and, by slot, "
                f"{', '.join('$' + s for s in site) or 'nothing else'}"
            ) from None


TILED_KERNELS = ("forward", "dkdv", "dq", "decode")  # the kernels the tile table has entries for


@frozen(kw_only=True)
class LoweredProgram:
    """A fused program for one configuration, flat: everything codegen needs to write its kernels.

    ``tiles``: by kernel (``TILED_KERNELS``); the split-KV kernel's BLOCK_M is the most rows of a program.
    """

    signature: str
    listing: str
    config: KernelConfig
    accumulator_dtype: str  # the accumulation dtype: "float32", or "float64" for float64 inputs
    tiles: dict[str, TileConfig]
    block_d: int
    block_dv: int
    block_h: int  # width of each half of the head dim, when qk transforms split it
    columns: tuple[str, str] = HALVES  # the columns of the halves' element dh: the transforms' column map
    scale: float
    score_factor: float
    transforms: tuple[Instance, ...]
    mods: tuple[Instance, ...]
    masks: tuple[Instance, ...]
    normaliser: Instance

    @property
    def accumulator(self) -> str:
        """The accumulation type as kernel code: ``tl.float32`` or ``tl.float64``."""
        return f"tl.{self.accumulator_dtype}"

    def instances(self) -> tuple[Instance, ...]:
        return (*self.transforms, *self.mods, *self.masks, self.normaliser)

    def args(self) -> tuple[Param, ...]:
        """The plugins' kernel parameters, in the order the kernels take them."""
        return tuple(a for inst in self.instances() for a in inst.args)


def _resolve(value: Any, mapping: dict[str, str]) -> Any:
    """Substitute ``mapping`` into every string of a fragment (a frozen attrs record), recursively."""
    return _rewritten(value, lambda text: string.Template(text).safe_substitute(mapping))


def _rewritten(value: Any, rewrite: Callable[[str], str]) -> Any:
    """A fragment (a frozen attrs record) with ``rewrite`` applied to every string, recursively."""
    if isinstance(value, str):
        return rewrite(value)
    if isinstance(value, tuple):
        return tuple(_rewritten(v, rewrite) for v in value)
    if attrs.has(type(value)):  # a derived field (a Range's starts_at_zero) is derived again
        return attrs.evolve(
            value, **{f.name: _rewritten(getattr(value, f.name), rewrite) for f in attrs.fields(type(value)) if f.init}
        )
    return value


_INDICES = re.compile(r"(?<![\w.])(q_idx|k_idx)\b")
_PACKED_ROWS = {"q_idx": "(q_start + q_idx)", "k_idx": "(k_start + k_idx)"}


def packed_rows(inst: Instance) -> Instance:
    """``inst`` for a packed call's kernels (``KernelConfig.varlen``): where its combinator declares
    ``packed_rows``, its fragment's ``q_idx`` and ``k_idx``, which index the call's tensors, are rows of the
    packed q and k (the kernels' own are the document's, from its first rows ``q_start``, ``k_start``:
    ``codegen/packed.py``); unchanged otherwise (such a packed call is refused: ``runtime/packed.py``)."""
    if not inst.apply.declaration.packed_rows:
        return inst
    return attrs.evolve(
        inst, fragment=_rewritten(inst.fragment, lambda t: _INDICES.sub(lambda m: _PACKED_ROWS[m[1]], t))
    )


_TRANSFORM_SITE = {"x1", "x2", "pos", "ok", "tmp", "col1", "col2"}
_SITE = {  # (fragment type, field) -> the template's own placeholders it may use (the rest are resolved here)
    (QKTransformFragment, "q"): _TRANSFORM_SITE,
    (QKTransformFragment, "k"): _TRANSFORM_SITE,
    (QKTransformFragment, "q_grad"): _TRANSFORM_SITE | {"g1", "g2"},
    (QKTransformFragment, "k_grad"): _TRANSFORM_SITE | {"g1", "g2"},
    (QKTransformFragment, "q_tensor_grads"): _TRANSFORM_SITE | {"g1", "g2", "d1", "d2"},
    (QKTransformFragment, "k_tensor_grads"): _TRANSFORM_SITE | {"g1", "g2", "d1", "d2"},
    (ScoreModFragment, "grad"): {"s_in", "s_out"},
    (ScoreModFragment, "tensor_grads"): {"s_in", "s_out"},
    (MaskFragment, "kv_range"): {"q_lo", "q_hi"},
    (MaskFragment, "full_range"): {"q_lo", "q_hi"},
    (MaskFragment, "q_range"): {"k_lo", "k_hi"},
    (MaskFragment, "q_full_range"): {"k_lo", "k_hi"},
    (BlockList, "count"): {"block"},
    (BlockList, "index"): {"block", "i"},
    (BlockList, "q_count"): {"block"},
    (BlockList, "q_index"): {"block", "i"},
    (BlockList, "partial"): {"block", "i"},
    (BlockList, "q_partial"): {"block", "i"},
    (BlockList, "order"): {"slot"},
    (BlockList, "q_order"): {"slot"},
    (NormaliserFragment, "scaled_update"): {"factor"},
}
_PLACEHOLDER = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _check_placeholders(combinator: str, value: Any, allowed: frozenset = frozenset(), field: str = "") -> None:
    """Raise a clear error for a ``$name`` neither the plugin's parameters nor the template's slot defines."""
    if isinstance(value, str):
        for braced, plain in _PLACEHOLDER.findall(value):
            name = braced or plain
            if name not in allowed:
                slot = ", ".join(f"${p}" for p in sorted(allowed)) or "none"
                raise ValueError(
                    f"fragment of combinator {combinator!r}: ${name} in {field or 'its code'} is neither "
                    f"a parameter, tensor, scalar or $self, nor a placeholder of that slot ({slot})"
                )
    elif isinstance(value, tuple):
        for item in value:
            _check_placeholders(combinator, item, allowed, field)
    elif attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            site = _SITE.get((type(value), f.name))
            _check_placeholders(
                combinator, getattr(value, f.name), frozenset(site) if site else allowed, f.name if site else field
            )


def fragment_of(app: ir.Apply) -> Any:
    """Deprecated since 2026-12-03 (documented for plugin authors until then): ``app.fragment()``."""
    warnings.warn(
        "attnfuse.passes.lower.fragment_of(app) is deprecated since 2026-12-03 and will be removed in a "
        "future release: call app.fragment() on the ir.Apply instead",
        DeprecationWarning,
        stacklevel=2,
    )
    return app.fragment()


def instance(app: ir.Apply, index: int, accumulator: str = "float32") -> Instance:
    """Resolve one application: ``$param`` -> literal, ``$tensor``/``$tensor_s<i>``/``$scalar`` -> argument,
    ``$acc_dtype`` -> the type of dtype ``accumulator``."""
    comb = app.declaration
    prefix = f"{comb.name}_{index}"
    mapping: dict[str, str] = {name: literal(value) for name, value in app.static().items()}
    mapping["self"] = prefix
    mapping[ACCUMULATOR] = f"tl.{accumulator}"
    args: list[Param] = []
    for t in comb.tensors:
        tensor, tensor_strides = f"{prefix}_{t.name}", indexed_strides(f"{prefix}_{t.name}", t.rank)
        mapping[t.name] = tensor
        mapping.update({f"{t.name}_s{i}": p.name for i, p in enumerate(tensor_strides)})
        args += [Param(tensor, TENSOR), *tensor_strides]
    for sc in comb.scalars:
        mapping[sc.name] = f"{prefix}_{sc.name}"
        args.append(Param(f"{prefix}_{sc.name}", SCALAR))
    fragment = app.fragment()
    if not attrs.has(type(comb.fragment)):  # a fragment function's result: checked as registration checks
        lint(comb, fragment, app.record.distribution)
    refuse_old_accumulator(comb, fragment, app.record.distribution, accumulator)  # deprecated tl.float32
    fragment = _resolve(fragment, mapping)
    _check_placeholders(comb.name, fragment)
    return Instance(prefix=prefix, apply=app, role=comb.role, fragment=fragment, args=tuple(args))


def masked_head(masks: tuple[Instance, ...]) -> bool:
    """Whether a query block's key loop can start with blocks that need the mask: some mask's facts start
    past key 0 (a sliding window's). Not causal's: its loop starts at key 0 (or at a block-aligned split
    of the keys) with blocks every row keeps."""
    return any(
        facts is not None and not facts.starts_at_zero
        for m in masks
        if m.fragment.keep
        for facts in (m.fragment.kv_range, m.fragment.full_range)
    )


def _variant(transforms: list[Instance], masks: tuple[Instance, ...]) -> str:
    """The tile table's variant key: "rope" (a qk transform), "listed" (a mask lists its blocks: block-sparse
    loops, often short), "window" (masked first blocks, as a sliding window's: few keys per row), "masked"
    (other loop bounds, as causal's) or "dense"."""
    if transforms:
        return "rope"
    if any(m.fragment.block_list is not None for m in masks):
        return "listed"
    if masked_head(masks):
        return "window"
    return "masked" if any(m.fragment.kv_range is not None for m in masks) else "dense"


def lower(fused: FusedProgram, config: KernelConfig, listing: str = "") -> LoweredProgram:
    """Flatten a fused program for one configuration."""
    counter = iter(range(1_000_000))
    accumulator = accumulator_type(config.dtype)

    def inst(app: ir.Apply) -> Instance:
        return instance(app, next(counter), accumulator)

    transforms = [inst(t) for t in fused.transforms]
    source = inst(fused.source)
    if source.fragment.transform is not None:
        transforms.append(attrs.evolve(source, role=Role.QK_TRANSFORM, fragment=source.fragment.transform))
    if transforms and config.head_dim % 2:
        raise InputError(
            f"qk transforms ({', '.join(t.apply.combinator for t in transforms)}) act on the two "
            f"halves of the head dim, so it must be even; got D={config.head_dim}"
        )
    mods = tuple(inst(m) for m in fused.mods)
    masks = _one_listing(tuple(inst(m) for m in fused.masks), config.varlen)
    normaliser = inst(fused.normaliser)
    if config.varlen:  # the combinators that declare it read their tensors at packed rows
        mods, masks, normaliser = tuple(map(packed_rows, mods)), tuple(map(packed_rows, masks)), packed_rows(normaliser)
    if config.partial and normaliser.fragment.partial is not None:
        normaliser = attrs.evolve(normaliser, fragment=normaliser.fragment.partial)
    block_d = _block(config.head_dim)
    block_dv = _block(config.head_dim_v)
    variant, widest = _variant(transforms, masks), max(block_d, block_dv)
    tiles = {
        kind: choose_tiles(config.arch, variant, widest, kind, config.dtype, config.fp32_precision)
        for kind in TILED_KERNELS
    }
    scale = _scale(fused.source, normaliser, config.head_dim)
    return LoweredProgram(
        signature=fused.signature,
        listing=listing,
        config=config,
        accumulator_dtype=accumulator,
        tiles=tiles,
        block_d=block_d,
        block_dv=block_dv,
        block_h=_block(config.head_dim // 2),
        columns=_column_map(transforms),
        scale=scale,
        score_factor=normaliser.fragment.score_factor,
        transforms=tuple(transforms),
        mods=mods,
        masks=masks,
        normaliser=normaliser,
    )


_COLUMN_PLACEHOLDER = re.compile(r"\$\{?col[12]\b")
_DH = re.compile(r"\bdh\b")


def _column_map(transforms: list[Instance]) -> tuple[str, str]:
    """The program's column map (``QKTransformFragment.columns``): the one its transforms declare, or
    ``HALVES``. A ProgramError for two different ones, and for a transform that reads columns by ``dh``
    but not by ``$col1``/``$col2`` alongside a map that moves them."""
    declared = [t for t in transforms if t.fragment.columns is not None and t.fragment.columns != HALVES]
    for t in declared[1:]:
        if t.fragment.columns != declared[0].fragment.columns:
            raise ProgramError(
                f"{declared[0].apply} and {t.apply} lay q's and k's columns out differently (column maps "
                f"{declared[0].fragment.columns} and {t.fragment.columns}): a program's qk transforms need one"
            )
    if not declared:
        return HALVES
    for t in transforms:
        texts = [t.fragment.q, t.fragment.k, t.fragment.q_grad or "", t.fragment.k_grad or ""]
        if t.fragment.columns is None and any(_DH.search(x) for x in texts):
            if not any(_COLUMN_PLACEHOLDER.search(x) for x in texts):
                raise ProgramError(
                    f"{t.apply} reads head-dim columns by dh, but {declared[0].apply} moves them (column map "
                    f"{declared[0].fragment.columns}): the fragments of {t.apply.combinator} must load per-column "
                    f"data at $col1/$col2, the columns of the halves, to run with it"
                )
    return declared[0].fragment.columns


def _scale(source: ir.Apply, normaliser: Instance, head_dim: int) -> float:
    """The score source's scale (None: 1/√D). The kernels write it, and it times the normaliser's score
    factor, as literals, so both must be values ``literal`` writes."""
    scale = source.static()["scale"]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    factor = normaliser.fragment.score_factor
    try:
        literal(scale)
        literal(scale * factor)
    except ValueError as exc:
        raise ProgramError(
            f"{source.combinator}: parameter 'scale' (times {factor!r}, the score factor of "
            f"{normaliser.apply.combinator}): {exc}"
        ) from None
    return scale


def _one_listing(masks: tuple[Instance, ...], varlen: bool) -> tuple[Instance, ...]:
    """The loops follow one mask's block lists; any further listing mask is applied element by element, as
    every one is in a packed call (``varlen``: the loops follow each document's tiles, and the lists index
    blocks of the packed row, which a document's tiles need not align with)."""
    listing = [m for m in masks if m.fragment.block_list is not None]
    followed = listing[:0] if varlen else listing[:1]
    return tuple(
        m if m not in listing or m in followed else attrs.evolve(m, fragment=attrs.evolve(m.fragment, block_list=None))
        for m in masks
    )


def _block(n: int) -> int:
    """The power-of-two tile width (at least 16, tl.dot's minimum) that holds n columns."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())
