"""Registers, spills and shared memory of a generated kernel on an H100/H200, with no GPU.

Compiles the kernel for sm90 with Triton (as a launch would, with the usual specialisations: unit strides
on the head dim, 16-divisible sizes and pointers) and reads ptxas' resource report. Spills and shared
memory decide most tile choices, so candidates can be weeded out here before a sweep on the device.

    python benchmarks/kernel_resources.py llama --kernel dkdv --head-dim 128 --group 4 --tiles 64,64,4,2 64,128,8,3
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton

from attnfuse.cli import resolve_program
from attnfuse.plan import KERNEL_KINDS, KernelConfig
from attnfuse.runtime.compiled import compiled
from attnfuse.triton_compat import ASTSource, GPUTarget, knobs

_SIZES = {
    "HQ",
    "Nq",
    "N_K",
    "BATCH",
    "PAGE_SIZE",
    "NUM_PAGES",
    "SPLIT",
    "NUM_SPLITS",
    "SPLIT_BLOCKS",
    "SPLIT_ROWS",
    "HEAD_GROUP",
}
_FLOAT32 = {"Lse", "Delta", "PartOut", "PartLse", "DLse", "PartDKV"}
_INT32 = {"KvLens", "BlockTable", "SplitCount"}


def signature(fn, tensors: dict[str, int], dtype: str) -> tuple[dict, dict, dict]:
    """Triton's (signature, specialised values, attributes) for a generated kernel's runtime parameters.
    ``tensors``: the plugins' tensor arguments and their ranks (index-like names are int32, others
    float32; their last dim is contiguous)."""
    unit = {f"{name}_s{rank - 1}" for name, rank in tensors.items()}
    types, values, attributes = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            types[p.name] = "constexpr"
        elif p.name in tensors:
            types[p.name] = "*i32" if re.search(r"(num|idx|index|count|active|lens|order)$", p.name) else "*fp32"
            attributes[(i,)] = [["tt.divisibility", 16]]
        elif p.name[0].isupper() and p.name not in _SIZES:
            types[p.name] = "*" + ("fp32" if p.name in _FLOAT32 else "i32" if p.name in _INT32 else dtype)
            attributes[(i,)] = [["tt.divisibility", 16]]
        elif re.fullmatch(r"stride_\w*d", p.name) or p.name in unit:  # unit strides, as Triton specialises
            types[p.name], values[p.name] = "constexpr", 1
        else:
            types[p.name] = "i32"
            attributes[(i,)] = [["tt.divisibility", 16]]
    return types, values, attributes


def report(kernel, plan, tiles: tuple[int, int, int, int], dtype: str) -> str:
    block_m, block_n, warps, stages = tiles
    fn = kernel._kernel.fn
    tensors = {f"{call.prefix}_{t.name}": t.rank for call in plan.plugin_calls for t in call.apply.declaration.tensors}
    types, values, attributes = signature(fn, tensors, dtype)
    values.update(kernel.spec.launch.constants, BLOCK_M=block_m, BLOCK_N=block_n)
    values.update({name: True for name in ("EVEN_K", "EVEN_M") if name in fn.arg_names})
    values = {k: v for k, v in values.items() if k in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn, types, values, attributes),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    # the ptxas Triton compiled with: torch.compile sets TRITON_PTXAS_PATH to torch's own (a newer CUDA), whose
    # PTX version an older ptxas refuses
    ptxas = knobs.nvidia.ptxas.path
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        out = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True
        ).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    return (
        f"BM{block_m} BN{block_n} w{warps} s{stages}: {regs.group(1) if regs else '?'} registers, "
        f"spills {spills.group(1) if spills else '?'} B stored / {spills.group(2) if spills else '?'} B loaded, "
        f"shared memory {compiled.metadata.shared} B"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", help="an example name (llama, gpt2, ...) or module:attribute, as `attnfuse show`")
    parser.add_argument("--kernel", default="forward", choices=KERNEL_KINDS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--group", type=int, default=1, help="Hq // Hkv")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
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
        dtype = "bf16" if args.dtype == "bfloat16" else "fp16"
        print("  " + report(kernel, program_kernels.plan, tiles, dtype), flush=True)


if __name__ == "__main__":
    main()
