"""Attention dropout (``dropout_p`` of a call): SDPA's meaning. Each attention weight is zeroed with probability
p and the others are scaled by 1 / (1 - p), after normalisation: out = (P ∘ M / (1 - p))·V, the normaliser's
statistics (the log-sum-exp) taken without dropout. ``dropout_p=0`` (the default) runs the kernels of a call
without it, unchanged.

Random numbers: the kernels draw one Philox number per (batch, query head, query row, key column)
(``passes/codegen/dropout.py``), keyed by a seed and counted from an offset; the backward regenerates the same
mask, so none is stored. Seed and offset are one (2,) int64 tensor on q's device, the call's *dropout state*,
drawn by ``dropout_state`` with ``torch.randint`` from the device's default generator once the call's checks pass
(the only draw of a call; a refused call draws nothing): ``torch.manual_seed`` makes a run repeatable. The kernels
read the two values on the device, so none is baked into a launch: a CUDA graph replay draws a fresh state as any
torch random op does (torch's generators are graph-safe), and under torch.compile the draw is an op of the graph,
ahead of ``attnfuse::attention``, which takes the state as an input, as does its backward (SDPA's backward
likewise takes the seed and offset its forward used).

``dropout_keep`` replays a state's mask (from the same Philox stream, through a small generated kernel) for the
reference evaluator: ``program.reference(..., dropout_p=p, dropout_mask=keep)``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton

from ..errors import InputError, UnsupportedError
from ..passes.compiler import dropout_mask_source
from ..plan import DROPOUT_P, DROPOUT_SCALE, DROPOUT_STATE
from .gpu_gate import Gate
from .interpreter import InterpretedKernel
from .launcher import Launcher, cdiv
from .source_cache import load_function, write_source

MASK_KERNEL = "attnfuse_dropout_mask"
OFFSET_LIMIT = 2**62  # offsets below it: an offset plus an element's index (< 2**62) stays below 2**63
MASK_TILE = 32  # the mask kernel's block of rows and of keys


class Dropout(NamedTuple):
    """A call's dropout: the rate ``p`` in (0, 1) and its state, (2,) int64 on q's device: seed, offset."""

    p: float
    state: torch.Tensor


def check_dropout_p(value: Any) -> float:
    """``dropout_p`` as a float in [0, 1); an InputError for anything else (a tensor, a bool, NaN, 1.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:  # NaN fails too
        raise InputError(
            f"dropout_p must be a Python number in [0, 1) (the probability of zeroing each attention weight), "
            f"got {value!r}" + (" (a tensor: pass a float)" if isinstance(value, torch.Tensor) else "")
        )
    return float(value)


def dropout_state(device: torch.device | str) -> torch.Tensor:
    """A fresh dropout state (2,) int64 on ``device``: a Philox seed and a counter offset, drawn with
    ``torch.randint`` from ``device``'s default generator (what a call with dropout draws first)."""
    return torch.randint(0, OFFSET_LIMIT, (2,), dtype=torch.int64, device=device)


GATE = Gate(
    "attention dropout (dropout_p > 0)",
    "ATTNFUSE_DROPOUT_ON_GPU",
    "tests/test_gpu.py::test_dropout_replays",
    checked=("interpreter", "sm90"),
)


def call_dropout(dropout_p: Any, device: torch.device) -> Dropout | None:
    """The dropout of a call with ``dropout_p`` on ``device`` (its state drawn now), or None for p = 0. An
    UnsupportedError where no GPU run has checked the kernels with dropout (``GATE``)."""
    p = check_dropout_p(dropout_p)
    if p == 0.0:
        return None
    GATE.check(device)
    return Dropout(p, dropout_state(device))


def check_state(state: Any, device: torch.device) -> torch.Tensor:
    """An InputError unless ``state`` is a (2,) int64 tensor on ``device`` (``dropout_state``'s)."""
    if not (
        isinstance(state, torch.Tensor)
        and state.shape == (2,)
        and state.dtype == torch.int64
        and state.device == device
    ):
        raise InputError(
            f"dropout state must be a (2,) int64 tensor on {device} (attnfuse.dropout_state), got "
            f"{getattr(state, 'dtype', type(state).__name__)} {tuple(getattr(state, 'shape', ()))} "
            f"on {getattr(state, 'device', '-')}"
        )
    return state.contiguous()


def op_dropout(p: float, state: torch.Tensor | None, device: torch.device) -> Dropout | None:
    """The dropout of an ``attnfuse::attention`` call whose spec has rate ``p`` and whose state is ``state``."""
    return Dropout(p, check_state(state, device)) if p > 0.0 else None


def launch_args(dropout: Dropout | None) -> dict[str, Any]:
    """The kernels' dropout arguments by name (none without dropout)."""
    if dropout is None:
        return {}
    return {DROPOUT_STATE: dropout.state, DROPOUT_P: dropout.p, DROPOUT_SCALE: 1.0 / (1.0 - dropout.p)}


def refuse(feature: str) -> UnsupportedError:
    """The error for a call giving ``dropout_p`` > 0 with ``feature``, which does not take dropout."""
    return UnsupportedError(f"dropout_p > 0 is not supported with {feature}; call it with dropout_p=0")


def refuse_dropout_with(*, paged: bool, split_kv: bool) -> None:
    """Raise ``refuse``'s error for the first feature a call with dropout gives that does not take it."""
    for given, feature in (
        (paged, "a paged cache (block_table)"),
        (split_kv, "the split-KV decoding path (split_kv=True)"),
    ):
        if given:
            raise refuse(feature)


def reference_dropout(
    dropout_p: Any, dropout_mask: Any, q: torch.Tensor, k: torch.Tensor, paged: bool = False
) -> tuple[torch.Tensor, float] | None:
    """The reference evaluator's dropout: (keep mask (B, Hq, Nq, Nk) bool, p), or None for p = 0. An
    InputError for a mask missing with p > 0, given with p = 0, or not a bool tensor of that shape on q's
    device; ``refuse``'s error with a paged cache, as for a call."""
    p = check_dropout_p(dropout_p)
    if p == 0.0:
        if dropout_mask is not None:
            raise InputError("dropout_mask is given but dropout_p is 0: pass the call's dropout_p with its mask")
        return None
    if paged:
        raise refuse("a paged cache (block_table)")
    shape = (*q.shape[:3], k.shape[2])
    if (
        not isinstance(dropout_mask, torch.Tensor)
        or dropout_mask.dtype != torch.bool
        or tuple(dropout_mask.shape) != shape
        or dropout_mask.device != q.device
    ):
        raise InputError(
            f"dropout_mask must be the (B, Hq, Nq, Nk) = {shape} bool tensor on {q.device} of the weights the call "
            f"kept (attnfuse.dropout_keep), given with dropout_p > 0; got "
            f"{getattr(dropout_mask, 'dtype', type(dropout_mask).__name__)} "
            f"{tuple(getattr(dropout_mask, 'shape', ()))}"
        )
    return dropout_mask, p


@functools.lru_cache(maxsize=2)
def _mask_kernel(interpreted: bool) -> InterpretedKernel | Launcher:
    source = dropout_mask_source(MASK_KERNEL)
    fn = load_function(source, MASK_KERNEL, write_source(MASK_KERNEL, source))
    return InterpretedKernel(fn) if interpreted else Launcher(triton.jit(fn))


def dropout_keep(state: torch.Tensor, p: float, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """The keep mask (B, Hq, Nq, Nk) bool that a call of q (B, Hq, Nq, D) and Nk keys with dropout rate ``p``
    and dropout state ``state`` used (the same Philox numbers, on ``state``'s device): ``~keep`` marks the
    weights it zeroed. For the reference evaluator (``program.reference(..., dropout_mask=keep)``)."""
    p = check_dropout_p(p)
    state = check_state(state, state.device if isinstance(state, torch.Tensor) else torch.device("cpu"))
    if len(shape) != 4 or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise InputError(f"dropout_keep: shape must be (B, Hq, Nq, Nk), four sizes, got {shape!r}")
    B, Hq, Nq, Nk = shape
    keep = torch.empty(shape, dtype=torch.int8, device=state.device)
    blocks = B * Hq * cdiv(Nq, MASK_TILE) * cdiv(Nk, MASK_TILE)
    if blocks:
        _mask_kernel(state.device.type == "cpu").launch(
            (blocks,), (state, keep, Hq, Nq, Nk, p), {"BLOCK_M": MASK_TILE, "BLOCK_N": MASK_TILE}, device=state.device
        )
    return keep.bool()
