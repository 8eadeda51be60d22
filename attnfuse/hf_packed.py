"""Packed batches in ``attn_implementation="attnfuse"``: HF's ``DataCollatorWithFlattening`` gives one row of
documents one after another (batch size 1), with position_ids restarting at 0 for each and, with
``return_flash_attn_kwargs=True``, FlashAttention's ``cu_seq_lens_q``/``cu_seq_lens_k`` and
``max_length_q``/``max_length_k`` as attention keywords. ``attention_forward`` then calls its program with
``cu_seqlens_q``/``cu_seqlens_k``: each document attends within itself, with no (total, total) mask read.

HF still builds the block-diagonal boolean mask of such a batch for SDPA-style masks; it is checked to be
exactly the documents' causal (or sliding-window) mask: with the flash keywords anything else is refused
rather than dropped, and with position_ids alone it means no packing (the mask then runs as a bias).

These checks sync with the host. HF hands every layer of a forward the same position_ids, mask, flash keywords
and rotary tables, so each answer is remembered (``_Recent``) for the tensors it read, by identity and
version: the layers after the first reuse it with no host sync, and a tensor changed in place is read again.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, NamedTuple

import torch

from .errors import UnsupportedError
from .packing import cu_seqlens_from_position_ids

FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")


class PackedCall(NamedTuple):
    """A packed call's offsets (docs + 1,) and optional longest-document bounds, as the program takes them."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int | None
    max_seqlen_k: int | None


