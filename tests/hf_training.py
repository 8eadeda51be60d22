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
