"""Inside Table 9's training steps (benchmarks/hf_layer.py's layer and implementations), on the GPU:

python benchmarks/layer_steps.py --profile 8192   # the kernels and GPU idle gaps of three training steps
python benchmarks/layer_steps.py --timing 8192    # a training step timed three ways, with the SM clock
python benchmarks/layer_steps.py --busy 2048,4096,8192   # the GPU's busy time per forward and training step
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from hf_layer import Backend, Inputs, bench, in_rounds, median_and_spread, paired_ratio, setup


def profile(backends: dict[str, Backend], case: Inputs, steps: int = 3) -> None:
    """The GPU kernels of ``steps`` back-to-back training steps per backend (as do_bench runs them, after
    two warm-up steps), most time first, and where the GPU waits: its idle time and the longest gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for name, backend in backends.items():
        for _ in range(2):
            backend.train_step(case)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                backend.train_step(case)
            torch.cuda.synchronize()
        print(f"=== {name}, N={case.N}, {steps} steps")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
        print_gaps(prof.events())


def timing(backends: dict[str, Backend], case: Inputs, steps: int = 10) -> None:
    """A training step's ms per backend: do_bench's median; the mean of ``steps`` steps each between two
    synchronisations (CUDA events); ``steps`` back-to-back steps' total over ``steps``; each followed by the SM
    clock in MHz (NVML, where the nvidia-ml-py package is present): whether do_bench's figure is the kernels',
    the host's or a lower clock's."""

    def clock() -> str:
        try:
            return f"{torch.cuda.clock_rate()} MHz"
        except Exception:  # noqa: BLE001 - no NVML binding on this machine
            return "clock n/a"

    print(f"training step at N={case.N}: ms (SM clock after)")
    for name, backend in backends.items():
        for _ in range(3):
            backend.train_step(case)
        row = f"{name:<22} do_bench {bench(lambda: backend.train_step(case), torch.device('cuda')):8.3f} ({clock()})"
        single = []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            backend.train_step(case)
            end.record()
            torch.cuda.synchronize()
            single.append(start.elapsed_time(end))
        row += f"  single {sum(single) / steps:8.3f} ({clock()})"
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            backend.train_step(case)
        torch.cuda.synchronize()
        print(row + f"  back-to-back {(time.perf_counter() - began) * 1e3 / steps:8.3f} ({clock()})", flush=True)


def busy_and_gaps(events) -> tuple[float, float, list[tuple[float, float, str]]]:
    """Of a profile's ``events``: the µs in which some GPU kernel runs, the µs from the first kernel's start to
    the last one's end, and the idle gaps between (µs, start, the kernel before)."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA)
    if not kernels:
        return 0.0, 0.0, []
    gaps, end, busy, before = [], kernels[0][0], 0.0, ""
    for start, stop, name in kernels:
        if start > end:
            gaps.append((start - end, end, before))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    return busy, end - kernels[0][0], gaps


def print_gaps(events, shown: int = 5) -> None:
    """The GPU's busy and idle time between its first and last kernel, and its ``shown`` longest idle gaps
    with the kernel before each and the innermost host operations running when it began."""
    from torch.autograd import DeviceType

    busy, span, gaps = busy_and_gaps(events)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    print(
        f"GPU busy {busy / 1e3:.3f} ms of {span / 1e3:.3f} ms from first to last kernel "
        f"(idle {(span - busy) / 1e3:.3f} ms in {len(gaps)} gaps)"
    )
    for length, at, before in sorted(gaps, reverse=True)[:shown]:
        running = sorted(
            (e.time_range.end - e.time_range.start, e.name)
            for e in host
            if e.time_range.start <= at <= e.time_range.end
        )
        print(f"  {length:8.1f} us after {before[:60]}; host in: {', '.join(n for _, n in running[:3])}")


def gpu_busy(step: Callable[[], None], steps: int = 3) -> float:
    """ms per call in which the GPU runs some kernel of ``step``, over ``steps`` back-to-back calls after two
    warm-up calls (torch.profiler's CUDA activity): the step's kernel time, whatever the host's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return busy_and_gaps(prof.events())[0] / steps / 1e3


def busy(backends: dict[str, Backend], inputs: Callable[[int], Inputs], lengths: list[int], rounds: int = 3) -> None:
    """The GPU's busy ms per forward and per training step of each backend at each N, in ``rounds`` rounds
    taken in turns (as hf_layer.py's timings): the median, its ratio to sdpa's, and the paired ratio."""
    print(
        f"GPU busy ms per step (torch.profiler; median of {rounds} rounds of 3 steps), ratio and paired ratio to sdpa"
    )
    for N in lengths:
        case = inputs(N)

        def forward(backend: Backend) -> None:
            with torch.no_grad():
                backend.forward(case)

        for label, run in (("forward", forward), ("train", lambda backend: backend.train_step(case))):
            times = in_rounds(
                {name: (lambda b=b: run(b)) for name, b in backends.items()},
                rounds,
                torch.device("cuda"),
                measure=gpu_busy,
            )
            sdpa = times["sdpa"]
            for name, t in times.items():
                ms = median_and_spread(t)[0]
                print(
                    f"{name:<22}{N:>6} {label:<8}{ms:9.3f}{ms / median_and_spread(sdpa)[0]:8.3f}"
                    f"{paired_ratio(t, sdpa):8.3f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="profile three back-to-back training steps per "
        "implementation at N: the GPU kernels that take the most time, and the GPU's idle gaps",
    )
    what.add_argument(
        "--timing",
        type=int,
        metavar="N",
        help="time a training step per implementation at N three "
        "ways (do_bench; synchronised single steps; back-to-back steps; the SM clock after each)",
    )
    what.add_argument(
        "--busy",
        metavar="N,N",
        help="the GPU's busy time per forward and per training step of each "
        "implementation at each N (kernel time, without the host's gaps)",
    )
    args = parser.parse_args()
    _, backends, inputs = setup(tiny=False)
    if args.profile:
        profile(backends, inputs(args.profile))
    elif args.busy:
        busy(backends, inputs, [int(n) for n in args.busy.split(",")])
    else:
        timing(backends, inputs(args.timing))


if __name__ == "__main__":
    main()
