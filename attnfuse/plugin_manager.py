"""The plugin manager: finds plugins through the ``attnfuse`` entry points and collects their combinators.

Order, as in pytest and tox: add the hookspecs, load the entry points (the built-ins are entry points of
the ``attnfuse`` distribution itself), load the built-ins no entry point named (a source checkout run
without ``pip install``; see ``builtin_plugins``), check for hook implementations no hookspec knows.
Setting ``ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD=1`` loads the built-ins only.

One installed plugin never takes the others down. A plugin that fails (its import raises, even
``SystemExit`` or another ``BaseException`` but ``KeyboardInterrupt``, which still interrupts; it implements
an unknown hook, its hook raises or returns something other than valid combinators) is reported with a
warning, listed by ``broken_plugins()`` and skipped. A combinator whose name another plugin also declares,
or attnfuse's own API uses, is skipped alone (the plugin's other combinators stay): a built-in keeps its
name; two installed packages that declare one name both lose it (neither takes precedence). A plugin
registered from code (``register_plugin``) that fails or clashes is refused with a ``PluginError`` instead.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import threading
import warnings
from typing import Any, Iterable

import attrs
import pluggy
from attrs import frozen

from . import builtin_plugins, hookspecs
from .combinator import Combinator
from .errors import PluginError
from .fragment_lint import lint
from .hookspecs import NAME

DISABLE_AUTOLOAD_ENV = "ATTNFUSE_DISABLE_PLUGIN_AUTOLOAD"
BUILTIN_DISTRIBUTION = "attnfuse"
IN_CODE = "<registered in code: {}>"
"""The distribution ``register_plugin`` records for plugin ``{}``."""


@frozen
class Registered:
    """A combinator and where it comes from."""

    combinator: Combinator
    distribution: str
    plugin: str


@frozen
class BrokenPlugin:
    """A plugin that was skipped, or the one combinator of it that was (``combinator``), and why."""

    plugin: str
    distribution: str
    cause: str  # a whole sentence naming the plugin and distribution
    combinator: str | None = None  # None: the whole plugin was skipped

    def describe(self) -> str:
        return self.cause


class PluginWarning(UserWarning):
    """An installed plugin, or one combinator of it, was skipped."""


_lock = threading.RLock()
_load_failures: list[BrokenPlugin] = []
_broken: list[BrokenPlugin] = []
_manager: pluggy.PluginManager | None = None
_distributions: dict[str, str] = {}
_registry: dict[str, Registered] | None = None
_reserved: frozenset[str] = frozenset()  # the names the attnfuse module defines (``reserve_names``)


def _autoload_disabled() -> bool:
    return os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, created on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _load_failures.clear()  # what a load an interrupt ended left
            _distributions.clear()
            pm = pluggy.PluginManager(NAME)
            pm.add_hookspecs(hookspecs)
            skip_third_party = _autoload_disabled()
            named: set[str] = set()
            for ep in importlib.metadata.entry_points(group=NAME):
                dist = ep.dist.name if ep.dist is not None else "unknown"
                if skip_third_party and dist != BUILTIN_DISTRIBUTION:
                    continue
                name = f"{dist}:{ep.name}"
                if name not in named:  # once, though a distribution may be seen twice on sys.path
                    named.add(name)
                    _load(pm, name, dist, ep.value, ep.load)
            missing = [m for m in builtin_plugins.MODULES if f"{BUILTIN_DISTRIBUTION}:{m}" not in named]
            if missing:
                builtin_plugins.package()  # a PluginError saying what to install when there is none
            for module in missing:
                _load(
                    pm,
                    f"{BUILTIN_DISTRIBUTION}:{module}",
                    BUILTIN_DISTRIBUTION,
                    f"{builtin_plugins.PACKAGE}.{module}",
                    functools.partial(builtin_plugins.load, module),
                )
            _drop_unknown_hooks(pm)
            _manager = pm
        return _manager


def _ending(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a plugin's import or hook, makes the plugin broken: any exception, and any
    other BaseException that would end the process (``sys.exit``, ``SystemExit``, ``GeneratorExit``, one of
    the plugin's own), but not ``KeyboardInterrupt``: Ctrl-C while plugins load interrupts, as anywhere else
    (an interrupt a plugin raises itself cannot be told apart from one, and is taken as one)."""
    return not isinstance(exc, KeyboardInterrupt)


def _load(pm: pluggy.PluginManager, name: str, dist: str, target: str, load) -> None:
    """Import one plugin (``load()``) and register it as ``name``; a failure (``_ending``) is kept as a
    broken plugin."""
    try:
        plugin = load()
    except BaseException as exc:
        if not _ending(exc):
            raise
        _load_failures.append(
            BrokenPlugin(
                name,
                dist,
                f"plugin {name!r} of distribution {dist!r}: failed to import {target}: {type(exc).__name__}: {exc}",
            )
        )
        return
    try:
        pm.register(plugin, name=name)
    except BaseException as exc:  # a hook pluggy refuses, or a module another entry point registered already
        if not _ending(exc):
            raise
        _load_failures.append(
            BrokenPlugin(
                name,
                dist,
                f"plugin {name!r} of distribution {dist!r}: failed to register {target}: {type(exc).__name__}: {exc}",
            )
        )
        return
    _distributions[name] = dist


