"""The plugin registry: built-ins, plugins registered in code, name clashes, autoload control, declarations.

Tests that register plugins clean up after themselves (``registered``), so the process-wide registry is
the same before and after each of them. Tests of entry points run in a subprocess, with a fake
distribution (a ``.dist-info`` folder) on its ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import attnfuse as af
from attnfuse import PluginError, builtin_plugins, hookspecs
from attnfuse.checks import positive_number
from attnfuse.combinator import (
    Combinator,
    MaskFragment,
    NormaliserFragment,
    Param,
    QKTransformFragment,
    Role,
    ScalarArg,
    ScoreModFragment,
    ScoreSourceFragment,
    TensorArg,
)
from attnfuse import plugin_manager as plugin_manager_module
from attnfuse.plugin_manager import BUILTIN_DISTRIBUTION, DISABLE_AUTOLOAD_ENV, plugin_manager

# pyproject.toml's entry points; their roles are those of the docs' tables (tests/test_docs_references.py)
BUILTINS = builtin_plugins.MODULES
ROOT = Path(__file__).resolve().parents[1]


def plugin_of(*combs) -> types.ModuleType:
    """A plugin object (a module, as an entry point would load) providing ``combs``."""
    module = types.ModuleType("attnfuse_test_plugin")

    @af.hookimpl
    def attnfuse_combinators():
        return list(combs)

    module.attnfuse_combinators = attnfuse_combinators
    return module


@contextlib.contextmanager
def registered(plugin, name: str):
    """Register ``plugin`` under ``name`` for the duration of the block, then remove it whatever happened."""
    try:
        af.register_plugin(plugin, name=name)
        yield
    finally:
        af.unregister_plugin(name)
        assert not plugin_manager().has_plugin(name)
        assert set(BUILTINS) <= set(af.combinators())  # the registry works again


def keep_all_mask(name: str) -> Combinator:
    return Combinator(
        name=name,
        role=Role.MASK,
        doc="Keeps every key (test).",
        reference=lambda ctx: None,
        fragment=MaskFragment(keep=None),
    )


# --- the built-ins ---------------------------------------------------------------------------------------


def test_builtins_present_with_distribution():
    registry = af.combinators()
    assert BUILTINS, "no built-in entry points in pyproject.toml"
    for name in BUILTINS:
        assert name in registry, name
        entry = registry[name]
        assert entry.combinator.name == name
        assert entry.distribution == BUILTIN_DISTRIBUTION == "attnfuse"
        assert entry.plugin == f"attnfuse:{name}"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_is_an_af_attribute(name):
    fn = getattr(af, name)
    assert fn is getattr(af, name)  # cached
    assert name in dir(af)
    assert fn.__name__ == name


def test_every_registered_combinator_is_callable_and_documented():
    for name, entry in af.combinators().items():
        fn = getattr(af, name)
        assert callable(fn), name
        assert entry.combinator.doc.strip(), f"combinator {name} has no doc"
        assert fn.__doc__ and fn.__doc__.startswith(f"{name}("), name
        assert f"[{entry.combinator.role.value}]" in fn.__doc__
        assert entry.combinator.doc in fn.__doc__


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_parameters_documented(name):
    comb = af.combinators()[name].combinator
    for p in comb.params:
        assert p.doc.strip(), f"{name}: parameter {p.name} has no doc"
        assert p.name in getattr(af, name).__doc__


def test_af_docstring_signature():
    assert af.sliding_window.__doc__.startswith("sliding_window(s, left, right=0)  [mask]")
    assert af.rope.__doc__.startswith(
        "rope(q, k, theta=10000.0, scale=None, cos=None, sin=None, rotate_keys=True, rotary_dim=None, "
        "interleaved=False)  [score source]"
    )
    assert af.causal.__doc__.startswith("causal(s)  [mask]")


# --- plugins registered in code ---------------------------------------------------------------------------


SCALE_SCORES = Combinator(
    name="test_plugins_scale_scores",
    role=Role.SCORE_MOD,
    doc="s * factor (test).",
    params=[Param(name="factor", default=2.0, check=positive_number, doc="a positive multiplier")],
    reference=lambda s, ctx, factor: s * factor,
    fragment=ScoreModFragment(body="s = s * $factor"),
)
DROP_FIRST_KEY = Combinator(
    name="test_plugins_drop_first_key",
    role=Role.MASK,
    doc="Keeps every key but key 0 (test).",
    reference=lambda ctx: ctx.k_pos != 0,
    fragment=MaskFragment(keep="k_pos[None, :] != 0"),
)


def test_register_and_unregister_a_plugin():
    names = (SCALE_SCORES.name, DROP_FIRST_KEY.name)
    assert not any(n in af.combinators() for n in names)
    with registered(plugin_of(SCALE_SCORES, DROP_FIRST_KEY), "test-plugins-in-code"):
        registry = af.combinators()
        for n in names:
            assert n in registry and n in dir(af)
            assert registry[n].plugin == "test-plugins-in-code"
            assert registry[n].distribution != BUILTIN_DISTRIBUTION
            assert "test-plugins-in-code" in registry[n].distribution
        assert callable(af.test_plugins_scale_scores)
        assert "s * factor (test)." in af.test_plugins_scale_scores.__doc__

        @af.attention
        def prog(q, k, v):
            s = af.scaled_dot_product(q, k)
            s = af.test_plugins_scale_scores(s, factor=3.0)
            s = af.test_plugins_drop_first_key(s)
            return af.softmax(s) @ v

        q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
        out = prog(q, k, v)
        torch.testing.assert_close(out.double(), prog.reference(q, k, v), atol=1e-5, rtol=1e-5)
        with pytest.raises(
            af.ProgramError,
            match=r"test_plugins_scale_scores: parameter 'factor': must be a "
            r"finite number > 0, got -1",
        ):
            af.attention(
                lambda q, k, v: af.softmax(af.test_plugins_scale_scores(af.scaled_dot_product(q, k), factor=-1)) @ v
            )(q, k, v)
    for n in names:
        assert n not in af.combinators()
        assert n not in dir(af)
        with pytest.raises(AttributeError, match="attnfuse list"):
            getattr(af, n)


def test_plugin_providing_no_combinators():
    module = types.ModuleType("attnfuse_test_empty")
    module.attnfuse_combinators = af.hookimpl(lambda: None)
    with registered(module, "test-plugins-empty"):
        assert set(BUILTINS) <= set(af.combinators())


def test_same_name_from_two_plugins_names_both():
    with pytest.raises(PluginError) as info:
        with registered(plugin_of(keep_all_mask("causal")), "test-plugins-clash"):
            af.combinators()
    message = str(info.value)
    assert "combinator 'causal' is declared twice" in message
    assert "plugin 'attnfuse:causal' of distribution 'attnfuse'" in message
    assert "plugin 'test-plugins-clash'" in message
    assert "the built-in keeps its name, so plugin 'test-plugins-clash' cannot provide it" in message
    assert af.combinators()["causal"].distribution == "attnfuse"


def test_same_name_twice_from_one_plugin():
    with pytest.raises(PluginError, match=r"combinator 'test_plugins_twice' is declared twice"):
        with registered(
            plugin_of(keep_all_mask("test_plugins_twice"), keep_all_mask("test_plugins_twice")), "test-plugins-twice"
        ):
            af.combinators()


@pytest.mark.parametrize("name", ["attention", "register_plugin", "combinators", "BlockMask", "hookimpl"])
def test_reserved_name_refused(name):
    with pytest.raises(
        PluginError,
        match=rf"plugin 'test-plugins-reserved' .*declares combinator '{name}', a name "
        rf"attnfuse's own API uses; choose another",
    ):
        with registered(plugin_of(keep_all_mask(name)), "test-plugins-reserved"):
            af.combinators()


@pytest.mark.parametrize("name", ["unregister_plugin", "ProgramError", "errors", "dsl"])
def test_every_module_attribute_is_reserved(name):
    import importlib

    importlib.import_module(f"attnfuse.{name}") if name in ("errors", "dsl") else None
    assert name in dir(af) or hasattr(af, name)
    with pytest.raises(PluginError, match=rf"'{name}', a name attnfuse's own API uses"):
        with registered(plugin_of(keep_all_mask(name)), "test-plugins-shadowed"):
            af.combinators()


def test_reserved_names_cover_the_public_api():
    public = {
        n
        for n in af.__all__
        if n not in ("unregister_plugin", "AttnFuseError", "InputError", "PluginError", "ProgramError")
    }
    assert public <= plugin_manager_module._reserved


@pytest.mark.parametrize("bad", ["causal", 42, None, keep_all_mask], ids=["str", "int", "None", "function"])
def test_non_combinator_refused(bad):
    with pytest.raises(
        PluginError,
        match=r"plugin 'test-plugins-bad' of distribution .* returned \w+ from "
        r"attnfuse_combinators\(\), not a Combinator",
    ):
        with registered(plugin_of(bad), "test-plugins-bad"):
            af.combinators()


def test_unknown_hook_refused_with_plugin_error():
    module = types.ModuleType("attnfuse_test_typo")
    module.attnfuse_combinatorz = af.hookimpl(lambda: [])
    try:
        with pytest.raises(PluginError, match=r"attnfuse_combinatorz"):
            af.register_plugin(module, name="test-plugins-typo")
        assert not plugin_manager().has_plugin("test-plugins-typo")
    finally:
        af.unregister_plugin("test-plugins-typo")


# --- entry points and ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD (in subprocesses) -----------------------------------

LIST_COMBINATORS = textwrap.dedent("""
    import json
    import attnfuse as af
    try:
        print(json.dumps({n: r.distribution for n, r in af.combinators().items()}))
    except af.PluginError as exc:
        print(json.dumps({"PluginError": str(exc)}))
