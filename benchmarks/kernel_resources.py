"""Registers, spills and shared memory of a generated kernel on an H100/H200, with no GPU.

Compiles the kernel for sm90 with Triton (as a launch would, with the usual specialisations: unit strides
on the head dim, 16-divisible sizes and pointers) and reads ptxas' resource report
(``attnfuse.kernels.generated_resources``). Spills and shared
memory decide most tile choices, so candidates can be weeded out here before a sweep on the device.

    python benchmarks/kernel_resources.py llama --kernel dkdv --head-dim 128 --group 4 --tiles 64,64,4,2 64,128,8,3
    python benchmarks/kernel_resources.py gpt2 --dtype float32 --kernel forward --tiles 128,128,8,3 32,32,8,2

Float32 kernels compile with their registers capped as a launch's are (``passes.tile.FLOAT32_REGISTER_CAP``);
each line gives the compile's seconds too, which spilling float32 tiles stretch to minutes.
"""

from __future__ import annotations

import argparse
import time

from attnfuse.cli import resolve_program
from attnfuse.kernels.generated_resources import generated_resources
from attnfuse.passes.tile import FLOAT32_REGISTER_CAP
from attnfuse.plan import KERNEL_KINDS, KernelConfig, TileConfig
from attnfuse.runtime.compiled import compiled


def report(plan, kind: str, tiles: tuple[int, int, int, int]) -> str:
    block_m, block_n, warps, stages = tiles
    cap = FLOAT32_REGISTER_CAP if plan.config.dtype == "float32" else None
    start = time.perf_counter()
    used = generated_resources(
        plan,
        kind,
        TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, max_registers=cap),
    )
    return (
        f"BM{block_m} BN{block_n} w{warps} s{stages}: {used.registers} registers, "
        f"spills {used.spill_bytes} B stored / {used.spill_load_bytes} B loaded, shared memory {used.shared_bytes} B, "
        f"compiled in {time.perf_counter() - start:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", help="an example name (llama, gpt2, ...) or module:attribute, as `attnfuse show`")
    parser.add_argument("--kernel", default="forward", choices=KERNEL_KINDS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=1, help="Hq // Hkv")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--hoisted", action="store_true", help="the kernels a hoisted program runs (q and k transformed by passes)"
    )
    parser.add_argument("--tiles", nargs="+", default=["128,128,8,3"], help="BLOCK_M,BLOCK_N,warps,stages ...")
    args = parser.parse_args()
    program, _ = resolve_program(args.program)
    graph = program.graph()
    training = args.kernel in ("dkdv", "dq", "gradient")
    config = KernelConfig(
        arch="sm90",
        dtype=args.dtype,
        head_dim=args.head_dim,
        head_dim_v=args.head_dim,
        group=args.group,
        save_lse=training and graph.has_lse,
        fp32_precision="ieee",
    )
    if args.hoisted:
        config = compiled(graph, config).plan.hoisted_config
    program_kernels = compiled(graph, config)
    kernel = program_kernels.kernel(args.kernel)
    print(f"{kernel.name} ({kernel.path})")
    for spec in args.tiles:
        tiles = tuple(int(x) for x in spec.split(","))
        print("  " + report(program_kernels.plan, args.kernel, tiles), flush=True)


if __name__ == "__main__":
    main()
