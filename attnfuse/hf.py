"""HuggingFace transformers backend: ``import attnfuse.hf`` registers ``attn_implementation="attnfuse"``.

    import attnfuse.hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnfuse")

Every attention layer then runs one fused AttnFuse kernel. The mask HF builds for it is SDPA's (a boolean
(B, 1, Nq, Nk) mask, or None where causal alone is right): None runs ``causal`` (or ``sliding_window`` for a
model's sliding layers) on the keys as given; a mask (padding, packed sequences, a sliding window) becomes
an additive bias of 0 and -inf (see ``_bias`` for padding rows). GQA runs natively, ``scaling`` is the
program's scale, Gemma 2's logit softcapping runs the built-in ``softcap``, and attention sinks (``s_aux``:
GPT-OSS) the built-in ``softmax_with_sinks``. Dropout and position biases raise a clear error.

``register(name, program)`` registers any ``@af.attention`` program; ``fuse_rope(model)`` moves the
rotary embedding of Llama-family models into the kernel (see ``attnfuse.hf_rope``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import attnfuse as af
from . import hf_packed, hf_rope
from .errors import InputError
from .hf_rope import INTERLEAVED_KWARG, QK_NORM_KWARG, ROPE_KWARG
from .program import AttentionProgram
from .runtime import packed as packed_runtime

__all__ = ["attention_forward", "fuse_rope", "register"]


@af.attention
def hf_attention(
    q,
    k,
    v,
    bias,
    cos,
    sin,
    scale,
    window,
    causal,
    rotate_keys,
    softcap=None,
    sinks=None,
    rotary_dim=None,
    interleaved=False,
    norm_q=None,
    norm_k=None,
    norm_eps=None,
):
    """What HF's attention asks for: q and k RMS-normalised with weights ``norm_q``, ``norm_k`` (D,) when given
    ``norm_eps`` (Qwen3, Gemma 3), the scaled product (rotated first when given cos and sin: the first
    ``rotary_dim`` columns of q and k, all without it; interleaved pairs with ``interleaved``), softcapped if
    asked (Gemma 2), then the mask as an additive bias, or a sliding window, or causal, then softmax, with each
    head's sink logit (Hq,) in its denominator when given (GPT-OSS)."""
    if norm_eps is not None:
        q, k = af.qk_norm(q, k, norm_q, norm_k, eps=norm_eps)
    if cos is None:
        s = af.scaled_dot_product(q, k, scale=scale)
    else:
        s = af.rope(
            q, k, scale=scale, cos=cos, sin=sin, rotate_keys=rotate_keys, rotary_dim=rotary_dim, interleaved=interleaved
        )
    if softcap is not None:
        s = af.softcap(s, softcap)
    if bias is not None:
        s = af.additive_bias(s, bias)
    elif window is not None:
        s = af.sliding_window(s, window, 0)
    elif causal:
        s = af.causal(s)
    return (af.softmax(s) if sinks is None else af.softmax_with_sinks(s, sinks)) @ v


def _refuse_unsupported(
    name: str, module: torch.nn.Module, kwargs: dict[str, Any], supported: tuple[str, ...] = ()
) -> None:
    """An InputError for each keyword HF passes that ``name`` cannot honour, those not in ``supported``
    (``"softcap"``, ``"s_aux"``: what ``attn_implementation="attnfuse"`` runs)."""
    for key in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(key) is not None and key not in supported:
            how = (
                "attn_implementation='attnfuse' or 'eager'"
                if key in ("softcap", "s_aux")
                else "attn_implementation='eager'"
            )
            raise InputError(
                f"attn_implementation={name!r}: {key} (given by {type(module).__name__}) is not "
                f"supported here; use {how}"
            )


def _rate(module: torch.nn.Module, dropout: float) -> float:
    """The call's ``dropout_p``: HF's ``dropout`` in training mode; in eval mode (where HF passes 0.0) the program's
    default, 0, which torch.compile does not read as a float."""
    return dropout if module.training else 0


