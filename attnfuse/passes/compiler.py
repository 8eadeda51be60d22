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
    partial_buffer,
    partial_grads,
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
        with_tensor_grads=functools.partial(_with_partials, program),
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


def _transform_sides(program: LoweredProgram) -> dict[tuple[str, str], tuple[str, ...]]:
    """(transform prefix, tensor) -> the sides whose rows give that tensor's gradient (the sides the
    transform touches and declares it in ``q_tensor_grads``/``k_tensor_grads``)."""
    sides: dict[tuple[str, str], tuple[str, ...]] = {}
    for t in program.transforms:
        for x in "qk":
            if getattr(t.fragment, x):
                for name, _ in getattr(t.fragment, f"{x}_tensor_grads"):
                    sides[t.prefix, name] = (*sides.get((t.prefix, name), ()), x)
    return sides


def _input_gradients(program: LoweredProgram) -> tuple[InputGradient, ...]:
    """Every (runtime argument, combinator parameter) pair of the program, each with its application's
    prefix where that application declares the parameter's gradient: a score modification (score-shaped), or
    a qk transform (from its rows, with the sides that give it)."""
    writes = {(m.prefix, name) for m in program.mods for name, _ in m.fragment.tensor_grads}
    rows = _transform_sides(program)
    return tuple(
        InputGradient(
            argument=sym.name,
            combinator=inst.apply.combinator,
            param=param,
            prefix=inst.prefix if (inst.prefix, param) in writes or (inst.prefix, param) in rows else None,
            sides=rows.get((inst.prefix, param), ()),
        )
        for inst in program.instances()
        for param, sym in inst.apply.inputs().items()
    )


def _instances(program: LoweredProgram, gradients: tuple[InputGradient, ...]) -> tuple[tuple[Instance, str], ...]:
    """The (modification instance, parameter) pairs writing the score-shaped ones of ``gradients``."""
    by_prefix = {m.prefix: m for m in program.mods}
    return tuple((by_prefix[g.prefix], g.param) for g in gradients if not g.sides)


def _partials(
    program: LoweredProgram, gradients: tuple[InputGradient, ...], sides: str
) -> tuple[tuple[Instance, InputGradient], ...]:
    """(transform, gradient) of each qk transform tensor gradient of ``gradients`` that the rows of ``sides``
    give, in their order; none of a side that the program's kernels read transformed (a pass gives those)."""
    by_prefix = {t.prefix: t for t in program.transforms}
    sides = "".join(x for x in sides if not getattr(program.config, f"{x}_transformed"))
    return tuple((by_prefix[g.prefix], g) for g in gradients if set(g.sides) & set(sides))


def _partial_facts(partials: tuple[tuple[Instance, InputGradient], ...]) -> dict:
    """The codegen argument (``wanted``: (prefix, tensor) pairs) and the spec fact (``partial_buffers``:
    (buffer parameter, runtime argument) pairs) of a kernel writing ``partials``."""
    return {
        "wanted": {(t.prefix, g.param) for t, g in partials},
        "partial_buffers": tuple((partial_buffer(t, g.param), g.argument) for t, g in partials),
    }


def _dq(program: LoweredProgram, gradients: tuple[InputGradient, ...]) -> KernelSpec:
    tensor_grads = _instances(program, gradients)
    facts = _partial_facts(_partials(program, gradients, "q"))
    partials = partial_grads(program, "q", facts.pop("wanted"))
    return _spec(
        program,
        "dq",
        dq_params(program, tensor_grads, partials),
        lambda name, parameters: generate_dq(program, name, parameters, tensor_grads, partials),
        scheduled=scheduled(program),
        grad_buffers=tuple(grad_buffer(inst, name) for inst, name in tensor_grads),
        **facts,
    )


def _with_partials(program: LoweredProgram, kind: str, gradients: tuple[InputGradient, ...]) -> KernelSpec:
    """The dK/dV kernel or the gradient pass (``kind``), also writing the partial sums of the qk transforms'
    tensor gradients among ``gradients`` that its sides' rows give."""
    if kind != "dkdv":
        return _pass(program, True, gradients)
    facts = _partial_facts(_partials(program, gradients, "k"))
    partials = partial_grads(program, "k", facts.pop("wanted"))
    return _spec(
        program,
        "dkdv",
        dkdv_params(program, partials),
        lambda name, parameters: generate_dkdv(program, name, parameters, partials),
        scheduled=scheduled(program, transposed=True),
        split_heads=split_heads(program) is not None,
        **facts,
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


def _pass(program: LoweredProgram, gradient: bool, gradients: tuple[InputGradient, ...] = ()) -> KernelSpec:
    """The transform pass, or (``gradient``) the gradient pass, writing the partial sums of the qk
    transforms' tensor gradients among ``gradients``."""
    sides = hoisted_sides(program)
    facts = _partial_facts(_partials(program, gradients, "".join(sides)))
    wanted = facts.pop("wanted")
    return _spec(
        program,
        "gradient" if gradient else "transform",
        pass_params(program, sides, gradient, wanted),
        lambda name, parameters: generate_pass(program, name, parameters, sides, gradient, wanted),
        tiles_of="forward",
        sides=sides,
        **facts,
    )
