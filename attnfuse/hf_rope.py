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

Qwen3 and Gemma 3 also normalise q and k (``q_norm``, ``k_norm``: RMSNorm over the head dim) before the rotation.
Their layers' norms are wrapped too (``QK_NORMS``): while a wrapped layer without a cache runs, they return their
input, and the wrapper passes the norms' weights (as the kernel scales by them: Gemma 3's ``1 + weight``, which
carries the gradient to ``weight``) and eps as the ``attnfuse_qk_norm`` keyword: the kernel runs ``af.qk_norm``,
then ``af.rope``, and the weights get their gradients from the kernels. With a cache, k must be stored as HF
stores it (normed and rotated), so both norms run in PyTorch as HF's, and the kernel rotates q only.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

import torch

from .errors import InputError

ROPE_KWARG = "attnfuse_rope"  # (cos (B, Nq, D), sin, rotate_keys), passed by fused forwards to attention_forward
INTERLEAVED_KWARG = "attnfuse_rope_interleaved"  # True: the tables rotate pairs (2i, 2i+1) (GPT-J)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # modeling modules whose attention rotates this way
OTHER_FAMILIES = ("gpt_neox", "gptj")  # modeling modules whose attention forward or rotation differ
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # the name differs between versions
QK_NORM_KWARG = "attnfuse_qk_norm"  # (weight_q (D,), weight_k (D,), eps), passed by fused forwards without a cache


