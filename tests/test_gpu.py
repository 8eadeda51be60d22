"""GPU-only checks: bfloat16, production shapes, against torch SDPA on the same inputs."""
import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference

from conftest import requires_cuda

pytestmark = requires_cuda


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


def _rope(x, positions, theta=10000.0):
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64, device=x.device) / D)
    emb = positions.double()[:, None] * inv_freq
    emb = torch.cat((emb, emb), dim=-1)
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("geometry", [(4, 12, 12, 64), (1, 32, 8, 128)], ids=["gpt2", "llama3-8b"])
@pytest.mark.parametrize("N", [1000, 2048])
@pytest.mark.parametrize("program", [dense, causal, llama], ids=lambda p: p.__name__)
def test_production_shapes_match_sdpa(program, N, geometry, dtype):
    B, Hq, Hkv, D = geometry
    q = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, N, D, device="cuda", dtype=dtype)
    out, lse = program(q, k, v, return_lse=True)
    qr, kr = q.double(), k.double()
    if program is llama:
        pos = torch.arange(N, device="cuda")
        qr, kr = _rope(q, pos), _rope(k, pos)
    g = Hq // Hkv
    args = (qr, kr.repeat_interleave(g, 1), v.double().repeat_interleave(g, 1))
    ref = torch.nn.functional.scaled_dot_product_attention(*args, is_causal=program is not dense)
    args_lowp = tuple(a.to(dtype) for a in args)
    ref_lowp = torch.nn.functional.scaled_dot_product_attention(*args_lowp, is_causal=program is not dense)
    assert_matches_reference(out, ref, ref_lowp, dtype)
    ref_lse = program.reference(q[:, :2, :256], k[:, :1, :256], v[:, :1, :256], return_lse=True)[1]
    torch.testing.assert_close(program(q[:, :2, :256], k[:, :1, :256], v[:, :1, :256], return_lse=True)[1].double(),
                               ref_lse, atol=2e-2, rtol=0)
    assert lse.shape == (B, Hq, N) and torch.isfinite(lse).all()


def test_bf16_fuzz_long_sequences():
    from attnfuse.testing import check_combinator

    check_combinator(None, dtypes=(torch.bfloat16,), max_examples=30, max_n=2000, head_dims=(64, 128))
