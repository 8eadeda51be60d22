"""kv_lens and block_table checked on the device with no host sync (runtime/validate.py, error_record.py).

The check kernel writes the first bad entry into its device's error record. On CPU (the interpreter) the
call raises at once; CUDA's deferred reporting is run here by a CPU record made deferred, whose copy's
completion is an injected event. The interpreter bounds-checks every load, so a call that returns read
nothing outside the pool.
"""

import threading
import time

import pytest
import torch

import attnfuse as af
from attnfuse.runtime import error_record, launch, validate
from attnfuse.runtime.error_record import RECORD_SIZE, ErrorRecord

P, PAGE, HKV, HQ, NQ, D = 6, 16, 2, 4, 2, 16  # pool pages, page size, kv heads, q heads, queries, head dim
CPU = torch.device("cpu")

# Every hostile value tests/test_hostile_memory.py and tests/test_gpu.py use: block_table entries ("page"; P is
# the first page past the pool, 64 in test_gpu's 64-page pool) and kv_lens ("length"; the cache holds 3 * PAGE
# keys per sequence, so 3 * PAGE + 1 is the first length past its capacity).
HOSTILE = [
    ("page", P, torch.int32),
    ("page", -1, torch.int32),
    ("page", 10**6, torch.int32),
    ("page", -(2**31), torch.int32),
    ("page", 2**32 + 3, torch.int64),
    ("length", 2**32 + 5, torch.int64),
    ("length", -1, torch.int64),
    ("length", 3 * PAGE + 1, torch.int32),
    ("length", 2**31 - 1, torch.int32),
    ("length", 3 * PAGE + 1, torch.int64),
]
CASES = [
    (what, value, dtype, cache)
    for what, value, dtype in HOSTILE
    for cache in (("paged",) if what == "page" else ("contiguous", "paged"))
]


@af.attention
def dense(q, k, v):
    return af.softmax(af.scaled_dot_product(q, k)) @ v


