"""The conformance kit's packed calls: the document lengths it draws, and its check of a packed call against
each document run alone through the reference (which a whole-row result fails), or, for a program that indexes a
tensor by query and key, against the packed call's reference over the whole row."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnfuse as af
from attnfuse.examples import EXAMPLES
from attnfuse.passes import lower
from attnfuse.runtime import launch
from attnfuse.testing import program_case
from attnfuse.testing.program_case import check_program_case
from attnfuse.testing.strategies import ProgramCase, Shape, documents

PACKS = [([5, 0, 1, 9], [5, 3, 1, 12]), ([15], [21])]


@settings(max_examples=60, deadline=None, database=None)
@given(data=st.data(), Nq=st.integers(0, 40), extra=st.integers(0, 30))
def test_documents_fill_the_rows_with_keys_for_every_query(data, Nq, extra):
    queries, keys = data.draw(documents(Nq, Nq + extra))
    assert len(queries) == len(keys) >= 1
    assert sum(queries) == Nq and sum(keys) == Nq + extra
    assert all(0 <= q <= k for q, k in zip(queries, keys))


def _case(name: str, packed) -> ProgramCase:
    shape = Shape(B=1, Hq=4, Hkv=2, Nq=sum(packed[0]), Nk=sum(packed[1]), D=16, DV=16)
    return ProgramCase(program=EXAMPLES[name], text=name, shape=shape, extras={})


@pytest.mark.parametrize("name", ["gpt2", "llama", "alibi"])
@pytest.mark.parametrize("packed", PACKS, ids=["mixed", "one-document"])
def test_a_packed_call_matches_each_document_alone(name, packed):
    check_program_case(_case(name, packed), torch.float32, "cpu", seed=3, grads=True, packed=packed)


def test_a_result_that_attends_across_documents_fails(monkeypatch):
    """The check can fail: a reference over the whole row (what a kernel ignoring the documents computes) differs
    from the packed call's."""
    packed = PACKS[0]

    def whole_row(case, q, k, v, extras, packed, has_lse, dtype):
        found = case.program.reference(q, k, v, return_lse=has_lse, dtype=dtype, **extras)
        return found if has_lse else (found, None)

    monkeypatch.setattr(program_case, "_packed_reference", whole_row)
    with pytest.raises(AssertionError, match="out of gpt2"):
        check_program_case(_case("gpt2", packed), torch.float32, "cpu", seed=3, packed=packed)


def test_a_tensor_indexed_by_query_and_key_is_checked_over_the_packed_row():
    """A bias over the packed row (1, Hq, total_q, total_k): the kit checks the call against the packed call's
    reference (the whole row), and a planted misreading (each document reading the bias at its local rows, as
    if it began at row 0) fails; with gradients, the bias's too."""

    @af.attention
    def biased(q, k, v, bias):
        return af.softmax(af.additive_bias(af.scaled_dot_product(q, k), bias)) @ v

    packed = PACKS[0]
    shape = Shape(B=1, Hq=2, Hkv=2, Nq=sum(packed[0]), Nk=sum(packed[1]), D=16, DV=16)
    bias = torch.randn(1, 2, shape.Nq, shape.Nk)
    case = ProgramCase(program=biased, text="biased", shape=shape, extras={"bias": bias})
    check_program_case(case, torch.float32, "cpu", seed=0, packed=packed, grads=True)
    q, k, v = case.inputs(torch.float32, "cpu", 0)  # the call takes the bias's gradient: the kit checked it
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in packed]
    leaf = bias.detach().requires_grad_(True)
    out = biased(q, k, v, leaf, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    assert torch.autograd.grad(out.sum(), leaf)[0].shape == bias.shape
    case = attrs.evolve(case, extras={"bias": bias.detach()})
    local = {"(q_start + q_idx)": "q_idx", "(k_start + k_idx)": "k_idx"}
    planted = lambda inst: attrs.evolve(inst, fragment=lower._rewritten(inst.fragment, lambda t: _undo(t, local)))  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lower, "packed_rows", planted)
        launch.clear_cache()
        with pytest.raises(AssertionError):
            check_program_case(case, torch.float32, "cpu", seed=0, packed=packed)
    launch.clear_cache()


def _undo(text: str, renamed: dict[str, str]) -> str:
    for packed_rows, local in renamed.items():
        text = text.replace(packed_rows, local)
    return text


def test_a_program_packed_calls_do_not_take_is_left_out():
    @af.attention
    def sinks(q, k, v, sinks):
        return af.softmax_with_sinks(af.causal(af.scaled_dot_product(q, k)), sinks) @ v

    packed = PACKS[1]
    shape = Shape(B=1, Hq=2, Hkv=2, Nq=sum(packed[0]), Nk=sum(packed[1]), D=16, DV=16)
    extras = {"sinks": torch.randn(shape.Hq)}
    case = ProgramCase(program=sinks, text="sinks", shape=shape, extras=extras)
    with pytest.raises(af.UnsupportedError, match=r"gradients of runtime inputs \(sinks\)"):  # the call refuses it
        q, k, v = case.inputs(torch.float32, "cpu", 0)
        cu = [torch.tensor([0, n], dtype=torch.int32) for n in (shape.Nq, shape.Nk)]
        sinks(q, k, v, extras["sinks"].clone().requires_grad_(True), cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])
    check_program_case(case, torch.float32, "cpu", seed=0, packed=packed, grads=True)  # so the kit leaves it out
