"""``compile(graph, config) -> Plan``: the compiler's one entry point (fuse -> lower, which picks the tiles -> plan).

Each kernel's spec holds its name (``attnfuse_<kind>_<first 12 hex digits of the signature>``), its tiles, its
launch spec (the ordered parameters that also write its ``def`` line, and its constexpr values), the
scheduling facts the runtime's grid needs, and its source, generated on first use. The plan's other facts
are read off the lowered program here, so that the runtime never reads fragments.
"""

from __future__ import annotations

import functools
from typing import Callable

from .. import ir
from ..launch_spec import STRIDE, LaunchSpec, Param
from ..plan import KERNEL_KINDS, InputGradient, KernelConfig, KernelSpec, MaskRange, Plan, PluginCall
from .codegen.dropout import mask_kernel_source
from .codegen import (
    constants,
    decode_params,
    dkdv_params,
    dq_params,
    forward_params,
    generate_decode,
    generate_dkdv,
    generate_dq,
    generate_forward,
    generate_pass,
    grad_buffer,
    pass_params,
    scheduled,
    split,
    split_heads,
)
from .fuse import fuse
from ..kernels.instance import template_plan
from .lower import Instance, LoweredProgram, lower


def lowered(graph: ir.MatMulPV, config: KernelConfig) -> LoweredProgram:
    """fuse -> lower (tiles included): the flat record codegen writes ``graph``'s kernels for ``config`` from."""
    return lower(fuse(graph), config, listing=ir.render(graph))


def compile(graph: ir.MatMulPV, config: KernelConfig) -> Plan:  # noqa: A001 (the compiler's one verb)
    """The plan of ``graph`` for ``config``: every kernel's spec (sources on first use) and the facts a call
    needs."""
    program = lowered(graph, config)
    listing = next((m.fragment.block_list for m in program.masks if m.fragment.block_list is not None), None)
    return Plan(
        graph=graph,
        config=config,
        signature=program.signature,
        listing=program.listing,
        has_lse=program.normaliser.fragment.has_lse,
        combine=program.normaliser.fragment.combine,
        partial=program.normaliser.apply.fragment().partial is not None,
        refuses_offsets=next(
            (
                inst.apply.combinator
                for inst in program.instances()
                if inst.apply.declaration.prepare is not None and not inst.apply.declaration.takes_offsets
            ),
            None,
        ),
        refuses_fp8=next((t.apply.combinator for t in program.transforms if not t.apply.declaration.runs_on_fp8), None),
        missing_backward=_missing_backward(program),
        plugin_calls=tuple(
            PluginCall(prefix=inst.prefix, apply=inst.apply) for inst in program.instances() if inst.args
        ),
        plugin_args=tuple(p.name for p in program.args() if p.kind != STRIDE),
        block_limit=listing and listing.size,
        heavy_split=(listing and listing.q_split) or None,
        input_gradients=_input_gradients(program),
        mask_ranges=tuple(
            MaskRange(combinator=m.apply.combinator, lo=m.fragment.kv_range.lo, hi=m.fragment.kv_range.hi)
            for m in program.masks
            if m.fragment.kv_range is not None
        ),
        kernels=_kernels(program),
        templates=template_plan(program),
        dq_for=functools.partial(_dq, program),
    )


def dropout_mask_source(name: str) -> str:
    """The source of kernel ``name``, which writes the keep mask of a call with attention dropout from its state
    (``runtime.dropout.dropout_keep``), with the generated kernels' own Philox stream."""
    return mask_kernel_source(name)


