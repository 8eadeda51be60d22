"""The template instances of one lowered program: a ``KernelSpec`` per kernel kind the templates serve, and for
every other kind the reason it runs the generated kernel."""

from __future__ import annotations

import functools
import hashlib
import importlib
import re
from pathlib import Path

from ..launch_spec import LaunchSpec
from ..passes.codegen.fp8 import is_fp8
from ..passes.codegen.loops import listing_mask
from ..passes.lower import LoweredProgram, masked_head
from ..plan import KernelSpec, TemplatePlan, TileConfig
from . import pipeline
from .canonical import canonical_source
from .capability import dkdv_reason, dq_reason, forward_reason
from .dkdv import dkdv_params, generate_dkdv
from .dq import dq_params, generate_dq
from .forward import forward_params, generate_forward
from .listed import partial_keep
from .tiles import DKDV_TILES, DQ_NARROW_TILES, DQ_TILES, FORWARD_TILES, FP8_TILES, NARROW_TILES

TEMPLATE_KINDS = ("forward", "dkdv", "dq", "decode")  # the kernels `attnfuse show` reports an engine for
_NOT_YET = {
    "decode": "decoding reads few rows a program: the generated split-KV kernel serves it",
}


def template_plan(kernel: LoweredProgram) -> TemplatePlan:
    """The template instances of ``kernel`` and the reasons for the kinds that fall back."""
    kernels, reasons = {}, dict(_NOT_YET)
    for kind, reason, spec in (
        ("forward", forward_reason, _forward_spec),
        ("dkdv", dkdv_reason, _dkdv_spec),
        ("dq", dq_reason, _dq_spec),
    ):
        why = reason(kernel)
        if why is None:
            kernels[kind] = spec(kernel)
        else:
            reasons[kind] = why
    return TemplatePlan(
        kernels=kernels, reasons=reasons, scale=kernel.scale, qk_scale=kernel.scale * kernel.score_factor
    )


def loads_per_score(kernel: LoweredProgram) -> bool:
    """Whether a score modification reads a tensor inside the key loop (its body loads, not its prologue)."""
    return any("tl.load" in m.fragment.body for m in kernel.mods)


def listing_loads(kernel: LoweredProgram) -> bool:
    """Whether the mask that lists its blocks reads a tensor per score where it applies (a partial block)."""
    m = listing_mask(kernel)
    return m is not None and partial_keep(m) is not None and "tl.load" in m.fragment.keep


def _forward_spec(kernel: LoweredProgram) -> KernelSpec:
    narrow = loads_per_score(kernel) or masked_head(kernel.masks) or listing_loads(kernel)
    wide = FP8_TILES if is_fp8(kernel) else FORWARD_TILES
    tiles = (NARROW_TILES if narrow else wide)[kernel.config.head_dim]
    name = f"attnfuse_tfwd_{kernel.signature[:12]}"
    parameters = forward_params(kernel)
    return KernelSpec(
        kind="forward",
        name=name,
        tiles=TileConfig(block_m=2 * pipeline.ROWS.value, block_n=tiles.block_n, num_stages=tiles.stages),
        launch=LaunchSpec(name, parameters, {"BLOCK_N": tiles.block_n, "STAGES": tiles.stages}, tiles=()),
        generate=lambda name, _: generate_forward(kernel, name, pipeline.CONSUMER_REGISTERS, pipeline.LOADER_REGISTERS),
        origins={inst.prefix: inst.apply.record.distribution for inst in kernel.instances()},
    )


