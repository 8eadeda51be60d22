"""Inputs a program cannot take give an InputError naming the argument; odd but valid inputs work.

The error tests fail before any kernel is launched. The edge-case tests run the fused kernel through
Triton's interpreter (CPU tensors) on tiny shapes and compare it with the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnfuse as af
from attnfuse import InputError
from attnfuse.block_mask import create_block_mask_from_blocks

B, H, N, D = 1, 2, 8, 16


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def qkv(B=B, Hq=H, Nq=N, D=D, Hkv=None, Nk=None, DV=None, dtype=torch.float32):
    Hkv = Hq if Hkv is None else Hkv
    Nk = Nq if Nk is None else Nk
    DV = D if DV is None else DV
    return rand(B, Hq, Nq, D, dtype=dtype), rand(B, Hkv, Nk, D, dtype=dtype), rand(B, Hkv, Nk, DV, dtype=dtype)


@af.attention
def sdpa(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


@af.attention
def rotary(q, k, v, cos=None, sin=None):
    return af.softmax(af.rope(q, k, cos=cos, sin=sin)) @ v


@af.attention
def alibi(q, k, v, slopes):
    return af.softmax(af.alibi(af.scaled_dot_product(q, k), slopes)) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)
    assert issubclass(InputError, af.AttnFuseError)


# --- q, k, v --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize(
    "bad", [lambda t: t.tolist(), lambda t: t.numpy(), lambda t: None], ids=["list", "ndarray", "None"]
)
def test_not_a_tensor(which, bad):
    args = list(qkv())
    args[which] = bad(args[which])
    name = "qkv"[which]
    with pytest.raises(InputError, match=rf"^{name} must be a torch\.Tensor, got "):
        sdpa(*args)
    with pytest.raises(InputError, match=rf"^{name} must be a torch\.Tensor"):
        sdpa.reference(*args)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize(
    "reshape", [lambda t: t[0], lambda t: t[None], lambda t: t.flatten()], ids=["3-D", "5-D", "1-D"]
)
def test_not_4d(which, reshape):
    args = list(qkv())
    args[which] = reshape(args[which])
    name = "qkv"[which]
    with pytest.raises(InputError, match=rf"^{name} must be 4-D \(B, H, N, D\), got shape "):
        sdpa(*args)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_mixed_dtypes(which):
    args = list(qkv())
    args[which] = args[which].half()
    with pytest.raises(
        InputError,
        match=r"q, k and v must share one dtype, got q torch\.float(32|16), "
        r"k torch\.float(32|16), v torch\.float(32|16)",
    ):
        sdpa(*args)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_unsupported_dtype(dtype):
    q, k, v = (t.to(dtype) for t in qkv())
    with pytest.raises(InputError, match=rf"q has dtype {dtype}; allowed: float16, bfloat16, float32, float64"):
        sdpa(q, k, v)


def test_unsupported_dtype_of_k_only_named():
    q, k, v = qkv()
    with pytest.raises(InputError, match=r"^k has dtype torch\.int32"):
        sdpa(q, k.int(), v)


def test_mixed_devices():
    q, k, v = qkv()
    try:
        k_meta = k.to("meta")
    except Exception as exc:  # pragma: no cover - every torch build has the meta device
        pytest.skip(f"no second device type available: {exc}")
    with pytest.raises(InputError, match=r"q, k and v must be on one device, got q cpu, k meta, v cpu"):
        sdpa(q, k_meta, v)


def test_unsupported_device():
    q, k, v = (t.to("meta") for t in qkv())
    with pytest.raises(InputError, match=r"tensors on meta are not supported; use a CUDA device, or the CPU"):
        sdpa(q, k, v)


def test_head_dims_of_q_and_k_differ():
    q, _, v = qkv()
    with pytest.raises(InputError, match=r"q and k must have the same head dim, got 16 and 32"):
        sdpa(q, rand(B, H, N, 32), v)


@pytest.mark.parametrize("Hq, Hkv", [(3, 2), (2, 4), (1, 2)])
def test_hq_not_a_multiple_of_hkv(Hq, Hkv):
    q, k, v = qkv(Hq=Hq, Hkv=Hkv)
    with pytest.raises(InputError, match=rf"q's head count Hq={Hq} must be a multiple of k's and v's Hkv={Hkv}"):
        sdpa(q, k, v)


def test_zero_kv_heads():
    q, k, v = qkv(Hkv=0)
    with pytest.raises(InputError, match=r"Hq=2 must be a multiple of k's and v's Hkv=0"):
        sdpa(q, k, v)


def test_k_and_v_lengths_differ():
    q, k, _ = qkv()
    with pytest.raises(InputError, match=r"k and v must have the same sequence length, got 8 and 7"):
        sdpa(q, k, rand(B, H, 7, D))


def test_k_and_v_head_counts_differ():
    q, k, _ = qkv()
    with pytest.raises(InputError, match=r"k and v must have the same number of heads, got 2 and 1"):
        sdpa(q, k, rand(B, 1, N, D))


@pytest.mark.parametrize("batches", [(2, 1, 1), (1, 2, 1), (1, 1, 2)])
def test_batch_mismatch(batches):
    q, k, v = (rand(b, H, N, D) for b in batches)
    with pytest.raises(InputError, match=r"q, k and v must share the batch size, got {}, {}, {}".format(*batches)):
        sdpa(q, k, v)


def test_head_dim_above_256():
    q, k, v = qkv(D=272, DV=16)
    with pytest.raises(InputError, match=r"the head dim of q and k must be between 1 and 256, got 272"):
        sdpa(q, k, v)


def test_value_head_dim_above_256():
    q, k, v = qkv(D=16, DV=320)
    with pytest.raises(InputError, match=r"the head dim of v must be between 1 and 256, got 320"):
        sdpa(q, k, v)


def test_zero_head_dim():
    q, k, v = qkv(D=0, DV=16)
    with pytest.raises(InputError, match=r"the head dim of q and k must be between 1 and 256, got 0"):
        sdpa(q, k, v)


def test_bfloat16_on_cpu():
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"bfloat16 on the CPU would run through Triton's interpreter"):
        sdpa(q, k, v)


def test_input_requiring_grad_without_a_declared_gradient():
    @af.attention
    def with_slopes(q, k, v, slopes):
        return af.softmax(af.alibi(af.scaled_dot_product(q, k), slopes)) @ v

    q, k, v = qkv()
    slopes = torch.rand(q.shape[1], requires_grad=True)
    with pytest.raises(
        InputError,
        match=r"alibi: its input 'slopes' \(argument 'slopes'\) requires grad, but alibi "
        r"declares no gradient for it; pass it detached",
    ):
        with_slopes(q, k, v, slopes)


# --- extra arguments --------------------------------------------------------------------------------------


def test_extra_argument_of_unsupported_type():
    with pytest.raises(
        InputError,
        match=r"biased\(\): argument 'bias' must be a tensor, a BlockMask, or a "
        r"static None/bool/int/float/str, got list",
    ):
        biased(*qkv(), [[0.0]])


def test_missing_extra_argument():
    with pytest.raises(TypeError, match=r"biased\(\) is missing the argument 'bias'"):
        biased(*qkv())


def test_unexpected_extra_argument():
    with pytest.raises(TypeError, match=r"sdpa\(\) got an unexpected argument 'bias'"):
        sdpa(*qkv(), bias=rand(1))


def test_too_many_extra_arguments():
    with pytest.raises(TypeError, match=r"sdpa\(\) takes q, k, v and 0 extra argument\(s\), got 1 extra"):
        sdpa(*qkv(), rand(1))


# --- runtime inputs of plugins ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 3, N, N), (N, N + 1), (2, H, N, N)])
def test_additive_bias_does_not_broadcast(shape):
    bias = rand(*shape)
    match = r"additive_bias: bias of shape .* does not broadcast to \(B, Hq, Nq, Nk\) = \(1, 2, 8, 8\)"
    with pytest.raises(InputError, match=match):
        biased(*qkv(), bias)
    with pytest.raises(InputError, match=match):
        biased.reference(*qkv(), bias)


def test_additive_bias_not_float():
    with pytest.raises(InputError, match=r"additive_bias: bias must be a float tensor, got torch\.int64"):
        biased(*qkv(), torch.ones(1, 1, N, N, dtype=torch.int64))


@pytest.mark.parametrize("given", ["cos", "sin"])
def test_rope_with_only_one_table(given):
    table = rand(N, D)
    with pytest.raises(InputError, match=r"rope: pass both cos and sin, or neither"):
        rotary(*qkv(), **{given: table})


@pytest.mark.parametrize("shape", [(N, D // 2), (N - 1, D), (3, N, D), (N,)])
def test_rope_table_of_wrong_shape(shape):
    with pytest.raises(
        InputError,
        match=r"rope: cos must have shape \(Nk, D\) or \(B, Nk, D\) = \(8, 16\) "
        r"or \(1, 8, 16\).*got " + str(tuple(shape)).replace("(", r"\(").replace(")", r"\)"),
    ):
        rotary(*qkv(), rand(*shape), rand(*shape))


def test_rope_table_not_float():
    with pytest.raises(InputError, match=r"rope: cos must be a float tensor"):
        rotary(*qkv(), torch.ones(N, D, dtype=torch.int64), rand(N, D))


def test_rope_tables_need_nq_at_most_nk():
    q, k, v = qkv(Nq=8, Nk=4)
    with pytest.raises(
        InputError,
        match=r"rope: cos/sin tables are indexed by position, so they need Nq <= Nk "
        r"\(got Nq=8, Nk=4\)",
    ):
        rotary(q, k, v, rand(4, D), rand(4, D))


def test_rope_odd_head_dim():
    q, k, v = qkv(D=15)
    with pytest.raises(
        InputError,
        match=r"qk transforms \(rope\) act on the two halves of the head dim, so it "
        r"must be even; got D=15",
    ):
        rotary(q, k, v)
    with pytest.raises(InputError, match=r"rope: the head dim must be even"):
        rotary.reference(q, k, v)


@pytest.mark.parametrize(
    "slopes",
    [lambda: rand(3), lambda: rand(1, H), lambda: torch.ones(H, dtype=torch.int64)],
    ids=["(3,)", "(1, H)", "int"],
)
def test_alibi_slopes_of_wrong_shape(slopes):
    with pytest.raises(InputError, match=r"alibi: slopes must be a float tensor of shape \(Hq,\) = \(2,\)"):
        alibi(*qkv(), slopes())


def test_block_sparse_mask_for_another_nq():
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 4 * N, N, block_size=16)
    match = (
        r"block_sparse: block_mask was built for B=1, H=1, Nq=32, Nk=8; "
        r"the call has B=1, Hq=2, Nq=8, Nk=8"
    )
    with pytest.raises(InputError, match=match):
        sparse(*qkv(), mask)
    with pytest.raises(InputError, match=match):
        sparse.reference(*qkv(), mask)


def test_block_sparse_mask_for_another_batch_and_head_count():
    mask = create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, 3, 5, N, N, block_size=16)
    with pytest.raises(
        InputError,
        match=r"block_sparse: block_mask was built for B=3, H=5, Nq=8, Nk=8; "
        r"the call has B=1, Hq=2",
    ):
        sparse(*qkv(), mask)


def test_block_sparse_given_a_tensor():
    with pytest.raises(InputError, match=r"block_sparse: block_mask must be an attnfuse BlockMask.*got Tensor"):
        sparse(*qkv(), torch.ones(1, 1, 1, 1, dtype=torch.bool))


# --- valid edge cases -------------------------------------------------------------------------------------


def assert_matches(program, q, k, v, *extra, return_lse=False, **kwargs):
    """The fused result against the float64 reference; returns the fused result."""
    result = program(q, k, v, *extra, return_lse=return_lse, **kwargs)
    expected = program.reference(q, k, v, *extra, return_lse=return_lse, **kwargs)
    if return_lse:
        (out, lse), (ref, ref_lse) = result, expected
        assert lse.dtype == torch.float32
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    else:
        out, ref = result, expected
    assert out.dtype == q.dtype
    assert out.shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    return result


def test_one_key():
    q, k, v = qkv(Nk=1)
    out = assert_matches(sdpa, q, k, v)
    # one key: every query's weight on it is 1
    torch.testing.assert_close(out, v.expand_as(out), atol=1e-6, rtol=1e-6)


def test_one_query():
    assert_matches(sdpa, *qkv(Nq=1, Nk=N))
    assert_matches(causal, *qkv(Nq=1, Nk=N), return_lse=True)


def test_more_queries_than_keys_with_causal_masks_whole_rows():
    Nq, Nk = 8, 3
    q, k, v = qkv(Nq=Nq, Nk=Nk)
    out, lse = assert_matches(causal, q, k, v, return_lse=True)
    masked = Nq - Nk  # query i sits at position i + Nk - Nq: the first Nq - Nk rows see no key
    assert torch.equal(out[:, :, :masked], torch.zeros_like(out[:, :, :masked]))
    assert torch.isneginf(lse[:, :, :masked]).all()
    assert torch.isfinite(lse[:, :, masked:]).all()
    assert out[:, :, masked:].abs().sum() > 0
    assert not torch.isnan(out).any()


def test_non_contiguous_bnhd_inputs():
    q, k, v = (rand(B, N, H, D).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    out = assert_matches(causal, q, k, v)
    contiguous = causal(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(out, contiguous, atol=1e-6, rtol=1e-6)


def test_output_keeps_the_memory_order_of_q():
    q = rand(B, N, H, D).transpose(1, 2)
    k, v = (rand(B, H, N, D) for _ in range(2))
    out = assert_matches(sdpa, q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    assert not out.is_contiguous()
    out_contiguous_q = sdpa(q.contiguous(), k, v)
    assert out_contiguous_q.is_contiguous()


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dims_not_powers_of_two(head_dim):
    assert_matches(causal, *qkv(D=head_dim), return_lse=True)


@pytest.mark.parametrize("D, DV", [(32, 16), (16, 48)])
def test_value_head_dim_differs(D, DV):
    q, k, v = qkv(D=D, DV=DV)
    out = assert_matches(causal, q, k, v)
    assert out.shape == (B, H, N, DV)


def test_mqa():
    q, k, v = qkv(Hq=4, Hkv=1)
    assert_matches(causal, q, k, v, return_lse=True)


def test_gqa():
    q, k, v = qkv(Hq=4, Hkv=2)
    assert_matches(sdpa, q, k, v)


def test_rope_with_odd_lengths_and_gqa():
    q, k, v = qkv(Hq=4, Hkv=2, Nq=5, Nk=11)
    assert_matches(rotary, q, k, v)


def test_broadcast_bias():
    q, k, v = qkv()
    assert_matches(biased, q, k, v, rand(1, 1, 1, N))


def test_zero_size_batch():
    q, k, v = qkv(B=0, DV=24)
    out = sdpa(q, k, v)
    assert out.shape == (0, H, N, 24)
    assert out.dtype == torch.float32
    out, lse = causal(q, k, v, return_lse=True)
    assert out.shape == (0, H, N, 24) and lse.shape == (0, H, N)


def test_float16_inputs():
    q, k, v = qkv(dtype=torch.float16)
    out = causal(q, k, v)
    assert out.dtype == torch.float16
    ref = causal.reference(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    assert math.isfinite(out.float().abs().max().item())