def _kernels(program: LoweredProgram) -> dict[str, KernelSpec]:
    """The spec of each kernel of the program, by kind (the dQ kernel writing no tensor gradient)."""
    kernels = {
        "forward": _spec(
            program,
            "forward",
            forward_params(program),
            functools.partial(generate_forward, program),
            scheduled=scheduled(program),
        ),
        "decode": _spec(program, "decode", decode_params(program), functools.partial(generate_decode, program)),
        "dkdv": _spec(
            program,
            "dkdv",
            dkdv_params(program),
            functools.partial(generate_dkdv, program),
            scheduled=scheduled(program, transposed=True),
            split_heads=split_heads(program) is not None,
        ),
        "dq": _dq(program, ()),
    }
    if _hoistable(program):
        kernels.update(transform=_pass(program, False), gradient=_pass(program, True))
    return kernels


def _missing_backward(program: LoweredProgram) -> str | None:
    """The first combinator of the program that declares no backward, as a phrase, or None."""
    for t in program.transforms:
        if not t.fragment.differentiable():
            return f"the qk transform {t.apply.combinator}"
    for m in program.mods:
        if m.fragment.grad is None:
            return f"the score modification {m.apply.combinator}"
    if program.normaliser.fragment.grad is None:
        return f"the normaliser {program.normaliser.apply.combinator}"
    return None


def _input_gradients(program: LoweredProgram) -> tuple[InputGradient, ...]:
    """Every (runtime argument, combinator parameter) pair of the program, each with its application's
    prefix where that application is a score modification declaring the parameter's gradient."""
    writes = {(m.prefix, name) for m in program.mods for name, _ in m.fragment.tensor_grads}
    return tuple(
        InputGradient(
            argument=sym.name,
            combinator=inst.apply.combinator,
            param=param,
            prefix=inst.prefix if (inst.prefix, param) in writes else None,
        )
        for inst in program.instances()
        for param, sym in inst.apply.inputs().items()
    )


def _instances(program: LoweredProgram, gradients: tuple[InputGradient, ...]) -> tuple[tuple[Instance, str], ...]:
    """The (modification instance, parameter) pairs writing ``gradients``."""
    by_prefix = {m.prefix: m for m in program.mods}
    return tuple((by_prefix[g.prefix], g.param) for g in gradients)


def _dq(program: LoweredProgram, gradients: tuple[InputGradient, ...]) -> KernelSpec:
    tensor_grads = _instances(program, gradients)
    return _spec(
        program,
        "dq",
        dq_params(program, tensor_grads),
        lambda name, parameters: generate_dq(program, name, parameters, tensor_grads),
        scheduled=scheduled(program),
        grad_buffers=tuple(grad_buffer(inst, name) for inst, name in tensor_grads),
    )


def _spec(
    program: LoweredProgram, kind: str, parameters: tuple[Param, ...], generate: Callable, tiles_of: str = "", **facts
) -> KernelSpec:
    """The spec of one kernel; its tiles are those of kernel ``tiles_of`` (its own kind by default)."""
    name = f"attnfuse_{KERNEL_KINDS[kind]}_{program.signature[:12]}"
    return KernelSpec(
        kind=kind,
        name=name,
        tiles=program.tiles[tiles_of or kind],
        launch=LaunchSpec(name, parameters, constants(program)),
        generate=generate,
        origins={inst.prefix: inst.apply.record.distribution for inst in program.instances()},
        halves=split(program),
        **facts,
    )


def hoisted_sides(program: LoweredProgram) -> tuple[str, ...]:
    """The sides ("q", "k") whose transforms a pass applies: those some transform touches."""
    return tuple(x for x in "qk" if any(getattr(t.fragment, x) for t in program.transforms))


def _hoistable(program: LoweredProgram) -> bool:
    """Whether a program's keys have transforms a pass can apply (contiguous keys, one length for all)."""
    c = program.config
    return any(t.fragment.k for t in program.transforms) and not (c.kv_lens or c.paged or c.k_transformed)


def _pass(program: LoweredProgram, gradient: bool) -> KernelSpec:
    sides = hoisted_sides(program)
    return _spec(
        program,
        "gradient" if gradient else "transform",
        pass_params(program, sides, gradient),
        lambda name, parameters: generate_pass(program, name, parameters, sides, gradient),
        tiles_of="forward",
        sides=sides,
    )
