"""Context parallelism (``attnfuse.distributed``) on CPU tensors: gloo, 2 and 4 processes, Triton's interpreter.

Each world size spawns its processes once (a module fixture); they run every case in turn: the ring's
forward and backward of causal (also returning the lse), RoPE+causal (theta, and tables given as
shards), a sliding window with ALiBi (contiguous layout), a sinks normaliser, relu_attention and
contrib's sigmoid_attention, with GQA and chunks of 10 rows (not a multiple of a block). Then the ranks
share out the checks: each gathered result against the float64 reference, within twice the error of the
reference evaluated in float32 on the whole sequence. The processes also check the errors a bad call raises
(on every rank, also when one rank alone makes a bad call), and count the forward launches (pairs a mask
makes empty are skipped). Results come back as one JSON file per rank.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
import zlib
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnfuse as af
from attnfuse.testing import assert_matches_reference

ROOT = Path(__file__).resolve().parents[1]
# Under -n one worker spawns each world's processes, once: conftest.ONE_WORKER_MODULES


@af.attention
def causal(q, k, v):
    return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


@af.attention
def llama_tables(q, k, v, cos, sin):
    return af.softmax(af.causal(af.rope(q, k, cos=cos, sin=sin))) @ v


@af.attention
def window_alibi(q, k, v):
    return af.softmax(af.alibi(af.sliding_window(af.scaled_dot_product(q, k), 6))) @ v


@af.attention
def sinks_window(q, k, v, sinks):
    return af.softmax_with_sinks(af.sliding_window(af.scaled_dot_product(q, k), 13), sinks) @ v


@af.attention
def relu_causal(q, k, v):
    return af.relu_attention(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def sigmoid_window(q, k, v):
    return af.sigmoid_attention(af.alibi(af.sliding_window(af.scaled_dot_product(q, k), 25))) @ v


@af.attention
def no_combine(q, k, v):
    return af._cp_no_combine(af.causal(af.scaled_dot_product(q, k))) @ v


@af.attention
def no_offsets(q, k, v):
    return af.softmax(af._cp_no_offsets(af.causal(af.scaled_dot_product(q, k)))) @ v


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


@af.attention
def biased(q, k, v, bias):
    return af.softmax(af.additive_bias(af.causal(af.scaled_dot_product(q, k)), bias)) @ v


class _Provides:
    """A plugin object from code: it registers the combinators it is given."""

    def __init__(self, *combinators):
        self.combinators = combinators

    @af.hookimpl
    def attnfuse_combinators(self):
        return list(self.combinators)


def _register_refused_once() -> None:
    """``_cp_no_combine``: softmax without a combine rule, which a ring cannot merge; ``_cp_no_offsets``:
    alibi (it prepares its slopes) without ``takes_offsets``, which a ring cannot run."""
    found = af.combinators()
    softmax, alibi = found["softmax"].combinator, found["alibi"].combinator
    af.register_plugin(
        _Provides(
            attrs.evolve(softmax, name="_cp_no_combine", fragment=attrs.evolve(softmax.fragment, combine=None)),
            attrs.evolve(alibi, name="_cp_no_offsets", takes_offsets=False),
        ),
        name="_cp_refused",
    )


# name: (program, layout, (B, Hq, Hkv), extras, sharded); chunks of 10 rows, head dim 16
CASES = {
    "causal_lse": (causal, "zigzag", (2, 2, 1), None, None),
    "rope_causal": (llama, "zigzag", (1, 2, 1), None, None),
    "rope_tables_sharded": (llama_tables, "zigzag", (1, 2, 1), "tables", {"cos": 0, "sin": 0}),
    "window_alibi": (window_alibi, "contiguous", (1, 4, 2), None, None),
    "sinks_window": (sinks_window, "zigzag", (1, 4, 2), "sinks", None),
    "relu_causal": (relu_causal, "zigzag", (1, 2, 1), None, None),
    "sigmoid_window": (sigmoid_window, "contiguous", (1, 2, 1), None, None),
}
CHUNK, D = 10, 16
WITH_LSE = ("causal_lse",)  # cases that also return the lse, and take its gradient


def _extras(kind: str | None, N: int, Hq: int, g: torch.Generator) -> dict:
    if kind == "tables":
        angles = torch.rand(N, D // 2, generator=g) * 6
        angles = torch.cat((angles, angles), dim=-1)
        return {"cos": angles.cos(), "sin": angles.sin()}
    if kind == "sinks":
        return {"sinks": torch.randn(Hq, generator=g) * 2}
    return {}


def _inputs(name: str, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """q, k, v, the incoming gradients of out (and lse) of the whole sequence, and the runtime inputs of a
    case (the same on every rank)."""
    program, layout, (B, Hq, Hkv), kind, _ = CASES[name]
    N = CHUNK * (2 * world if layout == "zigzag" else world)
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}-{world}".encode()))
    q, dout = torch.randn(B, Hq, N, D, generator=g), torch.randn(B, Hq, N, D, generator=g)
    k, v = torch.randn(B, Hkv, N, D, generator=g), torch.randn(B, Hkv, N, D, generator=g)
    douts = [dout, torch.randn(B, Hq, N, generator=g)] if name in WITH_LSE else [dout]
    return [q, k, v], douts, _extras(kind, N, Hq, g)


def _ring(afd, name: str, world: int) -> list[torch.Tensor]:
    """The ring's out (and lse), dq, dk and dv of a case, gathered (every rank takes part and gets them)."""
    program, layout, _, _, sharded = CASES[name]
    qkv, douts, extras = _inputs(name, world)
    given = {
        n: afd.shard(t, layout=layout, dim=sharded[n]) if sharded and n in sharded else t for n, t in extras.items()
    }
    shards = [afd.shard(t, layout=layout).requires_grad_(True) for t in qkv]
    outs = afd.context_parallel(program, layout=layout, sharded=sharded)(*shards, **given, return_lse=name in WITH_LSE)
    outs = list(outs) if name in WITH_LSE else [outs]
    torch.autograd.backward(outs, [afd.shard(t, layout=layout) for t in douts])
    return [afd.unshard(t, layout=layout) for t in (*(o.detach() for o in outs), *(s.grad for s in shards))]


