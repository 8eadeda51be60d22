"""``attnfuse.hf.fuse_rope``: Llama-family, GPT-NeoX and GPT-J attention layers pass unrotated q (and k) and
HF's cos/sin to the kernel, which rotates them (``af.rope(..., cos=cos, sin=sin)``; GPT-NeoX's tables are its
rotary_ndims wide, so the kernel rotates that many columns: ``rotary_dim``; GPT-J rotates interleaved pairs).

HF's attention forward rotates q and k with its modeling module's ``apply_rotary_pos_emb`` before calling
the attention function, then stores k in the cache. ``fuse`` keeps HF's forward (so its signature may differ
between versions) and wraps it: while a wrapped layer runs, that module-level function returns q unrotated,
and k unrotated too when the layer has no cache (with a cache, k is rotated as HF stores it, and the kernel
rotates only q: ``rotate_keys=False``); the wrapper passes (cos, sin, rotate_keys) to the attention
function as the ``attnfuse_rope`` keyword, which HF forwards to it. A model switched to another
``attn_implementation`` afterwards runs HF's forward unchanged.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from .errors import InputError

ROPE_KWARG = "attnfuse_rope"  # (cos (B, Nq, D), sin, rotate_keys), passed by fused forwards to attention_forward
INTERLEAVED_KWARG = "attnfuse_rope_interleaved"  # True: the tables rotate pairs (2i, 2i+1) (GPT-J)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # modeling modules whose attention rotates this way
OTHER_FAMILIES = ("gpt_neox", "gptj")  # modeling modules whose attention forward or rotation differ
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # the name differs between versions


class _Fusing:
    """Whether a fused layer is running now, and whether it rotates its keys in PyTorch (it has a cache)."""

    active = False
    rotate_keys_here = False


_state = _Fusing()


def _fusing_rotation(original: Callable) -> Callable:
    """The modeling module's ``apply_rotary_pos_emb``, which leaves q (and without a cache k) unrotated while
    a fused layer runs."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _state.active:
            return original(q, k, cos, sin, *args, **kwargs)
        if _state.rotate_keys_here:
            return q, original(k, k, cos, sin, *args, **kwargs)[1]
        return q, k

    apply_rotary_pos_emb.__attnfuse_fusing__ = True
    return apply_rotary_pos_emb


def _has_cache(args: tuple, kwargs: dict[str, Any]) -> bool:
    if any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS):
        return True
    return len(args) > 0 and args[0] is not None  # (hidden_states, position_embeddings, attention_mask, cache)


def _fused_forward(
    layer: torch.nn.Module,
    original: Callable,
    hidden_states: torch.Tensor,
    position_embeddings=None,
    attention_mask=None,
    *args: Any,
    **kwargs: Any,
):
    if layer.config._attn_implementation != "attnfuse":  # switched away since: HF's own path, rotating itself
        return original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    if position_embeddings is None:
        raise InputError("fuse_rope: the attention layer got no position_embeddings (cos, sin)")
    cos, sin = position_embeddings
    cached = _has_cache(args, kwargs)
    _state.active, _state.rotate_keys_here = True, cached
    try:
        return original(
            hidden_states, position_embeddings, attention_mask, *args, **{ROPE_KWARG: (cos, sin, not cached)}, **kwargs
        )
    finally:
        _state.active = _state.rotate_keys_here = False


def _fused_neox_forward(
    layer: torch.nn.Module,
    original: Callable,
    hidden_states: torch.Tensor,
    attention_mask=None,
    layer_past=None,
    position_embeddings=None,
    **kwargs: Any,
):
    """``GPTNeoXAttention.forward(hidden_states, attention_mask, layer_past, position_embeddings, **kwargs)``
    as ``_fused_forward`` runs a Llama-family one: its cache is ``layer_past``, its cos/sin (B, N, rotary_ndims)
    rotate only the first rotary_ndims columns (HF's own ``apply_rotary_pos_emb`` keeps the rest)."""
    if layer.config._attn_implementation != "attnfuse":
        return original(hidden_states, attention_mask, layer_past, position_embeddings, **kwargs)
    if position_embeddings is None:
        raise InputError("fuse_rope: the attention layer got no position_embeddings (cos, sin)")
    cos, sin = position_embeddings
    cached = layer_past is not None
    _state.active, _state.rotate_keys_here = True, cached
    try:
        return original(
            hidden_states,
            attention_mask,
            layer_past,
            position_embeddings,
            **{ROPE_KWARG: (cos, sin, not cached)},
            **kwargs,
        )
    finally:
        _state.active = _state.rotate_keys_here = False


