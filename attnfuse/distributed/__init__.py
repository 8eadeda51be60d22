"""Context parallelism: one attention program over a sequence split across the ranks of a
``torch.distributed`` process group (NCCL on GPUs, gloo on CPUs), as a ring.

Import it explicitly (``import attnfuse`` does not)::

    import attnfuse.distributed as afd

    cp = afd.context_parallel(llama)                # every rank: the default group, the zigzag layout
    q_s, k_s, v_s = (afd.shard(t) for t in (q, k, v))   # this rank's rows of (B, H, N, D)
    out_s = cp(q_s, k_s, v_s)                        # this rank's rows of llama(q, k, v)
    out = afd.unshard(out_s)                         # the whole output, on every rank

docs/context-parallel.md has the layouts, what is supported and a model of scaling.
"""

from __future__ import annotations

from .context_parallel import ContextParallel, context_parallel
from .layout import LAYOUTS, shard, unshard

__all__ = ["LAYOUTS", "ContextParallel", "context_parallel", "shard", "unshard"]
