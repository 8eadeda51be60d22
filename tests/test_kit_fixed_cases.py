"""The kit's fixed cases: every kind of call a fragment can get wrong, under a program in which every part of
the fragment shows in the output, so that a planted bug is caught by them alone, on every run."""

from __future__ import annotations

import pytest

import attnfuse as af
from attnfuse.combinator import Role
from attnfuse.testing.fixed_cases import FIXED_CALLS, check_fixed_cases, fixed_program
from attnfuse.testing.mask_facts import check_mask_facts
from attnfuse.testing.planted_bugs import PLANTED, is_finding, planted
from attnfuse.testing.self_check import builtins
from attnfuse.testing.unit_weights import check_unit_weights


def test_fixed_calls_cover_every_axis():
    shapes = [c.shape for c in FIXED_CALLS]
    assert all(s.Hq > s.Hkv for s in shapes)  # GQA
    assert any(s.Nq != s.Nk for s in shapes) and any(s.Nq == 1 for s in shapes)
    assert any(c.grads for c in FIXED_CALLS)
    assert any(
        c.kv_lens and c.page_size is None and max(c.kv_lens) < c.shape.Nk and c.shape.Nq <= 16 for c in FIXED_CALLS
    )  # split-KV on a cache filled below its capacity
    assert any(c.page_size and max(c.kv_lens) < c.shape.Nk for c in FIXED_CALLS)
    assert any(c.positions and c.positions[0] != c.shape.Nk - c.shape.Nq for c in FIXED_CALLS)
    packed = [c for c in FIXED_CALLS if c.packed]  # documents of 0 and 1 queries, gradients, transforms hoisted
    assert any({0, 1} <= set(c.packed[0]) and c.grads and c.hoisted for c in packed)
    assert all(c.shape.B == 1 and (sum(c.packed[0]), sum(c.packed[1])) == (c.shape.Nq, c.shape.Nk) for c in packed)


@pytest.mark.parametrize("name", builtins())
def test_fixed_programs_show_every_part_of_a_fragment(name):
    """Softmax (scores of both signs count), several keys per row, no switched-off part (rope rotates keys),
    a window wider than one key, a cap that the scores reach."""
    role = af.combinators()[name].combinator.role
    for call in FIXED_CALLS:
        case = fixed_program(name, call.shape)
        assert case.text.startswith("softmax(") or role is Role.NORMALISER, case.text
        assert "=False" not in case.text, case.text
        if name == "rope":
            assert "rotate_keys=True" in case.text
        if name == "sliding_window":
            window = case.text.split("left=")[1].split(")")[0]
            left, right = int(window.split(", right=")[0]), int(window.split(", right=")[1])
            assert left + right + 1 >= 3, case.text
        if name == "softcap":
            assert "cap=1.0" in case.text or "cap=5.0" in case.text, case.text  # scores (|s| ~ 1.7) reach it


def _register(comb, name: str):
    """``comb`` registered from code as plugin ``name``."""

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name=name)
    return comb


def _registered(bug: str):
    return _register(planted(bug), f"test-fixed-{bug}")


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_every_planted_bug_is_caught_without_fuzzing(bug):
    """The deterministic checks alone (mask facts, unit weights, fixed cases) catch each planted bug: every run
    does."""
    comb = _registered(bug)
    try:
        with pytest.raises(AssertionError) as info:
            check_mask_facts(comb.name)
            check_unit_weights(comb.name)
            check_fixed_cases(comb.name, "cpu")
        assert is_finding(info.value, comb.name), str(info.value)
    finally:
        af.unregister_plugin(f"test-fixed-{bug}")


def test_a_prepare_that_takes_a_packed_calls_total_for_a_documents_length_is_caught_without_fuzzing():
    """A normaliser whose default bias, -log(the key count), comes from ``prepare``'s Nk, which in a packed call is
    the total of the documents, each of which has its own (the bug attnfuse-sigmoid had): the packed fixed case
    catches it on every run."""
    import attrs

    from test_third_party_roles import SIGMOID_ATTENTION, _offset

    comb = attrs.evolve(
        SIGMOID_ATTENTION,
        name="_test_sigmoid_packed_total",
        prepare=lambda ctx, bias: {"offset": _offset(bias, max(ctx.Nk, 1))},
        examples=lambda draw, shape: {"bias": None},
    )
    _register(comb, "test-fixed-packed-total")
    try:
        with pytest.raises(AssertionError) as info:
            check_fixed_cases(comb.name, "cpu")
        notes = "".join(getattr(info.value, "__notes__", []))
        assert is_finding(info.value, comb.name) and "fixed case (packed documents" in notes, notes
    finally:
        af.unregister_plugin("test-fixed-packed-total")
