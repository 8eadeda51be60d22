"""The baselines: SDPA (cuDNN, FlashAttention-2), compiled flex_attention, RoPE pre-rotated for them.

flex_attention and the pre-rotation are compiled on first use (``compiled()``), not at import.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..rotary import rotate_half
from .cases import SPARSE_BLOCK, WINDOW, alibi_slopes

SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


@functools.cache
def compiled():
    """(flex_attention, pre_rotate), each through torch.compile, with room for every case's recompile."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.recompile_limit = 1000
    rotate = torch.compile(lambda q, k, cos, sin: (_rotate(q, cos, sin), _rotate(k, cos, sin)))
    return torch.compile(flex_attention, dynamic=False), rotate


def flex(q, k, v, **kwargs):
    return compiled()[0](q, k, v, **kwargs)


def pre_rotate(q, k, cos, sin):
    """q and k rotated (NeoX half split) by a compiled function: what the RoPE baselines attend with."""
    return compiled()[1](q, k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def sdpa(backend: str, q, k, v, causal: bool):
    """SDPA through one backend (a SDPA_BACKENDS key), GQA by ``enable_gqa``."""
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def flex_case(variant: str, Hq: int, N: int, device):
    """flex_attention's (score_mod, BlockMask) for a variant of cases.PROGRAMS at N queries and keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    def causal_mask(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def window_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)

    slopes = alibi_slopes(Hq, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    mask = None
    if variant in ("causal", "causal_alibi", "rope_causal"):
        mask = create_block_mask(causal_mask, None, None, N, N, device=device)
    elif variant == "sliding_window":
        mask = create_block_mask(window_mask, None, None, N, N, device=device)
    return (alibi if variant == "causal_alibi" else None), mask


def flex_document_mask(cu_seqlens: torch.Tensor):
    """flex_attention's BlockMask for one packed row of documents (offsets ``cu_seqlens`` (docs + 1,)):
    causal within each document, nothing across documents."""
    from torch.nn.attention.flex_attention import create_block_mask

    total = int(cu_seqlens[-1])
    document = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), cu_seqlens.diff().long(), output_size=total
    )

    def document_causal(b, h, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(document_causal, None, None, total, total, device=cu_seqlens.device)


def flash3_fp8():
    """FlashAttention-3's ``flash_attn_func`` (float8 with descales) where installed, else None."""
    try:
        return importlib.import_module("flash_attn_interface").flash_attn_func
    except ImportError:
        return None


def sdpa_dropout(backend: str, q, k, v, p: float):
    """Causal SDPA with attention dropout ``p`` through one backend (a SDPA_BACKENDS key), GQA."""
    with sdpa_kernel(SDPA_BACKENDS[backend]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p, enable_gqa=True)


def flash_varlen():
    """FlashAttention's ``flash_attn_varlen_func`` (FlashAttention-3's interface where installed, else
    FlashAttention-2's), or None when neither is installed."""
    for module in ("flash_attn_interface", "flash_attn"):
        try:
            return importlib.import_module(module).flash_attn_varlen_func
        except ImportError:
            continue
    return None


def flex_block_mask(active: torch.Tensor):
    """flex_attention's BlockMask for a (B, H, n, n) block grid, every active block full (no mask_mod)."""
    from torch.nn.attention.flex_attention import BlockMask

    counts = active.sum(-1, dtype=torch.int32)
    order = torch.argsort((~active).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # active blocks first
    return BlockMask.from_kv_blocks(
        torch.zeros_like(counts), torch.zeros_like(order), counts, order, BLOCK_SIZE=SPARSE_BLOCK
    )


def failure(exc: BaseException) -> str:
    """A table cell for a contender that cannot run a case."""
    return f"n/a ({str(exc).splitlines()[0][:40] if str(exc) else type(exc).__name__})"
