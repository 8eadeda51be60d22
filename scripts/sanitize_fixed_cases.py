"""Every registered combinator's fixed cases (``attnfuse.testing.fixed_cases``: prefill with gradients, split-KV,
paged decode, offsets, dropout, packed documents) on the GPU under compute-sanitizer's memcheck, each in a process
of its own, so that a read outside a tensor is reported even where it does not fault.

    python scripts/sanitize_fixed_cases.py [NAME ...]     (WORKERS processes at once, 8; TIMEOUT seconds each, 600)

Prints each combinator's verdict and, for a failure, the sanitizer's first reports; exits 1 if any failed."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time

import attnfuse as af

SANITIZER = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"


def sanitized(name: str) -> tuple[str, int, float, list[str]]:
    """(name, exit status, seconds, the lines that report a fault or the output's last lines)."""
    start = time.time()
    check = f"from attnfuse.testing.fixed_cases import check_fixed_cases; check_fixed_cases({name!r}, 'cuda')"
    done = subprocess.run(
        [SANITIZER, "--tool", "memcheck", "--print-limit", "4", "--error-exitcode", "9", sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=int(os.environ.get("TIMEOUT", 600)),
    )
    lines = (done.stdout + done.stderr).splitlines()
    reports = [line for line in lines if line.startswith("=========") and line.strip("= ")]
    return name, done.returncode, time.time() - start, (reports or lines)[:12]


def main() -> int:
    names = sys.argv[1:] or sorted(af.combinators())
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(int(os.environ.get("WORKERS", 8))) as pool:
        for name, status, seconds, lines in pool.map(sanitized, names):
            print(f"{name}: {'clean' if status == 0 else f'FAILED (exit {status})'} in {seconds:.0f} s", flush=True)
            if status != 0:
                failed += 1
                print("    " + "\n    ".join(lines), flush=True)
    print(f"{len(names) - failed} of {len(names)} combinators' fixed cases clean under memcheck")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
