"""What ``attnfuse show`` reports of a program's qk transforms: where they run (in the kernel, or hoisted into a
pass, by the rule of ``runtime/hoisted.py``) and what each way costs a row (``passes/transform_cost.py``)."""

from __future__ import annotations

from attrs import frozen

from .. import ir
from ..passes.compiler import lowered
from ..passes.transform_cost import TransformCost, transform_cost
from ..plan import KernelConfig
from ..runtime.compiled import compiled
from ..runtime.hoisted import least_hoisted_queries


@frozen(kw_only=True)
class TransformChoice:
    """``names``: the transforms' instances in order; ``cost``: their per-row costs; ``hoisted_from``: the
    fewest queries of a call that hoists them (None: never, as for packed calls)."""

    names: tuple[str, ...]
    cost: TransformCost
    hoisted_from: int | None

    @classmethod
    def of(cls, graph: ir.MatMulPV, config: KernelConfig) -> TransformChoice | None:
        """The choice for calls of ``graph`` with ``config``; None for a program with no qk transform."""
        program = lowered(graph, config)
        cost = transform_cost(program)
        if cost is None:
            return None
        plan = compiled(graph, config).plan
        hoists = "transform" in plan.kernels and not config.dtype.startswith("float8")  # launch._fp8_call
        least = least_hoisted_queries(plan.kernels["forward"].tiles.block_m) if hoists else None
        return cls(names=tuple(t.prefix for t in program.transforms), cost=cost, hoisted_from=least)

    def fields(self) -> dict:
        """The JSON object ``attnfuse show --json`` prints under "transforms"."""
        return {"names": list(self.names), "hoisted_from_queries": self.hoisted_from, **self.cost.fields()}

    def lines(self) -> list[str]:
        q, k = self.cost.q, self.cost.k
        where = (
            "always in the kernel (never hoisted for these calls)"
            if self.hoisted_from is None
            else f"hoisted into a pass in calls with at least {self.hoisted_from} queries and contiguous keys of one "
            "length; in the kernel in shorter calls, decoding, and calls with kv_lens or a paged cache"
        )
        return [
            f"{', '.join(self.names)}: {where}",
            f"a row costs at most: q {q.flops} FLOPs and {q.table_bytes} table bytes, k {k.flops} FLOPs and "
            f"{k.table_bytes} table bytes",
            "in the kernel: each q row once, each k row once for every query block that reads it",
            f"hoisted: each row once, and the pass reads and writes {self.cost.pass_bytes} bytes a row",
        ]
