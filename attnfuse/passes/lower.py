"""Pass 3, lower: a fused program plus a launch configuration -> a flat ``TiledKernel`` record.

The record holds every constant codegen needs; fragments come out with their parameters substituted,
leaving only the template's own placeholders (``$x``, ``$pos``, ``$q_lo`` ...).
"""
from __future__ import annotations

import math
import string
from typing import Any

import attrs
from attrs import frozen

from .. import ir

from ..combinator import Role
from ..plugin_manager import lookup
from .fuse import FusedProgram
from .tile import TileConfig, choose_tiles

DTYPES = ("float16", "bfloat16", "float32")


@frozen(kw_only=True)
class KernelConfig:
    """What besides the program's structure decides the kernel: one compiled kernel per distinct value."""

    arch: str            # "sm90", "sm80", ... or "interpreter"
    dtype: str           # one of DTYPES
    head_dim: int        # D of q and k
    head_dim_v: int      # D of v
    group: int           # Hq // Hkv
    save_lse: bool       # write the log-sum-exp of each row
    fp32_precision: str  # "ieee" or "tf32": how a float32 tl.dot multiplies


@frozen(kw_only=True)
class Instance:
    """One combinator application, ready to splice: resolved fragment text and its kernel arguments."""

    prefix: str
    apply: ir.Apply
    role: Role
    fragment: Any
    args: tuple[str, ...]

    def code(self, text: str, **site: str) -> str:
        """Fragment text with the template's placeholders for this site filled in."""
        try:
            return string.Template(text).substitute(site)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"fragment of combinator {self.apply.combinator!r} uses an unknown placeholder "
                             f"{exc}; it may use its parameters, tensors, scalars, $self and, by slot, "
                             f"{', '.join('$' + s for s in site) or 'nothing else'}") from None


@frozen(kw_only=True)
class TiledKernel:
    """Everything codegen needs, flat."""

    name: str
    signature: str
    listing: str
    config: KernelConfig
    tiles: TileConfig
    block_d: int
    block_dv: int
    scale: float
    score_factor: float
    transforms: tuple[Instance, ...]
    mods: tuple[Instance, ...]
    masks: tuple[Instance, ...]
    normaliser: Instance

    def instances(self) -> tuple[Instance, ...]:
        return (*self.transforms, *self.mods, *self.masks, self.normaliser)

    def args(self) -> tuple[str, ...]:
        return tuple(a for inst in self.instances() for a in inst.args)


def _resolve(value: Any, mapping: dict[str, str]) -> Any:
    """Substitute ``mapping`` into every string of a fragment (a frozen attrs record), recursively."""
    if isinstance(value, str):
        return string.Template(value).safe_substitute(mapping)
    if isinstance(value, tuple):
        return tuple(_resolve(v, mapping) for v in value)
    if attrs.has(type(value)):
        return attrs.evolve(value, **{f.name: _resolve(getattr(value, f.name), mapping)
                                      for f in attrs.fields(type(value))})
    return value


def instance(app: ir.Apply, index: int, role: Role | None = None) -> Instance:
    """Resolve one application: ``$param`` -> literal, ``$tensor``/``$tensor_s<i>``/``$scalar`` -> argument."""
    comb = lookup(app.combinator)
    prefix = f"{comb.name}_{index}"
    mapping: dict[str, str] = {name: repr(value) for name, value in app.static().items()}
    mapping["self"] = prefix
    args: list[str] = []
    for t in comb.tensors:
        names = [f"{prefix}_{t.name}"] + [f"{prefix}_{t.name}_s{i}" for i in range(t.rank)]
        mapping[t.name] = names[0]
        mapping.update({f"{t.name}_s{i}": n for i, n in enumerate(names[1:])})
        args += names
    for sc in comb.scalars:
        mapping[sc.name] = f"{prefix}_{sc.name}"
        args.append(f"{prefix}_{sc.name}")
    fragment = comb.fragment
    if role is Role.QK_TRANSFORM and comb.role is Role.SCORE_SOURCE:
        fragment = fragment.transform
    return Instance(prefix=prefix, apply=app, role=role or comb.role, fragment=_resolve(fragment, mapping),
                    args=tuple(args))


def variant(fused: FusedProgram) -> str:
    """The tile table's variant key: "rope" (a qk transform), "masked" (loop bounds) or "dense"."""
    source = lookup(fused.source.combinator)
    if fused.transforms or source.fragment.transform is not None:
        return "rope"
    if any(lookup(m.combinator).fragment.kv_range is not None for m in fused.masks):
        return "masked"
    return "dense"


def lower(fused: FusedProgram, config: KernelConfig, listing: str = "") -> TiledKernel:
    """Flatten a fused program for one configuration."""
    block_d = max(16, 1 << (config.head_dim - 1).bit_length())
    block_dv = max(16, 1 << (config.head_dim_v - 1).bit_length())
    tiles = choose_tiles(config.arch, variant(fused), max(block_d, block_dv))
    counter = iter(range(1_000_000))

    def inst(app: ir.Apply, role: Role | None = None) -> Instance:
        return instance(app, next(counter), role)

    transforms = [inst(t) for t in fused.transforms]
    if lookup(fused.source.combinator).fragment.transform is not None:
        transforms.append(inst(fused.source, Role.QK_TRANSFORM))
    scale = fused.source.static()["scale"]
    scale = 1.0 / math.sqrt(config.head_dim) if scale is None else float(scale)
    normaliser = inst(fused.normaliser)
    return TiledKernel(
        name=f"attnfuse_fwd_{fused.signature[:12]}", signature=fused.signature, listing=listing,
        config=config, tiles=tiles, block_d=block_d, block_dv=block_dv, scale=scale,
        score_factor=normaliser.fragment.score_factor, transforms=tuple(transforms),
        mods=tuple(inst(m) for m in fused.mods), masks=tuple(inst(m) for m in fused.masks),
        normaliser=normaliser)
