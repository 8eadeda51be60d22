"""Conformance: fused kernels against the float64 reference, over programs drawn by Hypothesis."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ..plugin_manager import combinators, lookup
from .strategies import ProgramCase, program_cases, shapes
from .tolerances import assert_matches_reference


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtypes(device: str) -> tuple[torch.dtype, ...]:
    """bfloat16 is wrong under Triton's interpreter, so the CPU checks float32 and float16 only."""
    if device == "cpu":
        return (torch.float32, torch.float16)
    return (torch.float16, torch.bfloat16, torch.float32)


def check_program_case(case: ProgramCase, dtype: torch.dtype, device: str, seed: int) -> None:
    """Run ``case`` fused and compare out (and lse, when the normaliser has one) with the reference."""
    q, k, v = case.inputs(dtype, device, seed)
    extras = case.extras_on(device)
    has_lse = lookup(case.program.graph(**extras).weights.apply.combinator).fragment.has_lse
    result = case.program(q, k, v, return_lse=has_lse, **extras)
    out, lse = result if has_lse else (result, None)
    ref64 = case.program.reference(q, k, v, return_lse=has_lse, dtype=torch.float64, **extras)
    ref_lowp = case.program.reference(q, k, v, return_lse=has_lse, dtype=dtype, **extras)
    if not has_lse:
        ref64, ref_lowp = (ref64, None), (ref_lowp, None)
    assert_matches_reference(out, ref64[0], ref_lowp[0], dtype, what=f"out of {case.text}")
    if has_lse:
        assert lse.dtype == torch.float32
        assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what=f"lse of {case.text}")


def check_combinator(name: str | None = None, *, device: str | None = None,
                     dtypes: tuple[torch.dtype, ...] | None = None, max_examples: int = 20, max_n: int = 80,
                     head_dims: tuple[int, ...] = (16, 32, 64, 80, 128)) -> None:
    """Property test: programs that use combinator ``name`` (any program when None) match the reference.

    Programs are composed from every registered combinator, so a plugin is checked alongside the others.
    """
    if name is not None and name not in combinators():
        raise KeyError(f"no combinator named {name!r} is registered")
    device = device or default_device()
    dtypes = dtypes or default_dtypes(device)

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(data=st.data())
    def conforms(data):
        shape = data.draw(shapes(max_n=max_n, head_dims=head_dims), label="shape")
        case = data.draw(program_cases(shape, include=name), label="program")
        note(f"program: {case.text}")
        dtype = data.draw(st.sampled_from(dtypes), label="dtype")
        check_program_case(case, dtype, device, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))

    conforms()
