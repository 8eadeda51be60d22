"""The warm call: one ``Call`` per call signature (``runtime.launch.planned``). An equal signature is a hit
(nothing decided again); a change of any component a kernel depends on is a miss that decides a new
``Call``, and that call's result is right for the new metadata. A call generates its backward kernels only
when a gradient is first computed."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.runtime import launch

from conftest import last_call


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


@af.attention
def windowed(q, k, v):
    return af.softmax(af.sliding_window(af.rope(q, k), 5)) @ v


def _tensors(Nq: int = 8, Nk: int = 12, D: int = 16):
    q = torch.randn(1, 2, Nq, D)
    k, v = torch.randn(1, 2, Nk, D), torch.randn(1, 2, Nk, D)
    return q, k, v, torch.randn(1, 2, Nq, Nk)


def _planned(graph, q, k, v, bias, **flags):
    options = {
        "kv_lens": None,
        "block_table": None,
        "return_lse": False,
        "grads": None,
        "split_kv": False,
        "positions": None,
        **flags,
    }
    kv_lens, block_table = options.pop("kv_lens"), options.pop("block_table")
    return launch.planned(graph, q, k, v, {"bias": bias}, kv_lens, block_table, **options)


@pytest.fixture
def decided(monkeypatch):
    """The signatures ``launch._decide`` was asked about, in order (the calls start from an empty cache)."""
    launch.clear_cache()
    asked = []
    decide = launch._decide

    def counting(*args):
        asked.append(args)
        return decide(*args)

    monkeypatch.setattr(launch, "_decide", counting)
    return asked


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values with the same shape and other strides (heads innermost but one)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def test_an_equal_signature_is_a_hit_with_fresh_values(decided):
    q, k, v, bias = _tensors()
    graph = biased.graph(bias)
    first = _planned(graph, q, k, v, bias)
    again = _planned(graph, *(torch.randn_like(t) for t in (q, k, v, bias)))
    assert again is first and len(decided) == 1


MISSES = {  # each changes one component of the signature of _tensors' call
    "program": lambda g, q, k, v, b: (windowed.graph(), q, k, v, b, {}),
    "q shape": lambda g, q, k, v, b: (g, q[:, :, :6], k, v, b[:, :, :6], {}),
    "q strides": lambda g, q, k, v, b: (g, _strided(q), k, v, b, {}),
    "k strides": lambda g, q, k, v, b: (g, q, _strided(k), v, b, {}),
    "v strides": lambda g, q, k, v, b: (g, q, k, _strided(v), b, {}),
    "k dtype": lambda g, q, k, v, b: (g, q.double(), k.double(), v.double(), b, {}),
    "bias shape": lambda g, q, k, v, b: (g, q, k, v, b[:, :1], {}),
    "bias strides": lambda g, q, k, v, b: (g, q, k, v, b.transpose(2, 3).contiguous().transpose(2, 3), {}),
    "bias dtype": lambda g, q, k, v, b: (g, q, k, v, b.double(), {}),
    "kv_lens": lambda g, q, k, v, b: (g, q, k, v, b, {"kv_lens": torch.tensor([10], dtype=torch.int32)}),
    "return_lse": lambda g, q, k, v, b: (g, q, k, v, b, {"return_lse": True}),
    "gradients": lambda g, q, k, v, b: (g, q, k, v, b, {"grads": ()}),
    "split_kv": lambda g, q, k, v, b: (g, q, k, v, b, {"split_kv": None}),
}


@pytest.mark.parametrize("change", MISSES)
def test_a_change_of_any_component_is_a_miss(decided, change):
    q, k, v, bias = _tensors()
    graph = biased.graph(bias)
    first = _planned(graph, q, k, v, bias)
    *args, flags = MISSES[change](graph, q, k, v, bias)
    other = _planned(*args, **flags)
    assert other is not first and len(decided) == 2
    assert _planned(*args, **flags) is other and len(decided) == 2  # and then a hit


def test_tf32_and_positions_and_device_are_in_the_signature(decided):
    q, k, v, bias = _tensors()
    graph = biased.graph(bias)
    first = _planned(graph, q, k, v, bias)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    try:
        assert _planned(graph, q, k, v, bias) is not first
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    positions = launch.check_positions(3, 0, None, q.shape[2], k.shape[2], None, None)
    assert _planned(windowed.graph(), q, k, v, bias, positions=positions) is not _planned(
        windowed.graph(), q, k, v, bias
    )
    assert launch._meta(q) != launch._meta(q.to("meta"))  # no second device here: the metadata differ


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_after_a_stride_change_the_result_is_right(which):
    q, k, v, bias = _tensors()
    tensors = {"q": q, "k": k, "v": v}
    biased(q, k, v, bias)  # the contiguous signature first
    tensors[which] = _strided(tensors[which])
    assert tensors[which].stride() != {"q": q, "k": k, "v": v}[which].stride()
    out = biased(tensors["q"], tensors["k"], tensors["v"], bias)
    expected = biased.reference(q, k, v, bias, dtype=torch.float64)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def _built_backward() -> bool:
    return any(isinstance(what, tuple) and "backward" in what[0] for what in last_call().compiled._built)


@pytest.mark.parametrize("Nq", [8, 64])  # 64 rows: worth hoisting rope into passes
def test_the_backward_is_generated_when_a_gradient_is_first_computed(Nq):
    launch.clear_cache()
    q, k, v = (torch.randn(1, 2, Nq, 16, requires_grad=True) for _ in range(3))
    out = windowed(q, k, v)
    assert not _built_backward(), "a forward that wants gradients generated its backward already"
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert _built_backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(windowed.reference(q64, k64, v64, dtype=torch.float64), (q64, k64, v64), dout.double())
    for got, want in zip((dq, dk, dv), ref):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("limit", [200, 1000, 5000])
def test_the_quick_offset_decision_never_says_fit_where_the_layouts_do_not(monkeypatch, limit):
    """A new signature decides 64-bit offsets from the tensors' element counts when that settles it, and
    builds the layouts the runtime allocates only otherwise: the quick answer "fits" must agree with them."""
    from attnfuse.runtime import inputs, offsets

    monkeypatch.setattr(offsets, "OFFSET_LIMIT", limit)
    generator = torch.Generator().manual_seed(limit)
    for _ in range(200):
        B, H, N, D, width = (int(torch.randint(1, hi, (), generator=generator)) for hi in (3, 5, 40, 24, 40))
        order = torch.randperm(4, generator=generator).tolist()
        t = torch.empty([(B, H, N, D)[i] for i in order]).permute(*sorted(range(4), key=order.__getitem__))
        width = max(width, D)
        if offsets.rows_fit(t) and offsets.any_layout_fits(t, width):
            assert inputs._layouts_fit((t,), width), (t.shape, t.stride(), width)
