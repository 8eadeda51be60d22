"""Per-dtype tolerances, relative to PyTorch's own error in that dtype (as FlagAttention's tests do).

A fused result passes when its error against the float64 reference is, at every element, at most twice the
error of the naive reference evaluated in the input dtype, plus ATOL[dtype] times the output's scale, plus
what the caller derives for rounding the fused computation does and the naive one does not (the gradients'
delta term: ``grad_bounds``). fp16 and bf16 kernels round P to the input dtype before P·V, as FlashAttention
does, hence the floors. A naive result that overflows where float64 does not is a failure, never an
infinite tolerance.
"""

from __future__ import annotations

import torch

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def assert_matches_reference(
    actual: torch.Tensor,
    reference64: torch.Tensor,
    reference_in_dtype: torch.Tensor,
    dtype: torch.dtype | None = None,
    what: str = "out",
    summed: int = 1,
    rounding: torch.Tensor | None = None,
) -> None:
    """Raise AssertionError unless ``actual`` is as close to the float64 reference as inputs of ``dtype``
    (default: actual's) allow; ``reference_in_dtype`` is the naive evaluator's result in that dtype.

    ``summed``: each element of ``actual`` is a sum of that many rounded terms (the gradient of a tensor
    broadcast over the scores); rounding errors of independent terms grow like its square root, so the
    ATOL floor does too. ``rounding``: a bound, per element (broadcastable to ``actual``), on the error that
    the fused computation makes and the naive evaluator does not, derived by the caller from the magnitudes
    involved (``attnfuse.testing.grad_bounds``); it is added to the tolerance.

    The tolerance is always finite: where the float64 reference is finite and the naive evaluator's result in
    ``dtype`` is not (it overflowed), that is a failure of its own, reported as such. The message names the
    shape and the worst element (its index, both values and the tolerance), never whole tensors.
    """
    __tracebackhide__ = True  # pytest: the failure is the message, not this frame's tensors
    if actual.shape != reference64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != the reference's {tuple(reference64.shape)}")
    dtype = dtype or actual.dtype
    actual64 = actual.detach().to(torch.float64).cpu()
    ref = reference64.detach().cpu()
    finite = torch.isfinite(ref)
    where = f"{what}: shape {tuple(actual.shape)} {actual.dtype}"
    same = (torch.isfinite(actual64) == finite) & (finite | (actual64 == ref))  # the same infinities (NaN never)
    if not same.all():
        index = _index(~same)
        raise AssertionError(
            f"{where}; {int((~same).sum())} element(s) differ from the reference in being "
            f"non-finite, first at index {index}: actual {actual64[index].item():.6g}, "
            f"expected {ref[index].item():.6g}"
        )
    if not finite.any():
        return
    naive = reference_in_dtype.detach().to(torch.float64).cpu()
    overflowed = finite & ~torch.isfinite(naive)
    if overflowed.any():
        index = _index(overflowed)
        raise AssertionError(
            f"{where}; the naive reference evaluated in {dtype} is non-finite at {int(overflowed.sum())} "
            f"element(s) where the float64 reference is finite, first at index {index}: {naive[index].item():.6g} "
            f"in {dtype}, {ref[index].item():.6g} in float64. These inputs overflow {dtype} in the unfused "
            f"computation, so no tolerance relative to its error exists: check them in a wider dtype"
        )
    errors = torch.where(finite, (actual64 - ref).abs(), 0.0)
    torch_err = torch.where(finite, (naive - ref).abs(), 0.0).max().item()
    scale = max(1.0, ref[finite].abs().max().item())
    floor = 2 * torch_err + ATOL[dtype] * scale * summed**0.5
    derived = torch.zeros_like(ref) if rounding is None else rounding.detach().to(torch.float64).cpu().expand_as(ref)
    if not bool(torch.isfinite(torch.where(finite, derived, 0.0)).all()) or bool((derived < 0).any()):
        raise ValueError(f"{what}: the rounding bound must be finite and >= 0 wherever the reference is finite")
    bound = floor + derived
    if not bool((errors <= bound).all()):
        beyond = ~(errors <= bound)
        index = _index(errors - bound == (errors - bound).max())
        derived_text = f" + derived rounding bound {derived[index].item():.3g}" if rounding is not None else ""
        raise AssertionError(
            f"{where}; {int(beyond.sum())} element(s) beyond the tolerance, the worst at index {index}: "
            f"actual {actual64[index].item():.6g}, expected {ref[index].item():.6g} (float64 reference), error "
            f"{errors[index].item():.3g} > tolerance {bound[index].item():.3g} "
            f"(2 x torch's own {dtype} error {torch_err:.3g} + {ATOL[dtype]:g} x scale {scale:.3g}"
            f"{f' x sqrt({summed})' if summed != 1 else ''}{derived_text})"
        )


def _index(where: torch.Tensor) -> tuple[int, ...]:
    """The first index at which the bool tensor ``where`` holds."""
    return tuple(where.nonzero()[0].tolist())
