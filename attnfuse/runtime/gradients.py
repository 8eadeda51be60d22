"""Which gradients a differentiable call computes, checked the same way for eager calls and the op."""

from __future__ import annotations

from typing import Any, Collection

from ..errors import InputError, ProgramError, UnsupportedError
from ..plan import InputGradient, Plan


def check_differentiable(plan: Plan) -> None:
    """Raise unless every combinator of the program declares its backward."""
    if plan.missing_backward is not None:
        raise ProgramError(
            f"gradients were asked for, but {plan.missing_backward} declares no backward; compute "
            f"under torch.no_grad(), or give the combinator its backward fragment"
        )


def tensor_grads(
    plan: Plan, inputs: dict[str, Any], wanted: Collection[str], scores: tuple[int, int, int, int], head_dim: int
) -> tuple[InputGradient, ...]:
    """The gradients the backward kernels write for the runtime inputs named in ``wanted`` (argument names of
    ``inputs``). An InputError, before anything runs, for a wanted input whose combinator declares no
    gradient for it; whose shape does not broadcast to the scores ``scores`` (B, Hq, Nq, Nk) by torch's
    rules (a score modification's: the kernels write its gradient score by score, summed to its shape); or,
    a qk transform's, that is not a (``head_dim``,) tensor of the head dim's columns."""
    found = tuple(g for g in plan.input_gradients if g.prefix is not None and g.argument in wanted)
    covered = {g.argument for g in found}
    for g in plan.input_gradients:
        if g.argument in wanted and g.argument not in covered:
            raise InputError(
                f"{g.combinator}: its input {g.param!r} (argument {g.argument!r}) requires grad, but "
                f"{g.combinator} declares no gradient for it; pass it detached"
            )
    for g in found:
        shape = tuple(inputs[g.argument].shape)
        if g.sides:
            _check_columns(g, shape, head_dim)
        elif not _broadcasts(shape, scores):
            raise InputError(
                f"{g.combinator}: its input {g.param!r} (argument {g.argument!r}) requires grad and has shape "
                f"{shape}, which does not broadcast to the scores (B, Hq, Nq, Nk) = {scores}; its gradient is "
                f"summed over the dims it broadcasts along, so it must have at most 4 dims, each 1 or the scores' "
                f"size, aligned from the right (torch's rules): per head, (Hq, 1, 1); or pass it detached"
            )
    return found


def _check_columns(g: InputGradient, shape: tuple[int, ...], head_dim: int) -> None:
    """InputError unless a qk transform's tensor that requires grad has shape (D,)."""
    if shape != (head_dim,):
        raise InputError(
            f"{g.combinator}: its input {g.param!r} (argument {g.argument!r}) requires grad and has shape "
            f"{shape}; a qk transform's tensor gets its gradient as one value per column of the head dim, so it "
            f"must have shape (D,) = ({head_dim},); or pass it detached"
        )


def _broadcasts(shape: tuple[int, ...], scores: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``scores`` by torch's rules (no dims added on its left)."""
    return len(shape) <= len(scores) and all(n in (1, m) for n, m in zip(reversed(shape), reversed(scores)))


def no_double_backward() -> UnsupportedError:
    """The error of differentiating a program call's gradient again (eager calls and the op alike)."""
    return UnsupportedError(
        "double backward through an attnfuse program is not supported: a gradient taken with create_graph=True "
        "(a gradient penalty, a Hessian-vector product) was differentiated again, and the fused backward kernels "
        "have no derivative of their own. Use the gradient without differentiating it (first order works under "
        "create_graph=True), or differentiate program.reference(...), the plain PyTorch composition, twice"
    )
