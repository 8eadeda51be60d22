"""The fused forward against the float64 reference and torch SDPA, on CPU tensors (Triton's interpreter).

GPU runs of the same checks, with bfloat16 and larger shapes, are in test_gpu.py.
"""

import math

import pytest
import torch

import attnfuse as af
from attnfuse.block_mask import create_block_mask_from_blocks
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call, last_call


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def llama(q, k, v):
    s = af.rope(q, k)
    s = af.causal(s)
    return af.softmax(s) @ v


@af.attention
def window(q, k, v, left, right):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left, right)) @ v


@af.attention
def alibi_causal(q, k, v):
    return af.softmax(af.alibi(af.causal(af.scaled_dot_product(q, k)))) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


@af.attention
def rope_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def relu_causal(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v


def _qkv(B, Hq, Hkv, Nq, Nk, D, DV, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, Hq, Nq, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Nk, D, generator=g).to(dtype),
        torch.randn(B, Hkv, Nk, DV, generator=g).to(dtype),
    )


def _check(program, q, k, v, *extra, return_lse=True):
    out = program(q, k, v, *extra, return_lse=return_lse)
    out, lse = out if return_lse else (out, None)
    ref64 = program.reference(q, k, v, *extra, return_lse=return_lse)
    ref_lowp = program.reference(q, k, v, *extra, return_lse=return_lse, dtype=q.dtype)
    if return_lse:
        assert_matches_reference(out, ref64[0], ref_lowp[0], q.dtype)
        assert_matches_reference(lse, ref64[1], ref_lowp[1], q.dtype, what="lse")
    else:
        assert_matches_reference(out, ref64, ref_lowp, q.dtype)


SHAPES = [  # B, Hq, Hkv, Nq, Nk, D, DV
    (1, 2, 2, 64, 64, 32, 32),  # MHA, N a multiple of the interpreter's 32-blocks
    (2, 4, 2, 50, 77, 64, 64),  # GQA, Nq != Nk, neither a multiple of the block
    (1, 3, 1, 40, 40, 80, 80),  # MQA, head dim not a power of two
    (1, 2, 1, 33, 65, 16, 48),  # DV != D
]


