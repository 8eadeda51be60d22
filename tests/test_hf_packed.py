"""A packed batch (HF's ``DataCollatorWithFlattening``: one row, position_ids restarting at 0 per document, the
FlashAttention kwargs ``cu_seq_lens_q``/``cu_seq_lens_k``) under attn_implementation="attnfuse": each document
runs as a sequence of its own, through the program's packed path (``cu_seqlens_q``/``cu_seqlens_k``), so loss,
per-token logits and every parameter gradient equal the same documents run as a right-padded batch under HF's
"eager" attention.

Tolerance: ``attnfuse.testing.tolerances.assert_matches_reference`` against the padded eager run in float64
(twice its own float32 error plus ``ATOL[float32]`` times the tensor's scale). Tiny random-weight models, CPU.
"""

import copy

import attrs
import pytest
import torch

transformers = pytest.importorskip("transformers")

import attnfuse as af  # noqa: E402
import attnfuse.hf  # noqa: E402
import attnfuse.runtime.packed  # noqa: E402
from attnfuse.testing.tolerances import assert_matches_reference  # noqa: E402
from hf_training import SIZES, tiny_model  # noqa: E402

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {})}
GPT_OSS = {"sliding_window": 4, "num_local_experts": 2, "num_experts_per_tok": 2, "experts_implementation": "eager"}
LENGTHS = [(5, 1, 7), (1, 9, 3)]  # a document of one token, first and in the middle


def _model(family):
    model = tiny_model(transformers, *{**FAMILIES, "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", GPT_OSS)}[family])
    if family == "gpt_oss":  # sinks comparable to the scores, so that they take weight (HF draws std 0.02)
        for layer in model.model.layers:
            layer.self_attn.sinks.data = torch.randn(SIZES["num_attention_heads"]) * 2
    return model


def _documents(lengths):
    return [torch.randint(0, SIZES["vocab_size"], (n,)) for n in lengths]


def _packed_batch(documents, flash_kwargs=True):
    """HF's flattened batch of ``documents``: input_ids, labels, position_ids (1, total) (and the flash kwargs)."""
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": d.tolist()} for d in documents])


def _packed_step(model, implementation, documents, flash_kwargs=True):
    """Loss, per-document logits (total, V) and every parameter gradient of the packed batch."""
    model.set_attn_implementation(implementation)
    model.zero_grad()
    out = model(**_packed_batch(documents, flash_kwargs))
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "logits": out.logits.detach()[0],
        **{name: p.grad.clone() for name, p in model.named_parameters()},
    }


