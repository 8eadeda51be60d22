"""The rounding error of FlashAttention's backward that the naive evaluator does not make, bounded per element.

A normaliser with ``needs_delta`` (softmax and its kin) differentiates as ds = p·(dp − delta), and the fused
backward takes delta_i = Σ_d dO_id·O_id from the output O as stored, rounded to the input dtype (FlashAttention-2),
while dp_ij = dO_i·v_j comes from v itself. In exact arithmetic delta_i = Σ_j p_ij·dp_ij and the terms cancel
(in a row that keeps one key, ds is 0); rounded, delta_i is off by up to

    eps_i = u · Σ_d |dO_id| · (|O_id| + (p|V|)_id)

(u the dtype's unit roundoff: O's own rounding, and P's rounding before P·V in the forward). PyTorch's softmax
backward uses its output's p itself, so its error has no such term. An error e_i in delta_i changes ds_ij by
−e_i·p_ij = −e_i·∂lse_i/∂s_ij, so it reaches every leaf x as −Σ_i e_i·∂lse_i/∂x: a vector-Jacobian product of
the float64 reference's lse. The bound is that product with weights eps_i (all rows erring the same way) and
with eps_i of random signs (rows erring independently, for leaves such as k that sum rows of both signs),
the larger of the two, doubled as the naive evaluator's own error is.
"""

from __future__ import annotations

import torch


def delta_rounding(
    lse64: torch.Tensor,
    out64: torch.Tensor,
    abs_weighted_v64: torch.Tensor,
    dout: torch.Tensor,
    leaves: list[torch.Tensor],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Per-leaf bounds (each of its leaf's shape, float64) on the gradient error that rounding delta makes.

    lse64 (B, Hq, Nq): the float64 reference's lse, in the autograd graph of ``leaves``; out64 (B, Hq, Nq, DV):
    its output; abs_weighted_v64 (B, Hq, Nq, DV): the float64 reference's output for |v| (p|V|); dout: the
    output's gradient (B, Hq, Nq, DV). The graph is kept for the caller's own backward.
    """
    unit = torch.finfo(dtype).eps / 2
    magnitude = (dout.detach().to(torch.float64).abs() * (out64.detach().abs() + abs_weighted_v64.detach())).sum(-1)
    eps = unit * torch.nan_to_num(magnitude.cpu(), nan=0.0, posinf=0.0).to(lse64.device)
    signs = torch.randint(0, 2, eps.shape, generator=torch.Generator().manual_seed(0)).to(eps) * 2 - 1
    bounds = [torch.zeros(leaf.shape, dtype=torch.float64) for leaf in leaves]
    for weights in (eps, eps * signs):
        grads = torch.autograd.grad(
            lse64, leaves, torch.where(torch.isfinite(lse64), weights, 0.0), retain_graph=True, allow_unused=True
        )
        for i, g in enumerate(grads):
            if g is not None:
                bounds[i] = torch.maximum(bounds[i], g.detach().abs().cpu().to(torch.float64))
    return [2 * torch.nan_to_num(b, nan=0.0, posinf=0.0) for b in bounds]
