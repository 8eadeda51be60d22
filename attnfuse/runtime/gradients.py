"""Which gradients a differentiable call computes, checked the same way for eager calls and the op."""
from __future__ import annotations

from typing import Any, Collection

from ..errors import InputError, ProgramError, UnsupportedError
from ..passes.lower import Instance, LoweredProgram


def _no_backward(what: str) -> ProgramError:
    return ProgramError(f"gradients were asked for, but {what} declares no backward; compute under "
                        f"torch.no_grad(), or give the combinator its backward fragment")


def check_differentiable(lowered: LoweredProgram) -> None:
    """Raise unless every combinator of the program declares its backward."""
    for t in lowered.transforms:
        if not t.fragment.differentiable():
            raise _no_backward(f"the qk transform {t.apply.combinator}")
    for m in lowered.mods:
        if m.fragment.grad is None:
            raise _no_backward(f"the score modification {m.apply.combinator}")
    if lowered.normaliser.fragment.grad is None:
        raise _no_backward(f"the normaliser {lowered.normaliser.apply.combinator}")


def tensor_grads(lowered: LoweredProgram, inputs: dict[str, Any], wanted: Collection[str],
                 scores: tuple[int, int, int, int]) -> tuple[tuple[Instance, str], ...]:
    """The (modification instance, parameter) pairs that write the gradients of the runtime inputs named in
    ``wanted`` (argument names of ``inputs``). An InputError, before anything runs, for a wanted input whose
    combinator declares no gradient for it, or whose shape does not broadcast to the scores ``scores`` (B, Hq,
    Nq, Nk) by torch's rules: the kernels write its gradient score by score, summed to its shape."""
    found = tuple((m, name) for m in lowered.mods for name, _ in m.fragment.tensor_grads
                  if m.apply.inputs().get(name) is not None and m.apply.inputs()[name].name in wanted)
    covered = {m.apply.inputs()[name].name for m, name in found}
    for inst in lowered.instances():
        for param, sym in inst.apply.inputs().items():
            if sym.name in wanted and sym.name not in covered:
                raise InputError(f"{inst.apply.combinator}: its input {param!r} (argument {sym.name!r}) requires "
                                 f"grad, but {inst.apply.combinator} declares no gradient for it; pass it detached")
    for inst, param in found:
        arg = inst.apply.inputs()[param].name
        shape = tuple(inputs[arg].shape)
        if not _broadcasts(shape, scores):
            raise InputError(
                f"{inst.apply.combinator}: its input {param!r} (argument {arg!r}) requires grad and has shape "
                f"{shape}, which does not broadcast to the scores (B, Hq, Nq, Nk) = {scores}; its gradient is "
                f"summed over the dims it broadcasts along, so it must have at most 4 dims, each 1 or the scores' "
                f"size, aligned from the right (torch's rules): per head, (Hq, 1, 1); or pass it detached")
    return found


def _broadcasts(shape: tuple[int, ...], scores: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``scores`` by torch's rules (no dims added on its left)."""
    return len(shape) <= len(scores) and all(n in (1, m) for n, m in zip(reversed(shape), reversed(scores)))


def no_double_backward() -> UnsupportedError:
    """The error of differentiating a program call's gradient again (eager calls and the op alike)."""
    return UnsupportedError(
        "double backward through an attnfuse program is not supported: a gradient taken with create_graph=True "
        "(a gradient penalty, a Hessian-vector product) was differentiated again, and the fused backward kernels "
        "have no derivative of their own. Use the gradient without differentiating it (first order works under "
        "create_graph=True), or differentiate program.reference(...), the plain PyTorch composition, twice")
