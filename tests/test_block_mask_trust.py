"""BlockMask as untrusted input: hand-built or loaded block lists are checked before any kernel indexes keys
by them (checked once per mask, not per call), edits are detected in inference mode too, a mask does not
change with the tensor it was built from, and copies and files round-trip (and are checked).

The interpreter bounds-checks loads against the storages of the kernel's tensors, so k and v here are views
into a larger buffer whose other elements are NaN: a read outside the views shows in the output."""

import copy
import copyreg
import io
import pickle

import pytest
import torch

import attnfuse as af
from attnfuse import InputError
from attnfuse.block_mask import BlockMask
from attnfuse.runtime import interpreter
from attnfuse.testing import assert_matches_reference

from conftest import requires_cuda

N, BS, D = 64, 16, 16  # 4 x 4 blocks
EDITED_RE = r"block_mask: its tensors were edited in place after it was built.*build a new mask"
TENSORS = (
    "active",
    "kv_num_blocks",
    "kv_indices",
    "q_num_blocks",
    "q_indices",
    "q_block_order",
    "kv_block_order",
)  # the constructor's tensors without partial blocks (partial_index, partial_masks)


@af.attention
def sparse(q, k, v, block_mask):
    return af.softmax(af.block_sparse(af.scaled_dot_product(q, k), block_mask)) @ v


def _causal(H=2):
    """Blocks on and below the diagonal, for H heads: query block i lists key blocks 0..i."""
    return af.create_block_mask_from_blocks(lambda b, h, qb, kb: qb >= kb, None, H, N, N, block_size=BS)


def _fields(mask: BlockMask) -> dict:
    """The constructor's arguments for ``mask``, its tensors cloned."""
    return {
        "Nq": mask.Nq,
        "Nk": mask.Nk,
        "block_size": mask.block_size,
        "kv_heavy_blocks": mask.kv_heavy_blocks,
        **{name: getattr(mask, name).clone() for name in TENSORS},
    }


def _tensors(mask: BlockMask) -> tuple:
    return mask.tensors()


def _qkv(H=2, dtype=torch.float32, requires_grad=False):
    return tuple(torch.randn(1, H, N, D, dtype=dtype, requires_grad=requires_grad) for _ in range(3))


def _matches_reference(out, q, k, v, mask):
    assert_matches_reference(out, sparse.reference(q, k, v, mask), sparse.reference(q, k, v, mask, dtype=q.dtype))


@pytest.fixture
def launches(monkeypatch):
    """The number of interpreted kernel launches so far (a list holding one count)."""
    count = [0]
    launch = interpreter.InterpretedKernel.launch

    def counted(self, *args, **kwargs):
        count[0] += 1
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedKernel, "launch", counted)
    return count


def _set(name, index, value):
    def edit(f):
        f[name][index] = value

    return edit


def _set_field(name, value):
    def edit(f):
        f[name] = value

    return edit


# 1. hand-built lists are checked -------------------------------------------------------------------------

