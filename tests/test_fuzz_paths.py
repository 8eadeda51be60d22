"""The property fuzzer over the call paths the plain conformance check does not draw: paged caches, kv_lens
with empty sequences, value rows poisoned with NaN, and qk transforms hoisted into passes (pre-rotated
RoPE). Programs come from every registered combinator; each result is compared with the float64 reference.
Hypothesis draws from the test id's seed (tests/conftest.py), so a rerun replays a failure, and prints the
blob that replays it alone."""

import contextlib

import attrs
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, note, seed, settings
from hypothesis import strategies as st

from attnfuse.errors import InputError
from attnfuse.runtime import hoisted
from attnfuse.testing.strategies import program_cases, shapes
from attnfuse.testing.tolerances import assert_matches_reference

from conftest import CUDA, fuzz_examples, hoisted_last_call, plan_setting, seed_of

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = (torch.float16, torch.bfloat16, torch.float32) if CUDA else (torch.float32, torch.float16)
FUZZ = settings(
    max_examples=fuzz_examples(8, 60),
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _paged(k: torch.Tensor, v: torch.Tensor, page_size: int, data) -> tuple[torch.Tensor, ...]:
    """k, v (B, Hkv, Nk, D), Nk a multiple of ``page_size``, as pools (pages, page_size, Hkv, D) in a drawn
    page order, and the block table (B, Nk // page_size) int32."""
    B, Hkv, Nk, _ = k.shape
    per_seq = Nk // page_size
    order = torch.tensor(data.draw(st.permutations(range(B * per_seq)), label="page order"), dtype=torch.int32)

    def pool(x):
        pages = (
            x.reshape(B, Hkv, per_seq, page_size, -1).permute(0, 2, 3, 1, 4).reshape(B * per_seq, page_size, Hkv, -1)
        )
        out = torch.empty_like(pages)
        out[order.long()] = pages
        return out

    return pool(k), pool(v), order.reshape(B, per_seq).to(k.device)


def _compare(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, dtype, what: str) -> None:
    """NaN exactly where the reference has NaN; elsewhere within the dtype's tolerance."""
    nan = torch.isnan(ref64)
    assert torch.equal(torch.isnan(out.cpu()), nan.cpu()), f"{what}: NaN where the reference has none, or not"
    assert_matches_reference(
        out.masked_fill(nan.to(out.device), 0),
        ref64.masked_fill(nan, 0),
        ref_lowp.masked_fill(nan, 0),
        dtype,
        what=what,
    )


@pytest.mark.parametrize("path", ["paged", "empty_sequences", "nan_values", "hoisted"])
def test_program_paths(path, request):
    @FUZZ
    @seed(seed_of(request.node.nodeid))
    @given(data=st.data())
    def conforms(data):
        shape = data.draw(shapes(max_n=64, head_dims=(16, 32)), label="shape")
        if path == "paged":  # the cache's capacity is whole pages
            page_size = data.draw(st.sampled_from([16, 32]), label="page size")
            shape = attrs.evolve(shape, Nk=-(-shape.Nk // page_size) * page_size)
        case = data.draw(program_cases(shape), label="program")
        dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
        q, k, v = case.inputs(dtype, DEVICE, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))
        extras = dict(case.extras_on(DEVICE))
        call: dict = {}
        if path in ("paged", "empty_sequences"):
            lo = 0 if path == "empty_sequences" else min(shape.Nq, shape.Nk)
            lens = data.draw(st.lists(st.integers(lo, shape.Nk), min_size=shape.B, max_size=shape.B), label="kv_lens")
            if path == "empty_sequences":
                lens[data.draw(st.integers(0, shape.B - 1), label="empty")] = 0
            call["kv_lens"] = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        if path == "nan_values":
            rows = data.draw(st.lists(st.integers(0, shape.Nk - 1), min_size=1, max_size=3), label="NaN rows")
            v = v.clone()
            v[:, :, rows] = float("nan")
        note(f"program: {case.text}; {path}: {call}")
        try:
            ref64 = case.program.reference(q, k, v, dtype=torch.float64, **extras, **call)
        except InputError as error:  # e.g. RoPE tables and queries before an empty sequence's first key
            with pytest.raises(InputError) as raised:
                case.program(q, k, v, **extras, **call)
            assert str(raised.value).split(":")[0] == str(error).split(":")[0]  # the same argument named
            return
        ref_lowp = case.program.reference(q, k, v, dtype=dtype, **extras, **call)
        if path == "paged":
            k, v, call["block_table"] = _paged(k, v, page_size, data)
            call["kv_layout"] = "NHD"  # the pools _paged builds (a shape may fit both layouts)
        out = case.program(q, k, v, **extras, **call)
        _compare(out, ref64, ref_lowp, dtype, f"out of {case.text}")

    # "hoisted": hoist whenever the program has a qk transform to hoist
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1) if path == "hoisted" else contextlib.nullcontext():
        conforms()


def test_a_patched_plan_setting_reaches_calls_planned_before_and_ends_with_the_block():
    """``plan_setting`` (what the hoisted fuzz path runs under): a call signature planned before the block is
    planned again under the setting, and one planned under it again after."""
    from attnfuse.examples import llama

    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 1, 20, 16), torch.randn(1, 1, 20, 16)
    llama(q, k, v)
    assert not hoisted_last_call()  # one query block: not worth hoisting
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1):
        llama(q, k, v)
        assert hoisted_last_call()
    llama(q, k, v)
    assert not hoisted_last_call()
