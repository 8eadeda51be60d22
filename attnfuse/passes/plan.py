"""The compiler's result: one ``Plan`` per (graph, configuration), with a ``KernelSpec`` for every kernel a
call may launch.

A spec holds its kernel's name (``attnfuse_<kind>_<first 12 hex digits of the signature>``), its tiles, its
launch spec (the ordered parameters that also write its ``def`` line, and its constexpr values), the
scheduling facts the runtime's grid needs, and its source, generated on first use. The runtime binds
arguments by name and never reads codegen.
"""
from __future__ import annotations

import functools
from typing import Callable

import attrs
from attrs import field, frozen

from .. import ir
from .codegen import (constants, decode_params, dkdv_params, dq_params, forward_params, generate_decode,
                      generate_dkdv, generate_dq, generate_forward, generate_pass, grad_buffer, pass_params,
                      scheduled, split, split_heads)
from .fuse import fuse
from .hopper import HopperPlan, hopper_plan
from .launch_spec import LaunchSpec, Param
from .lower import Instance, KernelConfig, LoweredProgram, lower
from .tile import TileConfig

NAME_PARTS = {"forward": "fwd", "decode": "decode", "dkdv": "dkdv", "dq": "dq", "transform": "transformpass",
              "gradient": "gradpass"}  # kernel kind -> the part of its name


@frozen(kw_only=True, slots=False, eq=False)
class KernelSpec:
    """One generated kernel: what the runtime needs to load and launch it.

    ``scheduled``: its programs follow a listing mask's block order (grid (heads, slots)). ``split_heads``:
    (dK/dV) it splits heavy key blocks over a GQA group's query heads, and takes PartDKV and SplitCount.
    ``halves``: q and k are handled as two halves of the head dim. ``sides``: (passes) the sides it covers.
    ``grad_buffers``: (dQ) the parameters of the score-shaped gradient buffers it writes, in the order of
    its tensor gradients; each takes its strides as ``<buffer>_s<i>``.
    """

    kind: str
    name: str
    tiles: TileConfig
    launch: LaunchSpec
    generate: Callable[[str, tuple[Param, ...]], str] = field(repr=False)
    scheduled: bool = False
    split_heads: bool = False
    halves: bool = False
    sides: tuple[str, ...] = ()
    grad_buffers: tuple[str, ...] = ()

    @functools.cached_property
    def source(self) -> str:
        """The kernel's Triton source (one undecorated function named ``name``), generated on first use."""
        return self.generate(self.name, self.launch.params)


def hoisted_sides(lowered: LoweredProgram) -> tuple[str, ...]:
    """The sides ("q", "k") whose transforms a pass applies: those some transform touches."""
    return tuple(x for x in "qk" if any(getattr(t.fragment, x) for t in lowered.transforms))


def hoistable(lowered: LoweredProgram) -> bool:
    """Whether a program's keys have transforms a pass can apply (contiguous keys, one length for all)."""
    c = lowered.config
    return any(t.fragment.k for t in lowered.transforms) and not (c.kv_lens or c.paged or c.k_transformed)


@frozen(kw_only=True, slots=False, eq=False)
class Plan:
    """Every kernel of one program for one configuration. ``transform`` and ``gradient`` (the passes of
    hoisted qk transforms) exist when the keys' transforms are ``hoistable``; the kernels a hoisted call
    runs between the passes are those of ``hoisted_config``'s plan. ``hopper``: the Hopper
    templates' constants where they serve the program's forward and dK/dV (``passes/hopper.py``), else
    None."""

    graph: ir.MatMulPV
    lowered: LoweredProgram
    forward: KernelSpec
    decode: KernelSpec
    dkdv: KernelSpec
    transform: KernelSpec | None
    gradient: KernelSpec | None
    hopper: HopperPlan | None = None

    @property
    def config(self) -> KernelConfig:
        return self.lowered.config

    @property
    def hoisted_config(self) -> KernelConfig:
        """The configuration of the kernels that read the passes' transformed copies."""
        sides = self.transform.sides if self.transform is not None else ()
        return attrs.evolve(self.config, **{f"{x}_transformed": x in sides for x in "qk"})

    def dq(self, tensor_grads: tuple[tuple[Instance, str], ...] = ()) -> KernelSpec:
        """The dQ kernel writing the score-shaped gradients of ``tensor_grads`` ((instance, parameter) pairs)."""
        lowered = self.lowered
        return _spec(lowered, "dq", dq_params(lowered, tensor_grads),
                     lambda name, parameters: generate_dq(lowered, name, parameters, tensor_grads),
                     scheduled=scheduled(lowered),
                     grad_buffers=tuple(grad_buffer(inst, name) for inst, name in tensor_grads))


def _spec(lowered: LoweredProgram, kind: str, parameters: tuple[Param, ...], generate: Callable,
          tiles_of: str = "", **facts) -> KernelSpec:
    """The spec of one kernel; its tiles are those of kernel ``tiles_of`` (its own kind by default)."""
    name = f"attnfuse_{NAME_PARTS[kind]}_{lowered.signature[:12]}"
    return KernelSpec(kind=kind, name=name, tiles=lowered.tiles[tiles_of or kind],
                      launch=LaunchSpec(name, parameters, constants(lowered)), generate=generate,
                      halves=split(lowered), **facts)


def _pass(lowered: LoweredProgram, gradient: bool) -> KernelSpec:
    sides = hoisted_sides(lowered)
    return _spec(lowered, "gradient" if gradient else "transform", pass_params(lowered, sides, gradient),
                 lambda name, parameters: generate_pass(lowered, name, parameters, sides, gradient),
                 tiles_of="forward", sides=sides)


def build_plan(graph: ir.MatMulPV, config: KernelConfig) -> Plan:
    """fuse -> lower (+ tile) -> the specs of every kernel of ``graph`` for ``config``."""
    lowered = lower(fuse(graph), config, listing=ir.render(graph))
    return Plan(
        graph=graph, lowered=lowered,
        forward=_spec(lowered, "forward", forward_params(lowered), functools.partial(generate_forward, lowered),
                      scheduled=scheduled(lowered)),
        decode=_spec(lowered, "decode", decode_params(lowered), functools.partial(generate_decode, lowered)),
        dkdv=_spec(lowered, "dkdv", dkdv_params(lowered), functools.partial(generate_dkdv, lowered),
                   scheduled=scheduled(lowered, transposed=True), split_heads=split_heads(lowered) is not None),
        transform=_pass(lowered, False) if hoistable(lowered) else None,
        gradient=_pass(lowered, True) if hoistable(lowered) else None,
        hopper=hopper_plan(lowered))
