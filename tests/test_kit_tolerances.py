"""The conformance kit's tolerances: derived where the fused computation rounds differently from the naive
one (FlashAttention's delta = rowsum(dO∘O) in float16), and never infinite (a naive reference that overflows
is a failure of its own)."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.testing import ProgramCase, Shape, assert_matches_reference, check_program_case
from attnfuse.testing.planted_bugs import planted


@af.attention
def biased_sinks(q, k, v, bias, sinks):
    return af.softmax_with_sinks(af.causal(af.additive_bias(af.scaled_dot_product(q, k), bias)), sinks) @ v


def _single_key_case(seed: int, program=biased_sinks) -> ProgramCase:
    """A causal program whose first query row keeps one key (head dim 128: long dO·O sums), sinks far below."""
    g = torch.Generator().manual_seed(seed)
    n = 1 + seed % 5
    shape = Shape(B=1, Hq=2, Hkv=1, Nq=n, Nk=n, D=128, DV=128)
    extras = {"bias": torch.randn(1, 2, n, n, generator=g), "sinks": torch.randn(2, generator=g) * 0.5 - 8}
    return ProgramCase(program=program, text=program.__name__, shape=shape, extras=extras)


def test_float16_gradients_of_rows_with_one_key_pass():
    """A row with one key has score gradient p·(dp − delta) = 0 exactly; the fused backward's delta comes from
    the rounded output, so its float16 gradients are off by what the derived bound allows, and pass."""
    for seed in range(12):
        check_program_case(_single_key_case(seed), torch.float16, "cpu", seed=seed, grads=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_derived_gradient_bound_still_catches_a_dropped_delta(dtype):
    """softmax's backward without delta (ds = p·dp) fails the same cases in float16 and float32."""
    comb = planted("wrong_backward")

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name="test-kit-tolerances")
    try:

        @af.attention
        def dropped_delta(q, k, v, bias):
            return af._planted_wrong_backward(af.causal(af.additive_bias(af.scaled_dot_product(q, k), bias))) @ v

        for seed in range(4):
            case = _single_key_case(seed + 1, dropped_delta)
            case = ProgramCase(
                program=dropped_delta, text="dropped_delta", shape=case.shape, extras={"bias": case.extras["bias"]}
            )
            with pytest.raises(AssertionError, match=r"^d(q|k|bias) of dropped_delta: .* beyond the tolerance"):
                check_program_case(case, dtype, "cpu", seed=seed, grads=True)
    finally:
        af.unregister_plugin("test-kit-tolerances")


def test_a_naive_reference_that_overflows_fails_instead_of_passing_anything():
    """An all-zero float16 result against a reference near 1: where the float16 naive evaluator overflowed at
    one element, the tolerance used to be infinite and this passed."""
    reference = torch.rand(2, 3, 8, 16, dtype=torch.float64) + 0.5
    naive = reference.to(torch.float16)
    naive[1, 2, 3, 4] = float("inf")
    with pytest.raises(
        AssertionError,
        match=r"the naive reference evaluated in torch.float16 is non-finite at 1 "
        r"element\(s\) where the float64 reference is finite, first at index "
        r"\(1, 2, 3, 4\)",
    ):
        assert_matches_reference(torch.zeros(2, 3, 8, 16, dtype=torch.float16), reference, naive, torch.float16)
    naive[1, 2, 3, 4] = float("nan")
    with pytest.raises(AssertionError, match="non-finite at 1 element"):
        assert_matches_reference(reference.to(torch.float16), reference, naive, torch.float16)


def test_the_tolerance_is_never_infinite():
    reference = torch.randn(4, 8, dtype=torch.float64)
    bound = torch.rand(4, 8, dtype=torch.float64)
    bound[0, 0] = float("inf")
    with pytest.raises(ValueError, match="the rounding bound must be finite and >= 0"):
        assert_matches_reference(torch.zeros(4, 8), reference, reference.float(), torch.float32, rounding=bound)
    bound[0, 0] = 0.0
    with pytest.raises(AssertionError, match="beyond the tolerance"):  # a finite bound still fails what exceeds it
        assert_matches_reference(reference.float() + 2.0, reference, reference.float(), torch.float32, rounding=bound)
