"""``LaunchContext``: what a plugin's ``prepare`` is given about a call. Part of the plugin API
(``attnfuse.plugin``); the runtime builds one per call (``runtime/inputs.py: launch_context``). It imports
nothing of AttnFuse.
"""

from __future__ import annotations

import attrs
import torch
from attrs import frozen


@frozen(kw_only=True, eq=False)
class LaunchContext:
    """What a plugin's ``prepare`` may read: the call's sizes, device and dtype.

    ``Nk`` is the key capacity; with ``kv_lens`` (B,) int32, each sequence has its own count of keys (up
    to it), and query i of sequence b sits at position i + kv_lens[b] - Nq. When the call gives its
    positions, ``q_offset`` is its first query's (else None: bottom-right alignment), ``k_offset`` its
    first key's, and ``seq_len`` the sequence's length, above every position (``Nk`` without positions).
    Packed sequences (a call with ``cu_seqlens_q``, ``cu_seqlens_k``: (docs + 1,) offsets of each document's
    rows, B = 1): ``Nq`` and ``Nk`` are the packed totals; each document has at most that many queries and
    keys, its own positions (query i of a document of Nq_i queries and Nk_i keys at i + Nk_i - Nq_i), so
    every position lies in [-Nq, Nk).
    """

    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    DV: int
    device: torch.device
    dtype: torch.dtype
    kv_lens: torch.Tensor | None = None
    q_offset: int | None = None
    k_offset: int = 0
    seq_len: int = attrs.field(default=attrs.Factory(lambda self: self.Nk, takes_self=True))
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
