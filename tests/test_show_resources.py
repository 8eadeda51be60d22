"""``attnfuse show --resources``: each kernel's registers, spill bytes and shared memory on an H100/H200,
compiled with no GPU, next to its engine: a template instance's as ``template_resources`` reports the
instance the runtime itself chooses (``runtime.forward.template_forward``, ``runtime.backward.template_dkdv`` and
``template_dq``), and a generated kernel's within a block's shared memory."""

from __future__ import annotations

import json

import attrs
import pytest

from attnfuse.cli import main
from attnfuse.examples import EXAMPLES
from attnfuse.kernels import verified
from attnfuse.kernels.resources import template_resources
from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT
from attnfuse.plan import KernelConfig
from attnfuse.runtime.backward import template_dkdv, template_dq
from attnfuse.runtime.compiled import compiled
from attnfuse.runtime.forward import template_forward
from attnfuse.runtime.source_cache import CACHE_ENV

FIGURES = ("registers", "spill_bytes", "shared_bytes")
HEAD_DIM = 64
# Under -n one worker runs this module, so its compiles are shared: conftest.ONE_WORKER_MODULES


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A fresh kernel cache and the checked-in record read afresh."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "kernels"))
    verified._verified.cache_clear()
    yield
    verified._verified.cache_clear()


def show_resources(capsys, head_dim: int = HEAD_DIM, *options: str) -> dict:
    code = main(["show", "gpt2", "--json", "--resources", "--arch", "sm90", "--head-dim", str(head_dim), *options])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    return json.loads(captured.out)["kernels"]


