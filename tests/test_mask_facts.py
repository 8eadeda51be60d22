"""The conformance kit checks every mask's keep and declared facts deterministically (attnfuse.testing.mask_facts),
and catches every planted bug of the planted-bug table (a reduced run of attnfuse.testing.planted_bugs)."""

from __future__ import annotations

import pytest
import torch

import attnfuse as af
from attnfuse.combinator import Combinator, MaskFragment, Role
from attnfuse.testing.mask_facts import MaskFactError, check_mask_facts, violations
from attnfuse.testing.planted_bugs import PLANTED, catch_rate, planted
from attnfuse.host_eval import TL, Pointer, evaluate, integer

BUILTIN_MASKS = sorted(
    n for n, r in af.combinators().items() if r.combinator.role is Role.MASK and r.distribution == "attnfuse"
)


def registered_as_plugin(comb: Combinator):
    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name=f"test-mask-facts-{comb.name}")
    return f"test-mask-facts-{comb.name}"


@pytest.fixture
def plugin_of():
    names = []

    def register(comb: Combinator) -> str:
        names.append(registered_as_plugin(comb))
        return comb.name

    yield register
    for name in names:
        af.unregister_plugin(name)


@pytest.mark.parametrize("name", BUILTIN_MASKS)
def test_builtin_masks_keep_their_declared_facts(name):
    assert violations(name) == []


def test_a_mask_without_facts_is_valid(plugin_of):
    name = plugin_of(
        Combinator(
            name="_test_even_keys",
            role=Role.MASK,
            doc="even keys (test)",
            reference=lambda ctx: ctx.k_pos % 2 == 0,
            fragment=MaskFragment(keep="k_pos[None, :] % 2 == 0"),
        )
    )
    check_mask_facts(name)


@pytest.mark.parametrize(
    "bug, fact",
    [
        ("wrong_keep", "keep gives False"),
        ("full_range_off_by_one", r"full_range=\('0', '\$q_lo \+ 2'\)"),
        ("q_side_fact_transposed", "q_full_range="),
        ("kv_range_short", "kv_range="),
        ("q_range_transposed", "q_range="),
        ("block_list_short", "block_list omits block"),
        (
            "partial_called_full",
            r"block_list.partial calls block \d+ of the list of query block \d+ .* kept in full, "
            r"but it drops an element",
        ),
    ],
)
def test_planted_mask_bug_names_combinator_fact_parameters_and_block(plugin_of, bug, fact):
    name = plugin_of(planted(bug))
    with pytest.raises(MaskFactError, match=rf"combinator '{name}': {fact}") as info:
        check_mask_facts(name)
    message = str(info.value)
    assert "params={" in message and "Nq=" in message and "b=0, h=0" in message
    if bug not in ("wrong_keep", "block_list_short", "partial_called_full"):
        assert "block of positions" in message or "key block" in message


def test_full_range_off_by_one_is_reported_at_its_block(plugin_of):
    """causal with full_range (0, q_lo + 2): the first query of a block drops key q_lo + 1."""
    name = plugin_of(planted("full_range_off_by_one"))
    first = violations(name)[0]
    assert (
        "full_range=('0', '$q_lo + 2') is [0, 53) for the query block of positions 51..63 (rows 0..12, b=0, "
        "h=0), but query position 51 drops key 52 (B=1, Hq=2, Nq=13, Nk=64, kv_lens=None, params={})"
    ) in first


def test_shim_loads_through_strides_with_mask_and_other():
    g = torch.Generator().manual_seed(3)
    t = torch.randn(3, 5, generator=g).t()  # (5, 3), strides (1, 5)
    rows, cols = torch.arange(5)[:, None], torch.arange(4)[None, :]
    ok = cols < 3
    got = evaluate(
        compile("tl.load(p + rows * 1 + cols * 5, mask=ok, other=-1.0)", "<t>", "eval"),
        {"p": Pointer(t), "rows": rows, "cols": cols, "ok": ok},
    )
    want = torch.cat([t, torch.full((5, 1), -1.0)], dim=1)
    assert torch.equal(got, want)
    assert int(TL.minimum(integer(4), 7) + TL.maximum(-2, integer(1))) == 5


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_bug_caught_every_run(bug):
    """A reduced planted-bug table: 2 runs of 2 examples each (the full table: 10 runs of 8)."""
    found = catch_rate(bug, runs=2, max_examples=2)
    assert found.caught == 2, found.crashes
