"""fuse_rope on Qwen3 and Gemma 3: q_norm and k_norm run inside the kernel (``af.qk_norm`` then ``af.rope``).

Tiny random-weight models (``hf_training.SIZES``), float32 on the CPU, against HF's eager attention: the logits
(padded batch, real tokens), an unpadded training step's gradients (the norms' weights included, which the kernels give)
and greedy generations (with a cache, both norms run in PyTorch and the kernel rotates q only). Gemma 3 has a
sliding (local RoPE base) and a global layer, and scales by 1 + weight. Each test checks that the kernel did the
norm: the attention function got the norms' weights.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse.hf  # noqa: E402
from hf_training import SIZES, padded_batch, tiny_model  # noqa: E402

MODELS = {  # Gemma 3: a sliding layer (window 4 binds at N = 12, local RoPE base) and a global one
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 8},
    ),
}


def _model(family):
    """The family's tiny model, its q_norm/k_norm weights random (HF starts them at 1 or 0: no weight at all)."""
    model = tiny_model(transformers, *MODELS[family])
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data = torch.randn(SIZES["head_dim"]) * 0.5 + norm.weight.data
    return model


def _record_norms(monkeypatch) -> list:
    """Record (norm_eps given, rotate_keys, packed) of each kernel call of attn_implementation="attnfuse"."""
    calls = []
    program = attnfuse.hf.hf_attention

    def recording(q, k, v, bias, cos, sin, scale, window, causal, rotate_keys, *args, **kwargs):
        calls.append((args[4] is not None, rotate_keys, "cu_seqlens_q" in kwargs))
        return program(q, k, v, bias, cos, sin, scale, window, causal, rotate_keys, *args, **kwargs)

    monkeypatch.setattr(attnfuse.hf, "hf_attention", recording)
    return calls


def _step(model, implementation, batch):
    """Loss, logits and every parameter's gradient of one training step (no cache)."""
    ids, mask, labels = batch
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_logits_and_training_step_equal_eager_with_norms_in_kernel(family, monkeypatch):
    """A left-padded batch's logits on its real tokens, and an unpadded batch's training step (a padding row keeps
    no key: eager averages every value there, the kernels give 0 as sdpa does, so padded gradients differ by design)."""
    model = _model(family)
    padded, full = padded_batch(SIZES["vocab_size"]), padded_batch(SIZES["vocab_size"], pads=(0, 0))
    real = padded[1].bool()
    want_logits, _ = _step(model, "eager", padded)
    want_full, want_grads = _step(model, "eager", full)
    calls = _record_norms(monkeypatch)
    attnfuse.hf.fuse_rope(model)
    got_logits, _ = _step(model, "attnfuse", padded)
    got_full, got_grads = _step(model, "attnfuse", full)
    assert calls and all(normed and rotate_keys for normed, rotate_keys, _ in calls)  # q and k normed in the kernel
    torch.testing.assert_close(got_logits[real], want_logits[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_full, want_full, atol=1e-6, rtol=1e-6)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    norms = [name for name in want_grads if "q_norm" in name or "k_norm" in name]
    assert len(norms) == 2 * SIZES["num_hidden_layers"]
    assert all(want_grads[name].abs().max() > 1e-4 for name in norms)  # the weights matter to the loss


@pytest.mark.parametrize("family", sorted(MODELS))
def test_generate_gives_eager_tokens(family, monkeypatch):
    """With a cache, k is stored as HF stores it (normed, rotated): both norms run in PyTorch, the kernel rotates q."""
    model = _model(family).eval()
    ids = torch.randint(0, SIZES["vocab_size"], (1, 10))
    options = dict(max_new_tokens=6, do_sample=False, use_cache=True)
    model.set_attn_implementation("eager")
    want = model.generate(ids, **options)
    calls = _record_norms(monkeypatch)
    attnfuse.hf.fuse_rope(model)
    assert model.generate(ids, **options).tolist() == want.tolist()
    assert calls and all(not normed and not rotate_keys for normed, rotate_keys, _ in calls)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_switched_away_runs_hf_norms(family):
    """A fused model switched to another attn_implementation runs HF's norms and rotation itself."""
    model = _model(family).eval()
    ids = torch.randint(0, SIZES["vocab_size"], (2, 12))
    model.set_attn_implementation("eager")
    want = model(ids).logits
    attnfuse.hf.fuse_rope(model)
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_packed_training_step_equals_norms_in_pytorch(family, monkeypatch):
    """A packed batch (HF's DataCollatorWithFlattening: one row, position_ids restarting per document): with the
    norms in the kernel, loss, logits and every gradient equal those with HF's norms in PyTorch (the packed path,
    which tests/test_hf_packed.py holds to a padded batch under eager)."""
    model = _model(family)
    documents = [torch.randint(0, SIZES["vocab_size"], (n,)) for n in (5, 1, 7)]
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    batch = collator([{"input_ids": d.tolist()} for d in documents])

    def step():
        model.zero_grad()
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return {"logits": out.logits.detach(), **{name: p.grad.clone() for name, p in model.named_parameters()}}

    model.set_attn_implementation("attnfuse")
    want = step()
    calls = _record_norms(monkeypatch)
    attnfuse.hf.fuse_rope(model)
    got = step()
    assert calls and all(normed and packed for normed, _, packed in calls)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
