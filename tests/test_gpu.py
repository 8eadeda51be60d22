"""GPU-only checks: bfloat16, production shapes, against torch SDPA on the same inputs."""

import warnings

import pytest
import torch

import attnfuse as af
from attnfuse.examples import EXAMPLES
from attnfuse.testing import assert_matches_reference

from conftest import deterministic_algorithms, hoisted_last_call, requires_cuda

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
    torch.testing.assert_close(
        program(q[:, :2, :256], k[:, :1, :256], v[:, :1, :256], return_lse=True)[1].double(), ref_lse, atol=2e-2, rtol=0
    )
    assert lse.shape == (B, Hq, N) and torch.isfinite(lse).all()


def test_bf16_fuzz_long_sequences():
    from attnfuse.testing import check_combinator

    check_combinator(None, dtypes=(torch.bfloat16,), max_examples=30, max_n=2000, head_dims=(64, 128))


def _causal_sdpa_grads(leaves, dout, group, dtype):
    """dq, dk, dv of causal SDPA in ``dtype`` (k and v repeated over the GQA group), one batch element at a
    time: the float64 math path keeps (Hq, N, N) score-sized tensors, too much at once for a shared GPU."""
    grads = []
    for b in range(dout.shape[0]):
        q, k, v = (t[b : b + 1].detach().to(dtype).requires_grad_(True) for t in leaves)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), is_causal=True
        )
        grads.append(torch.autograd.grad(out, (q, k, v), dout[b : b + 1].to(dtype)))
    return [torch.cat(parts) for parts in zip(*grads)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,Hq,Hkv,N,bitwise",
    [(1, 8, 2, 1000, False), (1, 32, 8, 2048, True), (8, 8, 4, 3200, True)],
    ids=["gqa4-split", "llama3-8b-split", "gqa2-unsplit"],
)
def test_backward_matches_sdpa(dtype, B, Hq, Hkv, N, bitwise):
    """Causal GQA gradients against float64 SDPA: grids small enough that the dK/dV kernel splits its key
    blocks over the group's heads, and one large enough that it does not (on an H200's 132
    multiprocessors, where these run the Hopper dK/dV template). Under torch.use_deterministic_algorithms
    the gradients of a second step are bitwise equal (the group's last program sums the shares in order);
    by default dQ, and dK and dV of a group split over more than two programs, are float32 sums added in
    no fixed order, so only dK and dV of the others are (``bitwise``: the group of 4 at N 1000 splits in
    four)."""
    D, g = 128, Hq // Hkv
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=dtype, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=dtype)
    got = torch.autograd.grad(causal(*leaves), leaves, dout)
    again = torch.autograd.grad(causal(*leaves), leaves, dout)
    if bitwise:
        assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])
    with deterministic_algorithms():
        steady = torch.autograd.grad(causal(*leaves), leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(steady, torch.autograd.grad(causal(*leaves), leaves, dout)))
    want = _causal_sdpa_grads(leaves, dout, g, torch.float64)
    want_lowp = _causal_sdpa_grads(leaves, dout, g, dtype)
    names = ("dq", "dk", "dv", "dq deterministic", "dk deterministic", "dv deterministic")
    for name, a, b, c in zip(names, (*got, *steady), (*want, *want), (*want_lowp, *want_lowp)):
        assert_matches_reference(a, b, c, dtype, what=name)


@pytest.fixture
def fma_tiles_opened(monkeypatch):
    """IEEE float32 dots, with ``passes.tile.FLOAT32_FMA_TILES`` opened on this GPU by their environment variable;
    the kernels planned with them dropped before and after."""
    from attnfuse.passes import tile
    from attnfuse.runtime.launch import clear_cache

    monkeypatch.setenv(tile.FLOAT32_FMA_GATE.env, "1")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    clear_cache()
    yield
    clear_cache()