HOSTILE = {
    "index past the grid": (
        _set("kv_indices", (0, 1, 3, 2), 9),
        r"block_mask\.kv_indices\[0, 1, 3, 2\] = 9 is outside \[0, 4\)",
    ),
    "negative index": (
        _set("kv_indices", (0, 0, 2, 1), -1),
        r"block_mask\.kv_indices\[0, 0, 2, 1\] = -1 is outside \[0, 4\)",
    ),
    "column index past the grid": (
        _set("q_indices", (0, 1, 0, 3), 4),
        r"block_mask\.q_indices\[0, 1, 0, 3\] = 4 is outside \[0, 4\)",
    ),
    "count past the grid": (
        _set("kv_num_blocks", (0, 1, 3), 5),
        r"block_mask\.kv_num_blocks\[0, 1, 3\] = 5 is outside \[0, 4\] \(the key blocks\)",
    ),
    "negative count": (
        _set("q_num_blocks", (0, 0, 1), -1),
        r"block_mask\.q_num_blocks\[0, 0, 1\] = -1 is outside \[0, 4\] \(the query blocks\)",
    ),
    "duplicate entries": (
        _set("kv_indices", (0, 0, 3, 3), 1),
        r"block_mask\.kv_indices\[0, 0, 3, 1\] = 1 appears 2 times in the list of query block 3; "
        r"its first kv_num_blocks\[0, 0, 3\] = 4 entries must be distinct",
    ),
    "a row list short of the columns'": (
        _set("kv_num_blocks", (0, 1, 3), 3),
        r"block_mask\.kv_num_blocks\[0, 1, 3\] = 3, but block_mask\.active marks 4 "
        r"key blocks of query block 3 active",
    ),
    "a column list naming an inactive block": (
        _set("q_indices", (0, 0, 1, 0), 0),
        r"block_mask\.q_indices\[0, 0, 1, 0\] = 0: key block 1 lists query block 0, which "
        r"block_mask\.active\[0, 0, 0, 1\] marks inactive",
    ),
    "lists that disagree with active": (
        _set("active", (0, 1, 3, 0), False),
        r"block_mask\.kv_indices\[0, 1, 3, 0\] = 0: query block 3 lists key block 0, which "
        r"block_mask\.active\[0, 1, 3, 0\] marks inactive",
    ),
    "an order entry past the grid": (
        _set("kv_block_order", 1, 4),
        r"block_mask\.kv_block_order\[1\] = 4 is outside \[0, 4\)",
    ),
    "an order that is no permutation": (
        _set("q_block_order", 3, 3),
        r"block_mask\.q_block_order\[0\] = 3 appears 2 times; the order must be a "
        r"permutation of \[0, 4\)",
    ),
    "too many heavy blocks": (
        _set_field("kv_heavy_blocks", 5),
        r"block_mask\.kv_heavy_blocks must be an int in \[0, 4\] \(KB, the key blocks\), got 5",
    ),
    "int64 lists": (
        lambda f: f.update(kv_indices=f["kv_indices"].long()),
        r"block_mask\.kv_indices must be a torch\.int32 tensor \(Bm, Hm, QB, KB\) = \(1, 2, 4, 4\).*"
        r"got torch\.int64 \(1, 2, 4, 4\)",
    ),
    "an order of the wrong length": (
        lambda f: f.update(q_block_order=f["q_block_order"][:3]),
        r"block_mask\.q_block_order must be a torch\.int32 tensor \(QB,\) = \(4,\)",
    ),
    "a list that is not a tensor": (
        lambda f: f.update(q_indices=f["q_indices"].tolist()),
        r"block_mask\.q_indices must be a tensor, got list",
    ),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_hand_built_mask_is_refused_before_any_kernel_runs(case, launches):
    edit, message = HOSTILE[case]
    q, k, v = _qkv()
    fields = _fields(_causal())
    edit(fields)
    with pytest.raises(InputError, match=message):
        sparse(q, k, v, BlockMask(**fields))
    assert launches[0] == 0


def _poisoned_views(H=2):
    """k and v (1, H, N, D) as views of the first N rows of a (2, 1, H, 2N, D) buffer whose other rows are
    NaN, and clean copies of them."""
    buffer = torch.full((2, 1, H, 2 * N, D), float("nan"))
    buffer[:, :, :, :N] = torch.randn(2, 1, H, N, D)
    k, v = buffer[0, :, :, :N], buffer[1, :, :, :N]
    return k, v, k.clone(), v.clone()


def test_an_index_past_the_grid_cannot_read_outside_k_and_v(launches):
    q = torch.randn(1, 2, N, D)
    k, v, k_clean, v_clean = _poisoned_views()
    fields = _fields(_causal())
    fields["kv_indices"][0, 0, 3, 1] = 6  # key block 6: rows 96..111 of the buffer, past k and v
    with pytest.raises(InputError, match=r"block_mask\.kv_indices\[0, 0, 3, 1\] = 6 is outside \[0, 4\)"):
        sparse(q, k, v, BlockMask(**fields))
    assert launches[0] == 0
    mask = _causal()
    out = sparse(q, k, v, mask)
    assert launches[0] > 0 and not out.isnan().any()
    _matches_reference(out, q, k_clean, v_clean, mask)


def _shuffled(mask: BlockMask, g: torch.Generator) -> dict:
    """``mask``'s fields with each list's entries in a random order, entries past the counts set to -7,
    random orders and 2 heavy key blocks: a valid mask ``from_blocks`` would not build."""
    f = _fields(mask)
    f["kv_heavy_blocks"] = 2
    for num, idx in (("kv_num_blocks", "kv_indices"), ("q_num_blocks", "q_indices")):
        n = f[idx].shape[-1]
        keys = torch.rand(f[idx].shape, generator=g) + (torch.arange(n) >= f[num][..., None])  # listed first
        f[idx] = f[idx].gather(-1, keys.argsort(dim=-1)).masked_fill(torch.arange(n) >= f[num][..., None], -7)
    for order in ("q_block_order", "kv_block_order"):
        f[order] = torch.randperm(f[order].shape[0], generator=g).to(torch.int32)
    return f


@pytest.mark.parametrize("Hkv", [2, 1])
def test_a_valid_hand_built_mask_in_any_order_matches_the_reference(Hkv):
    """Lists in any order (padding past the counts never read), any orders, forward and backward (dK/dV
    walks the column lists), with k and v views into a poisoned buffer for the forward."""
    g = torch.Generator().manual_seed(1)
    active = (torch.rand(1, 2, 4, 4, generator=g) < 0.3) | torch.eye(4, dtype=torch.bool)
    active[..., 0, :] = active[..., :, 0] = True  # a heavy query block and a heavy key block
    mask = BlockMask(**_shuffled(BlockMask.from_blocks(active, N, N, block_size=BS), g))
    assert not torch.equal(mask.kv_indices, BlockMask.from_blocks(active, N, N, block_size=BS).kv_indices)
    q = torch.randn(1, 2, N, D)
    k, v, k_clean, v_clean = _poisoned_views(Hkv)
    _matches_reference(sparse(q, k, v, mask), q, k_clean, v_clean, mask)
    q, k, v = (t.requires_grad_() for t in (q, k_clean, v_clean))
    out = sparse(q, k, v, mask)
    ref = sparse.reference(q, k, v, mask)
    dout = torch.randn(out.shape)
    wants = torch.autograd.grad(ref, (q, k, v), dout.double())
    for got, want in zip(torch.autograd.grad(out, (q, k, v), dout), wants):
        torch.testing.assert_close(got.double(), want.double(), atol=5e-5, rtol=0)


def _count_checks(monkeypatch) -> list:
    """A list that grows by one each time a mask's values are checked."""
    from attnfuse import block_mask_checks

    checks = []
    check = block_mask_checks._check_values
    monkeypatch.setattr(block_mask_checks, "_check_values", lambda t: (checks.append(1), check(t)))
    return checks


def test_a_mask_is_checked_once_not_per_call(monkeypatch):
    checks = _count_checks(monkeypatch)
    mask = BlockMask(**_fields(_causal()))
    assert len(checks) == 1
    q, k, v = _qkv()
    for _ in range(3):
        _matches_reference(sparse(q, k, v, mask), q, k, v, mask)
    mask.to_dense()
    rebuilt = BlockMask.rebuilt((mask.Nq, mask.Nk, mask.block_size, mask.kv_heavy_blocks), _tensors(mask))
    assert rebuilt.kv_indices is mask.kv_indices and copy.copy(mask).active is mask.active
    assert len(checks) == 1
    af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: qb >= kb, None, 2, N, N, block_size=BS
    )  # derived: nothing to check
    assert len(checks) == 1


