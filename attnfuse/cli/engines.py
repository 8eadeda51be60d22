"""Which engine runs each kernel of a call, as ``attnfuse show`` reports it, in the runtime's order of choice
(``runtime/forward.py``, ``runtime/backward.py``): a Hopper template instance (``attnfuse/kernels``) where the
templates can run the kernel and ``verified.chosen`` chooses it, else the hand-written Hopper kernel where
``plan.hopper`` serves the forward and dK/dV, else the generated Triton kernel."""

from __future__ import annotations

from attrs import evolve, frozen

from .. import ir
from ..kernels.generated_resources import generated_resources
from ..kernels.instance import TEMPLATE_KINDS
from ..kernels.resources import template_resources
from ..kernels.tiles import SHARED_MEMORY_LIMIT
from ..kernels.verified import MODE_ENV, chosen, is_verified, mode, record_key
from ..plan import KernelConfig, KernelSpec, Plan
from ..runtime.backward import FUSED_DQ_ENV, fuses_dq
from ..runtime.compiled import compiled
from ..runtime.hoisted import HOIST_MIN_QUERY_BLOCKS

NOT_VERIFIED = f"instance not verified on a GPU ({MODE_ENV}=all opts in)"
TEMPLATES_OFF = f"the templates are turned off ({MODE_ENV}=off)"
HAND_WRITTEN = {  # kernel kind -> the hand-written Hopper kernel that does its work where plan.hopper is set
    "forward": ("hopper_forward_kernel", "attnfuse/runtime/hopper_kernel.py, on tensors TMA can address"),
    "dkdv": ("hopper_dkdv_kernel", "attnfuse/runtime/hopper_dkdv_kernel.py, on tensors TMA can address"),
    "dq": (
        "hopper_dkdv_kernel",
        f"attnfuse/runtime/hopper_dkdv_kernel.py computes dQ too ({FUSED_DQ_ENV}=1), on tensors TMA can address, "
        "except under torch.use_deterministic_algorithms(True), where the generated dQ kernel runs",
    ),
}
HOISTED_KINDS = ("forward", "dkdv", "dq")  # a call that hoists its qk transforms runs the hoisted plan's
HAND_WRITTEN_RESOURCES = (
    "not compiled here: a hand-written Hopper kernel (only template instances and generated ones are)"
)


@frozen(kw_only=True)
class KernelEngine:
    """The engine of one kernel kind of one plan (``config``). ``engine``: "template", "hand-written" or
    "generated"; ``name``: the kernel that runs; ``reason``: why the template does not (None when it runs);
    ``template``: the template's spec where the templates can run the kind, and ``instance`` its record key;
    ``config``: the plan's configuration (with ``template``, what a compile report of the instance reads).
    ``hoisted``: the kernel of the plan for transformed rows, which a call hoisting its qk transforms runs
    (``fused``: the kernel shorter calls run, with the transforms inside, and ``when``: which calls hoist)."""

    kind: str
    engine: str
    name: str
    reason: str | None
    template: KernelSpec | None
    instance: str | None
    verified: bool
    config: KernelConfig
    note: str | None = None
    hoisted: bool = False
    when: str | None = None
    fused: KernelEngine | None = None
    resources: dict | None = None  # with_resources's figures, where asked for

    def fields(self) -> dict:
        """The JSON object ``attnfuse show --json`` prints for this kernel."""
        fields = {
            "engine": self.engine,
            "name": self.name,
            "reason": self.reason,
            "template_available": self.template is not None,
            "verified": self.verified,
            "instance": self.instance,
            "note": self.note,
            "hoisted": self.hoisted,
        }
        if self.resources is not None:
            fields.update(self.resources)
        if self.fused is not None:
            fields.update(when=self.when, fused=self.fused.fields())
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
        elif self.engine == "hand-written":
            head = f"hand-written ({self.note})"
        else:
            head = "generated"
        words = head if self.reason is None else f"{head} — {self.reason}"
        if self.resources is None:
            return words
        if self.resources["registers"] is None:
            return f"{words}; resources: {self.resources['resources']}"
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
    common = dict(kind=kind, reason=reason, template=template, instance=instance, verified=verified, config=config)
    if plan.hopper is not None and kind in HAND_WRITTEN and (kind != "dq" or _hand_written_dq(plan)):
        name, note = HAND_WRITTEN[kind]
        return KernelEngine(engine="hand-written", name=name, note=note, **common)
    generated = plan.kernels[kind]
    return KernelEngine(engine="generated", name=generated.name, **common)


def _hand_written_dq(plan: Plan) -> bool:
    """Whether the hand-written dK/dV kernel computes dQ in ``plan``'s backward (``runtime/backward.py``): no
    dK/dV template instance runs it, and ``fuses_dq`` opts in (else the generated dQ kernel runs first)."""
    dkdv = plan.templates.kernels.get("dkdv")
    template = dkdv is not None and chosen(record_key(dkdv, plan.config.dtype, plan.config.head_dim))
    return not template and fuses_dq(True, tensor_grads=False)


def call_engines(graph: ir.MatMulPV, inference: KernelConfig, training: KernelConfig) -> dict[str, KernelEngine]:
    """The engine of each of ``TEMPLATE_KINDS`` in a call of ``graph``: the forward and decoding kernels for
    ``inference``, the backward's for ``training`` (which saves the log-sum-exp the backward reads). A program
    with qk transforms to hoist reports the kernels that calls long enough to hoist them run (those of the
    plan for transformed rows, ``Plan.hoisted_config``), each with the fused one shorter calls run."""
    engines = {}
    for kind in TEMPLATE_KINDS:
        plan = compiled(graph, training if kind in ("dkdv", "dq") else inference).plan
        engine = kernel_engine(plan, kind)
        if "transform" in plan.kernels and kind in HOISTED_KINDS:
            hoisted = kernel_engine(compiled(graph, plan.hoisted_config).plan, kind)
            least = (HOIST_MIN_QUERY_BLOCKS - 1) * plan.kernels[
                "forward"
            ].tiles.block_m + 1  # worth_hoisting's least Nq
            engine = evolve(hoisted, hoisted=True, when=f"calls with at least {least} queries", fused=engine)
        engines[kind] = engine
    return engines


def with_resources(engine: KernelEngine, graph: ir.MatMulPV) -> KernelEngine:
    """``engine`` (and the fused kernel it stands with) with what its kernel uses on an H100/H200, compiled
    for sm_90a with no GPU: a template instance as ``template_resources`` compiles it, a generated kernel as
    ``generated_resources`` does, with the tiles a launch runs (its plan's, shrunk as a launch shrinks them
    to fit a block's shared memory); ptxas' ``registers`` a thread, ``spill_bytes`` stored in the main path and
    ``shared_bytes`` a block, or None each and, in ``resources``, why (the hand-written Hopper kernels are not
    compiled here)."""
    fused = None if engine.fused is None else with_resources(engine.fused, graph)
    config = engine.config
    if engine.engine == "template":
        used = template_resources(engine.template, config.dtype, config.head_dim, config.save_lse)
    elif engine.engine == "generated":
        used = generated_resources(compiled(graph, config).plan, engine.kind, shared_limit=SHARED_MEMORY_LIMIT)
    else:
        figures = dict.fromkeys(("registers", "spill_bytes", "shared_bytes"))
        return evolve(engine, resources={**figures, "resources": HAND_WRITTEN_RESOURCES}, fused=fused)
    figures = {"registers": used.registers, "spill_bytes": used.spill_bytes, "shared_bytes": used.shared_bytes}
    return evolve(engine, resources={**figures, "resources": None}, fused=fused)
