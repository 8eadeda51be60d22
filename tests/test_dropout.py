"""Attention dropout (``dropout_p``): the kernels' mask against the float64 reference replaying it (forward and
gradients, every normaliser), its rate and expectation, repeatability, refusals, bad values, HF's training
mode and torch.compile."""

import copy
import json
import math

import attrs
import pytest
import torch

import attnfuse as af
from attnfuse.cli import main
from attnfuse.kernels import capability
from attnfuse.passes.compiler import compile as compile_plan
from attnfuse.passes.compiler import lowered
from attnfuse.plan import KernelConfig
from attnfuse.runtime import decode, hoisted
from attnfuse.testing import assert_matches_reference

from conftest import hoisted_last_call, last_call, plan_setting


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def full(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


@af.attention
def sinks(q, k, v, sinks):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), 9), sinks) @ v


@af.attention
def relu(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sigmoid(q, k, v, bias):
    return af.sigmoid_attention(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


def _qkv(B=2, Hq=4, Hkv=2, Nq=21, Nk=37, D=16, dtype=torch.float32):
    return tuple(torch.randn(B, h, n, D, dtype=dtype) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))


def _extras(name, q, k):
    B, Hq, Nq, Nk = *q.shape[:3], k.shape[2]
    return {
        "biased": {"bias": torch.randn(B, 1, Nq, Nk, requires_grad=True)},
        "sinks": {"sinks": torch.randn(Hq)},
        "sigmoid": {"bias": torch.randn(1, Hq, Nq, Nk)},
    }.get(name, {})


def _replayed(program, q, k, v, p, seed, **call):
    """The call's out (through the kernels) with dropout ``p`` under generator seed ``seed``, and its keep mask."""
    torch.manual_seed(seed)
    out = program(q, k, v, dropout_p=p, **call)
    torch.manual_seed(seed)
    keep = af.dropout_keep(af.dropout_state(q.device), p, (*q.shape[:3], k.shape[2]))
    return out, keep


PROGRAMS = {"causal": causal, "biased": biased, "sinks": sinks, "relu": relu, "sigmoid": sigmoid}


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_reference_replaying_the_mask(name, dtype):
    """out and the gradients of q, k, v (and of a bias) equal the float64 reference's with the call's mask."""
    program = PROGRAMS[name]
    q, k, v = (t.requires_grad_(True) for t in _qkv(dtype=dtype))
    extras = _extras(name, q, k)
    out, keep = _replayed(program, q, k, v, 0.3, seed=11, **extras)
    assert 0.5 < keep.float().mean() < 0.9 and not keep.all()
    ref64 = program.reference(q, k, v, dropout_p=0.3, dropout_mask=keep, **extras)
    ref_lowp = program.reference(q, k, v, dropout_p=0.3, dropout_mask=keep, dtype=dtype, **extras)
    assert_matches_reference(out, ref64, ref_lowp, dtype, what="out")
    if dtype == torch.float16 and name == "relu":
        return  # relu's weights are not smooth: float16 gradients are not compared (as the kit does)
    leaves = [q, k, v, *(t for t in extras.values() if t.requires_grad)]
    dout = torch.randn(out.shape).to(dtype)
    got = torch.autograd.grad(out, leaves, dout)
    want64 = torch.autograd.grad(ref64, leaves, dout.double())
    want_lowp = torch.autograd.grad(ref_lowp, leaves, dout)
    summed = [1, 1, 1] + [q.shape[1] for t in leaves[3:]]  # a (B, 1, Nq, Nk) bias sums over the heads
    for what, a, b, c, n in zip(("dq", "dk", "dv", "dbias"), got, want64, want_lowp, summed):
        assert_matches_reference(a, b, c, dtype, what=what, summed=n)


@pytest.mark.parametrize(
    "call",
    [
        {"kv_lens": torch.tensor([30, 37])},  # few queries on a cache: the forward kernel, not the split-KV one
        {"q_offset": 9, "k_offset": 0, "seq_len": 40},
    ],
    ids=["kv_lens", "positions"],
)
def test_cache_and_positions_match_the_reference(call):
    q, k, v = _qkv(Nq=5)
    out, keep = _replayed(causal, q, k, v, 0.4, seed=3, **call)
    ref = causal.reference(q, k, v, dropout_p=0.4, dropout_mask=keep, **call)
    ref_lowp = causal.reference(q, k, v, dropout_p=0.4, dropout_mask=keep, dtype=torch.float32, **call)
    assert_matches_reference(out, ref, ref_lowp, torch.float32, what="out")


@pytest.mark.parametrize("name", ["causal", "sinks", "llama"])
def test_packed_sequences_match_each_document_alone(name):
    """Packed documents (lengths 0 and 1 among them, GQA, positions restarting per document): the call's mask
    is that of the packed tensors as one sequence (``af.dropout_keep`` over (1, Hq, total_q, total_k)); each
    document's out and gradients equal the float64 reference of that document alone with its block of the
    mask."""
    program = PROGRAMS.get(name) or {"llama": llama}[name]
    lengths = [13, 0, 1, 26, 7]
    total = sum(lengths)
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, Nq=total, Nk=total))
    extras = _extras(name, q, k)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out, keep = _replayed(program, q, k, v, 0.3, seed=7, cu_seqlens_q=cu, cu_seqlens_k=cu, **extras)
    assert 0.5 < keep.float().mean() < 0.9
    dout = torch.randn(out.shape)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for start, n in zip(cu[:-1].tolist(), lengths):
        if n == 0:  # an empty document has no rows to compare
            continue
        rows = slice(start, start + n)
        alone = [t.detach()[:, :, rows].requires_grad_(True) for t in (q, k, v)]
        mask = keep[:, :, rows, rows]
        ref64 = program.reference(*alone, dropout_p=0.3, dropout_mask=mask, **extras)
        ref32 = program.reference(*alone, dropout_p=0.3, dropout_mask=mask, dtype=torch.float32, **extras)
        assert_matches_reference(out[:, :, rows], ref64, ref32, torch.float32, what=f"out of document {start}")
        want64 = torch.autograd.grad(ref64, alone, dout[:, :, rows].double())
        want32 = torch.autograd.grad(ref32, alone, dout[:, :, rows])
        for what, a, b, c in zip(("dq", "dk", "dv"), got, want64, want32):
            assert_matches_reference(a[:, :, rows], b, c, torch.float32, what=f"{what} of document {start}")


