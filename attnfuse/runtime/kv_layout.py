"""The layout of a paged cache's pools: which of their two middle dims holds a page's rows, which the heads.

AttnFuse's pools are (num_pages, page_size, Hkv, D), ``"NHD"``; FlashInfer's and vLLM's are (num_pages, Hkv,
page_size, D), ``"HND"``. A call names its pools' layout with ``kv_layout`` (FlashInfer's name for it). The
kernels read both through strides, as a (num_pages, Hkv, page_size, D) view: no copy. A call that names no
layout is read as ``"NHD"``, but a shape both layouts would read with a head count that divides the call's
query heads is refused as ambiguous: reading it the wrong way gives plausible, wrong numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError

KV_LAYOUTS = ("NHD", "HND")
_SHAPES = {"NHD": "(num_pages, page_size, Hkv, D)", "HND": "(num_pages, Hkv, page_size, D)"}
_USED_BY = {"NHD": "AttnFuse's", "HND": "FlashInfer's and vLLM's"}


def check_kv_layout(kv_layout: Any, paged: bool) -> None:
    """InputError unless ``kv_layout`` is None, or "NHD" or "HND" for a paged call."""
    if kv_layout is None:
        return
    if not (isinstance(kv_layout, str) and kv_layout in KV_LAYOUTS):
        raise InputError(
            f"kv_layout must be 'NHD' (pools {_SHAPES['NHD']}, {_USED_BY['NHD']}), 'HND' (pools "
            f"{_SHAPES['HND']}, {_USED_BY['HND']}) or None (read as 'NHD'), got {kv_layout!r}"
        )
    if not paged:
        raise InputError(
            f"kv_layout={kv_layout!r} describes a paged cache's pools (a call with block_table); a "
            f"contiguous cache is (B, Hkv, Nk, D) and takes no kv_layout"
        )


def pool_sizes(shape: tuple[int, ...], layout: str) -> tuple[int, int]:
    """(page_size, Hkv) of a pool of ``shape`` (num_pages, ., ., D) read in ``layout``."""
    return (shape[1], shape[2]) if layout == "NHD" else (shape[2], shape[1])


def head_second(pool: torch.Tensor, layout: str) -> torch.Tensor:
    """A pool read in ``layout`` as the (num_pages, Hkv, page_size, D) view the kernels take (no copy)."""
    return pool.permute(0, 2, 1, 3) if layout == "NHD" else pool


def pool_layout(Hq: int, shape: tuple[int, ...], kv_layout: str | None) -> str:
    """The layout pools of ``shape`` (num_pages, ., ., D) are read in for ``Hq`` query heads: ``kv_layout``
    (checked by ``check_kv_layout``), or "NHD" when it is None. An InputError naming both readings when
    kv_layout is None and both give a head count dividing Hq (unless both read the same: one head of one
    row), or when the layout read gives none and the other one does. Shapes neither layout fits are left
    to the head-count check."""
    fits = [layout for layout in KV_LAYOUTS if _heads_fit(Hq, pool_sizes(shape, layout)[1])]
    layout = kv_layout or "NHD"
    if kv_layout is None and len(fits) == 2 and tuple(shape[1:3]) != (1, 1):
        raise InputError(
            f"paged pools of shape {tuple(shape)} read two ways for Hq={Hq} query heads: "
            f"{_reading(shape, 'NHD')}, or {_reading(shape, 'HND')}. Name the pools' layout: "
            f"kv_layout='NHD' ({_USED_BY['NHD']}) or kv_layout='HND' ({_USED_BY['HND']})"
        )
    if fits and layout not in fits:
        named = f"kv_layout={layout!r}" if kv_layout is not None else f"kv_layout={layout!r} (when none is named)"
        raise InputError(
            f"paged pools of shape {tuple(shape)} in {named} have Hkv={pool_sizes(shape, layout)[1]} "
            f"heads, which Hq={Hq} query heads is not a multiple of; {_reading(shape, fits[0])} would "
            f"fit: pass kv_layout={fits[0]!r} if that is the pools' layout"
        )
    return layout


def _heads_fit(Hq: int, Hkv: int) -> bool:
    return Hkv > 0 and Hq % Hkv == 0


def _reading(shape: tuple[int, ...], layout: str) -> str:
    page_size, heads = pool_sizes(shape, layout)
    return f"as kv_layout={layout!r} {_SHAPES[layout]}, page_size {page_size} and Hkv {heads}"
