"""Which engine runs each kernel of a call, as ``attnfuse show`` reports it, in the runtime's order of choice
(``runtime/forward.py``, ``runtime/backward.py``): a Hopper template instance (``attnfuse/kernels``) where the
templates can run the kernel and ``verified.chosen`` chooses it, else the hand-written Hopper kernel where
``plan.hopper`` serves the forward and dK/dV, else the generated Triton kernel."""

from __future__ import annotations

from attrs import evolve, frozen

from .. import ir
from ..kernels.instance import TEMPLATE_KINDS
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
        return head if self.reason is None else f"{head} — {self.reason}"


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
    plan for transformed rows, ``Plan.hoisted_config``), each with the fused one shorter calls run (packed
    calls, ``KernelConfig.varlen``, never hoist)."""
    engines = {}
    for kind in TEMPLATE_KINDS:
        plan = compiled(graph, training if kind in ("dkdv", "dq") else inference).plan
        engine = kernel_engine(plan, kind)
        if "transform" in plan.kernels and kind in HOISTED_KINDS and not plan.config.varlen:  # packed: never
            hoisted = kernel_engine(compiled(graph, plan.hoisted_config).plan, kind)
            least = (HOIST_MIN_QUERY_BLOCKS - 1) * plan.kernels[
                "forward"
            ].tiles.block_m + 1  # worth_hoisting's least Nq
            engine = evolve(hoisted, hoisted=True, when=f"calls with at least {least} queries", fused=engine)
        engines[kind] = engine
    return engines