def _padded_step(model, documents, positions_run_on=False):
    """The same under "eager" as a right-padded batch (labels -100 on padding): logits of the real tokens only,
    in the packed order (total, V). ``positions_run_on``: each document's positions continue from the
    previous one's, as in the packed row when no position_ids are given."""
    N = max(len(d) for d in documents)
    ids = torch.zeros(len(documents), N, dtype=torch.long)
    mask = torch.zeros_like(ids)
    positions = torch.arange(N).repeat(len(documents), 1)
    for b, d in enumerate(documents):
        ids[b, : len(d)], mask[b, : len(d)] = d, 1
        positions[b] += sum(len(e) for e in documents[:b]) if positions_run_on else 0
    model.set_attn_implementation("eager")
    model.zero_grad()
    out = model(ids, attention_mask=mask, position_ids=positions, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    return {
        "loss": out.loss.detach(),
        "logits": out.logits.detach()[mask.bool()],
        **{name: p.grad.clone() for name, p in model.named_parameters()},
    }


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_training_equals_padded_eager(family, flash_kwargs, lengths):
    model, documents = _model(family), _documents(lengths)
    want64, want32 = _padded_step(copy.deepcopy(model).double(), documents), _padded_step(model, documents)
    got = _packed_step(model, "attnfuse", documents, flash_kwargs)
    assert got.keys() == want64.keys()
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_packed_batch_runs_the_documents_not_a_mask(monkeypatch, flash_kwargs):
    """Every layer calls the program with the documents' offsets and no (total, total) bias."""
    lengths, calls = (4, 1, 6), []

    def spy(*args, **kwargs):
        calls.append((args[3], kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_k")))
        return program(*args, **kwargs)

    program = attnfuse.hf.hf_attention
    monkeypatch.setattr(attnfuse.hf, "hf_attention", spy)
    _packed_step(_model("llama"), "attnfuse", _documents(lengths), flash_kwargs)
    want = torch.tensor([0, 4, 5, 11])
    assert len(calls) == SIZES["num_hidden_layers"]
    for bias, cu_q, cu_k in calls:
        assert bias is None and torch.equal(cu_q.long(), want) and torch.equal(cu_k.long(), want)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_the_layers_after_the_first_reuse_the_packing_checks(monkeypatch, flash_kwargs):
    """HF hands every layer the same position_ids, mask, flash keywords and rotary tables: the host-syncing
    checks (offsets from position_ids, the mask compared with the documents', fuse_rope's local tables) run
    once a forward, not once a layer; a second forward with new tensors runs them again."""
    counted = {"_packed_call": 0, "_local_rope_tables": 0}
    for name in counted:
        original = getattr(attnfuse.hf_packed, name)

        def counting(*args, _name=name, _original=original):
            counted[_name] += 1
            return _original(*args)

        monkeypatch.setattr(attnfuse.hf_packed, name, counting)
    model = attnfuse.hf.fuse_rope(_model("llama"))
    assert SIZES["num_hidden_layers"] >= 2
    for step in (1, 2):
        _packed_step(model, "attnfuse", _documents((4, 1, 6)), flash_kwargs)
        assert counted == {"_packed_call": step, "_local_rope_tables": step}


def test_packed_call_reads_a_tensor_changed_in_place_again():
    """The remembered answer belongs to the tensors' versions: position_ids rewritten in place (a new packing of
    the row) give the new documents, not the remembered ones."""
    _, q, k, _ = _attention_inputs(total=9)
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4]])
    first = attnfuse.hf_packed.packed_call(q, k, None, None, {"position_ids": positions})
    assert first.cu_seqlens_q.tolist() == [0, 3, 4, 9]
    assert attnfuse.hf_packed.packed_call(q, k, None, None, {"position_ids": positions}) is first
    positions[0, 4:] = torch.tensor([1, 2, 0, 1, 2])
    again = attnfuse.hf_packed.packed_call(q, k, None, None, {"position_ids": positions})
    assert again.cu_seqlens_q.tolist() == [0, 3, 6, 9]
    other = attnfuse.hf_packed.packed_call(q, k, None, None, {"position_ids": positions.clone()})
    assert other is not again and other.cu_seqlens_q.tolist() == [0, 3, 6, 9]  # another tensor: checked itself


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_training_with_fuse_rope_equals_padded_eager(family):
    """fuse_rope reads HF's per-token cos/sin as tables at document-local positions."""
    model, documents = _model(family), _documents((5, 1, 7))
    want64, want32 = _padded_step(copy.deepcopy(model).double(), documents), _padded_step(model, documents)
    attnfuse.hf.fuse_rope(model)
    got = _packed_step(model, "attnfuse", documents)
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)


def _attention_inputs(total=9):
    q, k, v = torch.randn(1, 4, total, 8), torch.randn(1, 2, total, 8), torch.randn(1, 2, total, 8)
    return torch.nn.Module(), q, k, v


def test_packed_call_refuses_a_mask_other_than_its_documents():
    """A padding mask (or any mask but the documents' causal one) on a packed call raises, never dropped."""
    module, q, k, v = _attention_inputs()
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    documents = attnfuse.hf_packed.documents_causal_mask(attnfuse.hf_packed.PackedCall(cu, cu, None, None), 9, 9, None)
    out, _ = attnfuse.hf.attention_forward(module, q, k, v, documents[None, None], **packed)  # HF's own mask: runs
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, _ = attnfuse.hf.attention_forward(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None)
        torch.testing.assert_close(out[:, s:e], alone, atol=2e-5, rtol=2e-5)
    padded = documents.clone()
    padded[:, 7] = False  # one key masked out as padding
    with pytest.raises(af.UnsupportedError, match="other than its documents' causal mask"):
        attnfuse.hf.attention_forward(module, q, k, v, padded[None, None], **packed)
    with pytest.raises(af.UnsupportedError, match="torch.float32"):
        attnfuse.hf.attention_forward(module, q, k, v, torch.zeros(1, 1, 9, 9), **packed)
    with pytest.raises(af.UnsupportedError, match="cu_seq_lens_k is missing"):
        attnfuse.hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)