def _qwen3_norm(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """Qwen3RMSNorm: x / rms(x) · weight."""
    return norm.weight, float(norm.variance_epsilon)


def _gemma3_norm(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """Gemma3RMSNorm: x / rms(x) · (1 + weight), in float32."""
    return 1.0 + norm.weight.float(), float(norm.eps)


# Families whose attention normalises q and k (q_norm, k_norm) before the rotation: (weight as the kernel scales
# by it, eps) of one norm module
QK_NORMS: dict[str, Callable[[torch.nn.Module], tuple[torch.Tensor, float]]] = {
    "qwen3": _qwen3_norm,
    "gemma3": _gemma3_norm,
}
SUPPORTED = (*FAMILIES, *OTHER_FAMILIES, *(family for family in QK_NORMS if family not in FAMILIES))


class _Fusing:
    """Whether a fused layer is running now, and whether it rotates its keys in PyTorch (it has a cache)."""

    active = False
    rotate_keys_here = False
    norms_in_kernel = False  # the layer's q_norm and k_norm return their input: the kernel normalises


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


def _skippable_norm(original: Callable, x: torch.Tensor) -> torch.Tensor:
    """A q_norm's or k_norm's forward: its input while a fused layer's kernel normalises, else ``original``'s."""
    return x if _state.active and _state.norms_in_kernel else original(x)


def _qk_norm_argument(layer: torch.nn.Module, cached: bool) -> dict[str, Any]:
    """The ``attnfuse_qk_norm`` keyword of a fused layer of a ``QK_NORMS`` family without a cache, else none."""
    family = _family_of(layer)
    if cached or family not in QK_NORMS:
        return {}
    (weight_q, eps_q), (weight_k, eps_k) = (QK_NORMS[family](norm) for norm in (layer.q_norm, layer.k_norm))
    if eps_q != eps_k:
        raise InputError(
            f"fuse_rope: {type(layer).__name__}'s q_norm and k_norm have different eps ({eps_q}, {eps_k}); the "
            f"kernel's qk_norm takes one"
        )
    return {QK_NORM_KWARG: (weight_q, weight_k, eps_q)}


def _wrap_norms(layer: torch.nn.Module) -> None:
    """Make a ``QK_NORMS`` family layer's q_norm and k_norm skippable (``_skippable_norm``)."""
    if _family_of(layer) not in QK_NORMS:
        return
    for norm in (layer.q_norm, layer.k_norm):
        norm.forward = functools.partial(_skippable_norm, norm.forward)


def _has_cache(args: tuple, kwargs: dict[str, Any]) -> bool:
    if any(kwargs.get(name) is not None for name in CACHE_ARGUMENTS):
        return True
    return len(args) > 0 and args[0] is not None  # (hidden_states, position_embeddings, attention_mask, cache)


@contextlib.contextmanager
def _running(rotate_keys_here: bool = False, norms_in_kernel: bool = False) -> Iterator[None]:
    """While a fused layer runs: HF's rotation (and, ``norms_in_kernel``, its q/k norms) leave their inputs to
    the kernel; ``rotate_keys_here``: the rotation still rotates k (a cache stores it rotated)."""
    _state.active, _state.rotate_keys_here, _state.norms_in_kernel = True, rotate_keys_here, norms_in_kernel
    try:
        yield
    finally:
        _state.active = _state.rotate_keys_here = _state.norms_in_kernel = False


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
    norms = _qk_norm_argument(layer, cached)
    with _running(rotate_keys_here=cached, norms_in_kernel=bool(norms)):
        return original(
            hidden_states,
            position_embeddings,
            attention_mask,
            *args,
            **{ROPE_KWARG: (cos, sin, not cached)},
            **norms,
            **kwargs,
        )


def _family_of(module: torch.nn.Module) -> str:
    """The modeling module's family (``llama``, ``qwen3`` ...) of a transformers module."""
    return type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")


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
    with _running(rotate_keys_here=cached):
        rope = {ROPE_KWARG: (cos, sin, not cached)}
        return original(hidden_states, attention_mask, layer_past, position_embeddings, **rope, **kwargs)


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
    with _running():
        return original(
            hidden_states,
            position_embeddings,
            attention_mask,
            *args,
            **{ROPE_KWARG: (cos, sin, True), INTERLEAVED_KWARG: True},
            **kwargs,
        )


_FORWARDS = {"gpt_neox": _fused_neox_forward, "gptj": _fused_gptj_forward}  # families with forwards of their own
_ROTATIONS = {"gptj": _fusing_tensor_rotation}  # families whose apply_rotary_pos_emb rotates one tensor


def _family_module(module: torch.nn.Module):
    name = type(module).__module__
    return sys.modules[name] if _family_of(module) in SUPPORTED and name.startswith("transformers.models.") else None


def _is_attention(module: torch.nn.Module) -> bool:
    """An attention layer: q_proj/k_proj (Llama family), or GPT-NeoX's fused query_key_value."""
    return type(module).__name__.endswith("Attention") and (
        hasattr(module, "k_proj") or hasattr(module, "query_key_value")
    )


def fuse(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every attention layer of a Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), GPT-NeoX or GPT-J model (or
    decoder layer); an InputError for any other."""
    layers = [m for m in model.modules() if _is_attention(m)]
    if not layers:
        raise InputError(
            f"fuse_rope: {type(model).__name__} has no attention layers with q_proj/k_proj or query_key_value"
        )
    for layer in layers:
        modeling = _family_module(layer)
        if modeling is None or not hasattr(modeling, "apply_rotary_pos_emb"):
            raise InputError(
                f"fuse_rope supports the attention of {', '.join(SUPPORTED)} models, got "
                f"{type(layer).__module__}.{type(layer).__name__}"
            )
        if not getattr(modeling.apply_rotary_pos_emb, "__attnfuse_fusing__", False):
            rotation = _ROTATIONS.get(_family_of(layer), _fusing_rotation)
            modeling.apply_rotary_pos_emb = rotation(modeling.apply_rotary_pos_emb)
        if not getattr(layer, "__attnfuse_fused__", False):
            layer.forward = functools.partial(_FORWARDS.get(_family_of(layer), _fused_forward), layer, layer.forward)
            _wrap_norms(layer)
            layer.__attnfuse_fused__ = True
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("attnfuse")
    else:  # a bare layer (benchmarks/hf_layer.py)
        for layer in layers:
            layer.config._attn_implementation = "attnfuse"
    return model