def test_hoisted_qk_transforms_match_the_reference():
    """With rope hoisted into passes, forward and backward still drop the replayed mask."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(Hq=2, Hkv=1, Nq=48, Nk=48))
    with plan_setting(hoisted, "HOIST_MIN_QUERY_BLOCKS", 1):
        out, keep = _replayed(llama, q, k, v, 0.25, seed=5)
        assert hoisted_last_call()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = llama.reference(q, k, v, dropout_p=0.25, dropout_mask=keep)
    ref_lowp = llama.reference(q, k, v, dropout_p=0.25, dropout_mask=keep, dtype=torch.float32)
    assert_matches_reference(out, ref, ref_lowp, torch.float32, what="out")
    for what, got, want, lowp in zip(
        ("dq", "dk", "dv"),
        (dq, dk, dv),
        torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref)),
        torch.autograd.grad(ref_lowp, (q, k, v), torch.ones_like(ref_lowp)),
    ):
        assert_matches_reference(got, want, lowp, torch.float32, what=what)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_rate_is_p(p):
    """The share of dropped weights is p within 5 binomial standard deviations, over 2 x 3 x 70 x 90 weights."""
    shape = (2, 3, 70, 90)
    keep = af.dropout_keep(af.dropout_state("cpu"), p, shape)
    n = math.prod(shape)
    dropped = (~keep).sum().item()
    assert abs(dropped - p * n) <= 5 * math.sqrt(n * p * (1 - p)), (dropped, p * n)
    # and no structure: each row and each key column drops about as often (the counter is per element)
    rows = (~keep).double().mean(dim=-1)
    assert abs(rows.mean().item() - p) <= 5 * math.sqrt(p * (1 - p) / n)


def test_expectation_is_the_output_without_dropout():
    """The mean over S seeds is the output without dropout, within 6 standard errors at every element and within 5
    for the sum of all elements. out_i = Σ_j P_ij M_ij v_j / (1 - p), the M_ij independent, has variance
    Σ_j P_ij² v_j² p / (1 - p), and the sum over all elements Σ_ij P_ij² (Σ_d v_jd)² p / (1 - p) (P: the float64
    weights). Values around 1, so that the sum is far from 0 and a wrong scale shows."""
    p, S, Nq, Nk = 0.3, 12, 16, 48
    q, k, _ = _qkv(B=1, Hq=2, Hkv=2, Nq=Nq, Nk=Nk)
    v = torch.randn(1, 2, Nk, 16) + 1
    plain = full(q, k, v).double()
    outs = []
    for seed in range(S):
        torch.manual_seed(seed)
        outs.append(full(q, k, v, dropout_p=p).double())
    mean = torch.stack(outs).mean(0)
    eye = torch.eye(Nk, dtype=torch.float64).expand(1, 2, Nk, Nk)
    weights = full.reference(q.double(), k.double(), eye)  # (B, H, Nq, Nk)
    odds = p / (1 - p)
    variance = (weights**2) @ (v.double() ** 2) * odds
    z = (mean - plain) / (variance / S).sqrt()
    assert z.abs().max() < 6, z.abs().max()
    total_variance = ((weights**2) @ (v.double().sum(-1, keepdim=True) ** 2)).sum() * odds
    z_total = (mean.sum() - plain.sum()) / (total_variance / S).sqrt()
    assert abs(z_total) < 5, z_total
    assert not torch.equal(mean, plain)


def test_same_seed_repeats_bitwise_and_other_seeds_differ():
    q, k, v = (t.requires_grad_(True) for t in _qkv())
    dout = torch.randn(2, 4, 21, 16)

    def run(seed):
        torch.manual_seed(seed)
        out = causal(q, k, v, dropout_p=0.2)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    first, again, other = run(7), run(7), run(8)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    states = [af.dropout_state("cpu") for _ in range(2)]
    masks = [af.dropout_keep(s, 0.2, (2, 4, 21, 37)) for s in states]
    assert not torch.equal(masks[0], masks[1])


def test_zero_is_no_dropout_and_draws_nothing():
    """dropout_p=0 runs the kernels of a call without it (the same source, bitwise the same out) and leaves the
    generator as it was."""
    q, k, v = _qkv()
    plain = causal(q, k, v)
    before = torch.get_rng_state()
    out = causal(q, k, v, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(out, plain)
    assert causal.source(q, k, v, dropout_p=0.0) == causal.source(q, k, v)
    assert "drop_keep" not in causal.source(q, k, v) and "drop_keep" in causal.source(q, k, v, dropout_p=0.1)


def test_few_queries_take_the_forward_kernel():
    """A decode-sized call with dropout takes the forward kernel (split-KV has no dropout), never silently
    without dropout; split_kv=True is refused by name."""
    q, k, v = _qkv(Nq=3)
    kv_lens = torch.tensor([20, 37])
    out, keep = _replayed(causal, q, k, v, 0.5, seed=1, kv_lens=kv_lens)
    assert last_call().decode is None and last_call().forward is not None
    ref = causal.reference(q, k, v, dropout_p=0.5, dropout_mask=keep, kv_lens=kv_lens)
    assert_matches_reference(out, ref, ref.float(), torch.float32, what="out")
    assert q.shape[2] <= decode.MAX_QUERIES
    with pytest.raises(af.UnsupportedError, match=r"dropout_p > 0 is not supported with the split-KV decoding path"):
        af.run_attention(causal.graph(), q, k, v, kv_lens=kv_lens, split_kv=True, dropout_p=0.5)


def test_refused_where_not_supported():
    q, k, v = _qkv(B=1, Nq=8, Nk=8)
    pool = torch.randn(4, 8, 2, 16)
    table = torch.tensor([[1]], dtype=torch.int32)
    with pytest.raises(af.UnsupportedError, match=r"dropout_p > 0 is not supported with a paged cache \(block_table\)"):
        causal(q, pool, pool, kv_lens=torch.tensor([8]), block_table=table, dropout_p=0.1)
    before = torch.get_rng_state()
    with pytest.raises(af.UnsupportedError):
        causal(q, pool, pool, kv_lens=torch.tensor([8]), block_table=table, dropout_p=0.1)
    assert torch.equal(torch.get_rng_state(), before)  # a refused call draws no state


def test_a_device_no_gpu_run_has_checked_refuses_dropout_unless_asked(monkeypatch):
    """Where the dropout kernels are unchecked (a GPU other than sm90, here the CPU made to look so) a call with
    p > 0 is refused with the variable that asks for it, eager and through the op; p = 0 runs; asked, it runs."""
    import attrs

    from attnfuse import custom_op
    from attnfuse.runtime import dropout as dropout_module

    monkeypatch.setattr(dropout_module, "GATE", attrs.evolve(dropout_module.GATE, checked=()))
    monkeypatch.delenv(dropout_module.GATE.env, raising=False)
    q, k, v = _qkv()
    with pytest.raises(af.UnsupportedError, match="no run has checked the kernels there.*ATTNFUSE_DROPOUT_ON_GPU=1"):
        causal(q, k, v, dropout_p=0.2)
    with pytest.raises(af.UnsupportedError, match="ATTNFUSE_DROPOUT_ON_GPU=1"):  # the op's path (torch.compile)
        custom_op.call(causal.graph(), q, k, v, {}, return_lse=False, kv_lens=None, block_table=None, dropout_p=0.2)
    torch.testing.assert_close(causal(q, k, v, dropout_p=0.0), causal(q, k, v))
    monkeypatch.setenv(dropout_module.GATE.env, "1")
    out, keep = _replayed(causal, q, k, v, 0.2, seed=3)
    assert_matches_reference(
        out,
        causal.reference(q, k, v, dropout_p=0.2, dropout_mask=keep),
        causal.reference(q, k, v, dropout_p=0.2, dropout_mask=keep, dtype=q.dtype),
        q.dtype,
    )


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.1", True, None, torch.tensor(0.1)])
def test_bad_dropout_p_is_an_input_error(bad):
    q, k, v = _qkv(Nq=8, Nk=8)
    with pytest.raises(af.InputError, match=r"dropout_p must be a Python number in \[0, 1\)"):
        causal(q, k, v, dropout_p=bad)
    with pytest.raises(af.InputError, match=r"dropout_p must be a Python number in \[0, 1\)"):
        af.run_attention(causal.graph(), q, k, v, dropout_p=bad)


def test_reference_needs_the_mask_with_dropout():
    q, k, v = _qkv(Nq=8, Nk=8)
    with pytest.raises(af.InputError, match=r"dropout_mask must be the \(B, Hq, Nq, Nk\) = \(2, 4, 8, 8\) bool"):
        causal.reference(q, k, v, dropout_p=0.2)
    with pytest.raises(af.InputError, match="dropout_mask must be"):
        causal.reference(q, k, v, dropout_p=0.2, dropout_mask=torch.ones(2, 4, 8, 7, dtype=torch.bool))
    with pytest.raises(af.InputError, match="dropout_mask is given but dropout_p is 0"):
        causal.reference(q, k, v, dropout_mask=torch.ones(2, 4, 8, 8, dtype=torch.bool))
    with pytest.raises(af.InputError, match=r"dropout state must be a \(2,\) int64 tensor"):
        af.dropout_keep(torch.zeros(3, dtype=torch.int64), 0.2, (1, 1, 2, 2))


def test_hopper_templates_take_dropout_once_a_gpu_verified_them(capsys, monkeypatch):
    """`attnfuse show --dropout` names the forward and dK/dV template instances of a call with dropout (their own,
    not llama's without dropout): run by default where the record holds them, by all always; a record without
    them leaves the generated kernels, with the reason."""
    from attnfuse.cli import engines
    from attnfuse.kernels import verified
    from attnfuse.runtime.launch import clear_cache

    def kernels(*options):
        clear_cache()
        assert main(["show", "llama", "--json", "--arch", "sm90", *options]) == 0
        return json.loads(capsys.readouterr().out)["kernels"]

    plain, dropped = kernels(), kernels("--dropout")
    monkeypatch.setenv("ATTNFUSE_TEMPLATES", "all")
    opted = kernels("--dropout")
    monkeypatch.delenv("ATTNFUSE_TEMPLATES")
    instances, recorded = {opted[kind]["instance"] for kind in ("forward", "dkdv")}, verified.is_verified
    unrecorded = lambda key: recorded(key) and key not in instances  # noqa: E731
    for module in (verified, engines):
        monkeypatch.setattr(module, "is_verified", unrecorded)
    without = kernels("--dropout")
    for kind in ("forward", "dkdv"):
        instance = opted[kind]["instance"]
        assert plain[kind]["engine"] == ("template" if recorded(plain[kind]["instance"]) else "generated")
        assert instance != plain[kind]["instance"]
        assert opted[kind]["engine"] == "template" and dropped[kind]["instance"] == instance
        assert dropped[kind]["engine"] == ("template" if recorded(instance) else "generated")
        assert without[kind]["engine"] == "generated" and not without[kind]["verified"]
        assert without[kind]["reason"].startswith("instance not verified on a GPU")
    few_queries = dropped["forward"]["fused"]  # a call too short to hoist llama's RoPE runs the fused forward
    assert dropped["decode"]["name"] == few_queries["name"] and few_queries["engine"] == "generated"  # never split
    assert dropped["decode"]["reason"].startswith("a call with attention dropout never takes the split-KV path")
    assert plain["decode"]["name"] != plain["forward"]["name"]


@pytest.mark.parametrize(
    "fact, words", [("kv_lens", "(kv_lens)"), ("positions", "given positions"), ("varlen", "(cu_seqlens)")]
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_forward_template_refuses_dropout_with_a_calls_fact(fact, words, head_dim):
    """The forward template takes dropout, and kv_lens, given positions and packed sequences, each alone; not
    together yet (its dropout numbers rows and keys as a plain call's, where a packed call's mask numbers them by
    their packed place): such a call runs the generated forward kernel, and the reason names both."""
    config = KernelConfig(
        arch="sm90", dtype="bfloat16", head_dim=head_dim, head_dim_v=head_dim, group=1, save_lse=True,
        fp32_precision="ieee",
    )  # fmt: skip
    for alone in ({fact: True}, {"dropout": True}):
        assert capability.forward_reason(lowered(causal.graph(), attrs.evolve(config, **alone))) is None
    both = attrs.evolve(config, dropout=True, **{fact: True})
    reason = capability.forward_reason(lowered(causal.graph(), both))
    assert reason is not None and "attention dropout (dropout_p)" in reason and words in reason
    assert "forward" not in compile_plan(causal.graph(), both).templates.kernels


def test_compiled_call_matches_the_eager_call():
    """Under torch.compile (the state drawn as an op of the graph, passed to attnfuse::attention and its
    backward) the same seed gives bitwise the eager call's out and gradients."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(B=1, Nq=16, Nk=16))

    def step(q, k, v):
        return causal(q, k, v, dropout_p=0.25)

    def run(fn):
        torch.manual_seed(4)
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    eager, traced = run(step), run(compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, traced))
    assert not torch.equal(eager[0], causal(q, k, v))


