"""The planted-bug table: how often the conformance kit catches a known wrong declaration.

    python -m attnfuse.testing.planted_bugs [--runs 10] [--examples 8] [--only NAME,...]

Each planted bug is a built-in combinator with one field changed, registered under ``_planted_<bug>``;
``check_combinator`` runs on it ``--runs`` times with different Hypothesis seeds, as a plugin author's
test would with default settings. Every row must read 100%: the mask facts and the fixed case with
gradients are deterministic, so a catch rate below that is a hole in the kit.
"""
from __future__ import annotations

import argparse
import sys
import time
import functools
from typing import Callable

import attrs

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


def _normaliser(**changes: str) -> Callable[[], Combinator]:
    def make() -> Combinator:
        comb = lookup("softmax")
        return attrs.evolve(comb, fragment=attrs.evolve(comb.fragment, **changes))
    return make


PLANTED: dict[str, tuple[str, Callable[[], Combinator]]] = {
    "wrong_keep": ("causal keeps k < q' instead of k <= q'",
                   _mask_fact("causal", keep="k_pos[None, :] < q_pos[:, None]")),
    "wrong_backward": ("softmax's grad drops delta: ds = p * dp", _normaliser(grad="ds = p * dp")),
    "full_range_off_by_one": ("causal full_range ends at P + 1 instead of P (P = $q_lo + 1)",
                              _mask_fact("causal", full_range=("0", "$q_lo + 2"))),
    "q_side_fact_transposed": ("causal q_full_range starts at $k_lo instead of $k_hi (dK/dV only)",
                               _mask_fact("causal", q_full_range=("$k_lo", "Nk"))),
    "kv_range_short": ("sliding_window kv_range ends one key early",
                       _mask_fact("sliding_window", kv_range=("$q_lo - $left", "$q_hi + $right"))),
    "q_range_transposed": ("sliding_window q_range swaps left and right",
                           _mask_fact("sliding_window", q_range=("$k_lo - $left", "$k_hi + $right + 1"))),
    "block_list_short": ("block_sparse lists one key block too few per query block",
                         _block_list(count="tl.load($kv_num + b.to(tl.int64) * $kv_num_s0 + "
                                           "h.to(tl.int64) * $kv_num_s1 + ($$block) * $kv_num_s2) - 1")),
    "partial_called_full": ("block_sparse's lists call every block full, so partial blocks keep every pair",
                            _block_list(partial="$block_size < 0", q_partial="$block_size < 0")),
}


def planted(bug: str) -> Combinator:
    """The combinator of planted bug ``bug``, named ``_planted_<bug>``."""
    return attrs.evolve(PLANTED[bug][1](), name=f"_planted_{bug}")


def catch_rate(bug: str, runs: int = 10, max_examples: int = 8, device: str | None = None) -> tuple[int, float]:
    """(runs in which check_combinator failed, seconds per run) for one planted bug."""
    comb = planted(bug)

    class Plugin:
        @hookimpl
        def attnfuse_combinators(self):
            return [comb]

    register_plugin(Plugin(), name=comb.name)
    caught, start = 0, time.perf_counter()
    try:
        for seed in range(runs):
            try:
                check_combinator(comb.name, max_examples=max_examples, seed=seed, device=device)
            except Exception:
                caught += 1
    finally:
        unregister_plugin(comb.name)
    return caught, (time.perf_counter() - start) / runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--examples", type=int, default=8, help="max_examples of each check_combinator run")
    parser.add_argument("--only", default="", help="comma-separated bugs (default: all)")
    args = parser.parse_args(argv)
    bugs = [b for b in args.only.split(",") if b] or list(PLANTED)
    print(f"{'planted bug':26} {'caught':>8} {'s/run':>7}  what")
    missed = 0
    for bug in bugs:
        caught, seconds = catch_rate(bug, args.runs, args.examples)
        missed += caught < args.runs
        print(f"{bug:26} {caught:>3}/{args.runs:<4} {seconds:7.2f}  {PLANTED[bug][0]}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