def _fusing_tensor_rotation(original: Callable) -> Callable:
    """GPT-J's ``apply_rotary_pos_emb(tensor, sin, cos)``, which leaves its tensor unrotated while a fused
    layer runs (it only runs with no cache: see ``_fused_gptj_forward``)."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(tensor, sin, cos, *args, **kwargs):
        return tensor if _state.active else original(tensor, sin, cos, *args, **kwargs)

    apply_rotary_pos_emb.__attnfuse_fusing__ = True
    return apply_rotary_pos_emb


def _fused_gptj_forward(
    layer: torch.nn.Module,
    original: Callable,
    hidden_states: torch.Tensor,
    position_embeddings=None,
    attention_mask=None,
    *args: Any,
    **kwargs: Any,
):
    """``GPTJAttention.forward``: with no cache, q and k reach the kernel unrotated with HF's (sin, cos)
    (B, N, R/2), one column per frequency, repeated as tables (B, N, R) of GPT-J's interleaved pairs
    (``repeat_interleave(2)``); the kernel rotates the first R columns (``rotary_dim``, ``interleaved``).
    GPT-J's rotation takes q and k one at a time, so with a cache (keys stored rotated) HF rotates both
    as before and the kernel runs the attention only."""
    if layer.config._attn_implementation != "attnfuse" or _has_cache(args, kwargs):
        return original(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    if position_embeddings is None:
        raise InputError("fuse_rope: the attention layer got no position_embeddings (sin, cos)")
    sin, cos = position_embeddings
    cos, sin = (t.repeat_interleave(2, dim=-1) for t in (cos, sin))
    _state.active = True
    try:
        return original(
            hidden_states,
            position_embeddings,
            attention_mask,
            *args,
            **{ROPE_KWARG: (cos, sin, True), INTERLEAVED_KWARG: True},
            **kwargs,
        )
    finally:
        _state.active = False


_FORWARDS = {"gpt_neox": _fused_neox_forward, "gptj": _fused_gptj_forward}  # families with forwards of their own
_ROTATIONS = {"gptj": _fusing_tensor_rotation}  # families whose apply_rotary_pos_emb rotates one tensor


def _family(module: torch.nn.Module) -> str:
    return type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")


def _family_module(module: torch.nn.Module):
    name = type(module).__module__
    family = _family(module)
    known = family in FAMILIES or family in OTHER_FAMILIES
    return sys.modules[name] if known and name.startswith("transformers.models.") else None


def _is_attention(module: torch.nn.Module) -> bool:
    """An attention layer: q_proj/k_proj (Llama family), or GPT-NeoX's fused query_key_value."""
    return type(module).__name__.endswith("Attention") and (
        hasattr(module, "k_proj") or hasattr(module, "query_key_value")
    )


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every attention layer of a Llama, Mistral, Qwen2, Qwen3, GPT-NeoX or GPT-J model (or decoder
    layer); an InputError for any other."""
    layers = [m for m in model.modules() if _is_attention(m)]
    if not layers:
        raise InputError(
            f"fuse_rope: {type(model).__name__} has no attention layers with q_proj/k_proj or query_key_value"
        )
    for layer in layers:
        modeling = _family_module(layer)
        if modeling is None or not hasattr(modeling, "apply_rotary_pos_emb"):
            raise InputError(
                f"fuse_rope supports the attention of {', '.join(FAMILIES + OTHER_FAMILIES)} models, got "
                f"{type(layer).__module__}.{type(layer).__name__}"
            )
        if not getattr(modeling.apply_rotary_pos_emb, "__attnfuse_fusing__", False):
            rotation = _ROTATIONS.get(_family(layer), _fusing_rotation)
            modeling.apply_rotary_pos_emb = rotation(modeling.apply_rotary_pos_emb)
        if not getattr(layer, "__attnfuse_fused__", False):
            layer.forward = functools.partial(_FORWARDS.get(_family(layer), _fused_forward), layer, layer.forward)
            layer.__attnfuse_fused__ = True
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("attnfuse")
    else:  # a bare layer (benchmarks/hf_layer.py)
        for layer in layers:
            layer.config._attn_implementation = "attnfuse"
    return model
