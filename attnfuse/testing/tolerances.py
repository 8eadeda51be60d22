"""Per-dtype tolerances, relative to PyTorch's own error in that dtype (as FlagAttention's tests do).

A fused result passes when its largest error against the float64 reference is at most twice the error
of the naive reference evaluated in the input dtype, plus ATOL[dtype] times the output's scale. fp16
and bf16 kernels round P to the input dtype before P·V, as FlashAttention does, hence the floors.
"""
from __future__ import annotations

import torch

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def assert_matches_reference(actual: torch.Tensor, reference64: torch.Tensor, reference_in_dtype: torch.Tensor,
                             dtype: torch.dtype | None = None, what: str = "out", summed: int = 1) -> None:
    """Raise AssertionError unless ``actual`` is as close to the float64 reference as inputs of ``dtype``
    (default: actual's) allow; ``reference_in_dtype`` is the naive evaluator's result in that dtype.

    ``summed``: each element of ``actual`` is a sum of that many rounded terms (the gradient of a tensor
    broadcast over the scores); rounding errors of independent terms grow like its square root, so the
    ATOL floor does too. (FlashAttention's backward computes rowsum(dO∘O) from the rounded output, so
    score gradients of a row do not cancel exactly in low precision, as they do in PyTorch's softmax.)

    The message names the shape and the worst element (its index, both values and the tolerance), never
    whole tensors.
    """
    __tracebackhide__ = True  # pytest: the failure is the message, not this frame's tensors
    if actual.shape != reference64.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != the reference's {tuple(reference64.shape)}")
    actual64 = actual.detach().to(torch.float64).cpu()
    ref = reference64.detach().cpu()
    finite = torch.isfinite(ref)
    where = f"{what}: shape {tuple(actual.shape)} {actual.dtype}"
    same = (torch.isfinite(actual64) == finite) & (finite | (actual64 == ref))  # the same infinities (NaN never)
    if not same.all():
        index = _index(~same)
        raise AssertionError(f"{where}; {int((~same).sum())} element(s) differ from the reference in being "
                             f"non-finite, first at index {index}: actual {actual64[index].item():.6g}, "
                             f"expected {ref[index].item():.6g}")
    if not finite.any():
        return
    errors = torch.where(finite, (actual64 - ref).abs(), 0.0)
    torch_err = torch.where(finite, (reference_in_dtype.detach().to(torch.float64).cpu() - ref).abs(), 0.0).max()
    scale = max(1.0, ref[finite].abs().max().item())
    bound = 2 * torch_err.item() + ATOL[dtype or actual.dtype] * scale * summed ** 0.5
    if not errors.max().item() <= bound:  # a NaN bound (the naive evaluator's NaN) fails too
        index = _index(errors == errors.max())
        raise AssertionError(
            f"{where}; {int((~(errors <= bound)).sum())} element(s) beyond the tolerance, the worst at index {index}: "
            f"actual {actual64[index].item():.6g}, expected {ref[index].item():.6g} (float64 reference), error "
            f"{errors[index].item():.3g} > tolerance {bound:.3g} (2 x torch's own {dtype or actual.dtype} error "
            f"{torch_err.item():.3g} + {ATOL[dtype or actual.dtype]:g} x scale {scale:.3g}"
            f"{f' x sqrt({summed})' if summed != 1 else ''})")


def _index(where: torch.Tensor) -> tuple[int, ...]:
    """The first index at which the bool tensor ``where`` holds."""
    return tuple(where.nonzero()[0].tolist())
