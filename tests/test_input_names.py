"""``af.run_attention`` with a runtime input missing or misspelled: an InputError naming the input, the names
the program expects and, for a misspelling, the given name closest to it (no kernel is compiled for it)."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse import InputError

B, H, N, D = 1, 2, 16, 16


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v


@af.attention
def sinks_and_tables(q, k, v, cos, sin, sinks):
    return af.softmax_with_sinks(af.causal(af.rope(q, k, cos=cos, sin=sin)), sinks) @ v


@af.attention
def sparse_alibi(q, k, v, block_mask, slopes):
    return af.softmax(af.alibi(af.block_sparse(af.scaled_dot_product(q, k), block_mask), slopes)) @ v


def _inputs(names: tuple[str, ...]) -> dict:
    made = {
        "bias": torch.randn(B, H, N, N),
        "cos": torch.randn(N, D),
        "sin": torch.randn(N, D),
        "sinks": torch.randn(H),
        "slopes": torch.rand(H),
        "block_mask": af.BlockMask.from_blocks(torch.rand(B, H, 1, 1) < 2, N, N, block_size=16),
    }
    return {name: made[name] for name in names}


def _qkv(nq: int = N):
    return torch.randn(B, H, nq, D), torch.randn(B, H, N, D), torch.randn(B, H, N, D)


PROGRAMS = [(biased, ("bias",)), (sinks_and_tables, ("cos", "sin", "sinks")), (sparse_alibi, ("block_mask", "slopes"))]


@pytest.mark.parametrize("nq", [N, 1], ids=["prefill", "decode"])
@pytest.mark.parametrize("program, names", PROGRAMS, ids=lambda p: getattr(p, "__name__", ""))
def test_each_missing_input_is_named_with_the_expected_names(program, names, nq):
    graph = program.graph(**_inputs(names))
    for missing in names:
        given = _inputs(tuple(n for n in names if n != missing))
        with pytest.raises(InputError) as info:
            af.run_attention(graph, *_qkv(nq), given)
        message = str(info.value)
        assert f"runtime input(s) {missing!r}, which the call does not give" in message
        assert f"expects inputs named {', '.join(map(repr, names))}" in message
        assert "did you mean" not in message
    with pytest.raises(InputError, match=r"got none"):
        af.run_attention(graph, *_qkv(nq))


@pytest.mark.parametrize("program, names", PROGRAMS, ids=lambda p: getattr(p, "__name__", ""))
def test_a_misspelled_input_suggests_its_name(program, names):
    graph = program.graph(**_inputs(names))
    for wrong in names:
        misspelled = wrong[:-1] + wrong[-1].upper() if len(wrong) > 3 else wrong + "s"
        given = {misspelled if n == wrong else n: value for n, value in _inputs(names).items()}
        with pytest.raises(InputError, match=rf"did you mean {wrong!r} for the given {misspelled!r}\?"):
            af.run_attention(graph, *_qkv(), given)


def test_an_input_the_program_does_not_read_is_allowed():
    """A program passes each of its tensor arguments, used or not: run_attention takes them."""
    q, k, v = _qkv()
    bias = torch.randn(B, H, N, N)
    out = af.run_attention(biased.graph(bias), q, k, v, {"bias": bias, "unused": torch.randn(3)})
    torch.testing.assert_close(out.double(), biased.reference(q, k, v, bias), atol=1e-5, rtol=1e-5)
