"""Where the device-side checks of ``kv_lens`` and ``block_table`` (``validate.py``) and of packed sequences'
``cu_seqlens_q``, ``cu_seqlens_k`` (``packed.py``) record a bad entry, and
how that error reaches the caller without a host sync.

One record per device, made once and kept: ``RECORD_SIZE`` int64 values ``FIELDS``, all zero while no error
is recorded. The check kernel writes the first bad entry it finds with an atomic compare-and-swap on
``kind``: the first error wins, and the record keeps it until it is reported.

On CPU (Triton's interpreter, synchronous) the call whose check found the error raises it right after the
check. On CUDA errors are reported asynchronously, like CUDA's own: after a check (outside a CUDA graph
capture, with no copy in flight) the record is copied to pinned host memory without blocking and an event
recorded; the next validated call, or any call with ``kv_lens``, raises the ``InputError`` once that event
has completed. ``check_errors`` waits for the record (a host sync) and raises. Reporting an error clears
the record, so each is raised once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ..device_cache import made_outside_graph_pools
from ..errors import InputError

FIELDS = ("kind", "sequence", "slot", "value", "length", "used", "num_pages", "page_size", "capacity")
RECORD_SIZE = len(FIELDS)
NO_ERROR, BAD_LENGTH, BAD_PAGE, BAD_OFFSET, LONG_DOCUMENT = 0, 1, 2, 3, 4  # kinds (the last two: runtime/packed.py)
MAX_LENGTH = 2**31 - 1


def message(values: list[int]) -> str:
    """The InputError message of a record's ``values`` (``FIELDS``; kind BAD_LENGTH or BAD_PAGE; page_size 0
    for a contiguous cache; capacity: its key rows per sequence, at most MAX_LENGTH)."""
    kind, b, slot, value, length, used, num_pages, page_size, capacity = values
    if kind in (BAD_OFFSET, LONG_DOCUMENT):
        return _packed_message(kind, b, "qk"[slot], value, length, used, capacity)
    if kind == BAD_LENGTH:
        if capacity >= MAX_LENGTH:
            held = "no more than an int32 counts"
        elif page_size:
            held = (
                f"the capacity of its paged cache: block_table's {capacity // page_size} pages x page_size {page_size}"
            )
        else:
            held = f"the capacity of the contiguous cache: Nk = {capacity}"
        return f"kv_lens[{b}] = {value}: a sequence's key count must be in [0, {capacity}], {held}"
    return (
        f"block_table[{b}, {slot}] = {value} is not a page of the pool: the {used} entries sequence {b} uses "
        f"(kv_lens[{b}] = {length}, page_size {page_size}) must each be in [0, {num_pages})"
    )


def _packed_message(kind: int, i: int, side: str, value: int, before: int, total: int, limit: int) -> str:
    """A packed call's bad offset (``BAD_OFFSET``: cu_seqlens_<side>[i] = value, after ``before``) or
    document longer than max_seqlen_<side> = ``limit`` (``LONG_DOCUMENT``); ``total``: the packed length."""
    name = f"cu_seqlens_{side}"
    if kind == LONG_DOCUMENT:
        return (
            f"max_seqlen_{side} = {limit} is below the length of document {i - 1}: {name}[{i}] - {name}[{i - 1}] "
            f"= {value} - {before} = {value - before}; pass the longest document's length, or None"
        )
    return (
        f"{name}[{i}] = {value}{f' (after {before})' if i else ''}: document offsets must start at 0, never "
        f"decrease, and end at the packed length of {'q' if side == 'q' else 'k and v'}, {total}"
    )


class StreamEvent:
    """A CUDA event recorded on the current stream of ``device`` (whichever device is current)."""

    def __init__(self, device: torch.device):
        self._device, self._event = device, torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()


class ErrorRecord:
    """One device's error record: ``values`` (RECORD_SIZE,) int64 on the device, zero while no error.

    Synchronous (``deferred=False``, CPU): ``run_check`` raises the error its check recorded. Deferred (CUDA):
    ``host`` (RECORD_SIZE,) int64 pinned memory receives non-blocking copies, ``event`` (``record()``,
    ``query()``, ``synchronize()``) marks each copy's completion and ``capturing()`` says whether the current
    stream is being captured into a CUDA graph (no copy, no query then)."""

    def __init__(
        self,
        values: torch.Tensor,
        *,
        deferred: bool,
        host: torch.Tensor | None = None,
        event: Any = None,
        capturing: Callable[[], bool] | None = None,
    ):
        self.values = values
        self._deferred, self._host, self._event, self._capturing = deferred, host, event, capturing
        self._in_flight = False  # a copy to ``host`` was issued and not yet seen complete
        self._lock = threading.Lock()

    def run_check(self, launch: Callable[[torch.Tensor], None]) -> None:
        """Report an earlier error whose copy has arrived, then ``launch(values)`` (the check kernel, in the
        current stream), then raise its error (synchronous) or start a copy of the record (deferred)."""
        if not self._deferred:
            with self._lock:  # another thread's check must not write the record between launch and read
                launch(self.values)
                self._raise_if_error(self.values.tolist())
            return
        capturing = self._capturing()
        if not capturing:
            self._report()
        launch(self.values)  # inside a capture: launched at every replay
        if not self._in_flight and not capturing:
            with self._lock:
                if not self._in_flight:
                    self._host.copy_(self.values, non_blocking=True)
                    self._event.record()
                    self._in_flight = True

    def report(self) -> None:
        """Raise the InputError of an error whose copy has completed (deferred; nothing inside a capture)."""
        if self._in_flight and not self._capturing():
            self._report()

    def _report(self) -> None:
        if not self._in_flight or not self._event.query():
            return
        with self._lock:
            if not self._in_flight:
                return
            self._in_flight = False
            self._raise_if_error(self._host.tolist())

    def wait(self) -> None:
        """Wait for every check launched so far on the device, in any stream (a host sync on CUDA), and raise
        the InputError of a recorded error."""
        if self._deferred and self._capturing():
            raise InputError(
                "attnfuse.check_errors() waits for the device, which a CUDA graph capture cannot; "
                "call it after the capture, or after a replay"
            )
        with self._lock:
            if self.values.is_cuda:
                torch.cuda.synchronize(self.values.device)
            if self._in_flight:  # its copy must not report this error again later
                self._event.synchronize()
                self._in_flight = False
            self._raise_if_error(self.values.tolist())

    def _raise_if_error(self, values: list[int]) -> None:
        """Clear the record and raise, if ``values`` (a copy of it) hold an error. Under the lock."""
        if values[0] == NO_ERROR:
            return
        self.values.zero_()  # in stream order: after the checks that were launched before this
        where = (
            ""
            if not self._deferred
            else (
                f" (recorded on {self.values.device} by the check of an earlier call: CUDA reports it at a later call "
                f"with kv_lens or cu_seqlens, or at attnfuse.check_errors())"
            )
        )
        raise InputError(message(values) + where)


_records: dict[torch.device, ErrorRecord] = {}
_records_lock = threading.Lock()


def record_for(device: torch.device) -> ErrorRecord:
    """The error record of ``device`` (a tensor's device), made on first use, once whichever threads ask."""
    found = _records.get(device)
    if found is None:
        with _records_lock:
            found = _records.get(device)
            if found is None:
                found = _records[device] = _made(device)
    return found


def _made(device: torch.device) -> ErrorRecord:
    """A new record: on CUDA outside every CUDA graph memory pool (a graph's later allocations would
    overwrite it), which a capture cannot do."""
    if device.type != "cuda":
        return ErrorRecord(torch.zeros(RECORD_SIZE, dtype=torch.int64, device=device), deferred=False)
    if torch.cuda.is_current_stream_capturing():
        raise InputError(
            f"validating kv_lens and block_table inside a CUDA graph capture needs {device}'s error "
            f"record, which is made outside a capture: make one validated call on {device} before "
            f"capturing (a warm-up call), or pass validate=False"
        )
    values = made_outside_graph_pools(lambda: torch.zeros(RECORD_SIZE, dtype=torch.int64, device=device), device)
    host = torch.zeros(RECORD_SIZE, dtype=torch.int64, pin_memory=True)
    return ErrorRecord(
        values, deferred=True, host=host, event=StreamEvent(device), capturing=torch.cuda.is_current_stream_capturing
    )


def report(device: torch.device) -> None:
    """Raise an error recorded on ``device`` whose copy has arrived (a call with kv_lens that validates
    nothing); no record is made."""
    found = _records.get(device)
    if found is not None:
        found.report()


def check_errors(device: torch.device | str | int | None = None) -> None:
    """Raise the ``InputError`` of a bad ``kv_lens`` or ``block_table`` entry that a validated call's
    device-side check recorded, waiting for the device first (a host sync, the explicit point where CUDA's
    asynchronous errors surface). ``device``: a device (``"cuda"``: the current one), or None for every
    device a validated call has used. Each error is raised once; a call raises nothing when none is
    recorded. On CPU a validated call raises its own error, so this never raises there."""
    if device is None:
        records = list(_records.values())
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        records = [_records[device]] if device in _records else []
    for record in records:
        record.wait()
