"""fuse_rope on GPT-NeoX and GPT-J (tiny random-weight models, float32, CPU). GPT-NeoX rotates the first
rotary_ndims columns of each head (``partial_rotary_factor``, Pythia's rotary_pct), GPT-J the interleaved pairs
of its first rotary_dim columns; the kernel then does (``af.rope(..., rotary_dim=..., interleaved=...)``).
Logits, greedy generations and a training step's gradients equal eager's. Needs transformers
(``pip install -e ".[hf]"``)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse.hf  # noqa: E402
from hf_training import check_fuse_rope_equals_eager  # noqa: E402

HEAD = 16  # head dim of every model here: 4 heads of a hidden size of 64


def _model(family: str, rotary: int):
    """A tiny GPT-NeoX or GPT-J rotating ``rotary`` of each head's 16 columns."""
    if family == "gpt_neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=64,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=128,
            vocab_size=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary / HEAD},
        )
        return transformers.GPTNeoXForCausalLM(config).eval()
    config = transformers.GPTJConfig(
        vocab_size=128,
        n_positions=64,
        n_embd=64,
        n_layer=2,
        n_head=4,
        rotary_dim=rotary,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPTJForCausalLM(config).eval()


def _gradients(model, implementation, ids):
    model.set_attn_implementation(implementation)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


CASES = [("gpt_neox", 4), ("gpt_neox", 8), ("gpt_neox", 16), ("gptj", 4), ("gptj", 16)]


@pytest.mark.parametrize("family, rotary", CASES, ids=[f"{f}-rotary{r}" for f, r in CASES])
def test_fuse_rope_logits_gradients_and_generation_equal_eager(family, rotary, monkeypatch):
    model, ids = _model(family, rotary), torch.randint(0, 128, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[0, :6] = 0  # left padded
    calls = []  # (rotate_keys, rotary_dim, interleaved) of each call with tables
    program = attnfuse.hf.hf_attention
    monkeypatch.setattr(
        attnfuse.hf,
        "hf_attention",
        lambda *a, **kw: (a[4] is not None and calls.append(a[9:10] + a[12:14])) or program(*a, **kw),
    )
    check_fuse_rope_equals_eager(model, ids, mask, _gradients, atol=1e-6)
    rotary_dim = None if rotary == HEAD else rotary  # the tables' width, or all of D
    interleaved = family == "gptj"
    assert (True, rotary_dim, interleaved) in calls  # the kernel rotated q and k (training)
    if family == "gpt_neox":  # with a cache, the keys HF rotated as it stored them, and q in the kernel
        assert (False, rotary_dim, interleaved) in calls
    assert set(calls) <= {(True, rotary_dim, interleaved), (False, rotary_dim, interleaved)}


@pytest.mark.parametrize("family", ["gpt_neox", "gptj"])
def test_switched_back_to_eager_runs_hf_rotation(family):
    """A model switched back to eager after fuse_rope runs HF's forward, with HF's rotation, unchanged."""
    model, ids = _model(family, 4), torch.randint(0, 128, (1, 12))
    model.set_attn_implementation("eager")
    want = model(ids).logits
    attnfuse.hf.fuse_rope(model)
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(ids).logits, want, atol=0, rtol=0)
