"""``attnfuse show --json`` and the text's engines section: which engine runs each kernel of a call (a Hopper
template instance or the generated kernel) and why, checked against the runtime's own choice
(``runtime.forward.template_forward``, ``runtime.backward.template_dkdv`` and ``template_dq``,
``runtime.hoisted.worth_hoisting``)."""

from __future__ import annotations

import json
import re

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.cli import main
from attnfuse.examples import EXAMPLES
from attnfuse.kernels import verified
from attnfuse.kernels.instance import TEMPLATE_KINDS
from attnfuse.plan import KernelConfig
from attnfuse.runtime.backward import template_dkdv, template_dq
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.forward import template_forward
from attnfuse.runtime.hoisted import worth_hoisting
from attnfuse.runtime.source_cache import CACHE_ENV

ENGINES = {"template", "generated"}
FIELDS = {"engine", "name", "reason", "template_available", "verified", "instance", "hoisted"}


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.causal(af.additive_bias(af.scaled_dot_product(q, k), bias))) @ v


@af.attention
def sinks_window(q, k, v, sinks, left=3):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), left), sinks) @ v


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A fresh kernel cache, the default template mode, and the checked-in record read afresh."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.delenv(verified.MODE_ENV, raising=False)
    verified._verified.cache_clear()
    yield
    verified._verified.cache_clear()


@pytest.fixture
def empty_record(tmp_path, monkeypatch):
    record = tmp_path / "verified.json"
    record.write_text(json.dumps({"about": "test", "run": None, "instances": []}))
    monkeypatch.setattr(verified, "RECORD", record)
    verified._verified.cache_clear()
    return record


def show_json(capsys, program: str, *options: str) -> dict:
    code = main(["show", program, "--json", *options])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    report = json.loads(captured.out)
    assert set(report["kernels"]) == set(TEMPLATE_KINDS)
    for entry in report["kernels"].values():
        assert FIELDS <= set(entry) and entry["engine"] in ENGINES
        assert (entry["reason"] is None) == (entry["engine"] == "template")
    return report


def runtime_forward_plan(name: str, head_dim: int, dtype: str = "bfloat16", arch: str = "sm90"):
    """The plan whose forward a long call of example ``name`` runs (the hoisted one where it hoists), and
    the fused forward's compiled kernels."""
    config = KernelConfig(
        arch=arch, dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, group=1, save_lse=False, fp32_precision="ieee"
    )
    kernels = compiled(EXAMPLES[name].graph(), config)
    return (kernels.hoisted_kernels.plan if "transform" in kernels.plan.kernels else kernels.plan), kernels


CASES = [(name, d) for name in ("gpt2", "llama") for d in (64, 128)]


@pytest.mark.parametrize("name, head_dim", CASES)
def test_forward_template_available_on_sm90_and_runs_with_templates_all(capsys, monkeypatch, name, head_dim):
    options = ("--arch", "sm90", "--dtype", "bfloat16", "--head-dim", str(head_dim))
    monkeypatch.setenv(verified.MODE_ENV, "all")
    report = show_json(capsys, name, *options)
    forward = report["kernels"]["forward"]
    plan, kernels = runtime_forward_plan(name, head_dim)
    chosen = template_forward(plan)  # the runtime's own choice, with ATTNFUSE_TEMPLATES=all
    assert chosen is not None and report["templates"] == "all"
    assert forward["template_available"] is True and forward["engine"] == "template"
    assert forward["instance"] == chosen.key and forward["name"] == chosen.spec.name
    assert forward["verified"] is verified.is_verified(chosen.key)
    assert forward["hoisted"] is ("transform" in kernels.plan.kernels)
    if forward["hoisted"]:  # llama: rope is hoisted for long calls; shorter ones run the transform in-kernel
        fused = forward["fused"]
        assert fused["engine"] == "generated" and fused["template_available"] is False
        assert fused["reason"] == kernels.plan.templates.reasons["forward"] and "qk transform" in fused["reason"]
        assert fused["name"] == kernels.plan.kernels["forward"].name
        queries = int(re.fullmatch(r"calls with at least (\d+) queries", forward["when"]).group(1))
        assert worth_hoisting(kernels.forward, queries) and not worth_hoisting(kernels.forward, queries - 1)
    else:
        assert "fused" not in forward