@pytest.mark.parametrize("D", [64, 128, 256])
def test_float32_fma_tiles_match_the_reference(fma_tiles_opened, D):
    """IEEE float32 calls with ``passes.tile.FLOAT32_FMA_TILES`` (a head dim from each row): causal GQA outputs and
    gradients against float64 SDPA, at a length that leaves partial tiles."""
    from attnfuse.passes import tile
    from attnfuse.runtime.gpu_gate import device_arch

    arch = device_arch(torch.device("cuda"))
    for kernel in tile.FMA_TILED_KERNELS:
        assert tile.choose_tiles(arch, "masked", D, kernel, "float32") == tile.float32_fma_tiles(kernel, D)
    B, Hq, Hkv, N = 2, 8, 2, 1000
    leaves = [torch.randn(B, h, N, D, device="cuda", requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda")
    out = causal(*leaves)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    g = Hq // Hkv
    args = [t.detach().double() for t in leaves]
    want_out = torch.nn.functional.scaled_dot_product_attention(
        args[0], args[1].repeat_interleave(g, 1), args[2].repeat_interleave(g, 1), is_causal=True
    )
    want_out32 = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], leaves[1].repeat_interleave(g, 1), leaves[2].repeat_interleave(g, 1), is_causal=True
    )
    want = (want_out, *_causal_sdpa_grads(leaves, dout, g, torch.float64))
    want32 = (want_out32.detach(), *_causal_sdpa_grads(leaves, dout, g, torch.float32))
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, want32):
        assert_matches_reference(a, b, c, torch.float32, what=name)


def test_more_batch_heads_than_a_grid_holds_along_y():
    """B x H = 65600 (batch, head) programs, past CUDA's 65535 along a grid's y: the generated kernels (head
    dim 64) take them over y and z (tests/test_grid.py). Training against float64 SDPA, and split-KV
    decoding of one query a sequence."""
    B, H, N, D = 4100, 16, 16, 64
    sdpa = torch.nn.functional.scaled_dot_product_attention
    leaves = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    out = causal(*leaves)
    grads = torch.autograd.grad(out, leaves, dout)
    refs = {}
    for dtype in (torch.float64, torch.bfloat16):
        ref_leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
        ref = sdpa(*ref_leaves, is_causal=True)
        refs[dtype] = (ref, *torch.autograd.grad(ref, ref_leaves, dout.to(dtype)))
    for name, got, want, lowp in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), refs[torch.float64], refs[torch.bfloat16]
    ):
        assert_matches_reference(got, want, lowp, torch.bfloat16, what=name)
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (t.detach() for t in leaves[1:])
    assert_matches_reference(
        dense(q, k, v), sdpa(q.double(), k.double(), v.double()), sdpa(q, k, v), torch.bfloat16, what="decoding"
    )


