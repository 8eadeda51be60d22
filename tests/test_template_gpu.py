"""The forward template's instances on the GPU against the float64 reference (``attnfuse/kernels/verify.py``):
every built-in and installed contrib variant, head dims 64/128/256, float16 and bfloat16, GQA, ragged lengths,
NaN values under the masks. With ``ATTNFUSE_VERIFY_OUT`` set, each result is appended there for the record."""

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


@pytest.mark.parametrize("case", verify.cases(), ids=lambda c: c.id)
def test_template_instance_matches_float64(case, monkeypatch):
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    before = TemplateForward.launches
    try:
        result = verify.check(case)
    except BaseException:
        if TemplateForward.launches != before:
            _log({"key": TemplateForward.last_key, "case": case.id, "failed": True})
        raise
    _log(result)