def _with_sink_gradient(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``out`` (B, Hq, Nq, DV) of ``softmax_with_sinks``, unchanged, with the gradient of ``sinks`` (Hq,), which
    the kernels do not compute: d out / d sink_h = -w·out, where w = exp(sink_h - lse) is the sink's own weight
    (``lse`` (B, Hq, Nq) includes the sink). The factor 1 - (w - w.detach()) is exactly 1; its derivative is -w.
    An infinite sink equal to the lse (-inf in a row with no key, +inf) has w 1 with no derivative: out is 0
    there, and so is -w·out (no inf - inf makes the out NaN)."""
    sink = sinks.view(1, -1, 1).to(lse.dtype)
    lse = lse.detach()
    w = torch.exp(torch.where(torch.isinf(sink) & (sink == lse), 0.0, sink - lse))
    return (out.to(lse.dtype) * (1.0 - (w - w.detach())).unsqueeze(-1)).to(out.dtype)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """HF's attention mask as an additive bias in ``dtype``: 0 where it keeps a key, -inf elsewhere. A query
    row that keeps no key (left padding's) gets output 0 and no gradient, as in torch's SDPA (HF's "sdpa"),
    so a left-padded batch's loss and gradients equal sdpa's. HF's eager attention, which adds the dtype's
    minimum, averages all values there instead: the last padding position predicts the first real token,
    so eager's loss and gradients differ. (A finite minimum would lose the scores to rounding, and the
    backward's recomputed weights with them.)"""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, -torch.inf)
    if not mask.is_floating_point():
        raise InputError(f"attention_mask must be a boolean or float 4-D mask, got {mask.dtype}")
    return mask.to(dtype)


def _rope_tables(rope: tuple, Nq: int, Nk: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Tables (B, Nk, D) indexed by key index, from HF's cos/sin (B, Nq, D) of the current tokens: query i
    sits at index i + Nk - Nq. With a cache (Nk > Nq) the keys were rotated when stored, so only the rows of
    the queries are read."""
    cos, sin, rotate_keys = rope
    if Nk == Nq:
        return cos, sin, rotate_keys
    if rotate_keys:
        raise InputError(
            f"fuse_rope: {Nk} keys for {Nq} queries with unrotated keys (keys of a cache are rotated "
            f"when they are stored)"
        )
    pad = cos.new_zeros((cos.shape[0], Nk - Nq, cos.shape[2]))
    return torch.cat((pad, cos), dim=1), torch.cat((pad, sin), dim=1), False


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF's attention function signature: query (B, Hq, Nq, D), key and value (B, Hkv, Nk, D) -> the output
    (B, Nq, Hq, D) and no weights. ``softcap`` (Gemma 2) and ``s_aux`` (each head's sink logit (Hq,): GPT-OSS)
    are honoured; the sinks get their gradient too. A packed batch (HF's flash keywords ``cu_seq_lens_q``/
    ``cu_seq_lens_k``, or position_ids restarting at 0 in a batch of one row) runs each document on its own
    through the program's ``cu_seqlens_q``/``cu_seqlens_k`` (``attnfuse.hf_packed``). ``dropout``: the rate HF
    passes (the model's ``attention_dropout`` in training mode, 0 in eval mode), the call's ``dropout_p``; a
    packed batch takes it too."""
    _refuse_unsupported("attnfuse", module, kwargs, supported=("softcap", "s_aux"))
    Nq, Nk = query.shape[2], key.shape[2]
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if attention_mask is None and causal and 1 < Nq < Nk:
        key, value, Nk = key[:, :, :Nq], value[:, :, :Nq], Nq  # a static cache's prefill: later slots are empty
    cos = sin = None
    rotate_keys = True
    window = None if sliding_window is None else sliding_window - 1
    if attention_mask is not None and not packed_runtime.GATE.opens(query.device):
        packed = None  # HF's mask as a bias (block-diagonal for a packed batch): no detection, no host sync
    else:
        packed = hf_packed.packed_call(query, key, attention_mask, window, kwargs)
    if packed is not None:  # documents one after another in one row: each attends within itself
        attention_mask = None
        if kwargs.get(ROPE_KWARG) is not None:
            cos, sin = hf_packed.local_rope_tables(*kwargs[ROPE_KWARG][:2], packed)
        call_kwargs = packed._asdict()
    else:
        if kwargs.get(ROPE_KWARG) is not None:
            cos, sin, rotate_keys = _rope_tables(kwargs[ROPE_KWARG], Nq, Nk)
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = attention_mask[..., :Nk]
        window = None if attention_mask is not None else window
        call_kwargs = {}
    sinks = kwargs.get("s_aux")
    sink_grad = sinks is not None and sinks.requires_grad and torch.is_grad_enabled()
    rotary_dim = cos.shape[-1] if cos is not None and cos.shape[-1] != query.shape[-1] else None  # GPT-NeoX's
    out = hf_attention(
        query,
        key,
        value,
        _bias(attention_mask, query.dtype),
        cos,
        sin,
        None if scaling is None else float(scaling),
        window,
        bool(causal),
        rotate_keys,
        None if kwargs.get("softcap") is None else float(kwargs["softcap"]),
        None if sinks is None else sinks.detach(),
        rotary_dim,
        bool(kwargs.get(INTERLEAVED_KWARG)),
        *(kwargs.get(QK_NORM_KWARG) or (None, None, None)),
        return_lse=sink_grad,
        dropout_p=_rate(module, dropout),
        **call_kwargs,
    )
    if sink_grad:
        out = _with_sink_gradient(*out, sinks)
    return out.transpose(1, 2), None


def _program_forward(name: str, program: AttentionProgram) -> Callable:
    """An HF attention function running ``program``; it gets q, k, v and, by name, those of ``scale``
    (the module's scaling), ``bias`` (the mask as an additive bias (B, 1, Nq, Nk), or None where causal alone
    is right; a row that keeps no key is all -inf, to which ``softmax`` gives 0, as SDPA does) and
    ``window`` (a sliding window's left extent when there is no mask, else None) it declares, and HF's
    ``dropout`` as ``dropout_p``. A mask given to a program without ``bias`` is an InputError."""
    declared = {n for n, _ in program._extra}

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
        _refuse_unsupported(name, module, kwargs)
        extras = {
            "scale": None if scaling is None else float(scaling),
            "bias": _bias(attention_mask, query.dtype),
            "window": None if sliding_window is None or attention_mask is not None else sliding_window - 1,
        }
        if extras["bias"] is not None and "bias" not in declared:  # never ignore a mask
            raise InputError(
                f"attn_implementation={name!r}: the model passes an attention mask (padding, or a "
                f"window longer than the keys), but program {program.__name__} takes no 'bias' "
                f"argument to honour it"
            )
        out = program(
            query, key, value, dropout_p=_rate(module, dropout), **{n: extras[n] for n in declared if n in extras}
        )
        return out.transpose(1, 2), None

    return forward


def register(name: str, program: AttentionProgram) -> None:
    """Register ``program`` as ``attn_implementation=name`` (with SDPA's masks)."""
    if not isinstance(program, AttentionProgram):
        raise InputError(f"register: program must be an @af.attention program, got {type(program).__name__}")
    AttentionInterface.register(name, _program_forward(name, program))
    AttentionMaskInterface.register(name, sdpa_mask)


AttentionInterface.register("attnfuse", attention_forward)
AttentionMaskInterface.register("attnfuse", sdpa_mask)


def fuse_rope(model: torch.nn.Module) -> torch.nn.Module:
    """Run the rotary embedding of ``model``'s attention layers inside the kernel (Llama, Mistral, Qwen2,
    Qwen3, Gemma 3), and Qwen3's and Gemma 3's q/k norms before it; switches the model to
    ``attn_implementation="attnfuse"``. Returns the model."""
    return hf_rope.fuse(model)
