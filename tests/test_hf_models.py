"""Gemma 2 and GPT-OSS through ``attn_implementation="attnfuse"`` with nothing else installed: Gemma 2's logit
softcapping runs the built-in ``softcap``, GPT-OSS's attention sinks (``s_aux``) the built-in
``softmax_with_sinks``, each with a sliding window on alternate layers.

Tiny random-weight models (2 layers, head dim 8, weights of std 0.2 so that scores are large enough for a cap
to bite; GPT-OSS with 2 experts, both chosen for every token so that no routing decision can flip, run by
HF's eager experts, which also take float64), float32 on the CPU. The reference is HF's eager attention, run
in float64 and in float32, and the tolerance ``attnfuse.testing.assert_matches_reference``'s: twice eager's own float32
error plus ``ATOL[float32]`` times the tensor's scale. transformers offers neither model on sdpa (Gemma 2:
sdpa does not softcap; GPT-OSS: sdpa has no sinks), so eager is the reference. Each test also checks that
what it exercises binds: without the cap, the sinks or the window, eager's logits differ.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse as af  # noqa: E402
import attnfuse.hf  # noqa: E402
from attnfuse.testing import assert_matches_reference  # noqa: E402
from hf_training import padded_batch, training_step  # noqa: E402

SIZES = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_hidden_layers=2,
    intermediate_size=32,
    vocab_size=64,
    use_cache=False,
    initializer_range=0.2,
)
MODELS = {  # caps, sinks and windows that bind at N = 12
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 4, "attn_logit_softcapping": 1.0}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"sliding_window": 4, "num_local_experts": 2, "num_experts_per_tok": 2, "experts_implementation": "eager"},
    ),
}


def _model(family):
    config_name, model_name, extra = MODELS[family]
    config = getattr(transformers, config_name)(**SIZES, **extra)
    model = getattr(transformers, model_name)(config).train()
    if family == "gpt_oss":  # sinks comparable to the scores, so that they take weight (HF draws std 0.02)
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(SIZES["num_attention_heads"]) * 2
    return model


def _assert_equals_eager(model, batch, real=None):
    """attnfuse's step against eager's in float64 (the reference) and float32 (its own error); ``real``: the
    (B, N) positions whose logits are compared (None: all)."""
    want64 = training_step(copy.deepcopy(model).double(), "eager", batch)
    want32 = training_step(model, "eager", batch)
    got = training_step(model, "attnfuse", batch)
    assert got.keys() == want64.keys()
    for name in want64:
        pick = (lambda t: t[real]) if name == "logits" and real is not None else (lambda t: t)
        assert_matches_reference(pick(got[name]), pick(want64[name]), pick(want32[name]), what=name)
    return want32


def _logits_differ(model, batch, want):
    return (training_step(model, "eager", batch)["logits"] - want["logits"]).abs().max() > 1e-2


def test_the_combinators_are_builtins():
    registry = af.combinators()
    assert registry["softcap"].distribution == registry["softmax_with_sinks"].distribution == "attnfuse"


def test_gemma2_softcapping_and_window_equal_eager():
    model, batch = _model("gemma2"), padded_batch(SIZES["vocab_size"], pads=(0, 0))
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    want = _assert_equals_eager(model, batch)
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    assert _logits_differ(model, batch, want)  # the cap binds
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 1.0
    model.config.sliding_window = 64  # eager's mask follows the config
    assert _logits_differ(model, batch, want)  # the window binds


def test_gpt_oss_sinks_and_window_equal_eager_with_left_padding():
    """A left-padding row keeps no key: with a sink, eager and attnfuse both give it all to the sink (output
    0), so the padded batch matches eager everywhere, and the sinks' gradients too."""
    model, batch = _model("gpt_oss"), padded_batch(SIZES["vocab_size"], pads=(5, 0))
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    want = _assert_equals_eager(model, batch)
    assert all(layer.self_attn.sinks.grad.abs().max() > 0 for layer in model.model.layers)
    sinks = [layer.self_attn.sinks.data.clone() for layer in model.model.layers]
    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-1e4)
    assert _logits_differ(model, batch, want)  # the sinks bind
    for layer, sink in zip(model.model.layers, sinks):
        layer.self_attn.sinks.data = sink
    model.config.sliding_window = 64  # eager's mask follows the config
    assert _logits_differ(model, batch, want)  # the window binds


def test_gpt_oss_generate_gives_eager_greedy_tokens():
    """Decoding from a cache: a sliding layer and a full one, with sinks, one query at a time."""
    model = _model("gpt_oss").eval()
    model.config.use_cache = True
    ids, mask, _ = padded_batch(SIZES["vocab_size"], N=8, pads=(3, 0))
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    model.set_attn_implementation("eager")
    want = model.generate(ids, **options)
    model.set_attn_implementation("attnfuse")
    assert model.generate(ids, **options).tolist() == want.tolist()


def test_a_registered_program_refuses_sinks_it_cannot_honour():
    @af.attention
    def causal_only(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v

    attnfuse.hf.register("test_hf_models_causal_only", causal_only)
    model, (ids, _, _) = _model("gpt_oss"), padded_batch(SIZES["vocab_size"], pads=(5, 0))
    model.set_attn_implementation("test_hf_models_causal_only")
    with pytest.raises(
        af.InputError,
        match=r"s_aux \(given by GptOssAttention\) is not supported here; use "
        r"attn_implementation='attnfuse' or 'eager'",
    ):
        model(ids)
