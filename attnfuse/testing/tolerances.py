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
    """
    assert actual.shape == reference64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(reference64.shape)}"
    actual64 = actual.detach().to(torch.float64).cpu()
    ref = reference64.detach().cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(actual64), finite), f"{what}: non-finite values differ from the reference"
    assert torch.equal(actual64[~finite], ref[~finite]), f"{what}: infinities differ from the reference"
    if not finite.any():
        return
    err = (actual64 - ref)[finite].abs().max().item()
    torch_err = (reference_in_dtype.detach().to(torch.float64).cpu() - ref)[finite].abs().max().item()
    scale = max(1.0, ref[finite].abs().max().item())
    bound = 2 * torch_err + ATOL[dtype or actual.dtype] * scale * summed ** 0.5
    assert err <= bound, (f"{what}: max error {err:.3g} > bound {bound:.3g} "
                          f"(torch's own {dtype or actual.dtype} error {torch_err:.3g}, scale {scale:.3g})")