def _check(name: str, world: int, ring: list[torch.Tensor]) -> list[str]:
    """The failures of a case's ring results against the float64 reference, within twice the error of the
    reference evaluated in float32 on the whole sequence (plus the float32 floor), as the rest of the suite
    checks a program: nothing of the code under test sets the tolerance."""
    program = CASES[name][0]
    qkv, douts, extras = _inputs(name, world)
    whole = [t.clone().requires_grad_(True) for t in qkv]
    lse = name in WITH_LSE
    in_float32, reference = (
        program.reference(*whole, **extras, return_lse=lse, dtype=dtype) for dtype in (torch.float32, torch.float64)
    )
    in_float32, reference = (list(x) if lse else [x] for x in (in_float32, reference))
    expected = [
        *zip(reference, in_float32),
        *zip(
            torch.autograd.grad(reference, whole, [t.double() for t in douts]),
            torch.autograd.grad(in_float32, whole, douts),
        ),
    ]
    failures = []
    for what, got, (want, baseline) in zip(("out", "lse")[: len(douts)] + ("dq", "dk", "dv"), ring, expected):
        try:
            assert_matches_reference(got, want, baseline, torch.float32, what=f"{name}: {what}")
        except AssertionError as exc:
            failures.append(str(exc))
    return failures


def _forward_launches(afd, program, layout: str, world: int) -> int:
    """How many forward kernels this rank's ring launches for ``program`` (B1, Hq 2, Hkv 1)."""
    from attnfuse.runtime import forward

    N = CHUNK * (2 * world if layout == "zigzag" else world)
    q, k, v = (afd.shard(torch.randn(1, h, N, D), layout=layout) for h in (2, 1, 1))
    calls = []
    original = forward.ForwardKernel.__call__
    forward.ForwardKernel.__call__ = lambda *args, **kw: calls.append(1) or original(*args, **kw)
    try:
        afd.context_parallel(program, layout=layout)(q, k, v)
    finally:
        forward.ForwardKernel.__call__ = original
    return len(calls)