def test_through_torch_compile_a_mask_is_checked_once(monkeypatch):
    checks = _count_checks(monkeypatch)
    mask = BlockMask(**_fields(_causal()))
    q, k, v = _qkv()
    compiled = torch.compile(lambda q, k, v: sparse(q, k, v, mask), backend="aot_eager", fullgraph=True)
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v), sparse(q, k, v, mask), atol=0, rtol=0)
    assert len(checks) == 1


def test_through_torch_compile_an_edited_mask_is_refused():
    mask = BlockMask(**_fields(_causal()))
    q, k, v = _qkv()
    compiled = torch.compile(lambda q, k, v: sparse(q, k, v, mask), backend="aot_eager", fullgraph=True)
    _matches_reference(compiled(q, k, v), q, k, v, mask)
    mask.kv_num_blocks[0, 0, 3] = 2  # lists that still fit the grid, but no longer the mask's blocks
    with pytest.raises(InputError, match=EDITED_RE):
        compiled(q, k, v)


# 2. edits in inference mode, and the tensor a mask was built from -------------------------------------------


def _uses(mask, q, k, v):
    return (
        lambda: sparse(q, k, v, mask),
        lambda: sparse.reference(q, k, v, mask),
        mask.to_dense,
        lambda: copy.deepcopy(mask),
    )


@pytest.mark.parametrize("built_in_inference_mode", [True, False])
def test_edits_in_inference_mode_are_refused(built_in_inference_mode):
    q, k, v = _qkv()
    with torch.inference_mode(built_in_inference_mode):
        mask = _causal()
    assert not any(t.is_inference() for t in _tensors(mask))
    with torch.inference_mode():
        _matches_reference(sparse(q, k, v, mask), q, k, v, mask)
        mask.active[0, 1, 3, 0] = False
        for use in _uses(mask, q, k, v):
            with pytest.raises(InputError, match=EDITED_RE):
                use()
    for use in _uses(mask, q, k, v):
        with pytest.raises(InputError, match=EDITED_RE):
            use()


@pytest.mark.parametrize("mode", [True, False], ids=["inference mode", "grad mode"])
def test_editing_the_grid_given_to_from_blocks_does_not_change_the_mask(mode):
    q, k, v = _qkv()
    with torch.inference_mode(mode):
        active = torch.rand(1, 2, 4, 4) < 0.5
        built = active.clone()
        mask = BlockMask.from_blocks(active, N, N, block_size=BS)
        active.logical_not_()
    assert torch.equal(mask.active, built)
    mask.check_unchanged()
    _matches_reference(sparse(q, k, v, mask), q, k, v, BlockMask.from_blocks(built, N, N, block_size=BS))