@pytest.mark.parametrize("name, head_dim", CASES)
def test_an_unverified_instance_falls_back_by_default(capsys, empty_record, name, head_dim):
    report = show_json(capsys, name, "--arch", "sm90", "--dtype", "bfloat16", "--head-dim", str(head_dim))
    forward = report["kernels"]["forward"]
    plan, _ = runtime_forward_plan(name, head_dim)
    assert template_forward(plan) is None  # the runtime runs no template either
    assert report["templates"] == "verified"
    assert forward["template_available"] is True and forward["verified"] is False
    assert forward["engine"] != "template" and "not verified" in forward["reason"]
    assert verified.MODE_ENV + "=all" in forward["reason"]
    # the runtime's next choice: the generated kernel
    assert forward["engine"] == "generated" and forward["name"] == plan.kernels["forward"].name
    # the backward (its plan saves the log-sum-exp): the dQ and dK/dV templates' instances are not verified
    # either, so the generated dQ kernel runs, then the generated dK/dV kernel
    training = compiled(plan.graph, attrs.evolve(plan.config, save_lse=True)).plan
    assert "dkdv" in training.templates.kernels and template_dkdv(training) is None
    assert "dq" in training.templates.kernels and template_dq(training) is None
    for kind in ("dkdv", "dq"):
        entry = report["kernels"][kind]
        assert entry["engine"] == "generated" and entry["name"] == training.kernels[kind].name, entry
        assert entry["template_available"] is True and entry["verified"] is False
        assert "not verified" in entry["reason"]
        assert entry["hoisted"] is forward["hoisted"]


@pytest.mark.parametrize("name, head_dim", CASES)
def test_the_dq_template_is_reported_where_the_backward_runs_it(capsys, monkeypatch, name, head_dim):
    """With ATTNFUSE_TEMPLATES=all, show's dq engine is the template, the instance the runtime's own choice
    (``template_dq``) names, beside the dK/dV instance."""
    monkeypatch.setenv(verified.MODE_ENV, "all")
    report = show_json(capsys, name, "--arch", "sm90", "--dtype", "bfloat16", "--head-dim", str(head_dim))
    plan, _ = runtime_forward_plan(name, head_dim)
    training = compiled(plan.graph, attrs.evolve(plan.config, save_lse=True)).plan
    chosen = template_dq(training)
    entry = report["kernels"]["dq"]
    assert chosen is not None and entry["engine"] == "template" and entry["reason"] is None
    assert entry["instance"] == chosen.key and entry["name"] == chosen.spec.name and chosen.key.startswith("dq/")
    assert entry["verified"] is verified.is_verified(chosen.key)
    assert report["kernels"]["dkdv"]["engine"] == "template"


def test_a_verified_instance_runs_by_default(capsys, tmp_path, monkeypatch, empty_record):
    """An instance the record lists runs without opting in, and is reported verified."""
    before = show_json(capsys, "gpt2", "--arch", "sm90", "--head-dim", "64")["kernels"]["forward"]
    empty_record.write_text(json.dumps({"about": "test", "run": None, "instances": [{"key": before["instance"]}]}))
    verified._verified.cache_clear()
    plan, _ = runtime_forward_plan("gpt2", 64)
    assert template_forward(plan) is not None
    after = show_json(capsys, "gpt2", "--arch", "sm90", "--head-dim", "64")["kernels"]["forward"]
    assert after["engine"] == "template" and after["verified"] is True and after["reason"] is None
    assert after["instance"] == before["instance"]


@pytest.mark.parametrize(
    "options, words",
    [
        (("--arch", "sm80"), r"built for sm90 \(Hopper\), not sm80"),
        (("--arch", "sm90", "--dtype", "float32"), r"takes float16, bfloat16, float8_e4m3fn, float8_e5m2, not float32"),
        (("--arch", "interpreter"), r"not interpreter"),
        (("--arch", "sm90", "--head-dim", "48"), r"head dims .*not 48"),
    ],
)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_program_the_template_cannot_run_reports_the_capability_reason(capsys, monkeypatch, name, options, words):
    monkeypatch.setenv(verified.MODE_ENV, "all")  # opting in changes nothing where the template cannot run
    report = show_json(capsys, name, *options)
    forward = report["kernels"]["forward"]
    for entry in filter(None, (forward, forward.get("fused"))):  # llama: the hoisted forward and the fused one
        assert entry["engine"] != "template" and entry["template_available"] is False
        assert entry["instance"] is None and entry["verified"] is False
        assert re.search(words, entry["reason"]), entry["reason"]


