"""One installed plugin never takes the others down: a combinator named like a built-in (as `attnfuse new
softmax` used to write), like attnfuse's own API, or like another installed package's is skipped with a
warning naming both distributions, and everything else keeps working (`af.softmax`, `attnfuse list`, the
package's other combinators). Installed distributions are simulated by a dist-info folder on PYTHONPATH, as
tests/test_plugin_isolation.py does; each scenario runs in a subprocess (the plugin manager loads once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attnfuse as af
from attnfuse import scaffold as scaffold_module
from attnfuse.errors import InputError, PluginError
from attnfuse.plugin_manager import DISABLE_AUTOLOAD_ENV
from attnfuse.scaffold import scaffold

# Under -n one worker runs this module's fixtures once: conftest.ONE_WORKER_MODULES

KEEP_ALL = textwrap.dedent("""
    import attnfuse
    from attnfuse.combinator import Combinator, MaskFragment, Role


    def keep_all(name):
        return Combinator(name=name, role=Role.MASK, doc="Keeps every key (test).", reference=lambda ctx: None,
                          fragment=MaskFragment(keep=None))
""")


def distribution(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Install (as a dist-info on PYTHONPATH) distribution ``dist`` with ``attnfuse`` entry points
    {name: module} and the modules' source."""
    for module, body in modules.items():
        (root / f"{module}.py").write_text(body)
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {module}\n" for name, module in entry_points.items())
    (info / "entry_points.txt").write_text(f"[attnfuse]\n{lines}")


def masks(*names: str) -> str:
    return KEEP_ALL + textwrap.dedent(f"""
        @attnfuse.hookimpl
        def attnfuse_combinators():
            return [keep_all(n) for n in {list(names)!r}]
    """)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A site with: the package `attnfuse new softmax --role mask` wrote before it refused built-in names;
    two packages declaring `clash_twice` (one of them also `clash_a_only`); a package declaring `attention`
    and `clash_c_only`; one implementing a misspelt hook; two whose entry points name one module."""
    root = tmp_path_factory.mktemp("clash-site")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scaffold_module, "_check_free", lambda name, module: None)
        pkg = scaffold("softmax", "mask", root / "attnfuse-softmax")
    (root / "attnfuse_softmax.py").write_text((pkg / "attnfuse_softmax.py").read_text())
    distribution(root, "attnfuse-softmax", {"softmax": "attnfuse_softmax"}, {})
    distribution(
        root,
        "attnfuse-clash-a",
        {"clash_a": "attnfuse_clash_a"},
        {"attnfuse_clash_a": masks("clash_twice", "clash_a_only")},
    )
    distribution(root, "attnfuse-clash-b", {"clash_b": "attnfuse_clash_b"}, {"attnfuse_clash_b": masks("clash_twice")})
    distribution(
        root,
        "attnfuse-clash-c",
        {"clash_c": "attnfuse_clash_c"},
        {"attnfuse_clash_c": masks("attention", "clash_c_only")},
    )
    typo = KEEP_ALL + textwrap.dedent("""
        @attnfuse.hookimpl
        def attnfuse_combinatorz():
            return [keep_all("clash_typo")]
    """)
    distribution(root, "attnfuse-clash-typo", {"typo": "attnfuse_clash_typo"}, {"attnfuse_clash_typo": typo})
    distribution(
        root,
        "attnfuse-clash-shared1",
        {"shared": "attnfuse_clash_shared"},
        {"attnfuse_clash_shared": masks("clash_shared")},
    )
    distribution(root, "attnfuse-clash-shared2", {"shared": "attnfuse_clash_shared"}, {})
    return root


REPORT = textwrap.dedent("""
    import json, warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import attnfuse as af
        from attnfuse.plugin_manager import PluginWarning, broken_plugins

        @af.attention
        def program(q, k, v):
            return af.softmax(af.clash_a_only(af.causal(af.scaled_dot_product(q, k)))) @ v

        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(3))
        error = (program(q, k, v).double() - program.reference(q, k, v, dtype=torch.float64)).abs().max().item()
    print(json.dumps({
        "registry": {n: r.distribution for n, r in af.combinators().items()},
        "skipped": sorted([b.plugin, b.distribution, b.combinator, b.cause] for b in broken_plugins()),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, PluginWarning)],
        "error": error,
    }))
