"""A broken plugin is reported and skipped; a bad declaration is refused when it is built; the conformance
kit checks a plugin with the built-ins only, in a temporary kernel cache, and says how to replay a failure."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attnfuse as af
from attnfuse.combinator import Combinator, MaskFragment, NormaliserFragment, Param, Role, ScoreModFragment
from attnfuse.errors import DeclarationError, PluginError
from attnfuse.plugin_manager import BUILTIN_DISTRIBUTION, DISABLE_AUTOLOAD_ENV, broken_plugins
from attnfuse.runtime.source_cache import CACHE_ENV, cache_dir
from attnfuse.testing import check_combinator
from attnfuse.testing.conformance import temporary_cache
from attnfuse.testing.planted_bugs import planted
from attnfuse.testing.strategies import pool

# Under -n one worker runs this module's fixtures once: conftest.ONE_WORKER_MODULES

ROOT = Path(__file__).resolve().parents[1]


def mask(**overrides) -> Combinator:
    fields = dict(
        name="_test_decl", role=Role.MASK, doc="test", reference=lambda ctx: None, fragment=MaskFragment(keep=None)
    )
    return Combinator(**{**fields, **overrides})


# --- declarations ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reference, says",
    [
        (None, "reference must be a function \\(ctx, \\*\\*params\\), got NoneType"),
        ("k_pos <= q_pos", "reference must be a function \\(ctx, \\*\\*params\\), got str"),
        (lambda s, ctx: None, "reference must take \\(ctx, \\*\\*params\\)"),
        (lambda: None, "reference must take"),
    ],
)
def test_reference_checked(reference, says):
    with pytest.raises(DeclarationError, match=rf"combinator '_test_decl'.*{says}"):
        mask(reference=reference)


def test_reference_must_take_the_parameters():
    with pytest.raises(DeclarationError, match=r"'_test_decl' \(mask\): reference must take \(ctx, width=\)"):
        mask(params=[Param(name="width", default=1)], reference=lambda ctx: None)
    mask(params=[Param(name="width", default=1)], reference=lambda ctx, width: None)


@pytest.mark.parametrize(
    "role, want",
    [
        ("mask", Role.MASK),
        ("MASK", Role.MASK),
        ("score_mod", Role.SCORE_MOD),
        ("score modification", Role.SCORE_MOD),
        (Role.MASK, Role.MASK),
    ],
)
def test_role_accepts_its_string_forms(role, want):
    ref = (lambda ctx: None) if want is Role.MASK else (lambda s, ctx: s)
    fragment = MaskFragment(keep=None) if want is Role.MASK else ScoreModFragment(body="s = s")
    assert mask(role=role, reference=ref, fragment=fragment).role is want


@pytest.mark.parametrize("role", ["maks", 3, None])
def test_unknown_role_lists_the_roles(role):
    with pytest.raises(
        DeclarationError, match=r"role must be one of Role.QK_TRANSFORM \('qk_transform'\), .*got " + repr(role)
    ):
        mask(role=role)


def test_required_parameter_needs_examples():
    """Deprecated, not refused: the contract of 2026-11-30 allowed it (tests/test_deprecated_contract.py)."""
    with pytest.warns(
        DeprecationWarning,
        match=r"combinator '_test_decl_width': parameters \['width'\] have no "
        r"default and it declares no examples, .*declare examples\(draw, "
        r"shape\)",
    ):
        mask(name="_test_decl_width", params=[Param(name="width")], reference=lambda ctx, width: None)
    mask(params=[Param(name="width")], reference=lambda ctx, width: None, examples=lambda draw, shape: {"width": 1})


@pytest.mark.parametrize(
    "role, name",
    [
        (Role.MASK, "q_lo"),
        (Role.MASK, "k_hi"),
        (Role.MASK, "block"),
        (Role.NORMALISER, "factor"),
        (Role.SCORE_MOD, "s_out"),
        (Role.MASK, "self"),
    ],
)
def test_parameter_named_like_a_placeholder_refused(role, name):
    fragment = {
        Role.MASK: MaskFragment(keep=None),
        Role.SCORE_MOD: ScoreModFragment(body="s = s"),
        Role.NORMALISER: NormaliserFragment(init="", update="p = s", finalize="out = acc"),
    }[role]
    ref = {
        Role.MASK: lambda ctx, **kw: None,
        Role.SCORE_MOD: lambda s, ctx, **kw: s,
        Role.NORMALISER: lambda s, keep, ctx, **kw: (s, None),
    }[role]
    with pytest.raises(
        DeclarationError,
        match=rf"combinator '_test_decl': the name '{name}' is a placeholder of "
        rf"the {role.value} slot \(\${name}\)",
    ):
        mask(role=role, fragment=fragment, reference=ref, params=[Param(name=name, default=1)])


def test_declaration_error_is_a_plugin_error():
    with pytest.raises(PluginError):
        mask(reference=None)


# --- a broken plugin registered in code --------------------------------------------------------------------


def test_raising_hook_is_refused_and_the_rest_keep_working():
    class Raises:
        @af.hookimpl
        def attnfuse_combinators(self):
            raise RuntimeError("boom")

    with pytest.raises(
        PluginError,
        match=r"plugin 'test-isolation-raises' of distribution .*: "
        r"attnfuse_combinators\(\) raised RuntimeError: boom",
    ):
        af.register_plugin(Raises(), name="test-isolation-raises")
    assert "causal" in af.combinators() and callable(af.causal)
    assert not any(b.plugin == "test-isolation-raises" for b in broken_plugins())


class Die(BaseException):
    """A BaseException of the plugin's own, neither Exception nor an interrupt."""


