"""Agreement before a collective: every rank checks its own call, then one small all-gather tells every rank
whether all of them may go on. A bad input on one rank so raises on every rank, never leaving the others
blocked in a collective until the backend's timeout.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InputError

Facts = dict[str, Any]  # what every rank's call must give alike, by name (shapes, dtypes, arguments): plain data


def agree(group: Any, world: int, facts: Facts | None, failure: Exception | None, what: str, hint: str) -> None:
    """Return on every rank when no rank's own checks failed (``failure`` None, ``facts`` given) and every rank
    gives equal ``facts``; else raise on every rank. A rank whose checks failed raises its own ``failure``;
    the others an ``InputError`` naming each failing rank and its error. With no failure but facts that
    differ, every rank raises an ``InputError`` naming the first fact that differs and each rank's value,
    followed by ``hint``. ``what``: the caller's name, which starts each message.

    One all-gather of 5 int64s (a failure flag and a hash of the facts) and one host sync; a failure or a
    difference costs one more (``all_gather_object``) to tell every rank what it was."""
    mine = [1, 0, 0, 0, 0] if failure is not None else [0, *_digest(facts)]
    every = [row.tolist() for row in _all_gather(group, world, mine)]
    if all(row == every[0] for row in every) and every[0][0] == 0:
        return
    report = {"error": f"{type(failure).__name__}: {failure}"} if failure is not None else {"facts": facts}
    reports: list = [None] * world
    dist.all_gather_object(reports, report, group=group)
    if failure is not None:
        raise failure
    errors = [(rank, r["error"]) for rank, r in enumerate(reports) if "error" in r]
    if errors:
        said = "; ".join(f"rank {rank}: {error}" for rank, error in errors)
        raise InputError(
            f"{what}: {'rank' if len(errors) == 1 else 'ranks'} "
            f"{', '.join(str(rank) for rank, _ in errors)} of {world} refused the call, so every rank "
            f"raises instead of waiting for it in a collective ({said})"
        )
    seen = {name: [r["facts"].get(name) for r in reports] for r in reports for name in r["facts"]}
    name = next(name for name, values in seen.items() if any(v != values[0] for v in values))
    by_rank = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(seen[name]))
    raise InputError(f"{what}: {name} differs across ranks ({by_rank}); {hint}")


def _digest(facts: Facts) -> list[int]:
    """Four int64s of a SHA-256 of ``facts``'s repr: equal facts give equal digests on every rank."""
    raw = hashlib.sha256(repr(sorted(facts.items())).encode()).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _all_gather(group: Any, world: int, values: list[int]) -> list[torch.Tensor]:
    """Every rank's ``values`` (equal lengths), as int64 tensors, in rank order."""
    mine = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    return every


def collective_device(group: Any) -> torch.device:
    """Where the group's backend takes tensors: the CPU for gloo (also under a "cpu:gloo,cuda:nccl" pair),
    else the current CUDA device (NCCL)."""
    if "gloo" in dist.get_backend(group) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
