"""qk_norm(q, k, weight_q=None, weight_k=None, eps=1e-6): RMSNorm of every head's q and k rows over the
head dim, a qk transform (Qwen3's and Gemma 3's q_norm/k_norm, before RoPE).

x̂ = x / sqrt(mean(x², over D) + eps) · weight, in float32 (float64 for float64 inputs), per row of q
(B, Hq, Nq, D) and of k (B, Hkv, Nk, D). ``weight_q``/``weight_k``: (D,) float tensors, or None for no
weight (all ones). Gemma 3 scales by (1 + weight): pass ``1 + weight``. Compose it before the score source,
``af.rope(*af.qk_norm(q, k, wq, wk), cos=cos, sin=sin)``: the norm runs first, then the rotation.

Gradients flow to q and k (the RMSNorm vector-Jacobian product, per row) and to a weight that requires grad:
dweight[d] = Σ g[row, d] · x[row, d] / rms(row) over every batch, head and row of its side (g: the gradient
with respect to the norm's output), summed per program by the kernels that carry dQ and dK back, in the
weight's dtype.
"""

from __future__ import annotations

import torch

from attnfuse.plugin import (
    Combinator,
    InputError,
    Param,
    QKTransformFragment,
    Role,
    TensorArg,
    device_cached,
    hookimpl,
    positive_number,
)

_WEIGHTS = ("weight_q", "weight_k")


def _check_weight(name: str, weight, ctx) -> None:
    """InputError unless ``weight`` is None or a (D,) float tensor on the inputs' device."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = getattr(weight, "dtype", type(weight).__name__)
        raise InputError(f"qk_norm: {name} must be a float tensor of shape (D,) = ({ctx.D},) or None, got {got}")
    if tuple(weight.shape) != (ctx.D,):
        raise InputError(f"qk_norm: {name} must have shape (D,) = ({ctx.D},), got {tuple(weight.shape)}")
    if weight.device != ctx.device:
        raise InputError(f"qk_norm: {name} is on {weight.device}, the inputs on {ctx.device}")


def _rms_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """x (..., D) / sqrt(mean(x², -1) + eps) · weight (D,) (or 1)."""
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight.to(x.dtype)


def reference(q, k, ctx, weight_q, weight_k, eps):
    """q (B, Hq, Nq, D), k (B, Hq, Nk, D) -> each row RMS-normalised and scaled by its side's weight."""
    for name, weight in zip(_WEIGHTS, (weight_q, weight_k)):
        _check_weight(name, weight, ctx)
    return _rms_norm(q, weight_q, eps), _rms_norm(k, weight_k, eps)


def prepare(ctx, weight_q, weight_k, eps):
    """The weights as given; an absent one is a (D,) placeholder the fragment never reads."""
    for name, weight in zip(_WEIGHTS, (weight_q, weight_k)):
        _check_weight(name, weight, ctx)
    unused = device_cached(("qk_norm", "unused", ctx.D), lambda: torch.ones(ctx.D, device=ctx.device), ctx.device)
    return {"weight_q": unused if weight_q is None else weight_q, "weight_k": unused if weight_k is None else weight_k}


def examples(draw, shape):
    from hypothesis import strategies as st

    from attnfuse.plugin import random_tensor

    return {
        "weight_q": random_tensor(draw, shape.D) * 0.5 + 1 if draw(st.booleans()) else None,
        "weight_k": random_tensor(draw, shape.D) * 0.5 + 1 if draw(st.booleans()) else None,
        "eps": draw(st.sampled_from([1e-6, 1e-2])),
    }


def _inverse_rms(eps: float) -> str:
    """``${tmp}_r`` (rows, 1): 1 / sqrt(mean(x², over D) + eps) of the input halves ``$x1``, ``$x2``."""
    return (
        "${tmp}_r = (1.0 / tl.sqrt((tl.sum($x1 * $x1, 1) + tl.sum($x2 * $x2, 1)) / (2 * HALF)"
        f" + {float(eps)!r}))[:, None]\n"
    )


def _weights(name: str | None) -> str:
    """``${tmp}_w1``, ``${tmp}_w2`` (1, BLOCK_H): the halves of weight ``name``, at the halves' columns
    ``$col1``, ``$col2``; nothing without one."""
    if name is None:
        return ""
    return "".join(
        f"${{tmp}}_w{i} = tl.load(${name} + $col{i} * ${name}_s0, mask=dh < HALF, other=0.0).to($acc_dtype)[None, :]\n"
        for i in (1, 2)
    )


def _side(name: str | None, eps: float) -> tuple[str, str]:
    """(normalise, its vector-Jacobian product) of one side, reading weight ``name`` (None: no weight).

    y = x·r·w with r = (mean(x²) + eps)^-1/2, so dx = r·(g·w) - x·r³·mean((g·w)·x).
    """
    scale = (lambda i: f" * ${{tmp}}_w{i}") if name is not None else (lambda i: "")
    normalise = _inverse_rms(eps) + _weights(name) + "".join(f"$x{i} = $x{i} * ${{tmp}}_r{scale(i)}\n" for i in (1, 2))
    vjp = (
        _inverse_rms(eps)
        + _weights(name)
        + "".join(f"${{tmp}}_gw{i} = $g{i}{scale(i)}\n" for i in (1, 2))
        + "${tmp}_c = ((tl.sum(${tmp}_gw1 * $x1, 1) + tl.sum(${tmp}_gw2 * $x2, 1)) / (2 * HALF))[:, None]"
        " * ${tmp}_r * ${tmp}_r * ${tmp}_r\n"
        + "".join(f"$g{i} = ${{tmp}}_gw{i} * ${{tmp}}_r - $x{i} * ${{tmp}}_c\n" for i in (1, 2))
    )
    return normalise, vjp


def _weight_grad(eps: float) -> str:
    """``$d1``, ``$d2``: each row's share of its weight's gradient, g · x / rms(x) (the normalised row)."""
    return _inverse_rms(eps) + "$d1 = $g1 * $x1 * ${tmp}_r\n$d2 = $g2 * $x2 * ${tmp}_r\n"


def fragment(weight_q, weight_k, eps) -> QKTransformFragment:
    """Normalise each row of the tile's halves; a side with no weight reads none (and has no weight gradient)."""
    given = [name if weight is not None else None for name, weight in zip(_WEIGHTS, (weight_q, weight_k))]
    (q, q_grad), (k, k_grad) = (_side(name, eps) for name in given)
    q_weight, k_weight = ([(name, _weight_grad(eps))] if name is not None else [] for name in given)
    return QKTransformFragment(q=q, k=k, q_grad=q_grad, k_grad=k_grad, q_tensor_grads=q_weight, k_tensor_grads=k_weight)


COMBINATOR = Combinator(
    name="qk_norm",
    role=Role.QK_TRANSFORM,
    doc="RMSNorm of every q and k row over the head dim, times a (D,) weight per side (Qwen3, Gemma 3).",
    params=[
        Param(name="weight_q", runtime=True, default=None, doc="(D,) float weight of q's norm; None: no weight"),
        Param(name="weight_k", runtime=True, default=None, doc="(D,) float weight of k's norm; None: no weight"),
        Param(name="eps", default=1e-6, check=positive_number, doc="added to the mean square, > 0"),
    ],
    reference=reference,
    tensors=[TensorArg(name="weight_q", rank=1), TensorArg(name="weight_k", rank=1)],
    prepare=prepare,
    fragment=fragment,
    examples=examples,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
