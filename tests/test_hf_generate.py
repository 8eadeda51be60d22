"""HF generate() through attn_implementation="attnfuse" on a tiny random-weight Llama (float32, CPU): every step
(the prefill, decode steps of one query against the cache, a static cache's unused tail hidden by the mask, a
left-padded batch) gives sdpa's greedy tokens and logits, eagerly and with generate()'s own compile of a static
cache's decode steps; and benchmarks/hf_generate.py runs. Needs transformers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse.hf  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 100
SIZES = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=VOCAB,
)
NEW = 6


def _model():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES)).eval()


def _prompts(B):
    """Random ids (B, 9) and their attention mask; with B=2 the first sequence is 4 tokens shorter, padded on
    the left."""
    ids, mask = torch.randint(1, VOCAB, (B, 9)), torch.ones(B, 9, dtype=torch.long)
    if B == 2:
        mask[0, :4] = 0
        ids[0, :4] = 0
    return ids, mask


def _generate(model, implementation, ids, mask, **options):
    model.set_attn_implementation(implementation)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **options,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


def _compile_config(fullgraph=True):
    """generate()'s compile of a static cache's decode steps, on the CPU (aot_eager: no C++ compiler needed)."""
    config = transformers.CompileConfig(backend="aot_eager", mode="default", fullgraph=fullgraph)
    config._compile_all_devices = True  # generate() compiles off CUDA only when told to
    return config


@pytest.mark.parametrize("B", [1, 2], ids=["B1", "B2-left-padded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_gives_sdpas_tokens_and_logits(cache, B):
    model, (ids, mask) = _model(), _prompts(B)
    options = dict(cache_implementation=cache, disable_compile=True)
    want_tokens, want_logits = _generate(model, "sdpa", ids, mask, **options)
    got_tokens, got_logits = _generate(model, "attnfuse", ids, mask, **options)
    assert got_tokens.tolist() == want_tokens.tolist()
    assert got_logits.shape == (B, NEW, VOCAB)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)


def test_compiled_static_cache_generate_gives_sdpas_tokens_and_logits():
    """generate() with a static cache compiles the model's call (fullgraph: a graph break raises) and runs
    every decode step through it; attnfuse's custom op there gives sdpa's tokens and logits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, (ids, mask) = _model(), _prompts(2)
    want_tokens, want_logits = _generate(model, "sdpa", ids, mask, cache_implementation="static", disable_compile=True)
    before = counters["stats"]["unique_graphs"]
    got_tokens, got_logits = _generate(
        model, "attnfuse", ids, mask, cache_implementation="static", compile_config=_compile_config()
    )
    assert counters["stats"]["unique_graphs"] > before  # the decode steps ran compiled
    assert got_tokens.tolist() == want_tokens.tolist()
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)


TINY = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--intermediate",
    "128",
    "--vocab",
    str(VOCAB),
    "--prompt",
    "8",
    "--new-tokens",
    "3",
    "--batch",
    "2",
    "--warmup",
    "1",
    "--runs",
    "1",
    "--compile-backend",
    "aot_eager",
    "--compile-mode",
    "default",
    "--fullgraph",
]


def test_benchmark_script_runs_tiny_and_writes_its_section(tmp_path):
    """benchmarks/hf_generate.py on the tiny model, both modes: a row per mode and implementation, the
    compiled rows without graph breaks, and its marked section written, the rest of the page untouched."""
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n<!-- BEGIN hf_generate -->\nold\n<!-- END hf_generate -->\nafter\n")
    env = {**os.environ, "ATTNFUSE_CACHE_DIR": str(tmp_path / "kernels")}
    argv = ["benchmarks/hf_generate.py", *TINY, "--markdown-section", str(page)]
    run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["eager"], ["compiled"])]
    assert [row[:3] for row in rows] == [
        ["eager", "2", "sdpa"],
        ["eager", "2", "attnfuse"],
        ["compiled", "2", "sdpa"],
        ["compiled", "2", "attnfuse"],
    ], run.stdout
    assert [row[8] for row in rows] == ["—", "—", "0", "0"]  # graph breaks
    assert all(float(row[3]) > 0 for row in rows)  # tokens/s
    text = page.read_text()
    assert text.startswith("# Page\n\n<!-- BEGIN hf_generate -->\n## HF generate() end to end") and text.endswith(
        "<!-- END hf_generate -->\nafter\n"
    )
    assert f"python3 {' '.join(argv)}" in text
    assert "\n| compiled | 2 | attnfuse | " in text and "old" not in text
