"""What the HF training tests share: a left-padded batch and one training step's results (tiny models, CPU)."""

import pytest
import torch

SIZES = dict(  # a tiny model: two layers, GQA (4 query heads, 2 kv heads), head dim 8
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    intermediate_size=64,
    vocab_size=64,
    head_dim=8,
)


def tiny_model(transformers, config_name: str, model_name: str, extra: dict):
    """A random-weight model ``model_name`` of ``SIZES`` (and ``extra``) in training mode, with no cache; the test
    is skipped where the installed transformers has no such model."""
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    config = getattr(transformers, config_name)(**SIZES, **extra, use_cache=False)
    return getattr(transformers, model_name)(config).train()


def padded_batch(vocab_size: int, B: int = 2, N: int = 12, pads: tuple[int, ...] = (5, 2)):
    """Token ids (B, N), HF's attention mask (0 on each sequence's first ``pads[b]`` positions: left padding)
    and labels (the ids, -100 on padding)."""
    ids = torch.randint(0, vocab_size, (B, N))
    mask = torch.ones(B, N, dtype=torch.long)
    for b, pad in enumerate(pads):
        mask[b, :pad] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def training_step(model, implementation: str, batch) -> dict[str, torch.Tensor]:
    """One training step's loss, logits (B, N, V) and every parameter gradient under ``implementation``."""
    ids, mask, labels = batch
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "logits": out.logits.detach(),
        **{name: p.grad.clone() for name, p in model.named_parameters()},
    }


def check_fuse_rope_equals_eager(model, ids, mask, gradients, atol: float) -> None:
    """``attnfuse.hf.fuse_rope(model)`` against eager on ``ids`` (B, N) with ``mask``: the logits of the real
    tokens (within ``atol``), a training step's gradients (``gradients(model, implementation, ids)``; no cache,
    so the kernel rotates q and k) and a greedy generation (with a cache)."""
    import attnfuse.hf

    model.set_attn_implementation("eager")
    want_logits = model(ids, attention_mask=mask).logits
    model.train()
    want_grads = gradients(model, "eager", ids)
    model.eval()
    want_tokens = model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False)
    attnfuse.hf.fuse_rope(model)
    assert model.config._attn_implementation == "attnfuse"
    real = mask.bool()
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[real], want_logits[real], atol=atol, rtol=atol)
    model.train()
    model.config.use_cache = False
    got_grads = gradients(model, "attnfuse", ids)
    model.config.use_cache = True
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    model.eval()
    assert model.generate(ids[:1, :10], max_new_tokens=5, do_sample=False).tolist() == want_tokens.tolist()