def _raise(exc: BaseException):
    raise exc


ENDINGS = {
    "sys.exit": lambda: sys.exit(3),
    "SystemExit": lambda: _raise(SystemExit("bye")),
    "GeneratorExit": lambda: _raise(GeneratorExit()),
    "a BaseException": lambda: _raise(Die("dead")),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_hook_ending_the_process_is_refused_and_the_rest_keep_working(ending):
    """SystemExit, GeneratorExit or another BaseException from a plugin's hook: a PluginError, never the end
    of the process."""

    class Exits:
        @af.hookimpl
        def attnfuse_combinators(self):
            ENDINGS[ending]()

    with pytest.raises(
        PluginError,
        match=r"plugin 'test-isolation-exits' of distribution .*: "
        r"attnfuse_combinators\(\) raised (SystemExit|GeneratorExit|Die)",
    ):
        af.register_plugin(Exits(), name="test-isolation-exits")
    assert "causal" in af.combinators() and callable(af.causal)


def test_a_keyboard_interrupt_in_a_hook_still_interrupts():
    """Ctrl-C while a plugin loads interrupts, as everywhere else (an interrupt raised by the plugin itself is
    taken as one too); nothing of the plugin stays registered."""

    class Interrupts:
        @af.hookimpl
        def attnfuse_combinators(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        af.register_plugin(Interrupts(), name="test-isolation-interrupts")
    assert af.plugin_manager.plugin_manager().get_plugin("test-isolation-interrupts") is None
    assert "causal" in af.combinators()


# --- broken installed plugins (in subprocesses) ------------------------------------------------------------


def fake_distribution(root: Path, dist: str, module: str, body: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[attnfuse]\n{module} = {module}\n")


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken")
    fake_distribution(
        root,
        "attnfuse-test-raises",
        "attnfuse_test_raises",
        """
        import attnfuse

        @attnfuse.hookimpl
        def attnfuse_combinators():
            raise RuntimeError("no GPU found")
    """,
    )
    fake_distribution(
        root,
        "attnfuse-test-badimport",
        "attnfuse_test_badimport",
        """
        from attnfuse.combinator import Combinator, MaskFragment
        COMBINATOR = Combinator(name="bad", role="mask", doc="", reference=None, fragment=MaskFragment(keep=None))
    """,
    )
    return root


def run_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_AUTOLOAD_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=root)


def test_broken_installed_plugins_are_skipped_and_reported(broken_site):
    done = run_in(
        broken_site,
        "-W",
        "always",
        "-c",
        textwrap.dedent("""
        import attnfuse as af
        from attnfuse.plugin_manager import broken_plugins
        print(af.causal.__name__, sorted(b.distribution for b in broken_plugins()))
    """),
    )
    assert done.returncode == 0, done.stderr
    assert "causal ['attnfuse-test-badimport', 'attnfuse-test-raises']" in done.stdout
    assert (
        "PluginWarning: attnfuse skipped a broken plugin 'attnfuse-test-raises:attnfuse_test_raises' of "
        "distribution 'attnfuse-test-raises': attnfuse_combinators() raised RuntimeError: no GPU found" in done.stderr
    )
    assert (
        "distribution 'attnfuse-test-badimport': failed to import attnfuse_test_badimport: DeclarationError: "
        "combinator 'bad': reference must be a function" in done.stderr
    )


def test_attnfuse_list_shows_broken_plugins_and_strict_fails(broken_site):
    done = run_in(broken_site, "-m", "attnfuse.cli", "list")
    assert done.returncode == 0, done.stderr
    assert "2 broken plugin(s), skipped:" in done.stdout
    assert (
        "BROKEN  plugin 'attnfuse-test-raises:attnfuse_test_raises' of distribution 'attnfuse-test-raises': "
        "attnfuse_combinators() raised RuntimeError: no GPU found" in done.stdout
    )
    assert "causal" in done.stdout and done.stderr == ""
    strict = run_in(broken_site, "-m", "attnfuse.cli", "list", "--strict")
    assert strict.returncode == 1 and "BROKEN" in strict.stdout


def test_conformance_kit_fails_on_broken_plugins_when_drawing_from_all(broken_site):
    done = run_in(
        broken_site, "-c", "from attnfuse.testing import check_combinator\ncheck_combinator('causal', installed=True)"
    )
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("attnfuse.errors.PluginError: broken plugins: plugin ")
    assert "plugin 'attnfuse-test-raises:attnfuse_test_raises' of distribution 'attnfuse-test-raises'" in error


ENDING_PLUGINS = {
    "attnfuse-test-sysexit": ("import sys\nsys.exit(3)\n", "failed to import attnfuse_test_sysexit: SystemExit: 3"),
    "attnfuse-test-systemexit": (
        "raise SystemExit('no GPU')\n",
        "failed to import attnfuse_test_systemexit: SystemExit: no GPU",
    ),
    "attnfuse-test-generatorexit": (
        "raise GeneratorExit('closed')\n",
        "failed to import attnfuse_test_generatorexit: GeneratorExit: closed",
    ),
    "attnfuse-test-baseexception": (
        "class Die(BaseException):\n    pass\nraise Die('dead')\n",
        "failed to import attnfuse_test_baseexception: Die: dead",
    ),
    "attnfuse-test-hookexit": (
        "import sys, attnfuse\n@attnfuse.hookimpl\ndef attnfuse_combinators():\n    sys.exit('no licence')\n",
        "attnfuse_combinators() raised SystemExit: no licence",
    ),
}


@pytest.fixture(scope="module")
def ending_site(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ending")
    for dist, (body, _) in ENDING_PLUGINS.items():
        fake_distribution(root, dist, dist.replace("-", "_"), body)
    return root


def test_installed_plugins_ending_the_process_are_skipped_and_reported(ending_site):
    """Each kind of ending (sys.exit, SystemExit, GeneratorExit, a BaseException of its own; at import or in
    its hook) is one broken plugin with a PluginWarning, and programs run."""
    done = run_in(
        ending_site,
        "-W",
        "always",
        "-c",
        textwrap.dedent("""
        import torch
        import attnfuse as af
        from attnfuse.plugin_manager import broken_plugins
        q = torch.randn(1, 1, 8, 8)
        out = af.attention(lambda q, k, v: af.softmax(af.scaled_dot_product(q, k)) @ v)(q, q, q)
        print("ran", tuple(out.shape), sorted(b.distribution for b in broken_plugins()))
    """),
    )
    assert done.returncode == 0, done.stderr
    assert f"ran (1, 1, 8, 8) {sorted(ENDING_PLUGINS)}" in done.stdout
    for dist, (_, cause) in ENDING_PLUGINS.items():
        assert (
            f"PluginWarning: attnfuse skipped a broken plugin '{dist}:{dist.replace('-', '_')}' of "
            f"distribution '{dist}': {cause}" in done.stderr
        )


def test_an_installed_plugin_raising_keyboard_interrupt_at_import_interrupts(tmp_path):
    """A KeyboardInterrupt while plugins load is taken as the user's Ctrl-C: it propagates."""
    fake_distribution(tmp_path, "attnfuse-test-interrupt", "attnfuse_test_interrupt", "raise KeyboardInterrupt\n")
    done = run_in(tmp_path, "-c", "import attnfuse as af\naf.combinators()")
    assert done.returncode != 0 and done.stderr.strip().endswith("KeyboardInterrupt"), done.stderr


# --- the conformance kit -----------------------------------------------------------------------------------


@pytest.fixture
def two_plugins():
    a = mask(
        name="_test_iso_a", reference=lambda ctx: ctx.k_pos >= 0, fragment=MaskFragment(keep="k_pos[None, :] >= 0")
    )
    b = mask(name="_test_iso_b")

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [a, b]

    af.register_plugin(Plugin(), name="test-isolation-two")
    yield
    af.unregister_plugin("test-isolation-two")


def test_programs_draw_from_the_plugin_and_the_builtins_only(two_plugins):
    builtins = {n for n, r in af.combinators().items() if r.distribution == BUILTIN_DISTRIBUTION}
    assert set(pool("_test_iso_a", installed=False)) == builtins | {"_test_iso_a"}
    assert {"_test_iso_a", "_test_iso_b"} | builtins <= set(pool("_test_iso_a", installed=True))


def test_failure_says_how_to_replay_it():
    comb = planted("wrong_backward")

    class Plugin:
        @af.hookimpl
        def attnfuse_combinators(self):
            return [comb]

    af.register_plugin(Plugin(), name="test-isolation-replay")
    try:
        with pytest.raises(AssertionError, match=r"dq of _planted_wrong_backward\(") as info:
            check_combinator(comb.name, max_examples=2, seed=12345)
    finally:
        af.unregister_plugin("test-isolation-replay")
    notes = "\n".join(info.value.__notes__)
    assert "fixed case (prefill with gradients, GQA, Nq != Nk): _planted_wrong_backward(" in notes
    assert "Nq=37, Nk=45" in notes and "with gradients" in notes
    assert "replay: check_combinator('_planted_wrong_backward', seed=12345, max_examples=2, installed=False" in notes


def test_unknown_combinator_is_a_plugin_error():
    with pytest.raises(PluginError, match=r"check_combinator: no combinator named '_test_nothing' is registered"):
        check_combinator("_test_nothing")


def test_conformance_cache_is_temporary_unless_set(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    with temporary_cache():
        inside = cache_dir()
    assert inside.name.startswith("attnfuse-conformance-") and Path.home() not in inside.parents
    assert CACHE_ENV not in os.environ
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with temporary_cache():
        assert cache_dir() == tmp_path
