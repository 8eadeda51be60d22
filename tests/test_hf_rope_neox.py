"""fuse_rope on GPT-NeoX (tiny random-weight models, float32, CPU): its attention rotates only the first
rotary_ndims columns of each head (``partial_rotary_factor``, Pythia's rotary_pct), which the kernel then does
(``af.rope(..., rotary_dim=...)``). Logits, greedy generations and a training step's gradients equal eager's.
Needs transformers (``pip install -e ".[hf]"``)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse.hf  # noqa: E402

SIZES = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=128)


def _model(partial_rotary_factor: float):
    """A GPT-NeoX of head size 16 rotating 16 · partial_rotary_factor columns of each head."""
    config = transformers.GPTNeoXConfig(
        **SIZES,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
    )
    return transformers.GPTNeoXForCausalLM(config).eval()


def _padding(B=2, N=20):
    mask = torch.ones(B, N, dtype=torch.long)
    mask[0, :6] = 0  # left padded
    return mask


def _gradients(model, implementation, ids):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("factor", [0.25, 0.5, 1.0])
def test_fuse_rope_logits_gradients_and_generation_equal_eager(factor, monkeypatch):
    model, ids, mask = _model(factor), torch.randint(0, 128, (2, 20)), _padding()
    assert model.gpt_neox.layers[0].attention.rotary_ndims == int(16 * factor)
    calls = []  # (rotate_keys, rotary_dim) of each fused call
    program = attnfuse.hf.hf_attention
    monkeypatch.setattr(attnfuse.hf, "hf_attention", lambda *a, **kw: calls.append((a[9], a[12])) or program(*a, **kw))
    model.set_attn_implementation("eager")
    want_logits = model(ids, attention_mask=mask).logits
    model.train()
    want_grads = _gradients(model, "eager", ids)
    model.eval()
    want_tokens = model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False)
    attnfuse.hf.fuse_rope(model)
    assert model.config._attn_implementation == "attnfuse"
    real = mask.bool()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], want_logits[real], atol=1e-6, rtol=1e-6)
    model.train()
    model.config.use_cache = False  # training: no cache, so the kernel rotates q and k
    got_grads = _gradients(model, "attnfuse", ids)
    model.config.use_cache = True
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    model.eval()
    assert model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False).tolist() == want_tokens.tolist()
    rotary_dim = None if factor == 1.0 else int(16 * factor)  # the tables' width, or all of D
    assert set(calls) == {
        (True, rotary_dim),
        (False, rotary_dim),
    }  # keys rotated by the kernel (training), by HF (cache)


def test_unfused_model_runs_hf_rotation():
    """A NeoX model switched back to eager after fuse_rope runs HF's forward unchanged."""
    model, ids = _model(0.25), torch.randint(0, 128, (1, 12))
    model.set_attn_implementation("eager")
    want = model(ids).logits
    attnfuse.hf.fuse_rope(model)
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
