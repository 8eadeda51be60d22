"""AttnFuse: compose attention from combinators; get one fused Triton kernel for the whole program.

    import attnfuse as af

    @af.attention
    def llama(q, k, v):
        s = af.rope(q, k)
        s = af.causal(s)
        return af.softmax(s) @ v

Every registered combinator (built-in or from an installed plugin) is an attribute: ``af.<name>``.
"""

from __future__ import annotations

import pkgutil
from typing import Any, Callable

from .block_mask import BlockMask, create_block_mask, create_block_mask_from_blocks
from .combinator import Combinator, Role
from .errors import AttnFuseError, InputError, KernelCacheError, PluginError, ProgramError, UnsupportedError
from .hookspecs import hookimpl
from .packed_cache import PackedCache, packed_to_cache, packed_to_pages
from .packing import cu_seqlens_from_document_ids, cu_seqlens_from_position_ids
from .plugin_manager import combinators, register_plugin, reserve_names, unregister_plugin
from .program import AttentionProgram, attention
from .recompile import RecompileWarning
from .runtime.dropout import dropout_keep, dropout_state
from .runtime.error_record import check_errors
from .runtime.launch import run_attention

__all__ = [
    "AttentionProgram",
    "AttnFuseError",
    "BlockMask",
    "Combinator",
    "InputError",
    "KernelCacheError",
    "PackedCache",
    "PluginError",
    "ProgramError",
    "RecompileWarning",
    "Role",
    "UnsupportedError",
    "attention",
    "check_errors",
    "combinators",
    "create_block_mask",
    "create_block_mask_from_blocks",
    "cu_seqlens_from_document_ids",
    "cu_seqlens_from_position_ids",
    "dropout_keep",
    "dropout_state",
    "hookimpl",
    "packed_to_cache",
    "packed_to_pages",
    "register_plugin",
    "run_attention",
    "unregister_plugin",
]
__version__ = "0.1.0"

_functions: dict[Combinator, Callable] = {}


def __getattr__(name: str) -> Any:
    """``af.<combinator>``: the DSL function of a registered combinator."""
    from .dsl import dsl_function
    from .plugin_manager import combinators as registered

    if name.startswith("__"):
        raise AttributeError(name)
    entry = registered().get(name)
    if entry is None:
        raise AttributeError(
            f"module 'attnfuse' has no attribute {name!r} (no combinator of that name is "
            f"registered; `attnfuse list` shows those that are)"
        )
    fn = _functions.get(entry.combinator)
    if fn is None:
        fn = _functions[entry.combinator] = dsl_function(entry)
    return fn


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(combinators()))


reserve_names({*globals(), *__all__, *(module.name for module in pkgutil.iter_modules(__path__))})