def _dkdv_spec(kernel: LoweredProgram) -> KernelSpec:
    tiles = DKDV_TILES[kernel.config.head_dim]
    name = f"attnfuse_tdkdv_{kernel.signature[:12]}"
    rows = pipeline.ROWS.value
    return KernelSpec(
        kind="dkdv",
        name=name,
        tiles=TileConfig(block_m=rows, block_n=2 * rows, num_stages=tiles.stages),
        launch=LaunchSpec(name, dkdv_params(kernel), {"STAGES": tiles.stages}, tiles=()),
        generate=lambda name, _: generate_dkdv(kernel, name, pipeline.CONSUMER_REGISTERS, pipeline.LOADER_REGISTERS),
        origins={inst.prefix: inst.apply.record.distribution for inst in kernel.instances()},
    )


def _dq_spec(kernel: LoweredProgram) -> KernelSpec:
    narrow = listing_loads(kernel) or (kernel.config.dropout and bool(kernel.mods))
    tiles = (DQ_NARROW_TILES if narrow else DQ_TILES)[kernel.config.head_dim]
    name = f"attnfuse_tdq_{kernel.signature[:12]}"
    constants = {"BLOCK_N": tiles.block_n, "STAGES": tiles.stages}
    return KernelSpec(
        kind="dq",
        name=name,
        tiles=TileConfig(block_m=2 * pipeline.ROWS.value, block_n=tiles.block_n, num_stages=tiles.stages),
        launch=LaunchSpec(name, dq_params(kernel), constants, tiles=()),
        generate=lambda name, _: generate_dq(kernel, name, pipeline.CONSUMER_REGISTERS, pipeline.LOADER_REGISTERS),
        origins={inst.prefix: inst.apply.record.distribution for inst in kernel.instances()},
    )


# What launches an instance (host code): its change changes every instance
_LAUNCHED_BY = (
    "attnfuse.kernels.launch",
    "attnfuse.kernels.descriptors",
    "attnfuse.runtime.hopper",
    "attnfuse.runtime.template_rows",
)
_LAUNCHED_BY_KIND = {"dq": ("attnfuse.kernels.dq_launch",)}  # and what launches one kind's instances alone
# and, besides, what launches the instance of a packed call (its parameters hold the document offsets, CuQ), and
# a float8 call's (they hold its descales)
_PACKED_LAUNCH = "attnfuse.kernels.launch_packed"
_FP8_LAUNCH = "attnfuse.kernels.launch_fp8"
_PACKED_FP8_LAUNCH = "attnfuse.kernels.launch_fp8_packed"  # and a packed float8 call's, its copy of V by document
_IMPORTS = re.compile(r"^from (attnfuse(?:\.\w+)*) import", re.M)


@functools.lru_cache(maxsize=None)
def _module_source(module: str) -> str:
    return Path(importlib.import_module(module).__file__).read_text()


def _library(spec: KernelSpec) -> str:
    """The source of the AttnFuse modules the instance's source imports and of those that launch it (an instance of its
    kind; a packed call's; a float8 call's; a packed float8 call's): a change to them changes the instance, and a
    module it does not import (a new template's) does not."""
    imported = sorted(set(_IMPORTS.findall(spec.source)))
    names = {p.name for p in spec.launch.params}
    packed = (_PACKED_LAUNCH,) if "CuQ" in names else ()
    fp8 = (_FP8_LAUNCH,) if "QDescale" in names else ()
    packed_fp8 = (_PACKED_FP8_LAUNCH,) if packed and fp8 else ()
    launched = (*_LAUNCHED_BY, *_LAUNCHED_BY_KIND.get(spec.kind, ()), *packed, *fp8, *packed_fp8)
    return "".join(_module_source(m) for m in (*imported, *launched))


def instance_digest(spec: KernelSpec) -> str:
    """What identifies a template instance's code: a hash of its canonical source (``canonical.py``: no names,
    docstrings or unread parameters, so programs that get the same kernel share it), the constants and tiles it
    is launched with, and the library it imports and is launched by (``_library``)."""
    launched = f"{sorted(spec.launch.constants.items())!r}{spec.tiles!r}"
    text = canonical_source(spec.source) + launched + _library(spec)
    return hashlib.sha256(text.encode()).hexdigest()[:24]