def _error(fn) -> str:
    try:
        fn()
    except Exception as exc:  # any error, a timed-out collective too: the test shows what was raised
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _errors(afd, world: int, rank: int) -> dict[str, str]:
    """The error each bad use raises on this rank (every rank makes the same calls, collectives included)."""

    def q(n: int = 20, h: int = 2) -> torch.Tensor:
        return torch.randn(1, h, n, D)

    def zigzag_shard(h: int) -> torch.Tensor:
        return afd.shard(torch.randn(1, h, 4 * world, D))

    found = {
        "no_combine": _error(lambda: afd.context_parallel(no_combine)(q(), q(h=1), q(h=1))),
        "block_sparse": _error(
            lambda: afd.context_parallel(sparse)(
                q(),
                q(),
                q(),
                af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, None, 20, 20, block_size=16),
            )
        ),
        "reads_indices": _error(lambda: afd.context_parallel(biased)(q(), q(), q(), torch.zeros(20, 20))),
        "no_offsets": _error(lambda: afd.context_parallel(no_offsets)(q(), q(h=1), q(h=1))),
        "odd_shard": _error(lambda: afd.context_parallel(causal)(q(21), q(21), q(21))),
        "unequal_shards": _error(lambda: afd.context_parallel(causal)(*(q(20 + 2 * rank) for _ in range(3)))),
        "kv_shorter": _error(lambda: afd.context_parallel(causal)(q(20), q(18), q(18))),
        "kv_lens": _error(lambda: afd.context_parallel(causal)(q(), q(), q(), kv_lens=torch.tensor([20]))),
        "block_table": _error(lambda: afd.context_parallel(causal)(q(), q(), q(), block_table=torch.zeros(1, 1))),
        "q_offset": _error(lambda: afd.context_parallel(causal)(q(), q(), q(), q_offset=0)),
        "dropout_p": _error(lambda: afd.context_parallel(causal)(q(), q(), q(), dropout_p=0.1)),
        "cu_seqlens": _error(
            lambda: afd.context_parallel(causal)(q(), q(), q(), cu_seqlens_q=torch.tensor([0, 20]), cu_seqlens_k=None)
        ),
        "fp8": _error(lambda: afd.context_parallel(causal)(*(q().to(torch.float8_e4m3fn) for _ in "qkv"))),
        "fp8_descale": _error(lambda: afd.context_parallel(causal)(q(), q(), q(), q_descale=torch.ones(1))),
        "layout_mismatch": _error(
            lambda: afd.context_parallel(causal, layout="contiguous")(zigzag_shard(2), zigzag_shard(1), zigzag_shard(1))
        ),
        "unshard_layout": _error(lambda: afd.unshard(zigzag_shard(2), layout="contiguous")),
        "unshard_ring_out": _error(
            lambda: afd.unshard(
                afd.context_parallel(window_alibi, layout="contiguous")(
                    *(afd.shard(torch.randn(1, h, 2 * world, D), layout="contiguous") for h in (2, 1, 1))
                )
            )
        ),
        "shard_split": _error(lambda: afd.shard(torch.randn(1, 2, 4 * world + 2, D))),
        "shard_dim": _error(lambda: afd.shard(torch.randn(1, 2, 4 * world, D), dim=4)),
        "sharded_dim": _error(
            lambda: afd.context_parallel(llama_tables, sharded={"cos": 2, "sin": 0})(
                q(), q(h=1), q(h=1), torch.randn(20, D), torch.randn(20, D)
            )
        ),
        "lse_of_relu": _error(lambda: afd.context_parallel(relu_causal)(q(), q(), q(), return_lse=True)),
        "sharded_unknown": _error(lambda: afd.context_parallel(causal, sharded={"cos": 0})(q(), q(), q())),
        "input_grad": _error(
            lambda: afd.context_parallel(sinks_window)(q(), q(h=1), q(h=1), torch.zeros(2, requires_grad=True))
        ),
        "layout": _error(lambda: afd.context_parallel(causal, layout="striped")),
    }
    single = dist.new_group([0])  # every rank creates it; only rank 0 is in it
    if rank == 0:
        found["group_of_one"] = _error(lambda: afd.context_parallel(causal, group=single))
    return found