@pytest.mark.parametrize(
    "program, extra, options",
    [
        ("biased", lambda n: {"bias": torch.randn(1, 2, n, n)}, ()),
        ("sinks_window", lambda n: {"sinks": torch.randn(2)}, ("--arg", "left=5")),
    ],
)
@pytest.mark.parametrize("mode", ["verified", "all"])
def test_a_program_with_runtime_tensors_reports_its_engines(capsys, monkeypatch, program, extra, options, mode):
    """Runtime tensors are traced as placeholders: the report is the plan a call with real tensors compiles."""
    monkeypatch.setenv(verified.MODE_ENV, mode)
    report = show_json(capsys, f"{__name__}:{program}", "--arch", "sm90", "--head-dim", "64", *options)
    runtime = [n for n in extra(8) if n not in dict(o.split("=") for o in options[1::2])]
    assert all(report["arguments"][n] == "<runtime input>" for n in runtime)
    values = {**extra(8), **{n: int(v) for n, v in (o.split("=") for o in options[1::2])}}
    config = KernelConfig(
        arch="sm90", dtype="bfloat16", head_dim=64, head_dim_v=64, group=1, save_lse=False, fp32_precision="ieee"
    )
    plan = compiled(globals()[program].graph(**values), config).plan
    forward, chosen = report["kernels"]["forward"], template_forward(plan)
    assert (forward["engine"] == "template") is (chosen is not None)
    assert forward["template_available"] is ("forward" in plan.templates.kernels)
    if forward["template_available"]:
        assert forward["instance"] == verified.record_key(plan.templates.kernels["forward"], "bfloat16", 64)
    else:
        assert forward["reason"] == plan.templates.reasons["forward"]
    for kind in ("dkdv", "dq", "decode"):
        entry = report["kernels"][kind]
        if kind in plan.templates.kernels:  # the dK/dV template serves both programs
            assert entry["template_available"] is True and (entry["engine"] == "template") is (mode == "all")
        else:
            assert entry["reason"] == plan.templates.reasons[kind]


def test_text_output_names_each_kernels_engine(capsys, monkeypatch, empty_record):
    def engines(*options: str) -> list[str]:
        code = main(["show", "gpt2", "--arch", "sm90", "--head-dim", "128", *options])
        out = capsys.readouterr().out
        assert code == 0
        section = out.split("# engines    ", 1)[1].split("\n# ", 1)[0].splitlines()
        return [line.strip() for line in section]

    lines = engines()
    assert lines[0] == "(ATTNFUSE_TEMPLATES=verified)" and len(lines) == 1 + len(TEMPLATE_KINDS)
    assert lines[1].startswith("forward: generated — ")
    assert "— instance not verified on a GPU (ATTNFUSE_TEMPLATES=all opts in)" in lines[1]
    assert lines[4].startswith("decode: generated — ")
    monkeypatch.setenv(verified.MODE_ENV, "all")
    lines = engines()
    assert lines[1] == "forward: template (not verified, ATTNFUSE_TEMPLATES=all)"
    monkeypatch.setenv(verified.MODE_ENV, "off")
    lines = engines()
    assert lines[1] == "forward: generated — the templates are turned off (ATTNFUSE_TEMPLATES=off)"


