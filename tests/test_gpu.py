"""GPU-only checks: bfloat16, production shapes, against torch SDPA on the same inputs."""
import pytest
import torch

import attnfuse as af
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call, requires_cuda

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_matches_sdpa(dtype):
    B, Hq, Hkv, N, D = 1, 8, 2, 1000, 128
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    got = torch.autograd.grad(causal(*leaves), leaves, dout)
    q, k, v = (t.detach().double().requires_grad_(True) for t in leaves)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           is_causal=True)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowp = [t.detach().requires_grad_(True) for t in leaves]
    ref_lowp = torch.nn.functional.scaled_dot_product_attention(
        lowp[0], lowp[1].repeat_interleave(4, 1), lowp[2].repeat_interleave(4, 1), is_causal=True)
    want_lowp = torch.autograd.grad(ref_lowp, lowp, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want_lowp):
        assert_matches_reference(a, b, c, dtype, what=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rope_backward_hoisted(dtype):
    """RoPE+causal training at a size where the rotations are hoisted into passes (forward and backward),
    against float64 autograd of the reference."""
    B, Hq, Hkv, N, D = 1, 8, 2, 1000, 128
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    got = torch.autograd.grad(llama(*leaves), leaves, dout)
    assert hoisted_last_call()
    want = torch.autograd.grad(llama.reference(*leaves), leaves, dout.double())
    want_lowp = torch.autograd.grad(llama.reference(*leaves, dtype=dtype), leaves, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want_lowp):
        assert_matches_reference(a, b, c, dtype, what=name)


@pytest.mark.parametrize("Nq", [1, 8])
def test_decode_matches_sdpa(Nq):
    """Split-KV decoding, bf16, Llama-3-70B heads, per-sequence lengths."""
    B, Hq, Hkv, N, D = 2, 64, 8, 5000, 128
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([5000, 3001], dtype=torch.int32, device="cuda")
    out = dense(q, k, v, kv_lens=lens)
    for b, n in enumerate(lens.tolist()):
        args = (q[b:b + 1].double(), k[b:b + 1, :, :n].double().repeat_interleave(8, 1),
                v[b:b + 1, :, :n].double().repeat_interleave(8, 1))
        ref = torch.nn.functional.scaled_dot_product_attention(*args)
        ref_lowp = torch.nn.functional.scaled_dot_product_attention(*(a.to(torch.bfloat16) for a in args))
        assert_matches_reference(out[b:b + 1], ref, ref_lowp, torch.bfloat16)


def test_block_sparse_bf16():
    B, H, N, D = 1, 4, 1024, 128

    @af.attention
    def sparse(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    active = torch.rand(B, H, N // 128, N // 128, device="cuda") > 0.7
    active |= torch.eye(N // 128, dtype=torch.bool, device="cuda")
    mask = af.BlockMask.from_blocks(active, N, N, block_size=128)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert_matches_reference(sparse(q, k, v, mask), sparse.reference(q, k, v, mask),
                             sparse.reference(q, k, v, mask, dtype=torch.bfloat16), torch.bfloat16)


def test_block_sparse_backward_bf16_splits_global_columns():
    """BigBird with GQA, bf16 training: the global key blocks' dK/dV is split over each group's query heads;
    gradients match float64 autograd of the reference, and a second step is bitwise equal."""
    B, Hq, Hkv, N, D, bs = 1, 8, 2, 2000, 128, 128

    @af.attention
    def sparse(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    n = -(-N // bs)
    active = torch.rand(B, Hq, n, n, device="cuda") > 0.9
    qb, kb = torch.arange(n, device="cuda")[:, None], torch.arange(n, device="cuda")[None, :]
    active |= ((qb - kb).abs() <= 1) | (qb < 2) | (kb < 2)
    mask = af.BlockMask.from_blocks(active, N, N, block_size=bs)
    assert mask.kv_heavy_blocks >= 2
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    got = torch.autograd.grad(sparse(*leaves, mask), leaves, dout)
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(sparse(*leaves, mask), leaves, dout)))
    want = torch.autograd.grad(sparse.reference(*leaves, mask), leaves, dout.double())
    want_lowp = torch.autograd.grad(sparse.reference(*leaves, mask, dtype=torch.bfloat16), leaves, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want_lowp):
        assert_matches_reference(a, b, c, torch.bfloat16, what=name)


def test_fast_launch_path_respecialises():
    """Repeated calls go straight to the compiled kernel; a misaligned pointer or a new size gets its
    own specialisation. Every result matches SDPA."""
    B, H, D = 2, 4, 64
    for N, offset in ((300, 0), (300, 0), (300, 1), (320, 1), (320, 0), (301, 0), (300, 0)):
        pool = torch.randn(3, B * H * N * D + offset, device="cuda", dtype=torch.float16)
        q, k, v = (x[offset:].view(B, H, N, D) for x in pool)
        out = causal(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        ref_lowp = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert_matches_reference(out, ref, ref_lowp, torch.float16, what=f"N={N} offset={offset}")


def test_compile_error_inside_a_fragment_names_the_combinator():
    """Triton's compiler (not the interpreter) rejects a fragment: the error names the combinator."""
    from test_fragment_lint import bad_call_program

    prog, q = bad_call_program("cuda")
    try:
        with pytest.raises(Exception) as info:
            prog(q.half(), q.half(), q.half())
    finally:
        af.unregister_plugin("test-lint-bad-call")
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "the failing line is in the fragment of combinator '_test_bad_call'" in notes
    assert notes.endswith(": s = tl.no_such_function(s)")
