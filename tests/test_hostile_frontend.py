"""Hostile use of the front end: what used to give silently wrong results or errors that named nothing."""

import re

import pytest
import torch

import attnfuse as af
from attnfuse import KernelCacheError, ProgramError
from attnfuse.runtime.launch import clear_cache
from attnfuse.runtime.source_cache import load_function
from attnfuse.testing import assert_matches_reference

WINDOW = 4  # read as a global by `global_window` below


@af.attention
def causal_softmax(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


def attention(q, k, v, scale=None, keep=None, dtype=torch.float64):
    """Hand-written softmax attention in ``dtype``; ``keep`` (Nq, Nk) bool."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def window_keep(Nq, Nk, left, right=0):
    """(Nq, Nk): keys within ``left`` before and ``right`` after each query's bottom-right position."""
    q_pos = torch.arange(Nq)[:, None] + Nk - Nq
    k_pos = torch.arange(Nk)[None, :]
    return (k_pos >= q_pos - left) & (k_pos <= q_pos + right)


def assert_attention(out, q, k, v, **kwargs):
    """``out`` equals the hand-written float64 attention within the tolerance of q's dtype."""
    assert_matches_reference(out, attention(q, k, v, **kwargs), attention(q, k, v, dtype=q.dtype, **kwargs))


def _qkv(seed, B=1, H=2, N=32, D=16, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, N, D, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3))


# 1. Double backward ------------------------------------------------------------------------------------------


def test_second_derivative_raises_and_first_derivative_matches_reference():
    q, k, v = _qkv(0, requires_grad=True)
    out = causal_softmax(q, k, v)
    gq, gk, gv = torch.autograd.grad(out.pow(2).sum(), (q, k, v), create_graph=True)
    with pytest.raises(af.UnsupportedError):  # the gradient is connected to q: no silent zero
        torch.autograd.grad(gq.sum(), (q, k, v))
    with pytest.raises(af.UnsupportedError, match="double backward through an attnfuse program is not supported"):
        gq.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(causal_softmax.reference(q64, k64, v64).pow(2).sum(), (q64, k64, v64))
    for got, want in zip((gq, gk, gv), ref):
        torch.testing.assert_close(got.detach().double(), want, atol=5e-5, rtol=0)


# 2. Values read from closures and globals ------------------------------------------------------------------


def test_changed_closure_value_traces_again():
    cfg = {"scale": 0.5}

    @af.attention
    def scaled(q, k, v):
        return af.softmax(af.scaled_dot_product(q, k, scale=cfg["scale"])) @ v

    q, k, v = _qkv(1)
    assert_attention(scaled(q, k, v), q, k, v, scale=0.5)
    cfg["scale"] = 2.0
    assert_attention(scaled(q, k, v), q, k, v, scale=2.0)


@af.attention
def global_window(q, k, v):
    mask = lambda s: af.sliding_window(s, WINDOW)  # noqa: E731 (a global read by a nested lambda)
    return af.softmax(mask(af.scaled_dot_product(q, k))) @ v


def test_changed_global_read_by_a_nested_lambda_traces_again(monkeypatch):
    q, k, v = _qkv(2)
    assert_attention(global_window(q, k, v), q, k, v, keep=window_keep(32, 32, WINDOW))
    monkeypatch.setitem(globals(), "WINDOW", 9)
    assert_attention(global_window(q, k, v), q, k, v, keep=window_keep(32, 32, 9))


def test_closure_over_a_tensor_names_the_variable():
    bias = torch.randn(1, 2, 32, 32, generator=torch.Generator().manual_seed(3))

    @af.attention
    def biased(q, k, v):
        return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v

    with pytest.raises(
        ProgramError,
        match=r"biased reads the closure variable 'bias', which holds a Tensor.*"
        r"pass 'bias' as an argument of the program",
    ):
        biased(*_qkv(3))


def test_a_program_reading_only_code_checks_nothing_per_call():
    assert causal_softmax._outside.empty  # reads `af` only: nothing to freeze at each call
    assert not global_window._outside.empty


# 5. Errors that name what is wrong -------------------------------------------------------------------------


@af.attention
def recursive(q, k, v):
    return recursive(q, k, v)


