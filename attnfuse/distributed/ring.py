"""The ring: each rank sends tensors to the next rank and receives the previous rank's, asynchronously
(``torch.distributed.batch_isend_irecv``: NCCL on GPUs, gloo on CPUs), so the transfer overlaps the kernels
that run meanwhile."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Transfer:
    """Tensors on their way from the previous rank; ``wait()`` returns them once they have arrived (and
    those sent have left)."""

    def __init__(self, works: list, sent: tuple[torch.Tensor, ...], received: tuple[torch.Tensor, ...]):
        self._works = works
        self._sent = sent  # kept alive until the sends complete
        self._received = received

    def wait(self) -> tuple[torch.Tensor, ...]:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], ()
        return self._received


class Ring:
    """The ring of ``group`` (None: the default group), rank r sending to r + 1 and receiving from r - 1."""

    def __init__(self, group: Any, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self._next, self._prev = peer((rank + 1) % world), peer((rank - 1) % world)

    def pass_on(self, tensors: tuple[torch.Tensor, ...]) -> Transfer:
        """Send ``tensors`` (contiguous) to the next rank and receive the same shapes from the previous one."""
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group) for t in received]
        return Transfer(dist.batch_isend_irecv(ops), tensors, received)


class LocalRing:
    """A ring of ``world`` ranks that moves nothing: each "received" tensor is the one sent. For timing the
    ring's kernels without its communication (``benchmarks/context_parallel.py``); results are not the
    program's."""

    def __init__(self, rank: int, world: int):
        self.group, self.rank, self.world = None, rank, world

    def pass_on(self, tensors: tuple[torch.Tensor, ...]) -> Transfer:
        return Transfer([], (), tensors)