def test_template_kernels_report_what_template_resources_compiles_for_the_runtimes_instance(capsys, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    kernels = show_resources(capsys)
    inference = KernelConfig(arch="sm90", dtype="bfloat16", head_dim=HEAD_DIM, head_dim_v=HEAD_DIM, group=1,
                             save_lse=False, fp32_precision="ieee")  # fmt: skip
    training = attrs.evolve(inference, save_lse=True)  # gpt2's softmax saves the lse its backward reads
    graph = EXAMPLES["gpt2"].graph()
    chosen = {
        "forward": (template_forward(compiled(graph, inference).plan).spec, inference),
        "dkdv": (template_dkdv(compiled(graph, training).plan).spec, training),
        "dq": (template_dq(compiled(graph, training).plan).spec, training),
    }
    for kind, (spec, config) in chosen.items():
        entry = kernels[kind]
        assert entry["engine"] == "template" and entry["name"] == spec.name, entry
        used = template_resources(spec, "bfloat16", HEAD_DIM, config.save_lse)
        assert {f: entry[f] for f in FIGURES} == {f: getattr(used, f) for f in FIGURES}, kind
    entry = kernels["decode"]
    assert entry["engine"] == "generated", entry
    assert entry["registers"] > 0 and entry["spill_bytes"] >= 0, entry
    assert 0 < entry["shared_bytes"] <= SHARED_MEMORY_LIMIT, entry


@pytest.mark.parametrize("fact", ["kv_lens", "positions", "varlen"])
@pytest.mark.parametrize("mode", ["all", "off"])
def test_a_call_with_a_fact_reports_each_kernel_s_figures(capsys, monkeypatch, fact, mode):
    """``--kv-lens``, ``--positions``, ``--varlen``: the forward template's instance of such a call (opted in), and
    of a packed call the dK/dV and dQ templates' too; or each generated kernel, which takes the fact's arguments
    (the packed offsets int32, the positions ints)."""
    monkeypatch.setenv(verified.MODE_ENV, mode)
    kernels = show_resources(capsys, HEAD_DIM, f"--{fact.replace('_', '-')}")
    config = KernelConfig(arch="sm90", dtype="bfloat16", head_dim=HEAD_DIM, head_dim_v=HEAD_DIM, group=1,
                          save_lse=False, fp32_precision="ieee", **{fact: True})  # fmt: skip
    training = attrs.evolve(config, save_lse=True)
    graph = EXAMPLES["gpt2"].graph()
    templates = {"forward": (template_forward, config)}
    if fact == "varlen":
        templates |= {"dkdv": (template_dkdv, training), "dq": (template_dq, training)}
    if mode == "all":
        for kind, (instance, plan_config) in templates.items():
            spec = instance(compiled(graph, plan_config).plan).spec
            entry = kernels[kind]
            assert entry["engine"] == "template" and entry["name"] == spec.name, entry
            used = template_resources(spec, "bfloat16", HEAD_DIM, save_lse=plan_config.save_lse)
            assert {f: entry[f] for f in FIGURES} == {f: getattr(used, f) for f in FIGURES}, kind
    generated = [kind for kind in kernels if mode == "off" or kind not in templates]
    for entry in (kernels[kind] for kind in generated):
        assert entry["engine"] == "generated", entry
        assert entry["registers"] > 0 and entry["spill_bytes"] >= 0, entry
        assert 0 < entry["shared_bytes"] <= SHARED_MEMORY_LIMIT, entry


def test_with_the_templates_off_every_kernel_reports_its_generated_figures(capsys, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "off")
    kernels = show_resources(capsys, head_dim=128)
    for entry in kernels.values():
        assert entry["engine"] == "generated", entry
        assert entry["registers"] > 0 and entry["spill_bytes"] >= 0, entry
        assert 0 < entry["shared_bytes"] <= SHARED_MEMORY_LIMIT, entry


def test_the_text_says_the_figures_in_the_engines_section(capsys, monkeypatch):
    monkeypatch.setenv(verified.MODE_ENV, "all")
    kernels = show_resources(capsys)
    code = main(["show", "gpt2", "--resources", "--arch", "sm90", "--head-dim", str(HEAD_DIM)])
    out = capsys.readouterr().out
    engines = out.split("# engines")[1].split("# source")[0]
    assert code == 0
    for kind, entry in kernels.items():
        line = next(line for line in engines.splitlines() if line.strip().startswith(f"{kind}:"))
        assert f"{entry['registers']} registers, {entry['spill_bytes']} spill bytes" in line, line
        assert f"{entry['shared_bytes'] / 1024:.1f} KiB shared memory" in line, line


@pytest.mark.parametrize("arch", [None, "interpreter", "sm80"])
def test_resources_need_the_sm90_arch(capsys, monkeypatch, arch):
    monkeypatch.setattr("attnfuse.cli.show.default_arch", lambda: "interpreter")  # no GPU, as in CI
    options = [] if arch is None else ["--arch", arch]
    code = main(["show", "gpt2", "--json", "--resources", *options])
    err = capsys.readouterr().err
    assert code == 2 and "--resources compiles the kernels for an H100/H200 with no GPU: give --arch sm90" in err
    assert f"not {arch or 'interpreter'!r}" in err


@pytest.mark.parametrize("mode", ["verified", "all"])
def test_a_call_with_dropout_reports_every_kernel(capsys, monkeypatch, mode):
    """`show --dropout --resources`: the kernels with dropout compile for sm90 with their dropout state int64
    and p a float32 scalar; the template instances with dropout run in mode "all", and by default where the
    GPU-verified record holds them. (Head dim 64: test_template_resources compiles the instances at 128.)"""
    monkeypatch.setenv(verified.MODE_ENV, mode)
    code = main(["show", "gpt2", "--json", "--resources", "--arch", "sm90", "--dropout", "--head-dim", str(HEAD_DIM)])
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "", captured.err
    kernels = json.loads(captured.out)["kernels"]
    for kind, entry in kernels.items():
        assert all(entry[f] > 0 for f in ("registers", "shared_bytes")), (kind, entry)
    for kind in ("forward", "dkdv", "dq"):
        entry = kernels[kind]
        assert entry["engine"] == ("template" if mode == "all" or entry["verified"] else "generated"), entry
