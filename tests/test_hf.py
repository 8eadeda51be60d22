"""The HuggingFace backend on tiny random-weight models (float32, CPU): attn_implementation="attnfuse" gives
eager's logits, gradients and greedy generations, with padding, sliding windows and GQA; fuse_rope; custom
programs. Needs transformers (``pip install -e ".[hf]"``)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse as af  # noqa: E402
import attnfuse.hf  # noqa: E402
from attnfuse.errors import InputError  # noqa: E402
from hf_training import check_fuse_rope_equals_eager  # noqa: E402

SIZES = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=128,
    vocab_size=128,
)


def _model(family="llama", **extra):
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }[family]
    return model_class(config_class(**SIZES, **extra)).eval()


def _logits(model, implementation, ids, mask=None):
    model.set_attn_implementation(implementation)
    return model(ids, attention_mask=mask).logits


def _padding(B=2, N=20):
    mask = torch.ones(B, N, dtype=torch.long)
    mask[0, :6] = 0  # left padded
    mask[1, 13:] = 0  # right padded
    return mask


def test_import_attnfuse_does_not_import_transformers():
    code = "import sys, attnfuse; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_llama_logits_equal_eager():
    model, ids = _model(), torch.randint(0, 128, (2, 20))
    torch.testing.assert_close(_logits(model, "attnfuse", ids), _logits(model, "eager", ids), atol=1e-5, rtol=1e-5)


def test_padded_batch_gives_eager_logits_on_real_tokens():
    model, ids, mask = _model(), torch.randint(0, 128, (2, 20)), _padding()
    got, want = _logits(model, "attnfuse", ids, mask), _logits(model, "eager", ids, mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert got.isfinite().all()
    unpadded = _logits(model, "eager", ids)
    assert (unpadded[0, 6:] - want[0, 6:]).abs().max() > 1e-3  # the mask changes the result: it was honoured


def test_mistral_sliding_window_equals_eager():
    model, ids = _model("mistral", sliding_window=6), torch.randint(0, 128, (1, 20))
    want = _logits(model, "eager", ids)
    torch.testing.assert_close(_logits(model, "attnfuse", ids), want, atol=1e-5, rtol=1e-5)
    model.config.sliding_window = None
    assert (_logits(model, "eager", ids) - want).abs().max() > 1e-3  # the window binds at this length


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_gives_eager_greedy_tokens(cache):
    model, ids, mask = _model(), torch.randint(0, 128, (2, 12)), _padding(N=12)
    mask[1] = 1  # generation pads on the left
    options = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation=cache)
    model.set_attn_implementation("eager")
    want = model.generate(ids, **options)
    model.set_attn_implementation("attnfuse")
    got = model.generate(ids, **options)
    assert got.tolist() == want.tolist()


def _gradients(model, implementation, ids, mask=None):
    """Parameter gradients of a cross-entropy loss over the real tokens' logits (targets: the next tokens)."""
    model.set_attn_implementation(implementation)
    model.zero_grad()
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    logits = model(ids, attention_mask=mask).logits
    torch.nn.functional.cross_entropy(logits[real], ids.roll(-1, dims=1)[real]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_training_step_gradients_equal_eager():
    model, ids, mask = _model(), torch.randint(0, 128, (2, 20)), _padding()
    model.train()
    got, want = _gradients(model, "attnfuse", ids, mask), _gradients(model, "eager", ids, mask)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fuse_rope_logits_gradients_and_generation_equal_eager(family, monkeypatch):
    model, ids, mask = _model(family), torch.randint(0, 128, (2, 20)), _padding()
    fused_calls = []
    tables = attnfuse.hf._rope_tables
    monkeypatch.setattr(attnfuse.hf, "_rope_tables", lambda *a: fused_calls.append(a[0][2]) or tables(*a))
    check_fuse_rope_equals_eager(model, ids, mask, _gradients, atol=1e-5)
    assert True in fused_calls and False in fused_calls  # the kernel rotated keys (training) and only q (cache)


def test_registered_program_runs_the_model_and_must_honour_masks():
    @af.attention
    def causal_biased(q, k, v, scale, bias):
        s = af.scaled_dot_product(q, k, scale=scale)
        s = af.causal(s) if bias is None else af.additive_bias(s, bias)
        return af.softmax(s) @ v

    @af.attention
    def causal_only(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v

    attnfuse.hf.register("causal_biased", causal_biased)
    attnfuse.hf.register("causal_only", causal_only)
    model, ids, mask = _model(), torch.randint(0, 128, (2, 20)), _padding()
    real = mask.bool()
    torch.testing.assert_close(
        _logits(model, "causal_biased", ids, mask)[real], _logits(model, "eager", ids, mask)[real], atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(_logits(model, "causal_only", ids), _logits(model, "eager", ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="takes no 'bias' argument"):
        _logits(model, "causal_only", ids, mask)
    with pytest.raises(InputError, match="must be an @af.attention program"):
        attnfuse.hf.register("not_a_program", lambda q, k, v: q)


def test_gemma2_softcapping_equals_eager():
    model = _model("gemma2", head_dim=16, attn_logit_softcapping=0.001, sliding_window=6)
    ids, mask = torch.randint(0, 128, (2, 20)), _padding()
    real = mask.bool()
    want = _logits(model, "eager", ids, mask)
    torch.testing.assert_close(_logits(model, "attnfuse", ids, mask)[real], want[real], atol=1e-5, rtol=1e-5)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert (_logits(model, "eager", ids, mask) - want)[real].abs().max() > 1e-4  # the cap binds


def test_fuse_rope_refuses_other_families():
    model = _model("gemma2", head_dim=16)
    with pytest.raises(InputError, match="fuse_rope supports the attention of llama, mistral, qwen2, qwen3"):
        attnfuse.hf.fuse_rope(model)


@pytest.mark.parametrize("fused", [False, True], ids=["attnfuse", "fuse_rope"])
def test_compiled_model_fullgraph_equals_eager(fused):
    model, ids, mask = _model(use_cache=False), torch.randint(0, 128, (2, 20)), _padding()
    want = _logits(model, "eager", ids, mask)
    model.set_attn_implementation("attnfuse")
    if fused:
        attnfuse.hf.fuse_rope(model)
    compiled = torch.compile(
        lambda ids, mask: model(ids, attention_mask=mask).logits, backend="aot_eager", fullgraph=True
    )
    real = mask.bool()
    torch.testing.assert_close(compiled(ids, mask)[real], want[real], atol=1e-5, rtol=1e-5)


def test_layer_steps_script_imports_table_9s_layer():
    """benchmarks/layer_steps.py (GPU only: a profile and timings of Table 9's training steps) imports its
    layer and implementations from hf_layer.py; its help runs anywhere."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "layer_steps.py"
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--timing" in run.stdout and "--profile" in run.stdout
