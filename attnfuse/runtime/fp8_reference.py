"""The reference evaluator's view of a float8 call: its inputs dequantised with their descales."""

from __future__ import annotations

from typing import Any

import torch

from .fp8 import check_fp8, dequantised, is_fp8, refuse
from .inputs import check_inputs


def reference_inputs(
    q: Any,
    k: Any,
    v: Any,
    q_descale: Any,
    k_descale: Any,
    v_descale: Any,
    dtype: torch.dtype,
    block_table: Any,
    kv_layout: Any,
) -> tuple[Any, Any, Any]:
    """q, k, v for the reference evaluator: float8 ones dequantised in ``dtype`` with their descales (checked
    as a call checks them), others as they are (descales given to them refused)."""
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if not is_fp8(q) and all(d is None for d in descales.values()):
        return q, k, v
    check_inputs(q, k, v, paged=block_table is not None, kv_layout=kv_layout)
    if block_table is not None:
        refuse("a paged cache (block_table)")
    fp8 = check_fp8(q, k, v, descales, None, k.shape[1])
    return tuple(dequantised(t, d, dtype) for t, d in zip((q, k, v), fp8[:3]))
