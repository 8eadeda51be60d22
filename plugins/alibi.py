"""alibi(s, slopes=None): s + slope_h·(j - q'), slopes defaulting to the ALiBi paper's sequence."""

from __future__ import annotations

import math

import torch

from attnfuse.plugin import Combinator, InputError, Param, Role, ScoreModFragment, TensorArg, device_cached, hookimpl


def default_slopes(num_heads: int) -> list[float]:
    """Press et al. (2022): a geometric sequence starting at 2^(-8/n) for n a power of two; otherwise
    the sequence for the closest smaller power of two, then every other slope of the next one."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads & (num_heads - 1) == 0:
        return power_of_two(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: num_heads - closest]


def _default_slopes_tensor(num_heads: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The default slopes (Hq,), made once per setting (outside CUDA graph pools)."""
    return device_cached(
        ("alibi", num_heads, dtype), lambda: torch.tensor(default_slopes(num_heads), dtype=dtype, device=device), device
    )


def _slopes(slopes, num_heads: int, device, dtype=torch.float32) -> torch.Tensor:
    if slopes is None:
        return _default_slopes_tensor(num_heads, device, dtype)
    if not isinstance(slopes, torch.Tensor) or slopes.shape != (num_heads,) or not slopes.is_floating_point():
        raise InputError(
            f"alibi: slopes must be a float tensor of shape (Hq,) = ({num_heads},), got "
            f"{getattr(slopes, 'shape', type(slopes).__name__)}"
        )
    return slopes


def reference(s, ctx, slopes):
    """s (B, Hq, Nq, Nk) + slope_h·(j - q')."""
    slopes = _slopes(slopes, ctx.Hq, s.device, torch.float64).to(s.dtype).view(1, ctx.Hq, 1, 1)
    return s + slopes * (ctx.k_pos - ctx.q_pos).to(s.dtype)


def prepare(ctx, slopes):
    dtype = torch.float64 if ctx.dtype == torch.float64 else torch.float32
    return {"slopes": _slopes(slopes, ctx.Hq, ctx.device, dtype)}


def examples(draw, shape):
    from hypothesis import strategies as st

    from attnfuse.plugin import random_tensor

    if draw(st.booleans()):
        return {"slopes": None}
    return {"slopes": random_tensor(draw, shape.Hq).abs()}


COMBINATOR = Combinator(
    name="alibi",
    role=Role.SCORE_MOD,
    doc="Linear position bias s + slope_h·(j - q'); default slopes per Press et al. for Hq heads.",
    params=[Param(name="slopes", runtime=True, default=None, doc="(Hq,) float tensor; None: the paper's")],
    reference=reference,
    tensors=[TensorArg(name="slopes", rank=1)],
    prepare=prepare,
    fragment=ScoreModFragment(
        prologue="${self}_slope = tl.load($slopes + h * $slopes_s0).to($acc_dtype)",
        body="s = s + ${self}_slope * (k_pos[None, :] - q_pos[:, None]).to($acc_dtype)",
        grad="",
    ),
    examples=examples,
    takes_offsets=True,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