def test_a_program_calling_itself_is_refused():
    with pytest.raises(
        ProgramError,
        match=r"recursive calls itself while it is traced: a program cannot be "
        r"recursive",
    ):
        recursive(*_qkv(4))


def test_a_program_called_inside_another_is_refused():
    @af.attention
    def outer(q, k, v):
        return causal_softmax(q, k, v)

    with pytest.raises(
        ProgramError,
        match=r"causal_softmax is called inside another program: programs cannot be "
        r"called inside a program; compose their combinators instead",
    ):
        outer(*_qkv(5))


@af.attention
def named(query, key, value):
    return af.softmax(af.scaled_dot_product(query, key)) @ value


def test_q_k_v_bind_by_the_programs_own_names():
    q, k, v = _qkv(6)
    assert_attention(named(query=q, key=k, value=v), q, k, v)
    assert_attention(named(q, key=k, v=v), q, k, v)
    torch.testing.assert_close(named.reference(query=q, key=k, value=v), attention(q, k, v), atol=1e-12, rtol=0)
    with pytest.raises(TypeError, match=r"named\(\) got argument 'query' twice"):
        named(q, k, v, query=q)
    with pytest.raises(TypeError, match=r"named\(\) is missing the argument 'value'"):
        named(query=q, key=k)


@af.attention
def window(q, k, v, left):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left)) @ v


@pytest.mark.parametrize("good, bad", [(2, 2.0), (1, True)])
def test_trace_key_tells_types_apart(good, bad):
    q, k, v = _qkv(7)
    assert_attention(window(q, k, v, good), q, k, v, keep=window_keep(32, 32, good))
    with pytest.raises(ProgramError, match=rf"sliding_window: parameter 'left': must be an int >= 0, got {bad!r}"):
        window(q, k, v, bad)


# 3. The on-disk kernel cache -------------------------------------------------------------------------------


def _truncate(text):
    lines = text.splitlines(keepends=True)
    return "".join(lines[: len(lines) * 3 // 5])


def _flip_a_digit(text):  # the softmax's log2(e) * scale factor: a wrong temperature
    return re.sub(r"exp2\(s \* (\d)\.(\d)", lambda m: f"exp2(s * {m[1]}.{(int(m[2]) + 1) % 10}", text)


@pytest.mark.parametrize("corrupt", [_truncate, _flip_a_digit, lambda text: ""], ids=["truncated", "digit", "empty"])
def test_a_corrupted_cache_file_is_written_again(corrupt, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFUSE_CACHE_DIR", str(tmp_path))
    clear_cache()
    q, k, v = _qkv(8)
    assert_attention(causal_softmax(q, k, v), q, k, v, keep=window_keep(32, 32, 32))
    (path,) = tmp_path.glob("attnfuse_fwd_*.py")
    source = path.read_text()
    path.write_text(corrupt(source))
    assert path.read_text() != source
    clear_cache()
    assert_attention(causal_softmax(q, k, v), q, k, v, keep=window_keep(32, 32, 32))
    assert path.read_text() == source


def test_an_unwritable_cache_file_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNFUSE_CACHE_DIR", str(tmp_path))
    clear_cache()
    causal_softmax(*_qkv(9))
    (path,) = tmp_path.glob("attnfuse_fwd_*.py")
    path.unlink()
    path.mkdir()  # a directory where the kernel's file should be
    clear_cache()
    with pytest.raises(KernelCacheError, match=rf"kernel cache file {re.escape(str(path))} could not be written"):
        causal_softmax(*_qkv(9))


def test_a_kernel_source_that_fails_to_load_is_named(tmp_path):
    path = tmp_path / "attnfuse_fwd_broken.py"  # the source's readable copy: named, never read
    with pytest.raises(
        KernelCacheError,
        match=rf"generated kernel kernel could not be loaded: SyntaxError.*\(its "
        rf"source is in {re.escape(str(path))}\)",
    ):
        load_function("import triton\n\ndef kernel(\n", "kernel", path)
    with pytest.raises(
        KernelCacheError,
        match=r"generated kernel kernel could not be loaded: its source defines no "
        rf"function kernel \(its source is in {re.escape(str(path))}\)",
    ):
        load_function("x = 1\n", "kernel", path)


# 4. A BlockMask edited after it was built ------------------------------------------------------------------


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def _block_keep(active, block_size, N):
    """(N, N) element mask of a (QB, KB) block grid."""
    return active.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)[:N, :N]


EDITED = r"block_mask: its tensors were edited in place after it was built.*build a new mask"


def test_editing_a_block_mask_in_place_is_refused():
    q, k, v = _qkv(10, N=48)
    mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 48, 48, block_size=16)
    assert_attention(sparse(q, k, v, mask), q, k, v, keep=_block_keep(mask.active[0, 0], 16, 48))
    mask.active[0, 0, 2, 0] = False
    for use in (lambda: sparse(q, k, v, mask), lambda: sparse.reference(q, k, v, mask), mask.to_dense):
        with pytest.raises(af.InputError, match=EDITED):
            use()


def test_editing_the_tensor_a_block_mask_was_built_from_leaves_the_mask_as_built():
    q, k, v = _qkv(11, N=48)
    active = torch.rand(1, 1, 3, 3, generator=torch.Generator().manual_seed(11)) > 0.3
    built = active.clone()
    mask = af.BlockMask.from_blocks(active, 48, 48, block_size=16)
    active[0, 0, 0, 0] = ~active[0, 0, 0, 0]
    assert torch.equal(mask.active, built)
    assert_attention(sparse(q, k, v, mask), q, k, v, keep=_block_keep(built[0, 0], 16, 48))


def test_using_an_unedited_block_mask_derives_nothing_again(monkeypatch):
    q, k, v = _qkv(12, N=48)
    mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: (qb + kb) % 2 == 0, None, None, 48, 48, block_size=16)

    def derived_again(*args):
        raise AssertionError("the block lists were derived again")

    monkeypatch.setattr("attnfuse.block_mask._csr", derived_again)
    monkeypatch.setattr("attnfuse.block_mask._heaviest_first", derived_again)
    keep = _block_keep(mask.active[0, 0], 16, 48)
    for _ in range(2):
        assert_attention(sparse(q, k, v, mask), q, k, v, keep=keep)
    torch.testing.assert_close(sparse.reference(q, k, v, mask), attention(q, k, v, keep=keep), atol=1e-12, rtol=0)
    assert torch.equal(mask.to_dense()[0, 0], keep)