@pytest.mark.parametrize("share", [0.0, float("inf")], ids=["one-head", "all-heads"])
def test_query_kernels_head_groups_match_sdpa(monkeypatch, share):
    """The generated forward and dQ kernels walking their heads one at a time (L2_SHARE 0: keys and values
    never fit in the L2 cache) and all together (L2_SHARE inf), 3 x 8 query heads (GQA 4) at head dim 64
    with 1000 queries (a partial last block): causal training against float64 SDPA."""
    from attnfuse.runtime import launcher

    monkeypatch.setattr(launcher, "L2_SHARE", share)
    B, Hq, Hkv, N, D = 3, 8, 2, 1000, 64
    leaves = [torch.randn(B, h, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (Hq, Hkv, Hkv)]
    dout = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16)
    out = causal(*leaves)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = (t.detach() for t in leaves)
    expand = dict(enable_gqa=True, is_causal=True)
    assert_matches_reference(
        out, sdpa(q.double(), k.double(), v.double(), **expand), sdpa(q, k, v, **expand), torch.bfloat16, what="out"
    )
    got = torch.autograd.grad(out, leaves, dout)
    want = _causal_sdpa_grads(leaves, dout, Hq // Hkv, torch.float64)
    want_lowp = _causal_sdpa_grads(leaves, dout, Hq // Hkv, torch.bfloat16)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want_lowp):
        assert_matches_reference(a, b, c, torch.bfloat16, what=name)


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
        args = (
            q[b : b + 1].double(),
            k[b : b + 1, :, :n].double().repeat_interleave(8, 1),
            v[b : b + 1, :, :n].double().repeat_interleave(8, 1),
        )
        ref = torch.nn.functional.scaled_dot_product_attention(*args)
        ref_lowp = torch.nn.functional.scaled_dot_product_attention(*(a.to(torch.bfloat16) for a in args))
        assert_matches_reference(out[b : b + 1], ref, ref_lowp, torch.bfloat16)


def test_block_sparse_bf16():
    B, H, N, D = 1, 4, 1024, 128

    @af.attention
    def sparse(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    active = torch.rand(B, H, N // 128, N // 128, device="cuda") > 0.7
    active |= torch.eye(N // 128, dtype=torch.bool, device="cuda")
    mask = af.BlockMask.from_blocks(active, N, N, block_size=128)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert_matches_reference(
        sparse(q, k, v, mask),
        sparse.reference(q, k, v, mask),
        sparse.reference(q, k, v, mask, dtype=torch.bfloat16),
        torch.bfloat16,
    )


def test_token_level_block_mask_bf16_matches_sdpa():
    """flex's document-causal mask_mod through af.create_block_mask, bf16 forward and backward, against SDPA
    with the same dense boolean mask (float64): partial blocks apply their token masks on the GPU too."""
    B, H, N, D = 2, 4, 1000, 128

    @af.attention
    def sparse(q, k, v, block_mask):
        return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v

    docs = torch.randint(0, 5, (B, N), device="cuda").sort(dim=-1).values
    mask_mod = lambda b, h, q_idx, kv_idx: (docs[b, q_idx] == docs[b, kv_idx]) & (kv_idx <= q_idx)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        mask = af.create_block_mask(mask_mod, B, None, N, N, device="cuda")
    assert mask.partial_blocks() > 0
    idx = torch.arange(N, device="cuda")
    dense = mask_mod(torch.arange(B, device="cuda").view(-1, 1, 1, 1), 0, idx.view(1, 1, -1, 1), idx.view(1, 1, 1, -1))
    leaves = [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    dout = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = sparse(*leaves, mask)
    ref = sdpa(*(x.double() for x in leaves), attn_mask=dense)
    ref_lowp = sdpa(*leaves, attn_mask=dense)
    assert_matches_reference(out, ref, ref_lowp, torch.bfloat16)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout.double())
    want_lowp = torch.autograd.grad(ref_lowp, leaves, dout)
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, want_lowp):
        assert_matches_reference(a, b, c, torch.bfloat16, what=name)


def test_block_sparse_backward_bf16_splits_global_columns():
    """BigBird with GQA, bf16 training: the global key blocks' dK/dV is split over each group's query heads;
    gradients match float64 autograd of the reference, and under torch.use_deterministic_algorithms a second
    step is bitwise equal (by default, a group of 4 split over four programs, as this grid of 32 programs is on
    an H100 or H200, adds its float32 shares in no fixed order: ``test_backward_matches_sdpa``)."""
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
    with deterministic_algorithms():
        steady = torch.autograd.grad(sparse(*leaves, mask), leaves, dout)
        assert all(torch.equal(a, b) for a, b in zip(steady, torch.autograd.grad(sparse(*leaves, mask), leaves, dout)))
    want = torch.autograd.grad(sparse.reference(*leaves, mask), leaves, dout.double())
    want_lowp = torch.autograd.grad(sparse.reference(*leaves, mask, dtype=torch.bfloat16), leaves, dout)
    names = ("dq", "dk", "dv", "dq deterministic", "dk deterministic", "dv deterministic")
    for name, a, b, c in zip(names, (*got, *steady), (*want, *want), (*want_lowp, *want_lowp)):
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


# torch.compile and CUDA graphs (the op boundary, attnfuse/custom_op.py) --------------------------------------


@af.attention
def llama_window(q, k, v, window):
    return af.softmax(af.sliding_window(af.rope(q, k, rotate_keys=False), window, 0)) @ v


def test_compile_fullgraph_forward_and_backward_bf16_equal_eager():
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (
        torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    dout = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    for backend in ("aot_eager", "inductor"):
        compiled = torch.compile(lambda q, k, v: llama(q, k, v), backend=backend, fullgraph=True)
        out = compiled(q, k, v)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        eager = llama(q, k, v)
        eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        for got, want in zip(grads, eager_grads):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_compile_reduce_overhead_decode_with_kv_lens_and_block_table():
    """CUDA graphs capture the split-KV decode (two launches) of a paged cache; replays follow new lengths."""
    g = torch.Generator(device="cuda").manual_seed(12)
    B, Hq, Hkv, D, page, pages = 4, 32, 8, 128, 64, 32
    pool_k, pool_v = (
        torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)
    )
    table = torch.randperm(B * pages, device="cuda", generator=g).to(torch.int32).view(B, pages)
    step = torch.compile(
        lambda q, k, v, lens, table: llama_window(q, k, v, 1000, kv_lens=lens, block_table=table),
        mode="reduce-overhead",
        fullgraph=True,
    )
    for lengths in ([2048, 17, 700, 1], [1500, 64, 2048, 999], [3, 2000, 128, 640]):
        lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        out = step(q, pool_k, pool_v, lens, table).clone()
        want = llama_window.reference(q, pool_k, pool_v, 1000, kv_lens=lens, block_table=table)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
    af.check_errors()
    hostile = table.clone()
    hostile[1, 0] = -1
    step(q, pool_k, pool_v, lens, hostile)  # the captured check runs at every replay
    with pytest.raises(af.InputError, match=r"block_table\[1, 0\] = -1 is not a page of the pool: the 32 entries "):
        af.check_errors()
    af.check_errors()  # raised once


def test_hf_llama_bf16_attnfuse_and_fuse_rope_match_sdpa():
    transformers = pytest.importorskip("transformers")
    import attnfuse.hf

    torch.manual_seed(13)
    config = transformers.LlamaConfig(
        hidden_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=2048,
        vocab_size=1000,
    )
    model = transformers.LlamaForCausalLM(config).to("cuda").eval()
    ids = torch.randint(0, 1000, (2, 512), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :100] = 0
    real = mask.bool()
    model.set_attn_implementation("sdpa")
    exact = model(ids, attention_mask=mask).logits[real].double()  # float32 SDPA
    model.to(torch.bfloat16)
    sdpa_error = (model(ids, attention_mask=mask).logits[real].double() - exact).abs().max()
    for fuse in (False, True):
        model.set_attn_implementation("attnfuse")
        if fuse:
            attnfuse.hf.fuse_rope(model)
        error = (model(ids, attention_mask=mask).logits[real].double() - exact).abs().max()
        assert error <= 2 * sdpa_error, (fuse, error, sdpa_error)  # no worse than bf16 SDPA's own rounding


HOSTILE_PAGES = [
    (64, torch.int32),
    (-1, torch.int32),
    (10**6, torch.int32),
    (-(2**31), torch.int32),
    (2**32 + 3, torch.int64),
]  # for a 64-page pool


@pytest.mark.parametrize("split_kv", [True, False])
def test_paged_pool_in_a_nan_arena_reads_nothing_outside_it(split_kv):
    """The pool is a view into an arena whose 8 pages before and after it are NaN. With validate=False,
    each hostile block_table entry makes its page's keys absent: no NaN, and the output equals a float64
    computation without those keys (an entry wrapped to int32, 2**32 + 3 -> page 3, would differ).
    Validated, the same call records the entry of one of the four sequences, which af.check_errors() raises."""
    P, guard, page, B, Hq, Hkv, Nq, D = 64, 8, 16, 4, 32, 8, 4, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    arenas = [
        torch.full((P + 2 * guard, page, Hkv, D), float("nan"), device="cuda", dtype=torch.float16) for _ in range(2)
    ]
    for arena in arenas:
        arena[guard : guard + P] = torch.randn(P, page, Hkv, D, device="cuda", generator=g)
    pool_k, pool_v = (arena[guard : guard + P] for arena in arenas)
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=torch.float16, generator=g)
    table = torch.randperm(P, device="cuda", generator=g)[: B * 12].view(B, 12).to(torch.int32)
    lens = torch.tensor([12 * page, 100, 37, 5 * page + 1], dtype=torch.int32, device="cuda")
    for value, dtype in HOSTILE_PAGES:
        hostile = table.to(dtype, copy=True)
        hostile[:, 1] = value  # slot 1 of every sequence: keys 16..31
        out = af.run_attention(
            causal.graph(),
            q,
            pool_k,
            pool_v,
            kv_lens=lens,
            block_table=hostile,
            kv_layout="NHD",
            split_kv=split_kv,
            validate=False,
        )
        assert not out.isnan().any(), f"block_table entry {value}: a NaN from outside the pool"
        pages = table.long()
        present = (torch.arange(12 * page, device="cuda") // page != 1)[None, :].expand(B, -1)
        k, v = (
            pool[pages].reshape(B, 12 * page, Hkv, D).transpose(1, 2).double().repeat_interleave(Hq // Hkv, 1)
            for pool in (pool_k, pool_v)
        )
        pos = torch.arange(12 * page, device="cuda")
        keep = (
            present[:, None, None, :]
            & (pos < lens[:, None, None, None])
            & (pos <= torch.arange(Nq, device="cuda")[:, None] + lens[:, None, None, None] - Nq)
        )
        want = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=keep)
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0, msg=f"block_table entry {value}")
        with pytest.raises(af.InputError, match=rf"block_table\[[0-3], 1\] = {value} is not a page of the pool"):
            af.run_attention(
                causal.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=hostile, kv_layout="NHD", split_kv=split_kv
            )
            af.check_errors()


def _paged_decode_case(B=4, Hq=32, Hkv=8, D=128, page=16, pages=16):
    """q (B, Hq, 1, D) fp16, pools (B * pages, page, Hkv, D) (kv_layout "NHD": page 16 and Hkv 8 read either way
    for Hq 32), a shuffled table (B, pages) int32, ragged lens."""
    g = torch.Generator(device="cuda").manual_seed(3)
    pool_k, pool_v = (
        torch.randn(B * pages, page, Hkv, D, device="cuda", dtype=torch.float16, generator=g) for _ in range(2)
    )
    table = torch.randperm(B * pages, device="cuda", generator=g).to(torch.int32).view(B, pages)
    lens = torch.tensor([pages * page, 17, 100, 1][:B], dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16, generator=g)
    return q, pool_k, pool_v, table, lens


def test_validated_calls_never_synchronise_and_a_later_call_raises_once():
    """With torch's sync debug mode set to error, validated paged decode calls run (no host sync); a bad
    entry is raised by one of the next calls after the device has finished, once."""
    q, pool_k, pool_v, table, lens = _paged_decode_case()
    call = lambda t: causal(q, pool_k, pool_v, kv_lens=lens, block_table=t, kv_layout="NHD")  # noqa: E731
    want = causal.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout="NHD")
    call(table)  # the device's error record is made (outside the checked region)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [call(table) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for out in outs:
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
    hostile = table.clone()
    hostile[2, 5] = 10**6  # sequence 2 (100 keys) uses 7 entries
    call(hostile)
    raised = []
    for _ in range(3):
        torch.cuda.synchronize()
        try:
            call(table)
        except af.InputError as error:
            raised.append(str(error))
    assert len(raised) == 1 and raised[0].startswith(
        "block_table[2, 5] = 1000000 is not a page of the pool: the 7 entries sequence 2 uses (kv_lens[2] = 100, "
        "page_size 16) must each be in [0, 64)"
    ), raised
    af.check_errors()


def test_validated_decode_inside_a_cuda_graph_checks_at_every_replay():
    """A validated paged decode captured by torch.cuda.graph (the record made by a warm-up call): replays
    follow the table's values, an entry edited to a bad one is raised by af.check_errors() after the replay,
    and its keys are absent from that replay's output."""
    q, pool_k, pool_v, table, lens = _paged_decode_case()
    step = lambda: causal(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout="NHD")  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    af.check_errors()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    good = table.clone()
    for slot, value in ((None, None), (0, 10**6), (None, None), (3, -1)):
        table.copy_(good)
        if slot is not None:
            table[0, slot] = value  # sequence 0 (256 keys) uses all 16 entries
        graph.replay()
        if slot is None:
            af.check_errors()
            want = causal.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout="NHD")
            torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=0)
        else:
            with pytest.raises(
                af.InputError,
                match=rf"^block_table\[0, {slot}\] = {value} is not a page of the "
                rf"pool: the 16 entries sequence 0 uses",
            ):
                af.check_errors()
            torch.testing.assert_close(
                out[1:].double(),
                causal.reference(q[1:], pool_k, pool_v, kv_lens=lens[1:], block_table=good[1:], kv_layout="NHD"),
                atol=2e-3,
                rtol=0,
            )


