"""softcap(s, cap): logit soft-capping, s <- cap·tanh(s/cap) (Gemma 2).

The kernel has no ``tl.tanh`` it can rely on (Triton's interpreter has none), so the fragment computes
tanh(x), x = s/cap, in two branches, both accurate to a few float32 ulps:

* |x| >= 1/4: sign(x)·(1 - e)/(1 + e) with e = exp(-2|x|) in (0, 1], so exp never overflows and no finite
  score gives NaN; the capped score stays within [-cap, cap];
* |x| < 1/4: cap·tanh(x) = s·(1 - x²/3 + 2x⁴/15 - 17x⁶/315 + 62x⁸/2835), the Taylor series (the next term
  is below 4e-9 relatively), because 1 - e would cancel catastrophically there (a large cap would lose
  every digit of s). x² is clamped to 1/16, so the branch tl.where discards never overflows either.
"""

from __future__ import annotations

import torch

from attnfuse.plugin import Combinator, Param, Role, ScoreModFragment, hookimpl, positive_number


def reference(s: torch.Tensor, ctx, cap: float) -> torch.Tensor:
    """s (B, Hq, Nq, Nk) -> cap·tanh(s/cap), in s's dtype."""
    return cap * torch.tanh(s / cap)


def examples(draw, shape):
    """Caps for the conformance kit: small caps bite hard, large ones barely."""
    from hypothesis import strategies as st

    return {"cap": draw(st.sampled_from([1.0, 5.0, 20.0, 50.0]))}


COMBINATOR = Combinator(
    name="softcap",
    role=Role.SCORE_MOD,
    doc="Logit soft-capping s <- cap·tanh(s/cap) (Gemma 2); cap a static float > 0.",
    params=[Param(name="cap", check=positive_number, doc="the cap, a finite number > 0 (Gemma 2: 50.0)")],
    reference=reference,
    fragment=ScoreModFragment(
        body="""
            ${self}_a = tl.abs(s / $cap)
            ${self}_x2 = tl.minimum(${self}_a * ${self}_a, 0.0625)
            ${self}_e = tl.exp(-2.0 * ${self}_a)
            s = tl.where(${self}_a < 0.25,
                         s * (1.0 + ${self}_x2 * (-0.3333333333333333 + ${self}_x2 * (0.13333333333333333
                              + ${self}_x2 * (-0.05396825396825397 + ${self}_x2 * 0.021869488536155203)))),
                         tl.where(s < 0.0, -$cap, $cap) * ((1.0 - ${self}_e) / (1.0 + ${self}_e)))
        """,
        # d/ds cap·tanh(s/cap) = 1 - tanh²(s/cap) = 1 - (s_out/cap)²
        grad="ds = ds * (1.0 - ($s_out / $cap) * ($s_out / $cap))",
    ),
    examples=examples,
)


@hookimpl
def attnfuse_combinators():
    return [COMBINATOR]
