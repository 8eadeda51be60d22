"""HuggingFace's left-padded training recipe (labels = input ids, -100 on padding) under
attn_implementation="attnfuse": loss, logits at every position and every parameter gradient equal HF's
"sdpa" backend's.

The last padding position predicts the first real token, so its loss counts, and its query row keeps no key:
HF's sdpa mask leaves it all False (transformers 5.17 and 5.24), and torch's SDPA gives it output 0 and no
gradient (``_safe_softmax``, torch >= 2.5), as AttnFuse does. Eager averages all values there, so its loss
and gradients differ (asserted, so the batch does exercise such rows). Gemma 2 has no sdpa backend: its
reference is HF's eager attention with those rows set to 0, checked against sdpa on the other families.

Tolerance: ``attnfuse.testing.tolerances.assert_matches_reference`` against the reference run in float64
(HF computes the loss, and eager its softmax, in float32 even then): twice the reference's own float32
error plus ``ATOL[float32]`` (2e-5) times the tensor's scale. Tiny random-weight models on the CPU.
"""

import copy
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse as af  # noqa: E402
import attnfuse.hf  # noqa: E402
from attnfuse.testing.tolerances import assert_matches_reference  # noqa: E402
from hf_training import SIZES, padded_batch, tiny_model, training_step  # noqa: E402

FAMILIES = {  # windows and caps small enough to bind at N = 12
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4, "attn_logit_softcapping": 1.0}),
}
REFERENCE = "test_hf_padding_eager_empty_rows_zero"


def _eager_empty_rows_zero(module, query, key, value, attention_mask, **kwargs):
    """HF's eager attention of ``module``'s model on HF's boolean sdpa mask, with the output of query rows that
    keep no key set to 0 (torch SDPA's rule): query (B, Hq, Nq, D) -> (B, Nq, Hq, D), None."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    minimum = torch.finfo(torch.float32).min  # eager's softmax runs in float32, also for a float64 model
    bias = torch.zeros((), dtype=query.dtype).masked_fill(~attention_mask, minimum)
    out, _ = eager(module, query, key, value, bias, **kwargs)
    return out * attention_mask.any(-1).transpose(1, 2)[..., None], None


def _sdpa_mask_always(*args, **kwargs):
    return transformers.masking_utils.sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})


transformers.AttentionInterface.register(REFERENCE, _eager_empty_rows_zero)
transformers.masking_utils.AttentionMaskInterface.register(REFERENCE, _sdpa_mask_always)


def _model(family):
    return tiny_model(transformers, *FAMILIES[family])


def _reference(model, implementation, batch):
    """(float64 results, float32 results) of ``implementation``: the reference and its own float32 error."""
    return (
        training_step(copy.deepcopy(model).double(), implementation, batch),
        training_step(model, implementation, batch),
    )


def _assert_matches(got, want64, want32):
    assert got.keys() == want64.keys()
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)


def _relative_difference(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in b)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_left_padded_training_equals_sdpa(family):
    model, batch = _model(family), padded_batch(SIZES["vocab_size"])
    if family == "gemma2":  # HF gives Gemma 2 no sdpa backend: the same rule on its eager attention
        want64, want32 = _reference(model, REFERENCE, batch)
    else:
        want64, want32 = _reference(model, "sdpa", batch)
        _assert_matches(training_step(model, REFERENCE, batch), want64, want32)  # Gemma 2's reference follows sdpa
    eager = training_step(model, "eager", batch)
    assert _relative_difference(eager, want32) > 1e-2  # the padding rows' convention reaches loss and gradients
    _assert_matches(training_step(model, "attnfuse", batch), want64, want32)


def test_left_padded_training_with_fuse_rope_equals_sdpa():
    model, batch = _model("llama"), padded_batch(SIZES["vocab_size"])
    want64, want32 = _reference(model, "sdpa", batch)
    attnfuse.hf.fuse_rope(model)
    _assert_matches(training_step(model, "attnfuse", batch), want64, want32)


def test_registered_program_left_padded_training_equals_sdpa():
    @af.attention
    def causal_biased(q, k, v, scale, bias):
        s = af.scaled_dot_product(q, k, scale=scale)
        return af.softmax(af.causal(s) if bias is None else af.additive_bias(s, bias)) @ v

    attnfuse.hf.register("test_hf_padding_causal_biased", causal_biased)
    model, batch = _model("qwen2"), padded_batch(SIZES["vocab_size"])
    want64, want32 = _reference(model, "sdpa", batch)
    _assert_matches(training_step(model, "test_hf_padding_causal_biased", batch), want64, want32)