def _causal_rows_reference(q, k, v, dtype):
    """Causal attention of the last Nq queries (q (1, H, Nq, D), bottom-right aligned) over k, v
    (1, H, N, D), head by head, in ``dtype``."""
    Nq, N = q.shape[2], k.shape[2]
    keep = torch.arange(N, device=q.device)[None, :] <= torch.arange(Nq, device=q.device)[:, None] + N - Nq
    return torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                q[:, h : h + 1].to(dtype), k[:, h : h + 1].to(dtype), v[:, h : h + 1].to(dtype), attn_mask=keep
            )
            for h in range(q.shape[1])
        ],
        dim=1,
    )


def test_packed_qkv_past_int32_offsets_matches_sdpa():
    """q, k, v views of one packed (1, 180000, 3, 32, 128) fp16 tensor: row offsets reach 2.2e9 elements
    (faulted with int32 offsets). The last 256 query rows against float64 SDPA."""
    torch.manual_seed(0)
    qkv = torch.randn(1, 180_000, 3, 32, 128, device="cuda", dtype=torch.float16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out = causal(q, k, v)[:, :, -256:]
    rows = q[:, :, -256:]
    assert_matches_reference(
        out,
        _causal_rows_reference(rows, k, v, torch.float64),
        _causal_rows_reference(rows, k, v, torch.float16),
        torch.float16,
    )


@pytest.mark.parametrize("Nq", [256, 8])
def test_bnhd_cache_past_int32_offsets_matches_sdpa(Nq):
    """k, v in (B, N, H, D) order with 2**20 + 256 rows of 16 heads (row offsets past 2**31), queried by
    Nq rows: the forward (256) and split-KV decoding (8)."""
    torch.manual_seed(1)
    kv = torch.randn(1, 2**20 + 256, 2, 16, 128, device="cuda", dtype=torch.float16)
    k, v = (kv[:, :, i].transpose(1, 2) for i in range(2))
    q = torch.randn(1, Nq, 16, 128, device="cuda", dtype=torch.float16).transpose(1, 2)
    assert_matches_reference(
        causal(q, k, v),
        _causal_rows_reference(q, k, v, torch.float64),
        _causal_rows_reference(q, k, v, torch.float16),
        torch.float16,
    )


def test_bench_command_end_to_end(tmp_path, monkeypatch):
    """`attnfuse bench` on the GPU: decoding rows and one forward row, each timed and checked against a
    baseline on the same inputs, then the JSON, the page and the plot written."""
    from attnfuse.bench.rows import Report
    from attnfuse.cli import main

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))  # not left set for later tests
    monkeypatch.setenv("ATTNFUSE_CACHE_DIR", str(tmp_path / "kernels"))
    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "md", "png")}
    assert (
        main(
            [
                "bench",
                "--suite",
                "decode,forward",
                "--geometry",
                "gpt2",
                "--N",
                "2048",
                "--variants",
                "causal",
                "--json",
                str(out["json"]),
                "--markdown",
                str(out["md"]),
                "--plot",
                str(out["png"]),
            ]
        )
        == 0
    )
    report = Report.from_json(out["json"].read_text())
    assert report.failures == []
    assert [row.suite for row in report.rows] == ["decode"] * 12 + ["forward"]
    for row in report.rows:
        assert isinstance(row.times["attnfuse"], float) and row.times["attnfuse"] > 0, row.case
        assert row.err is not None and row.err <= 1e-2, (row.case, row.err)
    forward = report.rows[-1]
    assert forward.case == "gpt2 N2048 causal"
    assert all(isinstance(forward.times[name], float) for name in ("fa2_triton", "flex"))
    page = out["md"].read_text()
    assert page.startswith(f"# Benchmarks: {torch.cuda.get_device_name(0)}, ")
    assert "## Decoding (one query per sequence, full cache)" in page and "## Forward" in page
    assert "](bench.png)" in page and out["png"].read_bytes()[:4] == b"\x89PNG"


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