def test_fuse_rope_refuses_documents_at_positions_that_do_not_restart():
    """Flash keywords with position_ids running on across documents: fuse_rope's local tables would be wrong."""
    model, documents = attnfuse.hf.fuse_rope(_model("llama")), _documents((4, 6))
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    with pytest.raises(af.UnsupportedError, match="do not restart alike in every document"):
        model(**collator([{"input_ids": d.tolist()} for d in documents]))


def test_flash_kwargs_without_position_ids_attend_within_documents():
    """cu_seq_lens_q/k alone (no position_ids: HF's mask is plain causal over the row) still keep each
    document to itself, as HF's flash_attention_2 does; RoPE positions then run on along the row."""
    model, documents = _model("qwen2"), _documents((5, 1, 7))
    want64 = _padded_step(copy.deepcopy(model).double(), documents, positions_run_on=True)
    want32 = _padded_step(model, documents, positions_run_on=True)
    model.set_attn_implementation("attnfuse")
    model.zero_grad()
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    out = model(**collator([{"input_ids": d.tolist()} for d in documents]))
    out.loss.backward()
    got = {"loss": out.loss.detach(), "logits": out.logits.detach()[0]}
    got.update({name: p.grad.clone() for name, p in model.named_parameters()})
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)


def test_where_packed_kernels_are_unchecked_hf_mask_runs_as_a_bias(monkeypatch):
    """On a device the packed kernels have not been checked on (a GPU but sm90 without ATTNFUSE_PACKED_ON_GPU=1, here
    the CPU made to look so), HF's block-diagonal mask runs as a bias, still each document on its own; flash
    keywords without that mask raise the packed path's UnsupportedError rather than attend across documents."""
    monkeypatch.setattr(attnfuse.runtime.packed, "GATE", attrs.evolve(attnfuse.runtime.packed.GATE, checked=()))
    monkeypatch.delenv(attnfuse.runtime.packed.GATE.env, raising=False)
    model, documents = _model("llama"), _documents((5, 1, 7))
    want64, want32 = _padded_step(copy.deepcopy(model).double(), documents), _padded_step(model, documents)
    got = _packed_step(model, "attnfuse", documents)
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    with pytest.raises(af.UnsupportedError, match=attnfuse.runtime.packed.GATE.env):
        model(**collator([{"input_ids": d.tolist()} for d in documents]))


def test_a_padded_row_whose_positions_restart_is_not_packing():
    """One left-padded row with generate()'s position_ids (1 on padding, then 0, 1, ...): the restart is not a
    document boundary, HF's padding mask runs as a bias, and logits equal sdpa's."""
    model = _model("llama").eval()
    ids, mask = torch.randint(0, SIZES["vocab_size"], (1, 10)), torch.ones(1, 10, dtype=torch.long)
    mask[:, :3] = 0
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    logits = {}
    for implementation in ("sdpa", "attnfuse"):
        model.set_attn_implementation(implementation)
        logits[implementation] = model(ids, attention_mask=mask, position_ids=positions).logits.detach()
    real = mask[0].bool()
    torch.testing.assert_close(logits["attnfuse"][:, real], logits["sdpa"][:, real], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
def test_gpt_oss_packed_training_with_window_and_sinks_equals_padded_eager(flash_kwargs):
    """GPT-OSS builds its masks without the position_ids (a causal or sliding mask over the whole row, which
    HF's own sdpa and eager then apply across documents); its packed batch still keeps each document apart,
    with a window of 4 binding in the 7-token document and a sink on every head."""
    model, documents = _model("gpt_oss"), _documents((7, 1, 6))
    want64, want32 = _padded_step(copy.deepcopy(model).double(), documents), _padded_step(model, documents)
    got = _packed_step(model, "attnfuse", documents, flash_kwargs)
    for name in want64:
        assert_matches_reference(got[name], want64[name], want32[name], what=name)
