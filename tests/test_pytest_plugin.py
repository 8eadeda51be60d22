"""The conformance kit as a pytest plugin (pytest11 entry point): the fixture and --attnfuse-conformance,
each run in a pytest subprocess on a throwaway project."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PLANTED_CONFTEST = textwrap.dedent("""
    import attnfuse as af
    from attnfuse.testing.planted_bugs import planted

    BUG = planted("full_range_off_by_one")


    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [BUG]


    af.register_plugin(Plugin(), name="planted")
""")


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest run in ``root``; a run that hangs dumps every thread's stack after 240 s (faulthandler) and fails
    with what it printed once 600 s have passed (a CI run once hung here, silently)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=240", "-rA"]
    try:
        return subprocess.run([*command, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as hung:
        printed = [(part or b"").decode(errors="replace") for part in (hung.stdout, hung.stderr)]  # always bytes
        pytest.fail(f"pytest {' '.join(args)} ran past 600 s; it printed:\n" + "\n".join(printed), pytrace=False)


def test_fixture_checks_a_combinator(tmp_path):
    (tmp_path / "test_it.py").write_text(
        textwrap.dedent("""
        def test_conforms(attnfuse_conformance):
            attnfuse_conformance("causal", max_examples=2)
    """)
    )
    done = pytest_in(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED test_it.py::test_conforms" in done.stdout


def test_option_checks_without_a_test_file_and_fails_on_a_wrong_fact(tmp_path):
    (tmp_path / "conftest.py").write_text(PLANTED_CONFTEST)
    done = pytest_in(tmp_path, "--attnfuse-conformance=causal, _planted_full_range_off_by_one", "--attnfuse-examples=2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "PASSED ::attnfuse-conformance[causal]" in done.stdout
    assert "FAILED ::attnfuse-conformance[_planted_full_range_off_by_one]" in done.stdout
    assert (
        "MaskFactError: mask '_planted_full_range_off_by_one' declares keep or facts its reference "
        "contradicts" in done.stdout
    )


def test_inert_unless_used(tmp_path):
    (tmp_path / "test_plain.py").write_text("def test_plain():\n    assert 1 + 1 == 2\n")
    done = pytest_in(tmp_path)
    assert done.returncode == 0 and "1 passed" in done.stdout
    assert "attnfuse-conformance" not in done.stdout
    help_text = pytest_in(tmp_path, "--help").stdout
    assert "--attnfuse-conformance=NAMES" in help_text and "--attnfuse-examples=N" in help_text