def _drop_unknown_hooks(pm: pluggy.PluginManager) -> None:
    """Unregister each installed plugin implementing a hook no hookspec declares (a typo such as
    ``attnfuse_combinatorz``), keeping it as broken; such a built-in is a PluginError."""
    while True:
        try:
            pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin)
            dist = _distributions.pop(name, "unknown")
            if dist == BUILTIN_DISTRIBUTION:
                raise PluginError(f"a plugin implements a hook attnfuse does not know: {exc}") from exc
            pm.unregister(name=name)
            _load_failures.append(
                BrokenPlugin(
                    name,
                    dist,
                    f"plugin {name!r} of distribution {dist!r}: implements a hook attnfuse does not know: {exc}",
                )
            )


def register_plugin(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object from code (a notebook, a test) as if a distribution had shipped it.

    Nothing is left registered when the plugin is broken or clashes with another.
    """
    global _registry
    with _lock:
        pm = plugin_manager()
        try:
            name = pm.register(plugin, name=name)
        except ValueError as exc:
            raise PluginError(
                f"cannot register plugin {name or plugin!r}: a plugin of that name or that object is registered already"
            ) from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r}: {exc}") from exc
        try:
            pm.check_pending()
            _distributions[name] = IN_CODE.format(name)
            registry, broken = _collect(pm)
            failed = [b for b in broken if b.plugin == name]
            if failed:
                raise PluginError(failed[0].cause)
            _publish(registry, broken)
        except BaseException as exc:  # a PluginError, or an interrupt while it loads: nothing stays registered
            pm.unregister(name=name)
            _distributions.pop(name, None)
            _registry = None
            if isinstance(exc, pluggy.PluginValidationError):
                raise PluginError(f"plugin {name!r}: {exc}") from exc
            raise


def unregister_plugin(name: str) -> None:
    """Undo :func:`register_plugin`."""
    global _registry
    with _lock:
        plugin_manager().unregister(name=name)
        _distributions.pop(name, None)
        _registry = None


def combinators() -> dict[str, Registered]:
    """Every registered combinator by name (of the plugins that work; see ``broken_plugins``)."""
    with _lock:
        if _registry is None:
            _publish(*_collect(plugin_manager()))
        return _registry


def _publish(registry: dict[str, Registered], broken: list[BrokenPlugin]) -> None:
    """Make ``registry`` current; warn once of each plugin or combinator newly skipped."""
    global _registry
    new = [b for b in broken if b not in _broken]
    _broken[:] = broken
    _registry = registry
    for b in new:
        what = f"combinator {b.combinator!r}: " if b.combinator else "a broken "
        warnings.warn(f"attnfuse skipped {what}{b.describe()}", PluginWarning, stacklevel=3)


def broken_plugins() -> list[BrokenPlugin]:
    """The installed plugins, or single combinators of them, that were skipped, with the cause."""
    with _lock:
        combinators()
        return list(_broken)


def reserve_names(names: Iterable[str]) -> None:
    """Keep ``names``, those the ``attnfuse`` module defines itself (its API and submodules; its
    ``__init__`` gives them), from every combinator: ``af.<name>`` could not reach one of that name."""
    global _registry, _reserved
    with _lock:
        _reserved = frozenset(names)
        _registry = None  # collected again, against these names


def name_in_use(name: str) -> str | None:
    """Why a new combinator could not be called ``name`` (a phrase), or None when the name is free."""
    if name in _reserved:
        return "a name attnfuse's own API uses"
    entry = combinators().get(name)
    if entry is not None:
        kind = "built-in" if entry.distribution == BUILTIN_DISTRIBUTION else "installed"
        return f"the name of the {kind} combinator of distribution {entry.distribution!r}"
    skipped = [b.distribution for b in broken_plugins() if b.combinator == name]
    if skipped:
        return f"a name installed distributions already clash over ({', '.join(sorted(set(skipped)))})"
    return None


def _collect(pm: pluggy.PluginManager) -> tuple[dict[str, Registered], list[BrokenPlugin]]:
    """The combinators of the working plugins, and the plugins or combinators skipped (load failures
    included)."""
    broken = list(_load_failures)
    claims: dict[str, list[Registered]] = {}
    for impl in pm.hook.attnfuse_combinators.get_hookimpls():  # in registration order
        plugin_name = impl.plugin_name
        dist = _distributions.get(plugin_name, "unknown")
        try:
            provided = _provided(impl, plugin_name, dist)
        except PluginError as exc:
            broken.append(BrokenPlugin(plugin_name, dist, str(exc)))
            continue
        for comb in provided:
            if comb.name in _reserved:
                broken.append(
                    BrokenPlugin(
                        plugin_name,
                        dist,
                        f"plugin {plugin_name!r} of distribution {dist!r} "
                        f"declares combinator {comb.name!r}, a name attnfuse's "
                        f"own API uses; choose another",
                        comb.name,
                    )
                )
            else:
                claims.setdefault(comb.name, []).append(Registered(comb, dist, plugin_name))
    found: dict[str, Registered] = {}
    for name, entries in claims.items():
        kept, reason = _winner(entries)
        if kept is not None:
            found[name] = kept
        broken += [
            BrokenPlugin(e.plugin, e.distribution, _clash(name, entries, e, kept, reason), name)
            for e in entries
            if e is not kept
        ]
    if not any(r.distribution == BUILTIN_DISTRIBUTION for r in found.values()):
        causes = "; ".join(b.cause for b in broken if b.distribution == BUILTIN_DISTRIBUTION)
        raise PluginError(f"no built-in combinators could be loaded: {causes or 'none is registered'}")
    return found, broken


def _in_code(distribution: str) -> bool:
    return distribution.startswith(IN_CODE.format(""))


def _winner(entries: list[Registered]) -> tuple[Registered | None, str]:
    """Of the plugins declaring one name (in registration order), the one that keeps it, and why: the
    built-in; else the one installed plugin, over plugins registered in code; else, among plugins
    registered in code, the first. Of several installed plugins none does: no installed package takes
    precedence over another, and choosing one would make a program's meaning depend on what else is
    installed."""
    if len(entries) == 1:
        return entries[0], ""
    builtins = [e for e in entries if e.distribution == BUILTIN_DISTRIBUTION]
    if len(builtins) > 1:
        raise PluginError(f"built-in plugins {[e.plugin for e in builtins]} declare one combinator twice")
    if builtins:
        return builtins[0], "the built-in keeps its name"
    installed = [e for e in entries if not _in_code(e.distribution)]
    if len(installed) == 1:
        return installed[0], "the installed plugin keeps its name"
    if not installed:
        return entries[0], "the plugin registered first keeps its name"
    dists = sorted({e.distribution for e in installed})
    return None, (
        f"no installed package takes precedence over another, so none of them provides it: uninstall "
        f"all but one of {', '.join(dists)}, or set {DISABLE_AUTOLOAD_ENV}=1 to load the built-ins only"
    )


def _clash(name: str, entries: list[Registered], loser: Registered, kept: Registered | None, reason: str) -> str:
    """The cause recorded for ``loser``, one of the plugins declaring combinator ``name``."""
    others = sorted((e for e in entries if e is not loser), key=lambda e: (e.distribution, e.plugin))
    by = " and by ".join(f"plugin {e.plugin!r} of distribution {e.distribution!r}" for e in [*others, loser])
    if kept is not None:
        reason += (
            f", so plugin {loser.plugin!r} cannot provide it: give its combinator another name, or "
            f"uninstall {loser.distribution!r} if it only provides what {kept.distribution!r} does"
        )
    return f"combinator {name!r} is declared twice: by {by}; {reason}"


def _provided(impl, plugin_name: str, dist: str) -> list[Combinator]:
    """One plugin's combinators, checked; a PluginError naming the plugin and distribution if it fails."""
    where = f"plugin {plugin_name!r} of distribution {dist!r}"
    try:
        result = list(impl.function() or ())
    except BaseException as exc:
        if not _ending(exc):
            raise
        raise PluginError(f"{where}: attnfuse_combinators() raised {type(exc).__name__}: {exc}") from exc
    names: set[str] = set()
    for comb in result:
        if not isinstance(comb, Combinator):
            raise PluginError(f"{where} returned {type(comb).__name__} from attnfuse_combinators(), not a Combinator")
        if comb.name in names:
            raise PluginError(f"combinator {comb.name!r} is declared twice, by {where}")
        names.add(comb.name)
        if attrs.has(type(comb.fragment)):  # a fragment function is checked when lowering calls it
            lint(comb, comb.fragment, dist)
    return result


def registered(name: str) -> Registered:
    """The record of the combinator registered under ``name``: the combinator and where it comes from."""
    registry = combinators()
    if name not in registry:
        raise PluginError(f"no combinator named {name!r}; registered: {', '.join(sorted(registry))}")
    return registry[name]


def lookup(name: str) -> Combinator:
    """The combinator registered under ``name``."""
    return registered(name).combinator


def tile_config(kernel: str, arch: str, variant: str, head_dim: int, dtype: str) -> Any:
    """The tiles plugins choose for one kernel: the first ``attnfuse_tile_config`` result, else the config of
    the first matching rule of ``attnfuse_tile_configs``; None when no plugin chooses."""
    hook = plugin_manager().hook
    config = hook.attnfuse_tile_config(kernel=kernel, arch=arch, variant=variant, head_dim=head_dim, dtype=dtype)
    if config is None:
        config = next(
            (
                rule.config
                for rules in hook.attnfuse_tile_configs()
                for rule in rules or ()
                if rule.matches(kernel, arch, variant, head_dim, dtype)
            ),
            None,
        )
    return config
