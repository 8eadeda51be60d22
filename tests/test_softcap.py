"""The built-in softcap (Gemma 2's logit soft-capping): a fixed program, registration, the tanh's accuracy for
any cap, parameter checks, gradients (the conformance kit runs on it in tests/test_conformance.py)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference

# The fixed program runs on the CPU (Triton's interpreter) always, and compiled on a GPU when there is one.
CASES = [pytest.param("cpu", dtype, id=f"cpu-{str(dtype)[6:]}") for dtype in (torch.float32, torch.float16)]
if torch.cuda.is_available():
    CASES += [
        pytest.param("cuda", dtype, id=f"cuda-{str(dtype)[6:]}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16)
    ]


def test_softcap_is_a_builtin():
    entry = af.combinators()["softcap"]
    assert entry.distribution == "attnfuse"
    assert entry.combinator.role is af.Role.SCORE_MOD
    assert callable(af.softcap)
    assert "cap" in af.softcap.__doc__


def test_attnfuse_list_shows_softcap(capsys):
    cli = pytest.importorskip("attnfuse.cli")
    assert cli.main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("softcap "))
    assert row.split()[1:5] == ["score", "modification", "attnfuse", "Logit"]


@af.attention
def capped_causal(q, k, v):
    return af.softmax(af.softcap(af.causal(af.scaled_dot_product(q, k)), 30.0)) @ v


@pytest.mark.parametrize("device, dtype", CASES)
@pytest.mark.parametrize(
    "shape",
    [(2, 4, 2, 37, 53, 32), (1, 2, 1, 64, 64, 16), (1, 1, 1, 70, 20, 64)],
    ids=lambda s: "B{}_Hq{}_Hkv{}_Nq{}_Nk{}_D{}".format(*s),
)
def test_fixed_program_matches_reference(device, dtype, shape):
    B, Hq, Hkv, Nq, Nk, D = shape
    g = torch.Generator().manual_seed(zlib.crc32(repr((shape, dtype)).encode()))
    # Large inputs, so that the cap actually bites (scores far beyond ±30 before capping).
    q = (torch.randn(B, Hq, Nq, D, generator=g) * 6).to(dtype).to(device)
    k = (torch.randn(B, Hkv, Nk, D, generator=g) * 6).to(dtype).to(device)
    v = torch.randn(B, Hkv, Nk, D, generator=g).to(dtype).to(device)
    out, lse = capped_causal(q, k, v, return_lse=True)
    ref64 = capped_causal.reference(q, k, v, return_lse=True, dtype=torch.float64)
    ref_lowp = capped_causal.reference(q, k, v, return_lse=True, dtype=dtype)
    assert out.dtype == dtype and out.shape == (B, Hq, Nq, D)
    assert_matches_reference(out, ref64[0], ref_lowp[0], dtype, what="out")
    assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what="lse")


def test_softcap_bounds_scores_without_overflow():
    """Huge scores (|s/cap| ~ 1e4) must neither overflow nor give NaN: the capped scores stay in [-cap, cap]."""

    @af.attention
    def tiny_cap(q, k, v):
        return af.relu_attention(af.softcap(af.scaled_dot_product(q, k, scale=1.0), 0.5)) @ v

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 20, 16, generator=g) * 30
    k = torch.randn(1, 1, 24, 16, generator=g) * 30
    v = torch.ones(1, 1, 24, 16)
    out = tiny_cap(q, k, v)
    assert torch.isfinite(out).all()
    # relu(capped) / Nk summed over keys: each term is at most cap / Nk.
    assert (out <= 0.5 + 1e-6).all()
    ref = tiny_cap.reference(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cap", [1e-3, 0.5, 1, 5.0, 30.0, 1e3, 1e6, 1e30])
def test_softcap_is_accurate_for_any_cap(cap):
    """The capped scores themselves, to float32 precision, for caps from tiny to huge.

    Scores are exact (small dyadic q, k), relu_attention with v = I reads them out: out(q) - out(-q) is
    cap·tanh(s/cap) / Nk, since softcap is odd. A plain (1 - e^{-2x})/(1 + e^{-2x}) would lose every digit
    of s for a large cap; the Taylor branch keeps them.
    """

    @af.attention
    def read_scores(q, k, v):
        return af.relu_attention(af.softcap(af.scaled_dot_product(q, k, scale=1.0), cap)) @ v

    g = torch.Generator().manual_seed(1)
    Nk = 32
    q = torch.randint(-4, 5, (1, 1, 40, 16), generator=g).float() * 0.25
    k = torch.randint(-4, 5, (1, 1, Nk, 16), generator=g).float() * 0.125
    v = torch.eye(Nk)[None, None]
    got = ((read_scores(q, k, v) - read_scores(-q, k, v)) * Nk).double()
    s = q.double() @ k.double().transpose(-1, -2)
    want = cap * torch.tanh(s / cap)
    assert torch.isfinite(got).all()
    assert (got.abs() <= cap * (1 + 1e-6)).all()  # cap is rounded to float32 in the kernel
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("cap", [0, 0.0, -1, -2.5, "x", None, math.inf, math.nan, True])
def test_bad_cap_is_a_program_error_naming_cap(cap):
    @af.attention
    def bad(q, k, v):
        return af.softmax(af.softcap(af.scaled_dot_product(q, k), cap)) @ v

    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(af.ProgramError, match="cap"):
        bad(q, q, q)
    with pytest.raises(af.ProgramError, match="cap"):
        bad.graph()


def test_missing_cap_is_an_error():
    @af.attention
    def missing(q, k, v):
        return af.softmax(af.softcap(af.scaled_dot_product(q, k))) @ v

    with pytest.raises(TypeError, match="cap"):
        missing.graph()


def test_softcap_gradients():
    """The backward fragment: float64 gradcheck, and float32 gradients against the reference's autograd."""

    @af.attention
    def capped(q, k, v):
        return af.softmax(af.softcap(af.causal(af.scaled_dot_product(q, k, scale=1.0)), 2.0)) @ v

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda *t: capped(*t), (q, k, v), fast_mode=True)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, requires_grad=True) for _ in range(3))
    got = torch.autograd.grad(capped(q, k, v).sum(), (q, k, v))
    want = torch.autograd.grad(capped.reference(q, k, v).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-5, rtol=0)