@af.attention
def window_64(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 64, 0)) @ v


@pytest.mark.parametrize("program", [causal, window_64], ids=lambda p: p.__name__)
def test_masked_non_finite_values_bf16_forward_and_backward_match_the_math(program):
    """Rows that mask a key whose value is NaN or infinite stay finite, in the forward and in every gradient,
    as the float64 oracle's do (bf16 on the GPU; the CPU tests cover float16/32/64)."""
    torch.manual_seed(21)
    q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[0, 1, 300, 7], v[1, 3, 100, 9], v[1, 3, 101, 9] = float("nan"), float("inf"), float("-inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = program(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    oracle = [t.double().requires_grad_() for t in (q, k, v)]
    want = program.reference(*oracle)
    want.backward(dout.double())
    for got, expected in zip((out, *(t.grad for t in leaves)), (want, *(t.grad for t in oracle))):
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected))
    finite = torch.isfinite(want)
    assert (out.double()[finite] - want[finite]).abs().max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lq,lk",
    [([1], [1]), ([700, 0, 1, 300, 64], [700, 5, 1, 257, 0]), ([128] * 9, [128] * 9)],
    ids=["one-token", "mixed", "whole-blocks"],
)
def test_packed_sequences_match_each_document_alone(monkeypatch, dtype, lq, lk):
    """Packed calls (cu_seqlens), forward and gradients, against each document run alone through the float64
    reference: GQA, lengths 0 and 1, a pack of one token (Triton specialises its lengths to 1), Nq_i != Nk_i.
    It asks for them (ATTNFUSE_PACKED_ON_GPU=1), so it checks any architecture; a GPU runs them by default only
    on the architectures where it has passed (runtime/packed.py: GATE)."""
    monkeypatch.setenv("ATTNFUSE_PACKED_ON_GPU", "1")
    Hq, Hkv, D = 8, 2, 128
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
                  for n in (lq, lk))  # fmt: skip
    q = torch.randn(1, Hq, sum(lq), D, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, Hkv, sum(lk), D, device="cuda", dtype=dtype, requires_grad=True) for _ in "kv")
    program = EXAMPLES["gpt2"]
    out = program(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def per_document(dtype_=None):
        outs = []
        for i in range(len(lq)):
            rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            if keys.stop == keys.start:
                outs.append(torch.zeros_like(q[:, :, rows], dtype=dtype_ or torch.float64) * v.sum())
            elif rows.stop > rows.start:
                kwargs = {} if dtype_ is None else {"dtype": dtype_}
                outs.append(program.reference(q[:, :, rows], k[:, :, keys], v[:, :, keys], **kwargs))
        return torch.cat(outs, 2)

    ref, low = per_document(), per_document(dtype)
    assert_matches_reference(out, ref, low, dtype)
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowp = torch.autograd.grad(low, (q, k, v), dout)
    for got, w, lw, name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, w, lw, dtype, what=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "relu"])