@pytest.mark.parametrize("program", [dense, causal, llama, alibi_causal, relu_causal], ids=lambda p: p.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_variant_matrix(program, shape, dtype):
    q, k, v = _qkv(*shape, dtype)
    _check(program, q, k, v, return_lse=program is not relu_causal)


@pytest.mark.parametrize("left,right", [(0, 0), (5, 0), (17, 3), (100, 100)])
def test_sliding_window(left, right):
    q, k, v = _qkv(1, 2, 1, 70, 90, 32, 32, torch.float32, seed=left)
    _check(window, q, k, v, left, right)


@pytest.mark.parametrize("bias_shape", [(2, 4, 50, 77), (1, 4, 50, 77), (50, 77), (77,), (2, 1, 1, 77)])
def test_additive_bias_broadcasts(bias_shape):
    q, k, v = _qkv(2, 4, 2, 50, 77, 32, 32, torch.float32, seed=3)
    _check(biased, q, k, v, torch.randn(bias_shape))


def test_rope_tables_match_hf_convention():
    """cos/sin tables as HF builds them (with a scaled RoPE: here, linear scaling by 4) override theta."""
    q, k, v = _qkv(2, 2, 2, 40, 60, 32, 32, torch.float32, seed=5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)) / 4.0
    angles = torch.arange(60, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    _check(rope_tables, q, k, v, cos, sin)
    _check(rope_tables, q, k, v, cos[None].expand(2, 60, 32), sin[None].expand(2, 60, 32))


def test_rope_equals_pre_rotated_sdpa():
    """Independent of the reference evaluator: rotate q, k by hand (HF rotate_half), then torch SDPA."""
    q, k, v = _qkv(1, 4, 2, 48, 48, 64, 64, torch.float32, seed=7)
    pos = torch.arange(48, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    emb = torch.cat((pos[:, None] * inv_freq,) * 2, dim=-1)

    def rotate(x):
        x = x.double()
        x1, x2 = x.chunk(2, dim=-1)
        return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()

    expected = torch.nn.functional.scaled_dot_product_attention(
        rotate(q), rotate(k).repeat_interleave(2, 1), v.double().repeat_interleave(2, 1), is_causal=True
    )
    torch.testing.assert_close(llama(q, k, v).double(), expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("program,is_causal", [(dense, False), (causal, True)])
def test_matches_torch_sdpa(program, is_causal):
    q, k, v = _qkv(2, 4, 2, 64, 64, 32, 32, torch.float32, seed=11)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=is_causal, enable_gqa=True
    )
    torch.testing.assert_close(program(q, k, v).double(), expected, atol=2e-5, rtol=0)


def test_block_sparse_with_causal():
    q, k, v = _qkv(2, 2, 1, 100, 100, 32, 32, torch.float32, seed=13)
    table = torch.rand(2, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    mask = create_block_mask_from_blocks(
        lambda b, h, qb, kb: (table[b, h, qb, kb] > 0.5) | (qb == kb), 2, 2, 100, 100, block_size=32
    )
    _check(sparse, q, k, v, mask)


def test_causal_never_visits_keys_past_the_block():
    """Keys after a query block's last position are never loaded: NaN there must not reach its rows."""
    q, k, v = _qkv(1, 2, 2, 128, 128, 32, 32, torch.float32, seed=17)
    poisoned = v.clone()
    poisoned[:, :, 64:] = float("nan")
    out = causal(q, k, poisoned)
    assert torch.isnan(out[:, :, 64:]).all(dim=-1).any()  # later blocks do read them
    torch.testing.assert_close(out[:, :, :64], causal(q, k, v)[:, :, :64], atol=0, rtol=0)


def test_sliding_window_never_visits_blocks_outside_the_window():
    """With one query row, key blocks wholly before the window are skipped (NaN there stays unread)."""
    q, k, v = _qkv(1, 2, 2, 1, 200, 32, 32, torch.float32, seed=19)
    poisoned = v.clone()
    poisoned[:, :, :160] = float("nan")  # the window of the last position 199 with left=30 starts at 169
    torch.testing.assert_close(window(q, k, poisoned, 30, 0), window(q, k, v, 30, 0), atol=0, rtol=0)


def test_generated_source_splits_full_and_masked_blocks():
    q, k, v = _qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    source = causal.source(q, k, v)
    full_loop = source.split("# full blocks: no mask arithmetic")[1].split("# masked tail")[0]
    assert "for start_n in range(full_start, full_end, BLOCK_N)" in full_loop
    assert "keep" not in full_loop and "tl.where(keep" in source
    loops, redo = source.split("# A masked key's non-finite value reaches acc")
    assert loops.count("tl.dot(q, tl.trans(k)") == 2  # full blocks from key 0, then the masked diagonal
    assert "v_finite" not in loops  # values are tested only when a block's accumulator is not finite
    assert redo.count("tl.dot(q, tl.trans(k)") == 1 and "for start_n in range(start, hi, BLOCK_N)" in redo
    assert "v_finite" in redo
    assert "# masked head" not in source  # causal keeps keys from position 0: no masked blocks come first
    assert "# masked head" in window.source(q, k, v, 30, 0)  # a window's first blocks are partly masked
    assert "# masked head" not in dense.source(q, k, v)  # no mask: only the tail past the last full block


@af.attention
def negated(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k, scale=-0.2))) @ v


def test_softmax_folds_a_positive_scale_into_its_exponent():
    """With no score modification, the scale rides in the exponent (one multiply-add per score); a
    modification (ALiBi) needs the scaled scores, and a negative scale would not commute with the row max:
    both keep the explicit multiply. All match the reference."""
    q, k, v = _qkv(1, 2, 1, 70, 70, 32, 32, torch.float32, seed=23)
    folded = causal.source(q, k, v)
    assert "tl.math.exp2(s * " in folded and "s = s * " not in folded
    for program in (alibi_causal, negated):
        source = program.source(q, k, v)
        assert "s = s * " in source and "tl.math.exp2(s * " not in source
    for program in (causal, alibi_causal, negated):
        assert_matches_reference(
            program(q, k, v), program.reference(q, k, v), program.reference(q, k, v, dtype=torch.float32), torch.float32
        )


def test_whole_key_blocks_drop_the_load_masks():
    """EVEN_K: with every sequence's keys a multiple of BLOCK_N, the key-bound mask is constant true;
    a ragged length and per-sequence lengths keep it. All match the reference."""
    from attnfuse.runtime.inputs import KVCache, even_keys
    from attnfuse.passes.tile import TileConfig

    tiles = TileConfig(block_m=32, block_n=32)
    k = torch.zeros(1, 1, 64, 16)
    assert even_keys(KVCache(k=k, v=k, capacity=64, lens=None))(tiles)
    assert not even_keys(KVCache(k=k, v=k, capacity=70, lens=None))(tiles)
    assert even_keys(KVCache(k=k, v=k, capacity=64, lens=torch.tensor([64], dtype=torch.int32))) is False
    assert "k_ok = (k_idx < Nk) | EVEN_K" in causal.source(*_qkv(1, 2, 1, 64, 64, 32, 32, torch.float32))
    for Nk in (64, 70):
        q, k, v = _qkv(1, 2, 1, 40, Nk, 32, 32, torch.float32, seed=Nk)
        assert_matches_reference(
            causal(q, k, v), causal.reference(q, k, v), causal.reference(q, k, v, dtype=torch.float32), torch.float32
        )


def test_whole_query_blocks_drop_the_row_masks():
    """EVEN_M: with Nq a multiple of BLOCK_M (32 under the interpreter) the row mask of q's load and out's
    store is constant true; a ragged Nq keeps it. Both match the reference, with and without the lse."""
    assert "q_ok = (q_idx < Nq) | EVEN_M" in causal.source(*_qkv(1, 2, 1, 64, 64, 32, 32, torch.float32))
    for Nq in (64, 50):
        q, k, v = _qkv(1, 2, 1, Nq, 80, 32, 32, torch.float32, seed=Nq)
        for return_lse in (True, False):
            _check(causal, q, k, v, return_lse=return_lse)


def test_rope_rotates_q_once_and_each_k_tile():
    q, k, v = _qkv(1, 2, 2, 64, 64, 32, 32, torch.float32)
    source = llama.source(q, k, v)
    before_loop, loops = source.split("# full blocks", 1)
    assert "qk transform of q" in before_loop and "qk transform of k" not in before_loop
    loops, redo = loops.split("# A masked key's non-finite value reaches acc")
    assert loops.count("qk transform of k") == 2 and "qk transform of q" not in loops  # full blocks, diagonal
    assert redo.count("qk transform of k") == 1 and "qk transform of q" not in redo  # the careful pass's one loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_hoisted_transforms_leave_a_plain_kernel(monkeypatch, dtype):
    """With many query blocks, one pass rotates q and k once each and the attention kernel is a plain one
    (no rotation, whole head dims); hoisted and fused outputs both match the reference."""
    from attnfuse.runtime import hoisted, launch

    q, k, v = _qkv(2, 4, 2, 150, 170, 80, 48, dtype)  # 5 query blocks of 32 under the interpreter
    source = llama.source(q, k, v, kernel="transform")
    assert "qk transform of k" in source and "qk transform of q" in source
    launch.clear_cache()
    out = llama(q, k, v)
    assert hoisted_last_call()
    main = last_call().forward.main
    assert main.plan.config.q_transformed
    assert "qk transform" not in main.source and "tl.dot(q, tl.trans(k)" in main.source  # one whole product
    references = llama.reference(q, k, v), llama.reference(q, k, v, dtype=dtype)
    assert_matches_reference(out, *references, dtype)
    monkeypatch.setattr(hoisted, "HOIST_MIN_QUERY_BLOCKS", 10**9)
    launch.clear_cache()
    fused = llama(q, k, v)
    assert not hoisted_last_call()
    assert_matches_reference(fused, *references, dtype)


def test_key_pass_needs_key_transforms():
    q, k, v = _qkv(1, 2, 2, 40, 40, 32, 32, torch.float32)
    with pytest.raises(af.InputError, match="no key-side qk transform"):
        causal.source(q, k, v, kernel="transform")


def test_one_kernel_launch_per_call(monkeypatch):

    q, k, v = _qkv(1, 2, 2, 40, 40, 32, 32, torch.float32)
    llama(q, k, v)
    kernel = last_call().forward.kernel
    calls = []
    original = kernel.launch
    monkeypatch.setattr(kernel, "launch", lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    llama(q, k, v)
    assert len(calls) == 1


def test_fully_masked_rows_are_zero_not_nan():
    q, k, v = _qkv(1, 2, 2, 50, 20, 32, 32, torch.float32, seed=23)  # Nq > Nk: the first 30 rows see no key
    out, lse = causal(q, k, v, return_lse=True)
    assert torch.equal(out[:, :, :30], torch.zeros_like(out[:, :, :30]))
    assert torch.isneginf(lse[:, :, :30]).all() and torch.isfinite(lse[:, :, 30:]).all()
    _check(causal, q, k, v)


def test_scale_parameter():
    @af.attention
    def scaled(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k, scale=0.3)) @ v

    q, k, v = _qkv(1, 2, 2, 30, 30, 32, 32, torch.float32)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    torch.testing.assert_close(scaled(q, k, v).double(), expected, atol=2e-5, rtol=0)


def _paper_alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's default slopes (Press et al., 2022), written out as the paper's reference code and HF's
    ``build_alibi_tensor`` compute them: 2^(-8i/n), i = 1..n, for the closest power of two n <= heads;
    past it, the odd powers 1, 3, 5, ... of 2^(-4/n) (the 2n-head sequence's every other slope)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest) - 3))), dtype=torch.float64)
    slopes = torch.pow(base, torch.arange(1, 1 + closest, dtype=torch.float64))
    if closest != heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), dtype=torch.float64)
        remaining = min(closest, heads - closest)
        slopes = torch.cat((slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.float64))))
    return slopes


@af.attention
def alibi_only(q, k, v):
    return af.softmax(af.alibi(af.scaled_dot_product(q, k))) @ v


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20])
def test_alibi_default_slopes_are_the_papers(heads):
    """The kernel with the default slopes, and the reference, against attention with the paper's slopes
    computed here in float64: s + slope_h·(j - i') for query position i' = i + Nk - Nq."""
    q, k, v = _qkv(1, heads, heads, 24, 40, 16, 16, torch.float32, seed=heads)
    assert torch.equal(_paper_alibi_slopes(8), 2.0 ** (-torch.arange(1, 9, dtype=torch.float64)))  # 2^(-8i/8)
    distance = (torch.arange(40)[None, :] - (torch.arange(24) + 40 - 24)[:, None]).double()
    scores = q.double() @ k.double().transpose(-1, -2) * 16**-0.5
    want = torch.softmax(scores + _paper_alibi_slopes(heads).view(heads, 1, 1) * distance, -1) @ v.double()
    assert_matches_reference(
        alibi_only(q, k, v), want, alibi_only.reference(q, k, v, dtype=torch.float32), torch.float32
    )
    torch.testing.assert_close(alibi_only.reference(q, k, v), want, atol=1e-12, rtol=0)
