"""The planted-bug table: how often the conformance kit catches a known wrong declaration.

    python -m attnfuse.testing.planted_bugs [--runs 10] [--examples 8] [--first-seed 0] [--only NAME,...]

Each planted bug is a built-in combinator with one field changed, registered under ``_planted_<bug>``;
``check_combinator`` runs on it ``--runs`` times with different Hypothesis seeds, as a plugin author's
test would with default settings. A run catches the bug only when the kit fails with its own finding naming
the planted combinator; a run that raises anything else is a crash, reported as such. Every row must read
100%: the mask facts and the fixed cases are deterministic, so a catch rate below that is a hole in the kit.
"""

from __future__ import annotations

import argparse
import sys
import time
import functools
from typing import Callable

import attrs
from attrs import frozen

from ..combinator import Combinator
from ..hookspecs import hookimpl
from ..plugin_manager import lookup, register_plugin, unregister_plugin
from .conformance import check_combinator


def _mask_fact(base: str, **changes: str) -> Callable[[], Combinator]:
    def make() -> Combinator:
        comb = lookup(base)
        if not callable(comb.fragment):
            return attrs.evolve(comb, fragment=attrs.evolve(comb.fragment, **changes))
        original = comb.fragment  # a function of the parameters (sliding_window's)

        @functools.wraps(original)
        def fragment(*args, **kwargs):
            return attrs.evolve(original(*args, **kwargs), **changes)

        return attrs.evolve(comb, fragment=fragment)

    return make


def _block_list(**changes: str) -> Callable[[], Combinator]:
    def make() -> Combinator:
        comb = lookup("block_sparse")
        lists = attrs.evolve(comb.fragment.block_list, **changes)
        return attrs.evolve(comb, fragment=attrs.evolve(comb.fragment, block_list=lists))

    return make


def _fragment(base: str, **changes: str) -> Callable[[], Combinator]:
    def make() -> Combinator:
        comb = lookup(base)
        return attrs.evolve(comb, fragment=attrs.evolve(comb.fragment, **changes))

    return make


def _replaced(base: str, old: str, new: str, *fields: str) -> Callable[[], Combinator]:
    """``base`` with ``old`` replaced by ``new`` in its fragment's ``fields`` (each must contain it)."""

    def make() -> Combinator:
        fragment = lookup(base).fragment
        texts = {f: getattr(fragment, f) for f in fields}
        missing = [f for f, text in texts.items() if old not in text]
        if missing:
            raise ValueError(f"planted bug on {base!r}: {old!r} is not in its fragment's {missing}")
        return _fragment(base, **{f: text.replace(old, new) for f, text in texts.items()})()

    return make


PLANTED: dict[str, tuple[str, Callable[[], Combinator]]] = {
    "wrong_keep": (
        "causal keeps k < q' instead of k <= q'",
        _mask_fact("causal", keep="k_pos[None, :] < q_pos[:, None]"),
    ),
    "wrong_backward": ("softmax's grad drops delta: ds = p * dp", _fragment("softmax", grad="ds = p * dp")),
    "full_range_off_by_one": (
        "causal full_range ends at P + 1 instead of P (P = $q_lo + 1)",
        _mask_fact("causal", full_range=("0", "$q_lo + 2")),
    ),
    "q_side_fact_transposed": (
        "causal q_full_range starts at $k_lo instead of $k_hi (dK/dV only)",
        _mask_fact("causal", q_full_range=("$k_lo", "Nk")),
    ),
    "kv_range_short": (
        "sliding_window kv_range ends one key early",
        _mask_fact("sliding_window", kv_range=("$q_lo - $left", "$q_hi + $right")),
    ),
    "q_range_transposed": (
        "sliding_window q_range swaps left and right",
        _mask_fact("sliding_window", q_range=("$k_lo - $left", "$k_hi + $right + 1")),
    ),
    "block_list_short": (
        "block_sparse lists one key block too few per query block",
        _block_list(
            count="tl.load($kv_num + b.to(tl.int64) * $kv_num_s0 + "
            "h.to(tl.int64) * $kv_num_s1 + ($$block) * $kv_num_s2) - 1"
        ),
    ),
    "partial_called_full": (
        "block_sparse's lists call every block full, so partial blocks keep every pair",
        _block_list(partial="$block_size < 0", q_partial="$block_size < 0"),
    ),
    "capacity_for_length": (
        "relu_attention divides by the capacity N_K, not the sequence's length Nk",
        _replaced("relu_attention", "tl.maximum(Nk, 1)", "tl.maximum(N_K, 1)", "update", "recompute", "grad"),
    ),
    "unit_weights_unkept": (
        "relu_attention declares unit_weights without dividing by its running maximum (the same out)",
        _fragment("relu_attention", update="p = tl.maximum(s, 0.0) * (1.0 / tl.maximum(Nk, 1))", finalize="out = acc"),
    ),
    "softcap_negative_scores": (
        "softcap caps negative scores at -cap/2 (positive ones are right)",
        _replaced("softcap", "tl.where(s < 0.0, -$cap, $cap)", "tl.where(s < 0.0, -0.5 * $cap, $cap)", "body"),
    ),
}