class _Recent:
    """The last ``size`` answers of a function of tensors and plain values. An answer is reused while each of
    its tensors is the same object at the same version (``Tensor._version``, bumped by in-place writes); the
    tensors are held weakly. Not while torch.compile traces (its tensors are fakes)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: list[tuple[tuple, tuple, Any, Any]] = []  # (weakrefs, versions, plain key, answer)

    def get_or_compute(self, tensors: tuple, plain: Any, compute: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling():
            return compute()
        versions = tuple(None if t is None else t._version for t in tensors)
        for refs, seen, key, answer in self.entries:
            if key == plain and seen == versions and all(_alive(r) is t for r, t in zip(refs, tensors)):
                return answer
        answer = compute()
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
        live = [e for e in self.entries if all(r is None or r() is not None for r in e[0])]
        self.entries = [(refs, versions, plain, answer), *live][: self.size]
        return answer


def _alive(ref: weakref.ref | None) -> torch.Tensor | None:
    return None if ref is None else ref()


_recent_calls, _recent_tables = _Recent(), _Recent()


def packed_call(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, window: int | None, kwargs: dict[str, Any]
) -> PackedCall | None:
    """The offsets of a packed call of query (1, Hq, total, D), key (1, Hkv, total, D) with HF's ``mask``
    (None or (1, 1, total, total) bool) and sliding ``window`` (left extent, or None): HF's flash keywords when
    given (then a mask other than the documents' causal one is an UnsupportedError), else position_ids
    (1, total) restarting at 0 inside the row, with no mask or exactly the documents' one (a padded row whose
    positions restart is no packing: its mask runs as a bias); None for an unpacked call. Remembered for the
    tensors it reads (``_Recent``)."""
    read = (mask, kwargs.get("position_ids"), *(kwargs.get(name) for name in FLASH_KWARGS))
    plain = (
        query.shape[0],
        query.shape[2],
        key.shape[2],
        window,
        *(_int_or_none(kwargs.get(f"max_length_{x}")) for x in "qk"),
    )
    return _recent_calls.get_or_compute(read, plain, lambda: _packed_call(query, key, mask, window, kwargs))


def _packed_call(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, window: int | None, kwargs: dict[str, Any]
) -> PackedCall | None:
    if any(kwargs.get(name) is not None for name in FLASH_KWARGS):
        cu_q, cu_k = (kwargs.get(name) for name in FLASH_KWARGS)
        if cu_q is None or cu_k is None:
            missing = FLASH_KWARGS[cu_q is not None]
            raise UnsupportedError(
                f"attn_implementation='attnfuse': a packed batch needs both {FLASH_KWARGS}; {missing} is missing"
            )
        bounds = (_int_or_none(kwargs.get("max_length_q")), _int_or_none(kwargs.get("max_length_k")))
        packed = PackedCall(cu_q, cu_k, *bounds)
        if mask is not None and not _is_documents_mask(mask, packed, window):
            raise UnsupportedError(
                f"attn_implementation='attnfuse': a packed batch (cu_seq_lens_q, cu_seq_lens_k) with an attention "
                f"mask ({mask.dtype} {tuple(mask.shape)}) other than its documents' causal mask (padding, or a "
                f"custom mask): packed calls cannot honour it; pass no attention_mask with packed sequences"
            )
        return packed
    position_ids = kwargs.get("position_ids")
    if position_ids is None or query.shape[0] != 1 or position_ids.numel() != query.shape[2]:
        return None
    if query.shape[2] != key.shape[2]:  # a cache: the row is one sequence continuing
        return None
    # One host sync (the number of documents), as HF's own flash path makes from position_ids.
    cu = cu_seqlens_from_position_ids(position_ids.reshape(-1))
    packed = PackedCall(cu, cu, None, None)
    if cu.shape[0] <= 2 or (mask is not None and not _is_documents_mask(mask, packed, window)):
        return None
    return packed


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


def _is_documents_mask(mask: torch.Tensor, packed: PackedCall, window: int | None) -> bool:
    """Whether HF's ``mask`` is a boolean (1, 1, total, total) equal to the documents' causal mask (keeping
    ``window`` keys to the left, when given), or to the whole row's, which HF builds where its mask function
    is not given the position_ids (GPT-OSS's layers), as None where it needs no mask. One or two host syncs."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[0] != 1 or mask.shape[1] != 1:
        return False
    Nq, Nk = mask.shape[-2:]
    whole_row = torch.tensor([0, Nk], device=mask.device)
    return any(
        torch.equal(mask[0, 0], documents_causal_mask(p, Nq, Nk, window))
        for p in (packed, PackedCall(whole_row - Nk + Nq, whole_row, None, None))
    )


def documents_causal_mask(packed: PackedCall, Nq: int, Nk: int, window: int | None) -> torch.Tensor:
    """(Nq, Nk) bool: query i keeps key j of its own document at a local position <= its own (and >= its own
    minus ``window``), queries bottom-right aligned to their document's keys."""
    cu_q, cu_k = packed.cu_seqlens_q.long(), packed.cu_seqlens_k.long()
    doc_q = torch.bucketize(torch.arange(Nq, device=cu_q.device), cu_q[1:], right=True)
    doc_k = torch.bucketize(torch.arange(Nk, device=cu_k.device), cu_k[1:], right=True)
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    query_at = torch.arange(Nq, device=cu_q.device) - cu_q[doc_q] + (lengths_k - lengths_q)[doc_q]
    key_at = torch.arange(Nk, device=cu_k.device) - cu_k[doc_k]
    offset = query_at[:, None] - key_at[None, :]
    keep = (doc_q[:, None] == doc_k[None, :]) & (offset >= 0)
    return keep if window is None else keep & (offset <= window)


def local_rope_tables(cos: torch.Tensor, sin: torch.Tensor, packed: PackedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's cos, sin (1, total, D), one row per packed token, as the tables (longest, D) a packed call reads at
    document-local positions: the longest document's rows. Refused
    (UnsupportedError) unless every token's row equals the table's row of its local position (position_ids
    restarting alike in every document), and when queries and keys are offset differently. Host syncs: the
    offsets, and the check; remembered for the tensors they read (``_Recent``)."""
    read = (cos, sin, packed.cu_seqlens_q, packed.cu_seqlens_k)
    return _recent_tables.get_or_compute(read, None, lambda: _local_rope_tables(cos, sin, packed))


def _local_rope_tables(cos: torch.Tensor, sin: torch.Tensor, packed: PackedCall) -> tuple[torch.Tensor, torch.Tensor]:
    if not torch.equal(packed.cu_seqlens_q, packed.cu_seqlens_k):
        raise UnsupportedError("fuse_rope: a packed batch with cu_seq_lens_q != cu_seq_lens_k is not supported")
    cu = packed.cu_seqlens_q.long()
    lengths = cu.diff()
    longest = int(lengths.argmax())
    start, end = cu[longest : longest + 2].tolist()
    local = torch.arange(cos.shape[1], device=cu.device) - torch.repeat_interleave(cu[:-1], lengths)
    if not all(torch.equal(t[0, start:end][local], t[0]) for t in (cos, sin)):
        raise UnsupportedError(
            "fuse_rope: a packed batch whose rotary tables differ between documents at the same local "
            "position (position_ids that do not restart alike in every document) is not supported"
        )
    return cos[0, start:end], sin[0, start:end]
