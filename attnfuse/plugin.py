"""The plugin API: everything a combinator plugin imports of AttnFuse, in one module.

    from attnfuse.plugin import Combinator, MaskFragment, Param, Role, hookimpl

docs/writing-a-combinator.md and docs/plugins.md describe each name. A plugin imports this module (and,
in its tests, ``attnfuse.testing``), never the ``attnfuse`` package itself, which would import the
compiler and the runtime into every process that loads the plugin. Nothing here imports them:
``tests/test_structure.py`` checks it. The modules these names come from (``attnfuse.combinator``,
``attnfuse.hookspecs``, ``attnfuse.errors`` ...) stay importable as before.

- the hook marker: ``hookimpl``;
- the declaration: ``Combinator``, ``Role``, ``Param``, ``TensorArg``, ``ScalarArg``, ``REQUIRED`` (a
  parameter with no default), ``INPUT`` (the marker a given runtime input gets in ``examples``);
- the fragments of each role: ``QKTransformFragment``, ``ScoreSourceFragment``, ``ScoreModFragment``,
  ``MaskFragment`` (with its ``Range`` facts and a ``BlockList``), ``NormaliserFragment``;
- what ``prepare`` is given and may use: ``LaunchContext``, ``device_cached``, ``rotate_half``,
  ``rotate_every_two``, ``BlockMask``;
- parameter checks: ``positive_number``, ``finite_number_or_none``, ``non_negative_int``;
- the errors a plugin raises: ``InputError`` (a call's inputs), ``DeclarationError`` and ``PluginError``
  (a declaration), ``ProgramError``, ``UnsupportedError``, and their base ``AttnFuseError``; and
  ``DeclarationViolation``, which a run raises when a kernel finds a declaration false;
- tiles (the ``attnfuse_tile_config`` and ``attnfuse_tile_configs`` hooks): ``TileConfig``, ``TileRule``;
- for ``examples``: ``random_tensor`` (it needs hypothesis, imported on first use of the name),
  ``create_block_mask``, ``create_block_mask_from_blocks``.
"""

from __future__ import annotations

from typing import Any

from .block_mask import BlockMask, create_block_mask, create_block_mask_from_blocks
from .checks import finite_number_or_none, non_negative_int, positive_number
from .combinator import INPUT, REQUIRED, Combinator, Param, Role, ScalarArg, TensorArg
from .device_cache import device_cached
from .errors import (
    AttnFuseError,
    DeclarationError,
    DeclarationViolation,
    InputError,
    PluginError,
    ProgramError,
    UnsupportedError,
)
from .fragments import (
    BlockList,
    MaskFragment,
    NormaliserFragment,
    QKTransformFragment,
    Range,
    ScoreModFragment,
    ScoreSourceFragment,
)
from .hookspecs import hookimpl
from .launch_context import LaunchContext
from .rotary import rotate_every_two, rotate_half
from .tiles import TileConfig, TileRule

__all__ = [
    "INPUT",
    "REQUIRED",
    "AttnFuseError",
    "BlockList",
    "BlockMask",
    "Combinator",
    "DeclarationError",
    "DeclarationViolation",
    "InputError",
    "LaunchContext",
    "MaskFragment",
    "NormaliserFragment",
    "Param",
    "PluginError",
    "ProgramError",
    "QKTransformFragment",
    "Range",
    "Role",
    "ScalarArg",
    "ScoreModFragment",
    "ScoreSourceFragment",
    "TensorArg",
    "TileConfig",
    "TileRule",
    "UnsupportedError",
    "create_block_mask",
    "create_block_mask_from_blocks",
    "device_cached",
    "finite_number_or_none",
    "hookimpl",
    "non_negative_int",
    "positive_number",
    "rotate_every_two",
    "rotate_half",
]  # and random_tensor, given by __getattr__ (left out here, so that ``import *`` needs no hypothesis)


def __getattr__(name: str) -> Any:
    """``random_tensor``, imported when first asked for: it draws with hypothesis, which only the
    conformance kit's runs need (a plugin imports it inside its ``examples``)."""
    if name == "random_tensor":
        from .examples_support import random_tensor

        return random_tensor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
