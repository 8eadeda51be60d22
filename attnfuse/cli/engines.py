"""Which engine runs each kernel of a call, as ``attnfuse show`` reports it, in the runtime's order of choice
(``runtime/forward.py``, ``runtime/backward.py``): a Hopper template instance (``attnfuse/kernels``) where the
templates can run the kernel and ``verified.chosen`` chooses it, else the generated Triton kernel."""

from __future__ import annotations

from attrs import evolve, frozen

from .. import ir
from ..kernels.generated_resources import generated_resources
from ..kernels.instance import TEMPLATE_KINDS
from ..kernels.pipeline import ROWS
from ..kernels.resources import template_resources
from ..kernels.tiles import SHARED_MEMORY_LIMIT
from ..kernels.verified import MODE_ENV, chosen, is_verified, mode, record_key
from ..plan import KernelConfig, KernelSpec, Plan
from ..runtime.compiled import compiled
from ..runtime.hoisted import least_hoisted_queries

NOT_VERIFIED = f"instance not verified on a GPU ({MODE_ENV}=all opts in)"
TEMPLATES_OFF = f"the templates are turned off ({MODE_ENV}=off)"
NO_SPLIT_KV = "{what} never takes the split-KV path: a call with few queries runs the forward kernel"
HOISTED_KINDS = ("forward", "dkdv", "dq")
LISTED_CONDITION = (  # capability.block_list_reason
    f"the template runs calls whose block lists' block size is a multiple of {2 * ROWS.value} (a program's query "
    "rows or keys), the generated kernel the others"
)  # a call that hoists its qk transforms runs the hoisted plan's


@frozen(kw_only=True)
class KernelEngine:
    """The engine of one kernel kind of one plan (``config``). ``engine``: "template" or "generated"; ``name``:
    the kernel that runs; ``reason``: why the template does not (None when it runs); ``template``: the template's
    spec where the templates can run the kind, and ``instance`` its record key; ``config``: the plan's
    configuration (with ``template``, what a compile report of the instance reads). ``hoisted``: the kernel of
    the plan for transformed rows, which a call hoisting its qk transforms runs (``fused``: the kernel shorter
    calls run, with the transforms inside, and ``when``: which calls hoist). ``condition``: what a call must meet
    for the template's instance to run (else it runs the generated kernel), where there is a condition."""

    kind: str
    engine: str
    name: str
    reason: str | None
    template: KernelSpec | None
    instance: str | None
    verified: bool
    config: KernelConfig
    hoisted: bool = False
    when: str | None = None
    fused: KernelEngine | None = None
    resources: dict | None = None  # with_resources's figures, where asked for
    condition: str | None = None

    def fields(self) -> dict:
        """The JSON object ``attnfuse show --json`` prints for this kernel."""
        fields = {
            "engine": self.engine,
            "name": self.name,
            "reason": self.reason,
            "template_available": self.template is not None,
            "verified": self.verified,
            "instance": self.instance,
            "hoisted": self.hoisted,
        }
        if self.resources is not None:
            fields.update(self.resources)
        if self.fused is not None:
            fields.update(when=self.when, fused=self.fused.fields())
        if self.condition is not None:
            fields["condition"] = self.condition
        return fields

    def lines(self) -> list[str]:
        """In words: "forward: template (verified)" or "forward: generated — <reason>", and for a hoisted
        kernel a second line, the kernel shorter calls run."""
        if self.fused is None:
            return [f"{self.kind}: {self._words()}"]
        return [
            f"{self.kind}, {self.when} (qk transforms hoisted into a pass): {self._words()}",
            f"{self.kind}, shorter calls (qk transforms in the kernel): {self.fused._words()}",
        ]

    def _words(self) -> str:
        if self.engine == "template":
            head = f"template ({'verified' if self.verified else f'not verified, {MODE_ENV}=all'})"
        else:
            head = "generated"
        words = head if self.reason is None else f"{head} — {self.reason}"
        if self.condition is not None:
            words = f"{words}; {self.condition}"
        if self.resources is None:
            return words
        r = self.resources
        return (
            f"{words}; {r['registers']} registers, {r['spill_bytes']} spill bytes, "
            f"{r['shared_bytes'] / 1024:.1f} KiB shared memory"
        )