def _cache():
    """q (2, HQ, NQ, D); pools (P, PAGE, HKV, D) and the contiguous k, v (2, HKV, 48, D) they hold through
    ``table`` (2, 3); lens (2,): 40 and 30 keys."""
    pool_k, pool_v = (torch.randn(P, PAGE, HKV, D, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
    k, v = (pool[table.long()].reshape(2, 3 * PAGE, HKV, D).transpose(1, 2).contiguous() for pool in (pool_k, pool_v))
    q = torch.randn(2, HQ, NQ, D, dtype=torch.float64)
    return q, pool_k, pool_v, k, v, table, torch.tensor([40, 30], dtype=torch.int32)


def _hostile(what, value, dtype, table, lens):
    """The table and lens with the hostile value: slot 1 of sequence 1 (keys 16..29 of its 30), or the
    length of sequence 1."""
    table, lens = table.to(dtype, copy=True), lens.to(dtype, copy=True)
    if what == "page":
        table[1, 1] = value
    else:
        lens[1] = value
    return table, lens


def _message(what, value, cache):
    if what == "page":
        return (
            rf"block_table\[1, 1\] = {value} is not a page of the pool: the 2 entries sequence 1 uses "
            rf"\(kv_lens\[1\] = 30, page_size {PAGE}\) must each be in \[0, {P}\)"
        )
    capacity = (
        rf"the capacity of the contiguous cache: Nk = {3 * PAGE}"
        if cache == "contiguous"
        else rf"the capacity of its paged cache: block_table's 3 pages x page_size {PAGE}"
    )
    return rf"kv_lens\[1\] = {value}: a sequence's key count must be in \[0, {3 * PAGE}\], {capacity}$"


def _call(q, pool_k, pool_v, k, v, table, lens, cache, split_kv, validate=True):
    if cache == "paged":
        return launch.run_attention(
            dense.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, split_kv=split_kv, validate=validate
        )
    return launch.run_attention(dense.graph(), q, k, v, kv_lens=lens, split_kv=split_kv, validate=validate)


@pytest.mark.parametrize("split_kv", [True, False], ids=["split_kv", "forward"])
@pytest.mark.parametrize("what, value, dtype, cache", CASES, ids=lambda x: str(x))
def test_hostile_value_is_named_and_never_read(what, value, dtype, cache, split_kv):
    q, pool_k, pool_v, k, v, table, lens = _cache()
    bad_table, bad_lens = _hostile(what, value, dtype, table, lens)
    with pytest.raises(af.InputError, match=_message(what, value, cache)):
        _call(q, pool_k, pool_v, k, v, bad_table, bad_lens, cache, split_kv)
    good = _call(q, pool_k, pool_v, k, v, table, lens, cache, split_kv)  # raised once: the record is clear
    torch.testing.assert_close(good, dense.reference(q, k, v, kv_lens=lens), atol=1e-10, rtol=0)

    out = _call(q, pool_k, pool_v, k, v, bad_table, bad_lens, cache, split_kv, validate=False)
    if what == "length":  # counts as the nearest bound: 49 or 2**32 + 5 as the capacity (48 keys), -1 as none
        want = dense.reference(q, k, v, kv_lens=bad_lens.clamp(0, 3 * PAGE))
    else:  # the keys on the bad page (16..29 of sequence 1) are absent
        want = torch.cat(
            (
                dense.reference(q[:1], k[:1], v[:1], kv_lens=lens[:1]),
                dense.reference(q[1:], k[1:, :, :16], v[1:, :, :16]),
            )
        )
    torch.testing.assert_close(out, want, atol=1e-10, rtol=0)


class _Event:
    """Stands for a CUDA event: ``done`` is whether the last copy has completed (set by the test)."""

    def __init__(self):
        self.done, self.recorded, self.queried = True, 0, 0

    def record(self):
        self.done, self.recorded = False, self.recorded + 1

    def query(self):
        self.queried += 1
        return self.done

    def synchronize(self):
        self.done = True


@pytest.fixture
def deferred(monkeypatch):
    """The CPU's error record made deferred, as a CUDA device's is: (record, event, capture flag)."""
    event, capture = _Event(), {"on": False}
    record = ErrorRecord(
        torch.zeros(RECORD_SIZE, dtype=torch.int64),
        deferred=True,
        host=torch.zeros(RECORD_SIZE, dtype=torch.int64),
        event=event,
        capturing=lambda: capture["on"],
    )
    monkeypatch.setitem(error_record._records, CPU, record)
    return record, event, capture


def _paged_calls():
    """(good call, call with table[1, 1] = 10**6, call with table[0, 0] = -1), each returning its output."""
    q, pool_k, pool_v, _, _, table, lens = _cache()
    bad, worse = table.clone(), table.clone()
    bad[1, 1], worse[0, 0] = 10**6, -1
    return tuple(
        (lambda t=t, **kw: dense(q, pool_k, pool_v, kv_lens=lens, block_table=t, **kw)) for t in (table, bad, worse)
    )


BAD_1_1 = r"block_table\[1, 1\] = 1000000 is not a page of the pool: .* \(recorded on cpu by the check of an earlier"


def test_deferred_error_is_raised_once_by_a_later_call_after_its_copy(deferred):
    record, event, _ = deferred
    good, bad, _ = _paged_calls()
    good()  # copy 1 in flight: its event not done
    assert event.recorded == 1
    bad()  # recorded on the device; no copy while one is in flight, and nothing raised here
    assert event.recorded == 1 and record.values[0] == error_record.BAD_PAGE
    good()  # copy 1 has not completed: not reported
    event.done = True
    good()  # copy 1 (made before the error) shows none; copy 2 starts after this call's check
    assert event.recorded == 2
    good()  # copy 2 not done yet
    event.done = True
    with pytest.raises(af.InputError, match=BAD_1_1):
        good()
    assert not record.values.any()  # cleared: raised once
    for _ in range(2):
        good()
        event.done = True
    af.check_errors()


def test_check_errors_waits_raises_and_clears(deferred):
    record, event, _ = deferred
    good, bad, _ = _paged_calls()
    bad()
    with pytest.raises(af.InputError, match=BAD_1_1):
        af.check_errors("cpu")
    assert event.done and not record.values.any()
    af.check_errors()  # raised once
    good()
    event.done = True
    good()


def test_first_error_wins_until_reported(deferred):
    _, event, _ = deferred
    good, bad, worse = _paged_calls()
    bad()
    worse()  # sequence 0's error comes second: the record keeps sequence 1's
    with pytest.raises(af.InputError, match=BAD_1_1):
        af.check_errors()
    worse()  # reported: a new error is recorded
    with pytest.raises(af.InputError, match=r"block_table\[0, 0\] = -1 is not a page of the pool: the 3 entries "):
        af.check_errors()


def test_one_launch_with_two_bad_sequences_records_one_with_its_facts():
    q, pool_k, pool_v, _, _, table, lens = _cache()
    table[0, 2], table[1, 0] = 7, -3
    with pytest.raises(af.InputError) as info:
        dense(q, pool_k, pool_v, kv_lens=lens, block_table=table)
    assert str(info.value) in (
        f"block_table[0, 2] = 7 is not a page of the pool: the 3 entries sequence 0 uses (kv_lens[0] = 40, "
        f"page_size {PAGE}) must each be in [0, {P})",
        f"block_table[1, 0] = -3 is not a page of the pool: the 2 entries sequence 1 uses (kv_lens[1] = 30, "
        f"page_size {PAGE}) must each be in [0, {P})",
    )


def test_a_capture_checks_but_neither_copies_nor_reports(deferred):
    record, event, capture = deferred
    good, bad, _ = _paged_calls()
    good()
    event.done = True  # copy 1 complete, not yet looked at
    capture["on"] = True
    bad()  # the captured check: recorded, no query, no copy
    good(validate=False)  # nor does an unvalidated call query inside a capture
    assert (event.recorded, event.queried) == (1, 0) and record.values[0] == error_record.BAD_PAGE
    with pytest.raises(af.InputError, match=r"check_errors\(\) waits for the device, which a CUDA graph capture"):
        af.check_errors()
    capture["on"] = False
    good()  # copy 1 showed no error; copy 2 starts
    event.done = True
    with pytest.raises(af.InputError, match=BAD_1_1):
        good()


def test_unvalidated_calls_report_but_make_no_record_and_launch_no_check(deferred, monkeypatch):
    _, event, _ = deferred
    good, bad, _ = _paged_calls()
    bad()
    event.done = True
    with pytest.raises(af.InputError, match=BAD_1_1):
        good(validate=False)  # a call with kv_lens reports a recorded error
    monkeypatch.setattr(error_record, "_records", {})
    monkeypatch.setattr(validate, "check_cache_values", None)  # a check would fail here
    bad(validate=False)
    assert error_record._records == {}


def test_the_reference_raises_at_once(deferred):
    q, pool_k, pool_v, _, _, table, lens = _cache()
    table[1, 1] = 10**6
    with pytest.raises(af.InputError, match=BAD_1_1):
        dense.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table)


def test_the_check_writes_the_record_without_reading_values_on_the_host(deferred, monkeypatch):
    record, event, _ = deferred
    _, _, _, _, _, table, lens = _cache()
    table, lens = table.to(torch.int64), lens.to(torch.int64)
    table[1, 1] = 2**32 + 3

    def refuse(*args, **kwargs):
        raise AssertionError("a host read of a tensor's values inside the check")

    for name in ("tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    validate.check_cache_values(lens, table, P, PAGE, 3 * PAGE)
    monkeypatch.undo()
    assert record.values.tolist() == [error_record.BAD_PAGE, 1, 1, 2**32 + 3, 30, 2, P, PAGE, 3 * PAGE]
    assert event.recorded == 1 and record._host.tolist() == record.values.tolist()  # the copy, not a read


@pytest.mark.parametrize("bad", [-4, 8])
def test_the_check_kernel_records_a_length_with_its_sequence(bad):
    """A negative length, or one past the capacity (7 keys here), of sequence 2; its neighbours fit."""
    values = torch.zeros(RECORD_SIZE, dtype=torch.int64)
    record = ErrorRecord(values, deferred=False)
    lens = torch.tensor([5, 7, bad], dtype=torch.int64)
    with pytest.raises(
        af.InputError,
        match=rf"^kv_lens\[2\] = {bad}: a sequence's key count must be in \[0, 7\], "
        rf"the capacity of the contiguous cache: Nk = 7$",
    ):
        record.run_check(
            lambda v: validate._interpreted.launch(
                (3,),
                validate.CHECK.bind(
                    {
                        "KvLens": lens,
                        "BlockTable": lens,
                        "Record": v,
                        "stride_btb": 0,
                        "stride_btp": 0,
                        "PAGE_SIZE": 0,
                        "NUM_PAGES": 0,
                        "CAPACITY": 7,
                    }
                ),
                validate.CHECK.constexprs({"PAGED": False, "BLOCK_P": 16}),
            )
        )
    assert not values.any()


def test_two_threads_make_one_record(monkeypatch):
    monkeypatch.setattr(error_record, "_records", {})
    made, slow = [], error_record._made

    def slowly(device):
        made.append(device)
        time.sleep(0.05)  # both threads are past their unlocked lookup by now
        return slow(device)

    monkeypatch.setattr(error_record, "_made", slowly)
    start, found = threading.Barrier(2), []

    def ask():
        start.wait()
        found.append(error_record.record_for(CPU))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert made == [CPU] and len(found) == 2 and found[0] is found[1] is error_record._records[CPU]


@pytest.mark.parametrize("validate", [True, False])
def test_the_op_under_torch_compile_checks_as_an_eager_call_does(deferred, validate):
    """The op records the error (validate=True) or launches no check (False), and reports a recorded
    one either way."""
    record, event, _ = deferred
    q, pool_k, pool_v, k, v, table, lens = _cache()
    bad = table.clone()
    bad[1, 1] = 10**6
    compiled = torch.compile(
        lambda q, k, v, lens, table: dense(q, k, v, kv_lens=lens, block_table=table, validate=validate),
        backend="aot_eager",
        fullgraph=True,
    )
    out = compiled(q, pool_k, pool_v, lens, bad)
    assert (record.values[0] == error_record.BAD_PAGE) == validate
    if validate:
        with pytest.raises(af.InputError, match=BAD_1_1):
            af.check_errors()
    else:
        want = torch.cat(
            (
                dense.reference(q[:1], k[:1], v[:1], kv_lens=lens[:1]),
                dense.reference(q[1:], k[1:, :, :16], v[1:, :, :16]),
            )
        )
        torch.testing.assert_close(out, want, atol=1e-10, rtol=0)
        dense(q, pool_k, pool_v, kv_lens=lens, block_table=bad)  # eager, validated: recorded
        event.done = True
        with pytest.raises(af.InputError, match=BAD_1_1):
            compiled(q, pool_k, pool_v, lens, table)


def test_a_cuda_record_is_not_made_inside_a_capture(monkeypatch):
    """Its memory would belong to the graph's pool: the capture needs a validated warm-up call first."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(
        af.InputError,
        match=r"inside a CUDA graph capture needs cuda:0's error record, which is made "
        r"outside a capture: make one validated call on cuda:0 before capturing",
    ):
        error_record._made(torch.device("cuda", 0))


@pytest.mark.parametrize("ones", [False, True], ids=["ints", "page_size_and_pages_1"])
def test_the_check_kernel_compiles_for_sm90_with_one_compare_and_swap(ones):
    """Triton's compiler and ptxas, not the interpreter (no GPU needed): one thread of the program swaps, and
    the others see its result; also with PAGE_SIZE and NUM_PAGES specialised to the constant 1."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ("PAGE_SIZE", "NUM_PAGES")
    signature = {
        "KvLens": "*i32",
        "BlockTable": "*i64",
        "Record": "*i64",
        "stride_l": "i32",
        "stride_btb": "i32",
        "stride_btp": "i32",
        **{n: "constexpr" if ones else "i32" for n in ints},
        "CAPACITY": "i32",
        "PAGED": "constexpr",
        "BLOCK_P": "constexpr",
    }
    constants = {"PAGED": True, "BLOCK_P": 16, **({n: 1 for n in ints} if ones else {})}
    compiled = triton.compile(
        ASTSource(validate._jitted.fn, signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
    )
    ptx = compiled.asm["ptx"]
    assert ptx.count("atom.global.acq_rel.gpu.cas.b64") == 1 and "bar.sync" in ptx and compiled.asm["cubin"]
