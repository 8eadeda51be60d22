"""The template instances on the GPU against the float64 reference (``attnfuse/kernels/verify.py``): the
forward's on every built-in and installed contrib variant, head dims 64/128/256, float16 and bfloat16, GQA,
ragged lengths, NaN values under the masks; the dK/dV and dQ templates' gradients on every variant (a
non-smooth normaliser's on exact scores), head dims 64/128; the forward and dK/dV templates with attention
dropout on two variants, against the reference replaying the call's mask. With ``ATTNFUSE_VERIFY_OUT`` set,
each result is appended there for the record."""

import json
import os
from pathlib import Path

import pytest

from attnfuse.kernels import verify
from attnfuse.kernels.launch import TemplateForward

from conftest import requires_cuda

pytestmark = requires_cuda


def _log(result: dict) -> None:
    out = os.environ.get(verify.OUT_ENV)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl", "a") as f:
            f.write(json.dumps(result) + "\n")


def _check(case, launcher) -> None:
    """``verify.check(case)``, its result logged; a failure after ``launcher`` (the template's class) ran is
    logged against the instance it ran."""
    before = launcher.launches
    try:
        result = verify.check(case)
    except BaseException:
        if launcher.launches != before:
            _log({"key": launcher.last_key, "case": case.id, "failed": True})
        raise
    _log(result)


@pytest.mark.parametrize("case", verify.cases(), ids=lambda c: c.id)
def test_template_instance_matches_float64(case, monkeypatch):
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    monkeypatch.setenv("ATTNFUSE_DROPOUT_ON_GPU", "1")  # what checks the dropout cases' kernels on a GPU
    _check(case, TemplateForward)


@pytest.mark.parametrize("case", verify.backward_cases(), ids=lambda c: c.id)
def test_backward_template_instance_gradients_match_float64(case, monkeypatch):
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    monkeypatch.setenv("ATTNFUSE_DROPOUT_ON_GPU", "1")
    _check(case, verify.BACKWARD_TEMPLATES[case.kind])