""")


def run_in(root: Path, *args: str, paths: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_AUTOLOAD_ENV}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths or (root,)), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=root)


@pytest.fixture(scope="module")
def report(site) -> dict:
    done = run_in(site, "-c", REPORT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_builtin_keeps_its_name_and_programs_run(report):
    assert report["registry"]["softmax"] == "attnfuse"
    assert report["error"] < 1e-5  # af.softmax, af.causal and a third-party mask, fused, against float64


def test_skipped_combinator_warns_naming_both_distributions(report):
    [warning] = [w for w in report["warnings"] if "'softmax'" in w]
    assert warning.startswith("attnfuse skipped combinator 'softmax': combinator 'softmax' is declared twice: ")
    assert "plugin 'attnfuse:softmax' of distribution 'attnfuse'" in warning
    assert "plugin 'attnfuse-softmax:softmax' of distribution 'attnfuse-softmax'" in warning
    assert "the built-in keeps its name" in warning
    assert ["attnfuse-softmax:softmax", "attnfuse-softmax", "softmax"] in [s[:3] for s in report["skipped"]]


def test_two_installed_packages_clashing_both_lose_the_name_only(report):
    assert "clash_twice" not in report["registry"]
    assert report["registry"]["clash_a_only"] == "attnfuse-clash-a"  # the same plugin's other combinator stays
    clashes = [w for w in report["warnings"] if "'clash_twice'" in w]
    assert len(clashes) == 2
    for warning in clashes:
        assert "distribution 'attnfuse-clash-a'" in warning and "distribution 'attnfuse-clash-b'" in warning
        assert "no installed package takes precedence over another" in warning
        assert "uninstall all but one of attnfuse-clash-a, attnfuse-clash-b" in warning


def test_reserved_name_skips_that_combinator_only(report):
    assert report["registry"]["clash_c_only"] == "attnfuse-clash-c"
    [warning] = [w for w in report["warnings"] if "'attention'" in w]
    assert "declares combinator 'attention', a name attnfuse's own API uses" in warning


def test_unknown_hook_and_reused_module_are_broken_plugins_not_errors(report):
    skipped = {s[0]: s[3] for s in report["skipped"]}
    assert "implements a hook attnfuse does not know" in skipped["attnfuse-clash-typo:typo"]
    reused = [cause for plugin, cause in skipped.items() if plugin.startswith("attnfuse-clash-shared")]
    assert len(reused) == 1 and "failed to register attnfuse_clash_shared: ValueError" in reused[0]
    assert report["registry"]["clash_shared"] in ("attnfuse-clash-shared1", "attnfuse-clash-shared2")


def test_resolution_does_not_depend_on_the_order_on_sys_path(site, report, tmp_path):
    """The same site seen through a second path entry listed first: the same registry and skips."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    for info in site.glob("*-clash-b-*.dist-info"):
        (mirror / info.name).symlink_to(info)
    (mirror / "attnfuse_clash_b.py").symlink_to(site / "attnfuse_clash_b.py")
    done = run_in(site, "-c", REPORT, paths=(mirror, site))
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout.strip().splitlines()[-1])
    assert again["registry"] == report["registry"]
    assert [s[:3] for s in again["skipped"]] == [s[:3] for s in report["skipped"]]


def test_attnfuse_list_exits_0_and_shows_the_skipped_combinators(site):
    done = run_in(site, "-m", "attnfuse.cli", "list")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[2] for line in done.stdout.splitlines()[1:] if line[:1].isalpha()}
    assert rows["softmax"] == "attnfuse" and rows["clash_a_only"] == "attnfuse-clash-a"
    assert "4 combinator(s) skipped, their names taken:" in done.stdout
    assert (
        "  SKIPPED combinator 'softmax' is declared twice: by plugin 'attnfuse:softmax' of distribution "
        "'attnfuse' and by plugin 'attnfuse-softmax:softmax' of distribution 'attnfuse-softmax'" in done.stdout
    )
    assert "2 broken plugin(s), skipped:" in done.stdout
    assert done.stderr == ""
    assert run_in(site, "-m", "attnfuse.cli", "list", "--strict").returncode == 1


# --- in this process: code registration still refuses; `attnfuse new` refuses taken names ----------------


def test_registering_a_clashing_plugin_in_code_is_still_an_error():
    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [af.combinators()["causal"].combinator]

    with pytest.raises(
        PluginError,
        match=r"combinator 'causal' is declared twice: by plugin 'attnfuse:causal' of "
        r"distribution 'attnfuse' and by plugin 'test-clash-code' .*the built-in "
        r"keeps its name, so plugin 'test-clash-code' cannot provide it",
    ):
        af.register_plugin(Plugin(), name="test-clash-code")
    assert af.combinators()["causal"].distribution == "attnfuse"


@pytest.mark.parametrize(
    "name, says",
    [
        ("softmax", "is the name of the built-in combinator of distribution 'attnfuse'"),
        ("causal", "is the name of the built-in combinator of distribution 'attnfuse'"),
        ("attention", "is a name attnfuse's own API uses"),
        ("testing", "is a name attnfuse's own API uses"),
        ("plugins", "would make a module 'attnfuse_plugins', but a module of that name is importable already"),
    ],
)
def test_attnfuse_new_refuses_taken_names(tmp_path, name, says):
    with pytest.raises(InputError, match=rf"NAME '{name}' {says}.*; choose another name"):
        scaffold(name, "mask", tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()


def test_attnfuse_new_command_says_why(tmp_path, capsys):
    from attnfuse.cli import main

    assert main(["new", "softmax", "--role", "mask", "--dir", str(tmp_path / "pkg")]) == 2
    assert "NAME 'softmax' is the name of the built-in combinator" in capsys.readouterr().err
