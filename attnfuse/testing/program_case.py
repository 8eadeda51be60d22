"""One program case run fused and compared with the float64 reference: the check the conformance kit repeats."""

from __future__ import annotations

import contextlib
import sys

import torch

from ..errors import UnsupportedError
from ..fragment_lint import indices_read
from ..ir import applications
from ..passes.fuse import fuse
from ..passes.lower import instance
from ..runtime.dropout import dropout_keep, dropout_state
from .grad_bounds import delta_rounding
from .strategies import ProgramCase, describe
from .tolerances import assert_matches_reference


def differentiable(case: ProgramCase, extras: dict) -> tuple[bool, dict[str, str]]:
    """Whether every combinator of the program declares a backward, and which extra tensors get gradients:
    by name, "" for a score-shaped one, or the sides ("q", "k", "qk") whose rows give a qk transform's."""
    fused = fuse(case.program.graph(**extras))
    grads: dict[str, str] = {}
    for i, app in enumerate(fused.applications()):
        fragment = instance(app, i).fragment
        transform = getattr(fragment, "transform", fragment)
        if hasattr(transform, "differentiable") and not transform.differentiable():
            return False, {}
        if getattr(fragment, "grad", "") is None:
            return False, {}
        declared = [(name, "") for name, _ in getattr(fragment, "tensor_grads", ())]
        for x in "qk" if transform is not None else "":
            if getattr(transform, x, ""):
                declared += [(name, x) for name, _ in getattr(transform, f"{x}_tensor_grads", ())]
        for name, side in declared:
            if name in app.inputs():
                argument = app.inputs()[name].name
                grads[argument] = "".join(sorted(set(grads.get(argument, "") + side)))
    return True, grads


