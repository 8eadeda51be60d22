"""The kit's self-check: the conformance kit over every built-in combinator, with many seeds, in float16 and
float32 (the dtypes Triton's interpreter computes right; bfloat16 too on a GPU).

    python -m attnfuse.testing.self_check [--seeds 10] [--examples 20] [--first-seed 0] [--only NAME,...]
                                          [--fuzz-only]

The built-ins are right (their own tests say so), so every run must pass: a failure is the kit blaming a
correct combinator, through a tolerance tighter than the dtype allows or a reference of its own that is
wrong, which a plugin author would read as their bug. Each built-in gets its deterministic checks (mask
facts, fixed cases) once, then ``--seeds`` fuzzing runs of ``--examples`` programs each. Exit status 1 on
any failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from attrs import frozen

from ..plugin_manager import BUILTIN_DISTRIBUTION, combinators
from .conformance import check_combinator, default_device, default_dtypes
from .strategies import drawable


@frozen(kw_only=True)
class Verdict:
    """One built-in's runs: how many, and a line per failing run (its seed and the first line of its error)."""

    name: str
    runs: int
    failures: tuple[str, ...]
    seconds: float


def builtins() -> list[str]:
    """The built-in combinators the kit can draw."""
    return sorted(
        n for n, e in combinators().items() if e.distribution == BUILTIN_DISTRIBUTION and drawable(e.combinator)
    )


def self_check(
    name: str,
    seeds: int,
    examples: int,
    first_seed: int = 0,
    fuzz_only: bool = False,
    device: str | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> Verdict:
    """Run check_combinator on built-in ``name`` with seeds ``first_seed`` .. ``first_seed + seeds - 1``
    (the first run with the deterministic checks, unless ``fuzz_only``), in each of ``dtypes`` (default: the
    device's)."""
    device = device or default_device()
    failures, start = [], time.perf_counter()
    for seed in range(first_seed, first_seed + seeds):
        try:
            check_combinator(
                name,
                seed=seed,
                max_examples=examples,
                device=device,
                dtypes=dtypes or default_dtypes(device),
                fixed=seed == first_seed and not fuzz_only,
            )
        except Exception as exc:  # a crash is as much the kit's failure as a wrong verdict
            failures.append(f"seed {seed}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
    return Verdict(name=name, runs=seeds, failures=tuple(failures), seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10, help="fuzzing runs per built-in")
    parser.add_argument("--examples", type=int, default=20, help="max_examples of each run")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated built-ins (default: all)")
    parser.add_argument(
        "--fuzz-only",
        action="store_true",
        help="leave out the deterministic checks (tests/test_conformance.py runs them)",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or builtins()
    print(f"{'built-in':20} {'failed':>10} {'seconds':>8}")
    failed = 0
    for name in names:
        verdict = self_check(name, args.seeds, args.examples, args.first_seed, args.fuzz_only)
        failed += len(verdict.failures)
        print(f"{name:20} {len(verdict.failures):>4}/{verdict.runs:<5} {verdict.seconds:8.1f}", flush=True)
        for failure in verdict.failures:
            print(f"{'':20} {failure}", flush=True)
    print(f"{failed} failed run(s) of {len(names) * args.seeds} ({args.examples} examples each)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