""")


def fake_distribution(root: Path, dist: str, module: str, combinator_name: str) -> None:
    """A distribution ``dist`` whose ``attnfuse`` entry point ``module`` provides a keep-all mask."""
    (root / f"{module}.py").write_text(
        textwrap.dedent(f"""
        import attnfuse
        from attnfuse.combinator import Combinator, MaskFragment, Role

        COMBINATOR = Combinator(name={combinator_name!r}, role=Role.MASK, doc="Keeps every key (test).",
                                reference=lambda ctx: None, fragment=MaskFragment(keep=None))

        @attnfuse.hookimpl
        def attnfuse_combinators():
            return [COMBINATOR]
    """)
    )
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[attnfuse]\n{combinator_name} = {module}\n")


def list_combinators(path: Path | None, disable: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != DISABLE_AUTOLOAD_ENV}
    if disable is not None:
        env[DISABLE_AUTOLOAD_ENV] = disable
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", LIST_COMBINATORS], env=env, capture_output=True, text=True, timeout=300, cwd=path or ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def third_party(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("site")
    fake_distribution(root, "attnfuse-test-fakeplugin", "attnfuse_test_fakeplugin", "test_fake_keep_all")
    return root


@pytest.fixture(scope="module")
def clashing(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clash")
    fake_distribution(root, "attnfuse-test-clash", "attnfuse_test_clash", "causal")
    return root


def test_third_party_entry_point_loaded(third_party):
    found = list_combinators(third_party, disable=None)
    assert found.get("test_fake_keep_all") == "attnfuse-test-fakeplugin"
    assert all(found[name] == "attnfuse" for name in BUILTINS)


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_disable_autoload_loads_builtins_only(third_party, value):
    in_this_process = {
        n
        for n, r in af.combinators().items()
        if r.distribution != BUILTIN_DISTRIBUTION and not r.distribution.startswith("<")
    }
    found = list_combinators(third_party, disable=value)
    assert set(BUILTINS) <= set(found)
    assert {n: d for n, d in found.items() if d != "attnfuse"} == {}
    assert "test_fake_keep_all" not in found
    assert not in_this_process & set(found), "installed third-party combinators must be excluded"


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_autoload_enabled_by_falsy_values(third_party, value):
    assert "test_fake_keep_all" in list_combinators(third_party, disable=value)


def test_clash_between_distributions_keeps_the_builtin(clashing):
    """An installed package declaring a built-in's name loses it; nothing else fails (tests/test_plugin_clash.py
    checks the warning)."""
    found = list_combinators(clashing, disable=None)
    assert "PluginError" not in found and found["causal"] == "attnfuse"
    found = list_combinators(clashing, disable="1")
    assert found["causal"] == "attnfuse"


# --- combinator declarations ------------------------------------------------------------------------------


REFERENCES = {
    Role.MASK: lambda ctx: None,
    Role.SCORE_MOD: lambda s, ctx: s,
    Role.NORMALISER: lambda s, keep, ctx: (s, None),
    Role.QK_TRANSFORM: lambda q, k, ctx: (q, k),
    Role.SCORE_SOURCE: lambda q, k, ctx, scale=None: q @ k.transpose(-1, -2),
}


def declare(**overrides) -> Combinator:
    """A valid declaration (a reference of the right arity for its role) with ``overrides``."""
    fields = dict(name="test_decl", role=Role.MASK, doc="test", fragment=MaskFragment(keep=None))
    fields.update(overrides)
    fields.setdefault("reference", REFERENCES[fields["role"]])
    return Combinator(**fields)


def test_valid_declaration():
    comb = declare()
    assert comb.params == () and comb.prepare is None


@pytest.mark.parametrize(
    "role, fragment",
    [
        (Role.MASK, ScoreModFragment(body="s = s")),
        (Role.SCORE_MOD, MaskFragment(keep=None)),
        (Role.NORMALISER, ScoreModFragment(body="s = s")),
        (Role.QK_TRANSFORM, ScoreSourceFragment()),
        (Role.SCORE_SOURCE, QKTransformFragment()),
        (Role.MASK, None),
        (Role.MASK, "k_pos[None, :] >= 0"),
    ],
)
def test_fragment_must_match_role(role, fragment):
    params = [Param(name="scale", default=None)] if role is Role.SCORE_SOURCE else []
    with pytest.raises(
        TypeError,
        match=rf"combinator 'test_decl' has role '{role.value}', so its fragment must be "
        rf"a \w+Fragment, got {type(fragment).__name__}",
    ):
        declare(role=role, fragment=fragment, params=params)


def test_every_role_accepts_its_fragment():
    declare(role=Role.SCORE_SOURCE, fragment=ScoreSourceFragment(), params=[Param(name="scale", default=None)])
    declare(role=Role.QK_TRANSFORM, fragment=QKTransformFragment())
    declare(role=Role.SCORE_MOD, fragment=ScoreModFragment(body="s = s"))
    declare(role=Role.NORMALISER, fragment=NormaliserFragment(init="", update="p = s", finalize="out = acc"))


def test_score_source_needs_scale():
    with pytest.raises(ValueError, match=r"score source 'test_decl' must declare a 'scale' parameter"):
        declare(role=Role.SCORE_SOURCE, fragment=ScoreSourceFragment())
    with pytest.raises(ValueError, match=r"must declare a 'scale' parameter"):
        declare(role=Role.SCORE_SOURCE, fragment=ScoreSourceFragment(), params=[Param(name="theta", default=1.0)])


def test_tensors_or_scalars_need_prepare():
    with pytest.raises(
        ValueError,
        match=r"combinator 'test_decl' declares kernel tensors or scalars but no "
        r"prepare\(\)",
    ):
        declare(tensors=[TensorArg(name="bias", rank=4)])
    with pytest.raises(ValueError, match=r"declares kernel tensors or scalars but no prepare\(\)"):
        declare(scalars=[ScalarArg(name="n")])
    declare(tensors=[TensorArg(name="bias", rank=4)], prepare=lambda ctx: {})


def test_parameter_declared_twice():
    with pytest.raises(ValueError, match=r"combinator 'test_decl' declares a parameter twice"):
        declare(params=[Param(name="left"), Param(name="left", default=1)])


@pytest.mark.parametrize("name", ["my-mask", "class", "1mask", "", "two words", "None"])
def test_names_must_be_identifiers(name):
    with pytest.raises(ValueError, match=r"name must be a Python identifier, got " + repr(name).replace("(", r"\(")):
        declare(name=name)
    with pytest.raises(ValueError, match=r"name must be a Python identifier"):
        Param(name=name)
    with pytest.raises(ValueError, match=r"name must be a Python identifier"):
        TensorArg(name=name, rank=1)
    with pytest.raises(ValueError, match=r"name must be a Python identifier"):
        ScalarArg(name=name)


def test_declarations_are_frozen():
    comb = declare()
    with pytest.raises(AttributeError):
        comb.name = "other"


# --- hookspecs --------------------------------------------------------------------------------------------


def hookspec_functions() -> dict:
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if hasattr(fn, f"{hookspecs.NAME}_spec")
    }


def test_hookspecs_found():
    specs = hookspec_functions()
    assert {"attnfuse_combinators", "attnfuse_tile_configs"} <= set(specs)
    for name in specs:
        assert hasattr(plugin_manager().hook, name)


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hookspec_documented(name):
    fn = hookspec_functions()[name]
    doc = inspect.getdoc(fn)
    assert doc and doc.strip(), f"hookspec {name} has no docstring"
    assert ":return:" in doc, f"hookspec {name} does not document what it returns"


@pytest.mark.parametrize("name", sorted(hookspec_functions()))
def test_every_hookspec_in_plugin_docs(name):
    docs = ROOT / "docs" / "plugins.md"
    if not docs.exists():
        pytest.skip("docs/plugins.md does not exist yet")
    assert name in docs.read_text(), f"docs/plugins.md does not mention hookspec {name}"


def test_the_plugin_module_holds_what_the_docs_tell_plugin_authors_to_use():
    """Every name the plugin docs import from ``attnfuse.plugin`` or spell ``attnfuse.plugin.<name>`` is
    there, and is the very object its old module (still importable) holds."""
    import re

    import attnfuse.block_mask
    import attnfuse.checks
    import attnfuse.combinator
    import attnfuse.device_cache
    import attnfuse.errors
    import attnfuse.examples_support
    import attnfuse.hookspecs
    import attnfuse.passes.tile
    import attnfuse.plugin
    import attnfuse.rotary
    import attnfuse.runtime.inputs

    docs = Path(__file__).resolve().parents[1] / "docs"
    text = "".join((docs / name).read_text() for name in ("writing-a-combinator.md", "plugins.md"))
    imported = re.findall(r"from attnfuse\.plugin import \(?([\w\s,]+?)\)?\n(?=\S|\n)", text)
    named = {n for group in imported for n in re.split(r"[\s,]+", group) if n} | set(
        re.findall(r"attnfuse\.plugin\.(\w+)", text)
    )
    assert {"hookimpl", "Combinator", "LaunchContext", "TileRule", "random_tensor", "InputError"} <= named
    old_homes = (
        attnfuse.block_mask,
        attnfuse.checks,
        attnfuse.combinator,
        attnfuse.device_cache,
        attnfuse.errors,
        attnfuse.examples_support,
        attnfuse.hookspecs,
        attnfuse.passes.tile,
        attnfuse.rotary,
        attnfuse.runtime.inputs,
    )
    for name in sorted(named | set(attnfuse.plugin.__all__)):
        value = getattr(attnfuse.plugin, name)
        homes = [m.__name__ for m in old_homes if getattr(m, name, None) is value]
        assert homes, f"attnfuse.plugin.{name} is in none of its old modules"