QUICK_TIMEOUT = 30  # seconds: the collectives' timeout in the group of the one-bad-rank cases


def _one_bad_rank(afd, world: int, rank: int) -> dict[str, tuple[str, float]]:
    """The error each case raises on this rank, and the seconds it took, when the last rank alone makes a bad
    call and the others a good one, in a group whose collectives time out after QUICK_TIMEOUT seconds (a rank
    left waiting fails with the backend's timeout, not an InputError)."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=QUICK_TIMEOUT))
    bad = rank == world - 1

    def q(n: int = 20, h: int = 2, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(1, h, n, D, dtype=dtype)

    cases = {
        "kv_lens": lambda: afd.context_parallel(causal, group=group)(
            q(), q(), q(), **({"kv_lens": torch.tensor([20])} if bad else {})
        ),
        "dtype": lambda: afd.context_parallel(causal, group=group)(
            q(dtype=torch.float64 if bad else torch.float32), q(), q()
        ),
        "odd_shard": lambda: afd.context_parallel(causal, group=group)(*(q(21 if bad else 20) for _ in range(3))),
        "missing_v": lambda: afd.context_parallel(causal, group=group)(*((q(), q()) if bad else (q(), q(), q()))),
        "layout": lambda: afd.context_parallel(window_alibi, group=group, layout="contiguous")(
            *(
                afd.shard(t, group, layout="zigzag") if bad else afd.shard(t, group, layout="contiguous")
                for t in (torch.randn(1, h, 2 * world * 5, D) for h in (4, 2, 2))
            )
        ),
        "input_grad": lambda: afd.context_parallel(sinks_window, group=group)(
            q(), q(h=1), q(h=1), torch.zeros(2, requires_grad=bad)
        ),
        "sinks_shape": lambda: afd.context_parallel(sinks_window, group=group)(
            q(), q(h=1), q(h=1), torch.zeros(3 if bad else 2)
        ),
        "unshard_dim": lambda: afd.unshard(q(), group, dim=5 if bad else 2),
    }
    found = {}
    for name, call in cases.items():
        dist.barrier(group)  # the ranks start each case together
        start = time.monotonic()
        found[name] = (_error(call), time.monotonic() - start)
    return found


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(rank)  # the draws of the launch counts and the errors (the cases seed their own)
    import attnfuse.distributed as afd

    _register_refused_once()
    results: dict = {"cases": {}, "launches": {}}
    try:
        rings = {name: _ring(afd, name, world) for name in CASES}
        results["launches"] = {
            "causal": _forward_launches(afd, causal, "zigzag", world),
            "window_alibi": _forward_launches(afd, window_alibi, "contiguous", world),
        }
        results["errors"] = _errors(afd, world, rank)
        for i, name in enumerate(CASES):  # the checks, shared out: they need no other rank
            if i % world == rank:
                results["cases"][name] = _check(name, world, rings[name])
        try:  # last: a rank left waiting by another's error times out, which may leave the group unusable
            results["one_bad_rank"] = _one_bad_rank(afd, world, rank)
        except Exception:
            results["one_bad_rank_crash"] = traceback.format_exc()
    except Exception:
        results["crash"] = traceback.format_exc()
        raise
    finally:
        Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SPAWN_DEADLINE = 900  # seconds for all of a world's processes: a rank that hangs fails the tests, never blocks CI


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ring(request, tmp_path_factory):
    """Every rank's results for one world size (the processes spawned once)."""
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"ring{world}")
    processes = mp.start_processes(_worker, args=(world, _free_port(), str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE
    while not processes.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail(f"the {world} ranks did not finish within {SPAWN_DEADLINE} s")
    return world, [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("case", list(CASES))
def test_ring_equals_the_whole_sequence(ring, case):
    """out, dq, dk and dv of the ring, gathered, against the float64 reference, as close as the reference
    evaluated in float32 on the whole sequence is."""
    world, results = ring
    [failures] = [r["cases"][case] for r in results if case in r["cases"]]
    assert failures == []


def test_pairs_a_mask_empties_are_skipped(ring):
    """Zigzag causal: each rank launches 2W + 1 of its 4W chunk pairs (its two diagonals, the pair below
    them, then two per visiting shard). Contiguous, a window shorter than a chunk: the rank's own chunk
    and its predecessor's only (rank 0: its own)."""
    world, results = ring
    assert [r["launches"]["causal"] for r in results] == [2 * world + 1] * world
    assert [r["launches"]["window_alibi"] for r in results] == [1] + [2] * (world - 1)


ERRORS = {  # the message each rank gets, {w} the world size and {c} the zigzag chunk count 2w
    "no_combine": r"ProgramError: context_parallel: the normaliser _cp_no_combine declares no combine rule",
    "block_sparse": r"ProgramError: context_parallel: the mask block_sparse lists blocks by their index",
    "reads_indices": r"ProgramError: context_parallel: additive_bias reads k_idx, q_idx: indices",
    "no_offsets": r"ProgramError: context_parallel: _cp_no_offsets cannot take position offsets: it prepares kernel "
    r"arguments but does not declare takes_offsets=True, and the ring runs every shard but the first at "
    r"an offset .* Its author declares Combinator\(\.\.\., takes_offsets=True\)",
    "odd_shard": r"InputError: context_parallel: a shard of 21 rows cannot hold 2 equal chunks \(layout 'zigzag'\): "
    r"the sequence length must be a multiple of {c}",
    "unequal_shards": r"InputError: context_parallel: q's shape differs across ranks \(rank 0: \[1, 2, 20, 16\], "
    r"rank 1: \[1, 2, 22, 16\].*\); every rank must give shards of equal size",
    "kv_shorter": r"InputError: context_parallel: q, k and v shards must have the same length, got 20, 18 and 18",
    "kv_lens": r"InputError: context_parallel: the ring takes no kv_lens: .*; kv_lens and block_table describe a "
    r"decoding cache, which needs no ring: call the program itself on it",
    "block_table": r"InputError: context_parallel: the ring takes no block_table: .*describe a decoding cache",
    "q_offset": r"InputError: context_parallel: the ring takes no q_offset: it splits one whole sequence \(q, k and "
    r"v shards of the same length\) and sets every chunk's positions itself$",
    "dropout_p": r"UnsupportedError: context_parallel: dropout_p > 0 is not supported by the ring yet; call it with "
    r"dropout_p=0$",
    "cu_seqlens": r"UnsupportedError: context_parallel: packed sequences \(cu_seqlens_q, cu_seqlens_k\) are not "
    r"supported by the ring yet",
    "fp8": r"UnsupportedError: float8 calls run the generated forward kernel only; context_parallel's ring does not "
    r"take float8 yet",
    "fp8_descale": r"UnsupportedError: float8 calls run the generated forward kernel only; context_parallel's ring "
    r"\(q_descale\) does not take float8 yet",
    "layout_mismatch": r"InputError: context_parallel: q is a shard of layout 'zigzag', but this context_parallel uses "
    r"layout 'contiguous'; shard with layout='contiguous', or use layout='zigzag' here",
    "unshard_layout": r"InputError: unshard: x_shard is a shard of layout 'zigzag', but this unshard uses layout "
    r"'contiguous'",
    "unshard_ring_out": r"InputError: unshard: x_shard is a shard of layout 'contiguous', but this unshard uses "
    r"layout 'zigzag'",
    "shard_split": r"InputError: shard: a sequence of {shard_rows} rows \(dim 2\) cannot be split by layout 'zigzag' "
    r"over {w} ranks: it needs a multiple of {c}",
    "shard_dim": r"InputError: shard: dim must be a dim of x \(\(1, 2, {shard_rows_even}, 16\), so from -4 to 3\), "
    r"got 4",
    "sharded_dim": r"InputError: context_parallel: sharded\['cos'\] must be a dim of cos \(\(20, 16\), so from -2 "
    r"to 1\), got 2",
    "lse_of_relu": r"InputError: return_lse=True needs a normaliser with a log-sum-exp",
    "sharded_unknown": r"InputError: context_parallel: sharded names 'cos', which is not a runtime input",
    "input_grad": r"InputError: context_parallel: runtime inputs \['sinks'\] require grad",
    "layout": r"InputError: layout must be one of 'zigzag', 'contiguous', got 'striped'",
    "group_of_one": r"InputError: context_parallel: the group has one rank, so there is nothing to split; call the "
    r"program itself",
}


@pytest.mark.parametrize("error", list(ERRORS))
def test_bad_use_is_a_clear_error(ring, error):
    """Every rank raises the error (rank 0 alone for a group of one, which only it is in)."""
    world, results = ring
    pattern = ERRORS[error].format(w=world, c=2 * world, shard_rows=4 * world + 2, shard_rows_even=4 * world)
    ranks = [0] if error == "group_of_one" else range(world)
    for rank in ranks:
        assert re.match(pattern, results[rank]["errors"][error]), (rank, results[rank]["errors"][error])


ONE_BAD_RANK = {  # the error of the rank with the bad call; the others name it (its rank {r}) and its error
    "kv_lens": r"InputError: context_parallel: the ring takes no kv_lens",
    "dtype": r"InputError: q, k and v must share one dtype, got q torch.float64",
    "odd_shard": r"InputError: context_parallel: a shard of 21 rows cannot hold 2 equal chunks",
    "missing_v": r"TypeError: causal\(\) is missing the argument 'v'",
    "layout": r"InputError: context_parallel: q is a shard of layout 'zigzag', but this context_parallel uses layout "
    r"'contiguous'",
    "input_grad": r"InputError: context_parallel: runtime inputs \['sinks'\] require grad",
    "unshard_dim": r"InputError: unshard: dim must be a dim of x_shard .* got 5",
}


@pytest.mark.parametrize("case", [*ONE_BAD_RANK, "sinks_shape"])
def test_one_bad_rank_raises_on_every_rank(ring, case):
    """The last rank alone makes a bad call: it raises its error, and every other rank an InputError naming
    that rank and its error, at once (well within the group's collective timeout: nobody waits for it)."""
    world, results = ring
    bad = world - 1
    for rank, result in enumerate(results):
        assert "one_bad_rank_crash" not in result, (rank, result["one_bad_rank_crash"])
        error, seconds = result["one_bad_rank"][case]
        if case == "sinks_shape":  # no rank's own check fails: the shapes differ across ranks
            pattern = (
                rf"InputError: context_parallel: sinks's shape and dtype differs across ranks \(rank 0: "
                rf"\[\[2\], 'torch.float32'\], .*rank {bad}: \[\[3\], 'torch.float32'\]\)"
            )
        elif rank == bad:
            pattern = ONE_BAD_RANK[case]
        else:
            who = "unshard" if case == "unshard_dim" else "context_parallel"
            pattern = (
                rf"InputError: {who}: rank {bad} of {world} refused the call, so every rank raises instead of "
                rf"waiting for it in a collective \(rank {bad}: {ONE_BAD_RANK[case]}"
            )
        assert re.match(pattern, error), (rank, error)
        assert seconds < QUICK_TIMEOUT / 3, (rank, seconds)


@af.attention
def window_both_sides(q, k, v):
    return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 7, 3)) @ v


@pytest.mark.parametrize("program", [causal, window_alibi, window_both_sides], ids=lambda p: p.__name__)
def test_chunk_pairs_skipped_are_those_the_reference_keeps_nothing_in(program):
    """``pairs.keeps_any`` (the masks' kv_range facts, evaluated on the host by ``attnfuse.host_eval``) against
    the float64 reference: with v the identity, out[i, j] is query i's weight of key j, nonzero where it is kept.
    Every (query chunk, key chunk) pair of 8 chunks of 5 keeps something exactly where the reference does."""
    from attnfuse.distributed.pairs import keeps_any, ring_program
    from attnfuse.plan import KernelConfig
    from attnfuse.runtime.compiled import compiled

    n, size = 40, 5
    q, k = torch.randn(1, 2, n, D), torch.randn(1, 2, n, D)
    weights = program.reference(q, k, torch.eye(n).expand(1, 2, n, n))
    config = KernelConfig(
        arch="interpreter",
        dtype="float32",
        head_dim=D,
        head_dim_v=n,
        group=1,
        save_lse=True,
        fp32_precision="ieee",
        positions=True,
    )
    masks = ring_program(compiled(program.graph(), config).plan).masks
    for qc in range(n // size):
        for kc in range(n // size):
            queries, keys = range(qc * size, qc * size + size), range(kc * size, kc * size + size)
            kept = bool((weights[..., queries.start : queries.stop, keys.start : keys.stop] != 0).any())
            assert keeps_any(masks, queries, keys, {"Nk": n, "HQ": 2, "GROUP": 1}) == kept, (qc, kc)


def test_without_a_process_group_is_an_input_error():
    import attnfuse.distributed as afd

    assert not dist.is_initialized()
    for call in (lambda: afd.context_parallel(causal), lambda: afd.shard(torch.zeros(1, 1, 4, 2))):
        with pytest.raises(
            af.InputError, match="needs an initialised process group: call torch.distributed.init_process_group first"
        ):
            call()


def test_import_attnfuse_leaves_distributed_out():
    """``import attnfuse`` imports neither attnfuse.distributed nor any torch.distributed module that
    ``import torch`` has not (a fresh interpreter)."""
    code = (
        "import sys, torch; before = {m for m in sys.modules if m.startswith('torch.distributed')}; "
        "import attnfuse, attnfuse.examples; "
        "after = {m for m in sys.modules if m.startswith('torch.distributed')}; "
        "print(sorted(after - before), 'attnfuse.distributed' in sys.modules)"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.split() == ["[]", "False"]


def test_benchmark_script_parses_its_arguments():
    """benchmarks/context_parallel.py (a GPU benchmark under torchrun) imports and parses its arguments on the
    CPU, and prints its scaling model there."""
    code = (
        "import runpy, sys; sys.argv = ['context_parallel.py', '--lengths', '65536', '131072', '--programs', "
        "'causal', '--rounds', '3']; ns = runpy.run_path('benchmarks/context_parallel.py'); "
        "args = ns['parse_args'](); print(args.lengths, args.programs, args.rounds, args.heads, args.model); "
        "print(ns['scaling_model']())"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    lines = shown.splitlines()
    assert lines[0] == "[65536, 131072] ['causal'] 3 (32, 8) False"
    assert "| 64 | 262144 | 4096 | yes | no |" in lines
