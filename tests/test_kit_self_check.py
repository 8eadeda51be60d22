"""The kit's self-check at CI size: the conformance kit, fuzzing only (tests/test_conformance.py runs the
deterministic checks), passes every built-in over several seeds in float16 and float32. Larger:
``ATTNFUSE_KIT_SEEDS=20 ATTNFUSE_FUZZ_EXAMPLES=20``, or ``python -m attnfuse.testing.self_check``."""

from __future__ import annotations

import os

from attnfuse.testing.self_check import builtins, main

from conftest import fuzz_examples


def test_the_kit_passes_every_builtin_over_many_seeds(capsys):
    seeds = int(os.environ.get("ATTNFUSE_KIT_SEEDS", 2))
    status = main(["--seeds", str(seeds), "--examples", str(fuzz_examples(3, 20)), "--fuzz-only"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert f"0 failed run(s) of {len(builtins()) * seeds}" in out