class _ReplayingReference:
    """Stands for ``attnfuse.hf.hf_attention`` in a test: its float64-capable reference, in the model's dtype,
    drawing each call's dropout state as the call would and replaying its mask."""

    def __init__(self, program):
        self.program = program

    def __call__(self, q, k, v, *args, dropout_p=0.0, **kwargs):
        replay = {}
        if dropout_p:
            keep = af.dropout_keep(af.dropout_state(q.device), dropout_p, (*q.shape[:3], k.shape[2]))
            replay = {"dropout_p": dropout_p, "dropout_mask": keep}
        return self.program.reference(q, k, v, *args, dtype=q.dtype, **replay, **kwargs)


def test_hf_attention_dropout_trains_and_is_off_in_eval_mode(monkeypatch):
    """A model whose config has attention_dropout 0.3, under attn_implementation="attnfuse": in eval mode its
    logits are bitwise those with no dropout; in training mode the loss differs, repeats bitwise with the seed,
    and loss, logits and every gradient equal the model run through the reference replaying each layer's mask
    (in float64, and in float32 for the reference's own error)."""
    transformers = pytest.importorskip("transformers")
    import attnfuse.hf
    from hf_training import padded_batch, tiny_model, training_step

    model = tiny_model(transformers, "LlamaConfig", "LlamaForCausalLM", {"attention_dropout": 0.3})
    batch = padded_batch(model.config.vocab_size)
    ids, mask, _ = batch

    def step(m, seed):
        torch.manual_seed(seed)
        return training_step(m, "attnfuse", batch)

    trained, again = step(model, 2), step(model, 2)
    assert all(torch.equal(trained[n], again[n]) for n in trained)
    assert all(torch.isfinite(t).all() for t in trained.values())
    undropped = copy.deepcopy(model)
    for layer in undropped.model.layers:
        layer.self_attn.attention_dropout = 0.0
    plain = step(undropped, 2)
    assert not torch.equal(trained["loss"], plain["loss"])
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(ids, attention_mask=mask).logits, plain["logits"])
        model.train()

    monkeypatch.setattr(attnfuse.hf, "hf_attention", _ReplayingReference(attnfuse.hf.hf_attention))
    want64, want32 = step(copy.deepcopy(model).double(), 2), step(model, 2)
    for name in want64:
        assert_matches_reference(trained[name], want64[name], want32[name], what=name)
