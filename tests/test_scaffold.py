"""`attnfuse new NAME --role ROLE` writes a plugin package that passes its own conformance test as generated.

Each role's package is generated into tmp_path and its module registered with register_plugin (rather than
pip-installed, to keep CI fast), then checked as its generated test does."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib

import pytest

import attnfuse as af
from attnfuse.cli import main
from attnfuse.combinator import Role
from attnfuse.errors import InputError
from attnfuse.scaffold import ROLES, scaffold
from attnfuse.testing import check_combinator

ROLE = {
    "mask": Role.MASK,
    "normaliser": Role.NORMALISER,
    "score_mod": Role.SCORE_MOD,
    "score_source": Role.SCORE_SOURCE,
    "transform": Role.QK_TRANSFORM,
}


@pytest.mark.parametrize("role", ROLES)
def test_generated_package_conforms(tmp_path, capsys, role):
    name = f"scaffolded_{role}"
    assert main(["new", name, "--role", role, "--dir", str(tmp_path / "pkg")]) == 0
    assert f"wrote {tmp_path / 'pkg'}" in capsys.readouterr().out
    root = tmp_path / "pkg"
    meta = tomllib.loads((root / "pyproject.toml").read_text())
    assert meta["project"]["name"] == f"attnfuse-scaffolded-{role.replace('_', '-')}"
    assert meta["project"]["entry-points"]["attnfuse"] == {name: f"attnfuse_{name}"}
    assert meta["tool"]["setuptools"]["py-modules"] == [f"attnfuse_{name}"]
    test = (root / "tests" / f"test_{name}.py").read_text()
    assert f'attnfuse_conformance("{name}")' in test
    assert f"af.{name}" in (root / "README.md").read_text()
    spec = importlib.util.spec_from_file_location(f"attnfuse_{name}", root / f"attnfuse_{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    af.register_plugin(module, name=f"test-scaffold-{role}")
    try:
        assert af.combinators()[name].combinator.role is ROLE[role]
        check_combinator(name, max_examples=2, seed=0)
    finally:
        af.unregister_plugin(f"test-scaffold-{role}")
        sys.modules.pop(f"attnfuse_{name}", None)


def test_refuses_bad_names_roles_and_a_non_empty_directory(tmp_path):
    with pytest.raises(InputError, match=r"NAME must be a lower-case Python identifier.*got 'Bad-Name'"):
        scaffold("Bad-Name", "mask", tmp_path / "a")
    with pytest.raises(
        InputError,
        match=r"--role must be one of mask, normaliser, score_mod, score_source, "
        r"transform, got 'modifier'",
    ):
        scaffold("ok_name", "modifier", tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x").write_text("")
    with pytest.raises(InputError, match=r"exists and is not empty"):
        scaffold("ok_name", "mask", tmp_path / "c")


def test_generated_test_passes_as_installed(tmp_path):
    """The generated package's own pytest run, with its entry point visible as an installed one would be
    (a dist-info next to the module) and the conformance kit's pytest plugin."""
    root = scaffold("scaffolded_window", "mask", tmp_path / "pkg")
    info = root / "attnfuse_scaffolded_window-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnfuse-scaffolded-window\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[attnfuse]\nscaffolded_window = attnfuse_scaffolded_window\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--attnfuse-examples=2", "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED tests/test_scaffolded_window.py::test_conforms" in done.stdout
