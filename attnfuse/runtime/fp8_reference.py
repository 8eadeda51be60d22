"""The reference evaluator's view of a float8 call: its inputs dequantised with their descales."""

from __future__ import annotations

from typing import Any

import torch

from ..reference import gather_pages
from .fp8 import check_fp8, dequantised, is_fp8
from .inputs import check_cache, check_inputs
from .validate import check_call_values


def reference_inputs(
    q: Any,
    k: Any,
    v: Any,
    q_descale: Any,
    k_descale: Any,
    v_descale: Any,
    dtype: torch.dtype,
    kv_lens: Any,
    block_table: Any,
    kv_layout: Any,
) -> tuple[Any, Any, Any, Any, Any]:
    """(q, k, v, block_table, kv_layout) for the reference evaluator: float8 ones dequantised in ``dtype`` with
    their descales (checked as a call checks them), others as they are (descales given to them refused). A paged
    float8 cache's pools are first checked as a call checks them and gathered into each sequence's (B, Hkv, N, D)
    keys and values, which then take their (batch, kv head)'s descale: a cache with no block table."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if not is_fp8(q) and all(d is None for d in descales.values()):
        return q, k, v, block_table, kv_layout
    layout = check_inputs(q, k, v, paged=block_table is not None, kv_layout=kv_layout)
    if block_table is not None:
        layout = check_cache(q, k, v, kv_lens, block_table, kv_layout).kv_layout
        check_call_values(k, kv_lens, block_table, kv_layout=layout, wait=True)
        k, v = (gather_pages(t, block_table, layout) for t in (k, v))
        block_table, kv_layout = None, None
    fp8 = check_fp8(q, k, v, descales, None, k.shape[1])
    q, k, v = (dequantised(t, d, dtype) for t, d in zip((q, k, v), fp8[:3]))
    return q, k, v, block_table, kv_layout