def test_text_output_of_a_hoisting_program_says_both_forwards(capsys, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    code = main(["show", "llama", "--arch", "sm90", "--head-dim", "64"])
    out = capsys.readouterr().out
    assert code == 0
    assert re.search(
        r"\n    forward, calls with at least \d+ queries \(qk transforms hoisted into a pass\): template \(", out
    )
    assert "\n    forward, shorter calls (qk transforms in the kernel): generated — a qk transform" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--json", "--kernel", "dq"], "--json reports every kernel of a call"),
        (["--json", "--source-only"], "not allowed with argument"),
    ],
)
def test_json_refuses_options_that_pick_one_kernel(capsys, argv, message):
    code = main(["show", "gpt2", "--arch", "sm90", *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err


def test_a_bad_templates_mode_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "sometimes")
    code = main(["show", "gpt2", "--arch", "sm90", "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "ATTNFUSE_TEMPLATES must be one of verified, all, off, or a comma-separated list" in captured.err
    assert "got 'sometimes'" in captured.err


@af.attention
def sparse_causal(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.causal(af.scaled_dot_product(q, k)), block_mask)) @ v


@pytest.mark.parametrize("mode", ["verified", "all"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_block_sparse_call_names_the_templates_and_their_block_size_condition(capsys, monkeypatch, mode, head_dim):
    """A program whose mask lists its blocks has a forward instance (GPU-verified, so chosen in either mode),
    which a call runs where its block size is one the template follows; at head dim 64 dK/dV and dQ instances
    (chosen where the record holds them, and when opted in) under the same condition; at 256 the backward
    templates have no tiles."""
    monkeypatch.setenv(verified.MODE_ENV, mode)
    report = show_json(capsys, f"{__name__}:sparse_causal", "--arch", "sm90", "--head-dim", str(head_dim))
    mask = af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 256, 256)
    config = KernelConfig(
        arch="sm90",
        dtype="bfloat16",
        head_dim=head_dim,
        head_dim_v=head_dim,
        group=1,
        save_lse=False,
        fp32_precision="ieee",
    )
    plan = compiled(sparse_causal.graph(block_mask=mask), config).plan
    forward, spec = report["kernels"]["forward"], plan.templates.kernels["forward"]
    assert forward["template_available"] is True
    assert forward["instance"] == verified.record_key(spec, "bfloat16", head_dim)
    assert forward["engine"] == "template" and template_forward(plan) is not None  # in the GPU-verified record
    assert forward["name"] == spec.name
    assert "multiple of 128" in forward["condition"]
    dkdv, dq = report["kernels"]["dkdv"], report["kernels"]["dq"]
    if head_dim == 64:
        training = compiled(sparse_causal.graph(block_mask=mask), attrs.evolve(config, save_lse=True)).plan
        for kind, engine in (("dkdv", dkdv), ("dq", dq)):
            assert engine["template_available"] is True and "multiple of 128" in engine["condition"]
            assert engine["instance"] == verified.record_key(training.templates.kernels[kind], "bfloat16", head_dim)
            chosen = mode == "all" or verified.is_verified(engine["instance"])
            assert engine["engine"] == ("template" if chosen else "generated")
    else:  # no tiles for the head dim
        for engine in (dkdv, dq):
            assert engine["engine"] == "generated" and engine["template_available"] is False
            assert "condition" not in engine


@pytest.mark.parametrize("fact, words", [("kv_lens", "kv_lens"), ("positions", "positions"), ("varlen", "cu_seqlens")])
@pytest.mark.parametrize("name, head_dim", [("gpt2", 64), ("llama", 128)])
def test_a_call_with_a_fact_reports_the_forward_template(capsys, monkeypatch, fact, words, name, head_dim):
    """``--kv-lens``, ``--positions``, ``--varlen``: the forward template's instance of such a call, the runtime's
    own choice (the hoisted one where the call hoists; with kv_lens, rope stays in the kernel and falls back),
    and the dK/dV template's: its instance of a packed call, its reason for the others."""
    monkeypatch.setenv(verified.MODE_ENV, "all")
    report = show_json(capsys, name, "--arch", "sm90", "--head-dim", str(head_dim), f"--{fact.replace('_', '-')}")
    assert report["config"][fact] is True
    forward, dkdv = report["kernels"]["forward"], report["kernels"]["dkdv"]
    config = KernelConfig(
        arch="sm90", dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim, group=1, save_lse=False,
        fp32_precision="ieee", **{fact: True},
    )  # fmt: skip
    kernels = compiled(EXAMPLES[name].graph(), config)
    hoists = "transform" in kernels.plan.kernels
    chosen = template_forward(kernels.hoisted_kernels.plan if hoists else kernels.plan)
    if chosen is None:  # rope inside the kernel: kv_lens (no pass takes per-sequence lengths)
        assert name == "llama" and fact == "kv_lens" and "qk transform" in forward["reason"]
    else:
        assert forward["engine"] == "template" and forward["instance"] == chosen.key and forward["reason"] is None
        assert forward["name"] == chosen.spec.name and forward["hoisted"] is hoists
    if fact == "varlen":
        assert dkdv["engine"] == "template" and dkdv["reason"] is None
    else:
        assert dkdv["engine"] == "generated" and words in dkdv["reason"] and "dK/dV" in dkdv["reason"]


COMBINED = [("--kv-lens", "--positions"), ("--kv-lens", "--varlen"), ("--positions", "--varlen")]


@pytest.mark.parametrize("options", COMBINED)
def test_facts_no_call_combines_are_refused(capsys, options):
    code = main(["show", "gpt2", "--arch", "sm90", "--json", *options])
    err = capsys.readouterr().err
    assert code == 2 and " and ".join(options) in err and "cannot be combined" in err