def _synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _paged(k: torch.Tensor, v: torch.Tensor, page_size: int, seed: int) -> tuple[torch.Tensor, ...]:
    """k (B, Hkv, Nk, D), v (B, Hkv, Nk, DV) -> pools (pages, page_size, Hkv, D or DV) holding them in shuffled
    pages among two spare ones, and the block table (B, ceil(Nk / page_size)) int32."""
    B, H, Nk, _ = k.shape
    per_seq = -(-Nk // page_size)
    order = torch.randperm(B * per_seq + 2, generator=torch.Generator().manual_seed(seed))
    table = order[: B * per_seq].view(B, per_seq).to(torch.int32)

    def pool(x):
        padded = torch.nn.functional.pad(x, (0, 0, 0, per_seq * page_size - Nk))
        pages = padded.transpose(1, 2).reshape(B * per_seq, page_size, H, x.shape[-1])
        out = torch.randn(B * per_seq + 2, page_size, H, x.shape[-1], generator=torch.Generator().manual_seed(seed))
        out = out.to(x.dtype).to(x.device)
        out[table.view(-1).long()] = pages
        return out

    return pool(k), pool(v), table.to(k.device)


def check_program_case(
    case: ProgramCase,
    dtype: torch.dtype,
    device: str,
    seed: int,
    grads: bool = False,
    kv_lens: list[int] | None = None,
    page_size: int | None = None,
    positions: tuple[int, int, int] | None = None,
    packed: tuple[list[int], list[int]] | None = None,
    dropout_p: float = 0.0,
) -> None:
    """Run ``case`` fused and compare out, lse (when the normaliser has one) and, with ``grads``, the
    gradients of q, k, v and of tensor inputs with declared gradients, with the reference's. ``kv_lens``:
    per-sequence key counts (a KV cache; with at most 16 queries and no gradients, the split-KV path).
    ``page_size`` (with ``kv_lens``, no gradients): k and v are stored as a paged cache of pages of that many
    keys, in shuffled pages of a pool. ``positions``: (q_offset, k_offset, seq_len), a chunk of a longer
    sequence. ``packed`` (with batch size 1): the documents' query and key lengths of a packed call
    (``cu_seqlens_q``/``cu_seqlens_k``), compared with each document run alone through the reference (with the
    packed call's reference, the whole row, where a combinator indexes a tensor by query and key); a program
    packed calls do not take yet (``UnsupportedError``) is left out. ``dropout_p`` (> 0: not with
    ``page_size`` or ``packed``): the call drops attention weights, its dropout state drawn from a generator
    seeded with ``seed``; the reference replays its mask (``attnfuse.dropout_keep``)."""
    __tracebackhide__ = True  # pytest: a failure is its message, not this frame's tensors
    q, k, v = case.inputs(dtype, device, seed)
    extras = dict(case.extras_on(device))
    call: dict = {}
    if kv_lens is not None:
        call["kv_lens"] = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    if positions is not None:
        call.update(zip(("q_offset", "k_offset", "seq_len"), positions))
    if packed is not None:
        call["cu_seqlens_q"], call["cu_seqlens_k"] = (_offsets(n, device) for n in packed)
    if page_size is not None:
        if kv_lens is None or grads:
            raise ValueError("check_program_case: page_size needs kv_lens, and no gradients")
        k, v, call["block_table"] = _paged(k, v, page_size, seed)
    graph = case.program.graph(**extras)
    norm = graph.weights.apply.fragment()
    has_lse = norm.has_lse
    can_grad, grad_sides = differentiable(case, extras) if grads else (False, {})
    grad_extras = tuple(grad_sides)
    if dtype in (torch.float16, torch.bfloat16) and not norm.smooth:
        can_grad = False
    leaves = [q, k, v] + [extras[n] for n in grad_extras]
    if can_grad:
        for t in leaves:
            t.requires_grad_(True)
    replay: dict = {}  # the reference's dropout arguments
    if dropout_p:
        if packed is not None or page_size is not None:
            raise ValueError("check_program_case: dropout_p takes no page_size or packed")
        with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
            torch.manual_seed(seed)
            result = case.program(q, k, v, return_lse=has_lse, **call, **extras, dropout_p=dropout_p)
            torch.manual_seed(seed)
            state = dropout_state(device)
        shape = (*q.shape[:3], k.shape[2])
        replay = {"dropout_p": dropout_p, "dropout_mask": dropout_keep(state, dropout_p, shape)}
    elif packed is None:
        result = case.program(q, k, v, return_lse=has_lse, **call, **extras)
    else:
        try:
            result = case.program(q, k, v, return_lse=has_lse, **call, **extras)
        except UnsupportedError:
            return  # what packed calls do not take yet (runtime/packed.py), refused by name
    _synchronize(device)  # a fault in the fused kernel is reported with this example, not a later one
    out, lse = result if has_lse else (result, None)

    def reference(q, k, v, precision):
        """(out, lse or None) of the reference in ``precision``: the call's (a packed call's whole row where the
        program indexes a tensor by packed rows), or each packed document's."""
        if packed is None or reads_indices(graph):
            found = case.program.reference(q, k, v, return_lse=has_lse, dtype=precision, **call, **replay, **extras)
            return found if has_lse else (found, None)
        return _packed_reference(case, q, k, v, extras, packed, has_lse, precision)

    ref64, ref_lowp = reference(q, k, v, torch.float64), reference(q, k, v, dtype)
    assert_matches_reference(out, ref64[0], ref_lowp[0], dtype, what=f"out of {case.text}")
    if has_lse:
        if lse.dtype != (torch.float64 if dtype == torch.float64 else torch.float32):
            raise AssertionError(f"lse of {case.text}: dtype {lse.dtype} for {dtype} inputs")
        assert_matches_reference(lse, ref64[1], ref_lowp[1], dtype, what=f"lse of {case.text}")
    if not can_grad:
        return
    g = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(out.shape, generator=g).to(dtype).to(device)
    got = torch.autograd.grad(out, leaves, dout)
    _synchronize(device)
    rounding = [None] * len(leaves)
    if norm.needs_delta:
        with torch.no_grad():
            abs_weighted_v = reference(q.detach(), k.detach(), v.detach().abs(), torch.float64)[0]
        rounding = delta_rounding(ref64[1], ref64[0], abs_weighted_v, dout, leaves, dtype)
    want64 = torch.autograd.grad(ref64[0], leaves, dout.to(torch.float64))
    want_lowp = torch.autograd.grad(ref_lowp[0], leaves, dout)
    scores = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    rows = {"q": q.shape[0] * q.shape[1] * q.shape[2], "k": k.shape[0] * k.shape[1] * k.shape[2]}
    summed = [1, 1, 1]  # a score-shaped gradient sums scores; a transform's, the rows of its sides
    summed += [sum(rows[x] for x in grad_sides[n]) or scores // extras[n].numel() for n in grad_extras]
    names = ["dq", "dk", "dv", *(f"d{n}" for n in grad_extras)]
    for name, a, b, c, n, r in zip(names, got, want64, want_lowp, summed, rounding):
        assert_matches_reference(a, b, c, dtype, what=f"{name} of {case.text}", summed=n, rounding=r)


def reads_indices(graph) -> bool:
    """Whether a combinator of ``graph`` reads q_idx or k_idx (indexes a tensor by query and key): in a packed
    call, by packed rows, so no document's reference alone has its tensors."""
    return any(indices_read(app) for app in applications(graph))


def _offsets(lengths: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _packed_reference(
    case: ProgramCase, q, k, v, extras: dict, packed: tuple[list[int], list[int]], has_lse: bool, dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Out (1, Hq, total_q, DV) and lse (1, Hq, total_q) or None of a packed call: each document through the
    reference on its own, concatenated along the rows (a document with no keys: out 0, lse -inf)."""
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(*((zip(c[:-1], c[1:])) for c in (_offsets(n, "cpu").tolist() for n in packed))):
        rows = q[:, :, q0:q1]
        if q1 == q0:
            continue  # a document of keys only: no rows
        if k1 == k0:
            zeros = rows.new_zeros((*rows.shape[:3], v.shape[3]), dtype=dtype) + 0 * v.sum().to(dtype)
            outs.append(zeros)
            lses.append(torch.full(rows.shape[:3], float("-inf"), dtype=zeros.dtype, device=q.device))
            continue
        found = case.program.reference(rows, k[:, :, k0:k1], v[:, :, k0:k1], return_lse=has_lse, dtype=dtype, **extras)
        out, lse = found if has_lse else (found, None)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2) if has_lse else None


def add_note(exc: BaseException, note_text: str) -> None:
    """Attach replay information to a failure (Python 3.11's notes; printed on older Pythons)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note_text)
    else:
        print(note_text, file=sys.stderr)


def show_extras(extras: dict, full: bool) -> str:
    if not full:
        return describe(extras) or "none"
    with _full_print():
        return "\n".join(f"{n} = {v!r}" for n, v in extras.items()) or "none"


@contextlib.contextmanager
def _full_print():
    torch.set_printoptions(profile="full")
    try:
        yield
    finally:
        torch.set_printoptions(profile="default")
