"""The planted-bug table counts a run as a catch only when the kit fails with its own finding naming the
planted combinator; a kit that crashes (or fails on something else) is reported as crashing, never as catching."""

from __future__ import annotations

import pytest

from attnfuse.testing import planted_bugs
from attnfuse.testing.planted_bugs import catch_rate, main


def _kit(error):
    def check_combinator(name, **options):
        raise error(name)

    return check_combinator


@pytest.mark.parametrize(
    "error",
    [
        lambda name: RuntimeError(f"the kit crashed on {name}"),
        lambda name: TypeError("unexpected keyword"),
        lambda name: AssertionError("an assertion about something else"),
    ],
)
def test_a_crashing_kit_catches_nothing(monkeypatch, error, capsys):
    monkeypatch.setattr(planted_bugs, "check_combinator", _kit(error))
    found = catch_rate("wrong_keep", runs=3, max_examples=1, first_seed=5)
    assert found.caught == 0 and len(found.crashes) == 3
    assert found.crashes[0].startswith("seed 5: ")
    assert main(["--runs", "2", "--only", "wrong_keep"]) == 1
    out = capsys.readouterr().out
    assert "  0/2 " in out and "crash, not a catch: seed 1: " in out


def test_the_kits_finding_naming_the_bug_is_a_catch(monkeypatch):
    monkeypatch.setattr(
        planted_bugs,
        "check_combinator",
        _kit(lambda name: AssertionError(f"out of softmax({name}(q, k)) @ v: beyond the tolerance")),
    )
    found = catch_rate("wrong_keep", runs=2, max_examples=1)
    assert found.caught == 2 and found.crashes == ()