def planted(bug: str) -> Combinator:
    """The combinator of planted bug ``bug``, named ``_planted_<bug>``."""
    return attrs.evolve(PLANTED[bug][1](), name=f"_planted_{bug}")


@frozen(kw_only=True)
class Catches:
    """What the kit did on a planted bug over ``runs`` runs: ``caught`` runs failed with the kit's own finding
    naming the planted combinator; ``crashes`` holds one line per run that raised anything else (counted
    as a hole, never as a catch); the rest passed."""

    runs: int
    caught: int
    crashes: tuple[str, ...]
    seconds_per_run: float


def is_finding(exc: BaseException, name: str) -> bool:
    """Whether ``exc`` is the kit's own finding about combinator ``name``: its AssertionError (a value beyond
    the tolerance, a contradicted mask fact) whose message names it; a group of findings counts when each is."""
    group = getattr(exc, "exceptions", None)  # an exception group (Python 3.11's, or the backport's)
    if isinstance(group, tuple):
        return bool(group) and all(is_finding(e, name) for e in group)
    return isinstance(exc, AssertionError) and name in str(exc)


def catch_rate(
    bug: str, runs: int = 10, max_examples: int = 8, device: str | None = None, first_seed: int = 0
) -> Catches:
    """Run check_combinator on planted bug ``bug`` with seeds ``first_seed`` .. ``first_seed + runs - 1``."""
    comb = planted(bug)

    class Plugin:
        @hookimpl
        def attnfuse_combinators(self):
            return [comb]

    register_plugin(Plugin(), name=comb.name)
    caught, crashes, start = 0, [], time.perf_counter()
    try:
        for seed in range(first_seed, first_seed + runs):
            try:
                check_combinator(comb.name, max_examples=max_examples, seed=seed, device=device)
            except Exception as exc:
                if is_finding(exc, comb.name):
                    caught += 1
                else:
                    crashes.append(f"seed {seed}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
    finally:
        unregister_plugin(comb.name)
    return Catches(
        runs=runs, caught=caught, crashes=tuple(crashes), seconds_per_run=(time.perf_counter() - start) / runs
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--examples", type=int, default=8, help="max_examples of each check_combinator run")
    parser.add_argument("--first-seed", type=int, default=0, help="Hypothesis seed of the first run (then +1 each)")
    parser.add_argument("--only", default="", help="comma-separated bugs (default: all)")
    args = parser.parse_args(argv)
    bugs = [b for b in args.only.split(",") if b] or list(PLANTED)
    print(f"{'planted bug':26} {'caught':>8} {'crashed':>7} {'s/run':>7}  what")
    missed = 0
    for bug in bugs:
        found = catch_rate(bug, args.runs, args.examples, first_seed=args.first_seed)
        missed += found.caught < args.runs
        print(
            f"{bug:26} {found.caught:>3}/{args.runs:<4} {len(found.crashes):>7} {found.seconds_per_run:7.2f}  "
            f"{PLANTED[bug][0]}",
            flush=True,
        )
        for crash in found.crashes:
            print(f"{'':26} crash, not a catch: {crash}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