# 5. Windows wider than int32, block predicates of the wrong shape ------------------------------------------


@af.attention
def two_sided(q, k, v, left, right):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), left, right)) @ v


@pytest.mark.parametrize("left, right", [(2**31, 0), (2**31, 2**31), (3, 2**40), (2**30 - 1, 2**30), (2**30, 5)])
def test_a_window_wider_than_int32_keeps_everything_on_that_side(left, right):
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 24, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 40, 16, generator=g, requires_grad=True) for _ in range(2))
    keep = window_keep(24, 40, left, right)
    out = two_sided(q, k, v, left, right)
    assert_attention(out, q, k, v, keep=keep)
    dout = torch.randn(out.shape, generator=g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention(q64, k64, v64, keep=keep), (q64, k64, v64), dout.double())
    for got, w in zip(torch.autograd.grad(out, (q, k, v), dout), want):
        torch.testing.assert_close(got.double(), w, atol=5e-5, rtol=0)


def test_a_huge_negative_window_is_refused():
    with pytest.raises(ProgramError, match=r"sliding_window: parameter 'left': must be an int >= 0, got -2147483649"):
        window(*_qkv(14), -(2**31) - 1)


@pytest.mark.parametrize(
    "predicate, got",
    [
        (lambda b, h, qb, kb: torch.ones(5, 7, dtype=torch.bool), r"got shape \(5, 7\)"),
        (lambda b, h, qb, kb: (qb >= kb).transpose(-1, -2).expand(1, 1, 3, 4), r"got shape \(1, 1, 3, 4\)"),
        (lambda b, h, qb, kb: None, r"got NoneType"),
    ],
)
def test_a_block_predicate_of_the_wrong_shape_is_named(predicate, got):
    match = r"the block predicate must return a bool tensor broadcastable to \(B, H, QB, KB\) = \(2, 1, 4, 3\).*" + got
    with pytest.raises(af.InputError, match=match):
        af.create_block_mask_from_blocks(predicate, 2, None, 64, 48, block_size=16)