def test_dropout_replays(monkeypatch, dtype, name):
    """Attention dropout on the GPU, forward and gradients, against the float64 reference replaying the call's
    mask (``af.dropout_keep``): GQA, ragged lengths, a normaliser with and without lse. It asks for the kernels
    with dropout (ATTNFUSE_DROPOUT_ON_GPU=1), so it checks any architecture; a GPU runs them by default only on the
    architectures where it has passed (runtime/dropout.py: GATE)."""
    monkeypatch.setenv("ATTNFUSE_DROPOUT_ON_GPU", "1")
    program, p = EXAMPLES[name], 0.3
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(2, 2, 333, 128, device="cuda", dtype=dtype, requires_grad=True) for _ in "kv")
    torch.manual_seed(11)
    out = program(q, k, v, dropout_p=p)
    torch.manual_seed(11)
    keep = af.dropout_keep(af.dropout_state(q.device), p, (2, 8, 300, 333))
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / keep.numel()) ** 0.5
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = program.reference(q, k, v, dropout_p=p, dropout_mask=keep)
    low = program.reference(q, k, v, dropout_p=p, dropout_mask=keep, dtype=dtype)
    assert_matches_reference(out, ref, low, dtype)
    if name == "relu":  # its weights' derivative jumps: low-precision gradients are not compared (smooth=False)
        return
    want = torch.autograd.grad(ref, (q, k, v), dout.double())
    lowp = torch.autograd.grad(low, (q, k, v), dout)
    for got, w, lw, grad_name in zip(grads, want, lowp, "qkv"):
        assert_matches_reference(got, w, lw, dtype, what=f"d{grad_name}")


@requires_cuda
@pytest.mark.parametrize("name", ["llama", "relu"])
def test_dropout_in_a_cuda_graph_draws_as_an_eager_call_and_afresh_at_each_replay(name):
    """The dropout state is drawn on the device from torch's graph-safe generator (runtime/dropout.py): a captured
    call, replayed after torch.manual_seed(s), gives bit for bit the eager call's out after torch.manual_seed(s), and
    the next replay draws another mask."""
    program, p = EXAMPLES[name], 0.3
    q = torch.randn(2, 8, 300, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 333, 128, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiles the kernels, off the capture
        program(q, k, v, dropout_p=p)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = program(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    eager = program(q, k, v, dropout_p=p)
    torch.manual_seed(5)
    graph.replay()
    assert torch.equal(captured, eager)
    first = captured.clone()
    graph.replay()
    assert not torch.equal(captured, first)
