"""Document offsets (``cu_seqlens``) of packed sequences, from the per-token ids training pipelines give."""

from __future__ import annotations

from typing import Any

import torch

from .errors import InputError


def _tokens(name: str, ids: Any) -> torch.Tensor:
    """``ids`` as a 1-D integer tensor: (total,) or (1, total) (a packed batch of one row)."""
    integer = isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex()
    if not integer or ids.dtype == torch.bool or ids.dim() not in (1, 2) or (ids.dim() == 2 and ids.shape[0] != 1):
        raise InputError(
            f"{name} must be an integer tensor of shape (total,) or (1, total) (one packed row), got "
            f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
        )
    return ids.reshape(-1)


def _offsets(starts: torch.Tensor) -> torch.Tensor:
    """(docs + 1,) int32 offsets from ``starts`` (total,) bool, True where a document begins (the first token
    always does). One host sync: the number of documents decides the result's size."""
    total = starts.shape[0]
    if total:
        starts = starts.clone()
        starts[0] = True
    first = torch.nonzero(starts).flatten()
    return torch.cat((first, torch.tensor([total], device=starts.device))).to(torch.int32)


def cu_seqlens_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Offsets (docs + 1,) int32 of packed documents from ``document_ids`` (total,) or (1, total): a new
    document begins wherever the id differs from the previous token's (the ids' values are not otherwise
    read). On the ids' device, with one host sync (the number of documents)."""
    ids = _tokens("document_ids", document_ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[1:] = ids[1:] != ids[:-1]
    return _offsets(starts)


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Offsets (docs + 1,) int32 of packed documents from ``position_ids`` (total,) or (1, total) that restart
    at 0 for each document, as HF's DataCollatorWithFlattening gives them: a document begins at each 0 (and
    at the first token). On the ids' device, with one host sync (the number of documents)."""
    return _offsets(_tokens("position_ids", position_ids) == 0)
