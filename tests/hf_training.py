"""What the HF training tests share: a left-padded batch and one training step's results (tiny models, CPU)."""

import torch


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
