"""The hooks an AttnFuse plugin may implement.

A plugin is a module (or any object) with functions marked ``@attnfuse.hookimpl``, registered under the
``attnfuse`` entry-point group of its distribution::

    [project.entry-points.attnfuse]
    softcap = "attnfuse_softcap"

The built-in combinators in ``attnfuse_plugins`` are registered exactly this way.
"""

from __future__ import annotations

import pluggy

NAME = "attnfuse"
"""One name for the hook markers, the plugin manager and the entry-point group."""

hookspec = pluggy.HookspecMarker(NAME)
hookimpl = pluggy.HookimplMarker(NAME)


@hookspec
def attnfuse_combinators() -> list:
    """Return the combinators this plugin provides.

    :return: a list of :class:`attnfuse.combinator.Combinator` declarations. Each becomes ``af.<name>``.
        A name another plugin also provides is skipped with a warning naming both distributions (a
        built-in keeps its name; see docs/plugins.md); from ``register_plugin`` it is a PluginError.
    """


@hookspec(firstresult=True)
def attnfuse_tile_config(kernel: str, arch: str, variant: str, head_dim: int, dtype: str):
    """Choose the tiles of one generated kernel, or leave the choice to the next plugin.

    Called when a program is compiled, for each kernel kind. The first implementation that returns tiles
    decides (pluggy's ``firstresult``), before the rules of ``attnfuse_tile_configs`` and the built-in table.
    An implementation takes only the arguments it uses, by name. Call
    ``attnfuse.runtime.launch.clear_cache()`` after registering one at run time.

    :param kernel: "forward", "dkdv", "dq" or "decode".
    :param arch: "sm90", "sm80", ... or "interpreter".
    :param variant: "dense", "masked", "window", "listed" or "rope" (``attnfuse.plugin.TileRule``).
    :param head_dim: the wider head dim of q/k and v, padded to a power of two.
    :param dtype: q, k and v's dtype: "bfloat16", "float16", "float32", "float64", "float8_e4m3fn" or
        "float8_e5m2".
    :return: an :class:`attnfuse.plugin.TileConfig`, or None.
    """


@hookspec
def attnfuse_tile_configs() -> list:
    """Return tile rules that take precedence over the built-in tuning table.

    :return: a list of :class:`attnfuse.plugin.TileRule`. The first rule matching a kernel's
        (kernel kind, arch, variant, head dim, dtype) wins; plugins' rules are tried after ``attnfuse_tile_config``
        and before the built-in table. Call ``attnfuse.runtime.launch.clear_cache()`` after registering
        rules at run time.
    """