def kernel_engine(plan: Plan, kind: str) -> KernelEngine:
    """The engine that runs ``plan``'s kernel ``kind`` (one of ``TEMPLATE_KINDS``)."""
    config = plan.config
    template = plan.templates.kernels.get(kind)
    instance = record_key(template, config.dtype, config.head_dim) if template is not None else None
    verified = instance is not None and is_verified(instance)
    if instance is not None and chosen(instance):
        return KernelEngine(
            kind=kind,
            engine="template",
            name=template.name,
            reason=None,
            template=template,
            instance=instance,
            verified=verified,
            config=config,
        )
    if template is None:
        reason = plan.templates.reasons[kind]
    else:
        reason = TEMPLATES_OFF if mode() == "off" else NOT_VERIFIED
    return KernelEngine(
        kind=kind,
        engine="generated",
        name=plan.kernels[kind].name,
        reason=reason,
        template=template,
        instance=instance,
        verified=verified,
        config=config,
    )


def call_engines(graph: ir.MatMulPV, inference: KernelConfig, training: KernelConfig) -> dict[str, KernelEngine]:
    """The engine of each of ``TEMPLATE_KINDS`` in a call of ``graph``: the forward and decoding kernels for
    ``inference``, the backward's for ``training`` (which saves the log-sum-exp the backward reads). A program
    with qk transforms to hoist reports the kernels that calls long enough to hoist them run (those of the
    plan for transformed rows, ``Plan.hoisted_config``), each with the fused one shorter calls run (a float8
    call never hoists)."""
    engines, fp8 = {}, inference.dtype.startswith("float8")
    for kind in TEMPLATE_KINDS:
        plan = compiled(graph, training if kind in ("dkdv", "dq") else inference).plan
        engine = kernel_engine(plan, kind)
        if "transform" in plan.kernels and kind in HOISTED_KINDS and not fp8:
            hoisted = kernel_engine(compiled(graph, plan.hoisted_config).plan, kind)
            least = least_hoisted_queries(plan.kernels["forward"].tiles.block_m)
            engine = evolve(hoisted, hoisted=True, when=f"calls with at least {least} queries", fused=engine)
        if kind in ("forward", "dkdv", "dq") and engine.template is not None and plan.block_limit is not None:
            engine = evolve(engine, condition=LISTED_CONDITION)
        if kind in ("dkdv", "dq") and fp8:
            engine = evolve(engine, reason="float8 calls have no backward (a gradient is an UnsupportedError)")
        if kind == "decode" and (inference.dropout or fp8):
            what = "a call with attention dropout" if inference.dropout else "a float8 call"
            engine = evolve(engine, name=plan.kernels["forward"].name, reason=NO_SPLIT_KV.format(what=what))
        engines[kind] = engine
    return engines


def with_resources(engine: KernelEngine, graph: ir.MatMulPV) -> KernelEngine:
    """``engine`` (and the fused kernel it stands with) with what its kernel uses on an H100/H200, compiled
    for sm_90a with no GPU: a template instance as ``template_resources`` compiles it, a generated kernel as
    ``generated_resources`` does, with the tiles a launch runs (its plan's, shrunk as a launch shrinks them
    to fit a block's shared memory); ptxas' ``registers`` a thread, ``spill_bytes`` stored in the main path and
    ``shared_bytes`` a block."""
    fused = None if engine.fused is None else with_resources(engine.fused, graph)
    config = engine.config
    if engine.engine == "template":
        used = template_resources(engine.template, config.dtype, config.head_dim, config.save_lse)
    else:
        plan = compiled(graph, config).plan
        # the kernel that runs: a dropout or float8 call's decode row names the forward kernel (call_engines)
        kind = next((k for k, spec in plan.kernels.items() if spec.name == engine.name), engine.kind)
        used = generated_resources(plan, kind, shared_limit=SHARED_MEMORY_LIMIT)
    figures = {"registers": used.registers, "spill_bytes": used.spill_bytes, "shared_bytes": used.shared_bytes}
    return evolve(engine, resources=figures, fused=fused)