def test_a_mask_built_from_inference_tensors_owns_normal_copies():
    q, k, v = _qkv()
    with torch.inference_mode():
        fields = _fields(_causal())
        mask = BlockMask(**fields)
        assert not any(t.is_inference() for t in _tensors(mask))
        fields["kv_indices"][0, 0, 3, 1] = 9  # the caller's inference tensor: not the mask's
        fields["active"].zero_()
        _matches_reference(sparse(q, k, v, mask), q, k, v, _causal())
        mask.kv_indices[0, 0, 3, 1] = 2  # the mask's own: detected
        with pytest.raises(InputError, match=EDITED_RE):
            sparse(q, k, v, mask)


# 3. copies and files ------------------------------------------------------------------------------------


def _saved(mask, weights_only):
    buffer = io.BytesIO()
    torch.save(mask, buffer)
    buffer.seek(0)
    if not weights_only:
        return torch.load(buffer, weights_only=False)
    with torch.serialization.safe_globals([BlockMask]):
        return torch.load(buffer, weights_only=True)


COPIES = {
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "torch.save": lambda m: _saved(m, False),
    "torch.save weights_only": lambda m: _saved(m, True),
}


@pytest.mark.parametrize("how", COPIES)
def test_a_copy_matches_the_reference_and_edits_to_it_are_refused(how):
    q, k, v = _qkv(dtype=torch.float64)
    original = af.create_block_mask_from_blocks(
        lambda b, h, qb, kb: (qb + kb + h) % 3 != 1, None, 2, N, N, block_size=BS
    )
    mask = COPIES[how](original)
    assert isinstance(mask, BlockMask) and all(torch.equal(a, b) for a, b in zip(_tensors(mask), _tensors(original)))
    _matches_reference(sparse(q, k, v, mask), q, k, v, original)
    mask.q_indices[0, 1, 0, 0] = 3
    for use in _uses(mask, q, k, v):
        with pytest.raises(InputError, match=EDITED_RE):
            use()


@pytest.mark.parametrize("weights_only", [False, True])
@pytest.mark.parametrize("case", ["index past the grid", "duplicate entries", "an order that is no permutation"])
def test_a_file_holding_hostile_lists_is_refused(case, weights_only, monkeypatch):
    edit, message = HOSTILE[case]
    mask = _causal()
    state = _fields(mask)
    edit(state)
    monkeypatch.setattr(BlockMask, "__getstate__", lambda self: state)  # the file's contents, forged
    with pytest.raises(InputError, match=message):
        _saved(mask, weights_only)


@pytest.mark.parametrize("state", [{"Nq": N}, None], ids=["missing fields", "not a dict"])
def test_a_malformed_state_is_refused(state):
    with pytest.raises(InputError, match=r"a pickled BlockMask's state must be a dict of \['Nk', 'Nq', "):
        BlockMask.__new__(BlockMask).__setstate__(state)


def test_a_file_holding_a_mask_without_its_state_is_refused_at_use(monkeypatch):
    mask = _causal()
    monkeypatch.setattr(BlockMask, "__reduce_ex__", lambda self, protocol: (copyreg.__newobj__, (BlockMask,)))
    loaded = _saved(mask, weights_only=True)  # NEWOBJ with no BUILD: an instance with no fields
    monkeypatch.undo()
    q, k, v = _qkv()
    with pytest.raises(InputError, match=r"block_mask: this BlockMask has no fields \(unpickled without its state"):
        sparse(q, k, v, loaded)


@requires_cuda
def test_on_cuda_lists_are_checked_and_a_valid_mask_round_trips():
    g = torch.Generator().manual_seed(2)
    fields = {name: t.cuda() if isinstance(t, torch.Tensor) else t for name, t in _shuffled(_causal(), g).items()}
    hostile = dict(fields, kv_indices=fields["kv_indices"].clone())
    hostile["kv_indices"][0, 1, 3, 2] = 9
    with pytest.raises(InputError, match=r"block_mask\.kv_indices\[0, 1, 3, 2\] = 9 is outside \[0, 4\)"):
        BlockMask(**hostile)
    mask = BlockMask(**fields)
    q, k, v = (t.cuda() for t in _qkv(dtype=torch.float16))
    for copied in (mask, _saved(mask, weights_only=True), copy.deepcopy(mask)):
        assert copied.active.is_cuda
        _matches_reference(sparse(q, k, v, copied), q, k, v, _causal())
