"""Registers, spills, shared memory and instruction counts of a template instance on an H100/H200, with no GPU.

``template_resources`` compiles an instance for sm_90a as a launch would (Triton, then ptxas for its resource
report, then nvdisasm for its SASS) and reads them back; ``tests/test_template_resources.py`` holds every
variant to no spills and no local memory in the main loop, within a block's shared memory.

    python -m attnfuse.kernels.resources --markdown                               # print the section
    python -m attnfuse.kernels.resources --markdown-section docs/benchmarks.md    # or rewrite it there

prints (or writes) the section "Template resources": every variant of ``verify.VARIANTS`` at each head dim and
dtype, or the reason a variant falls off the template.

The instance is compiled unspecialised: pointers not known to be 16-byte aligned, integers not known to be
multiples of 16 or 1 (a launch specialises on those, which only takes code away), a plugin's tensors float32.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from attrs import frozen

from ..errors import InputError
from ..triton_compat import GluonASTSource, GPUTarget, gl, knobs
from ..launch_spec import CONSTEXPR, SCALAR, TENSOR
from ..passes.compiler import compile as compile_plan
from ..plan import KernelConfig, KernelSpec, Plan
from ..runtime.source_cache import load_function, write_source
from . import pipeline, verify
from .tiles import SHARED_MEMORY_LIMIT

DTYPES = {"float16": (gl.float16, "fp16"), "bfloat16": (gl.bfloat16, "bf16")}  # dtype -> (Gluon's, Triton's)
SECTION = "template_resources"  # its marked section of docs/benchmarks.md (--markdown-section)
_CARRIED = {"Q", "K", "V", "Out"}  # the call's tensors, in the call's dtype; Lse is float32
_SPILLS = re.compile(r"Function properties for (\S+)\n\s*\d+ bytes stack frame, (\d+) bytes spill stores")
_LOCAL = re.compile(r"\b(?:STL|LDL)\b")  # a store to or load from local memory (a spill, or a stack array)
_WGMMA = re.compile(r"\bHGMMA\.")
_TMA = re.compile(r"\bUTMA(?:LDG|STG)\b")
_LABEL = re.compile(r"^(\.L_x_\d+):\s*$")  # a branch target in nvdisasm's listing
_BRANCH = re.compile(r"\bBRA\b[^`]*`\((\.L_x_\d+)\)")  # a branch (predicated or not) to one
_FUNCTION = re.compile(r"^(\$?[A-Za-z_][\w$]*):\s*$")  # a function's label in nvdisasm's listing


@frozen
class Resources:
    """What one compiled instance uses, per thread and per block.

    ``registers``: ptxas' count for the entry function (the launch's cap, ``pipeline.LAUNCH_REGISTERS``, which
    ``setmaxnreg`` then redistributes); ``consumer_registers`` / ``loader_registers``: the budget each partition
    is given (``pipeline``'s, stated, not measured). ``spill_bytes``: ptxas' spill stores of the entry function
    (the main path); ``careful_spill_bytes``: of the noinline ``*_careful`` functions together (the rare redo
    of rows a non-finite value reached). ``shared_bytes``: the block's shared memory. ``wgmma`` / ``tma``: HGMMA
    and UTMALDG/UTMASTG instructions in the SASS. ``loop_local_memory``: whether any STL or LDL lies inside a
    main loop of the entry function (a label to a later branch back to it, holding wgmma and no smaller such
    loop).
    ``compile_seconds``: Triton's compile and ptxas', from the source, with no cache."""

    registers: int
    spill_bytes: int
    careful_spill_bytes: int
    shared_bytes: int
    compile_seconds: float
    wgmma: int
    tma: int
    loop_local_memory: bool
    consumer_registers: int = pipeline.CONSUMER_REGISTERS
    loader_registers: int = pipeline.LOADER_REGISTERS


def variant_plan(variant: str, dtype: str, head_dim: int) -> Plan:
    """The sm90 plan of ``verify.VARIANTS[variant]`` (GQA group 2; the hoisted plan, which is the one that
    runs the template, where the program's transforms are hoisted)."""
    program, extra = verify.VARIANTS[variant]
    graph = program.graph(**extra(4, 64, 64, "cpu"))
    config = KernelConfig(
        arch="sm90",
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim,
        group=2,
        save_lse=graph.has_lse,
        fp32_precision="ieee",
    )
    plan = compile_plan(graph, config)
    return plan if "transform" not in plan.kernels else compile_plan(graph, plan.hoisted_config)


def signature(spec: KernelSpec, dtype: str, head_dim: int) -> dict[str, str]:
    """Triton's types of the parameters of ``spec`` (a forward instance) for tensors of ``dtype`` and ``head_dim``."""
    gluon_dtype, short = DTYPES[dtype]

    def tiles(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], gluon_dtype)
        return f"tensordesc<{short}[1, 1, {rows}, {head_dim}],{layout!r}>"

    block_n = spec.tiles.block_n
    named = {"q_desc": tiles(pipeline.ROWS.value), "o_desc": tiles(pipeline.ROWS.value), "k_desc": tiles(block_n),
             "v_desc": tiles(block_n), "Lse": "*fp32", **{n: f"*{short}" for n in _CARRIED}}  # fmt: skip
    kinds = {CONSTEXPR: "constexpr", SCALAR: "fp32", TENSOR: "*fp32"}
    return {p.name: named.get(p.name) or kinds.get(p.kind, "i32") for p in spec.launch.params}


def template_resources(spec: KernelSpec, dtype: str, head_dim: int, save_lse: bool) -> Resources:
    """Compile ``spec`` (a forward instance, ``plan.templates.kernels["forward"]``) for sm_90a with tensors of
    ``dtype`` ("float16" or "bfloat16", else InputError) and ``head_dim``, writing lse if ``save_lse``; what it
    uses. Raises whatever Triton raises on an instance that does not compile, and RuntimeError if ptxas or
    nvdisasm fails."""
    if dtype not in DTYPES:
        raise InputError(f"dtype={dtype!r}: the templates compile for {' and '.join(DTYPES)}")
    fn = load_function(spec.source, spec.name, write_source(spec.name, spec.source))
    source = GluonASTSource(fn, signature(spec, dtype, head_dim), {**spec.launch.constants, "SAVE_LSE": save_lse})
    start = time.perf_counter()
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True  # the time of a compile, not of a cache hit
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4, "maxnreg": pipeline.LAUNCH_REGISTERS},
        )
    # the ptxas Triton compiled with: torch.compile sets TRITON_PTXAS_PATH to torch's own (a newer CUDA), whose
    # PTX version an older ptxas refuses
    ptxas = Path(knobs.nvidia.ptxas.path)
    with tempfile.TemporaryDirectory(prefix="attnfuse-resources-") as tmp:
        ptx, cubin = Path(tmp) / f"{spec.name}.ptx", Path(tmp) / f"{spec.name}.cubin"
        ptx.write_text(compiled.asm["ptx"])
        report = _run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)]).stderr
        seconds = time.perf_counter() - start
        sass = _run([str(ptxas.with_name("nvdisasm")), "-c", str(cubin)]).stdout
    spills = {name: int(n) for name, n in _SPILLS.findall(report)}
    registers = re.search(rf"Compiling entry function '{re.escape(spec.name)}'.*?Used (\d+) registers", report, re.S)
    if spec.name not in spills or registers is None:
        raise RuntimeError(f"ptxas' report names no entry function {spec.name}:\n{report}")
    entry = _function(sass, spec.name)
    return Resources(
        registers=int(registers[1]),
        spill_bytes=spills[spec.name],
        careful_spill_bytes=sum(n for name, n in spills.items() if name != spec.name and "_careful" in name),
        shared_bytes=compiled.metadata.shared,
        compile_seconds=seconds,
        wgmma=len(_WGMMA.findall(sass)),
        tma=len(_TMA.findall(sass)),
        loop_local_memory=any(_LOCAL.search(line) for start, end in _loops(entry) for line in entry[start:end]),
    )


def _run(command: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def _function(sass: str, name: str) -> list[str]:
    """The lines of function ``name`` in nvdisasm's listing ``sass``: from its label to the next function's (its
    noinline callees follow it in the same section, each under a label ``$name$callee:``)."""
    lines = sass.splitlines()
    labels = [(i, m[1]) for i, line in enumerate(lines) if (m := _FUNCTION.match(line))]
    for (i, label), (end, _) in zip(labels, labels[1:] + [(len(lines), "")]):
        if label == name:
            return lines[i:end]
    raise RuntimeError(f"nvdisasm's listing has no function {name}")


def _loops(lines: list[str]) -> list[tuple[int, int]]:
    """The main loops of a function's listing: each (line of a label, line of a later branch back to it) whose
    body holds wgmma and no smaller such loop (the key loops; not the partitions' dispatch around them)."""
    labels = {m[1]: i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = [
        (labels[m[1]], i)
        for i, line in enumerate(lines)
        if (m := _BRANCH.search(line)) and labels.get(m[1], len(lines)) < i
    ]
    gemm = [(a, b) for a, b in loops if any(_WGMMA.search(line) for line in lines[a:b])]
    return [(a, b) for a, b in gemm if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in gemm)]


def table_rows(variants: list[str], head_dims: list[int], dtypes: list[str]):
    """The table's rows, one per variant x head dim x dtype, each printed as soon as it is compiled."""
    for variant in variants:
        for head_dim in head_dims:
            for dtype in dtypes:
                plan = variant_plan(variant, dtype, head_dim)
                spec = plan.templates.kernels.get("forward")
                what = f"| {variant} | {head_dim} | {dtype} |"
                if spec is None:
                    yield f"{what} falls back: {plan.templates.reasons['forward']} |" + " |" * 6
                    continue
                r = template_resources(spec, dtype, head_dim, plan.config.save_lse)
                yield (
                    f"{what} {r.registers} ({r.consumer_registers} / {r.loader_registers}) | {r.spill_bytes} / "
                    f"{r.careful_spill_bytes} | {'yes' if r.loop_local_memory else 'no'} | "
                    f"{r.shared_bytes / 1024:.1f} | {r.wgmma} | {r.tma} | {r.compile_seconds:.1f} |"
                )


def heading(arguments: list[str]) -> list[str]:
    """The section's heading, versions, the command that printed it (with ``arguments``) and what it shows."""
    ptxas = _run([knobs.nvidia.ptxas.path, "--version"]).stdout
    release = re.search(r"release ([\d.]+)", ptxas)
    return [
        "## Template resources (sm90, compiled on the CPU)",
        "",
        f"{datetime.date.today().isoformat()} · CPU, compiled for sm_90a · triton {triton.__version__} · "
        f"ptxas {release[1] if release else '?'} · Python {sys.version.split()[0]}.",
        "",
        "Printed by:",
        "",
        "```bash",
        shlex.join(["python", "-m", "attnfuse.kernels.resources", *arguments]),
        "```",
        "",
        "The forward template's instance of each variant (GQA group 2), compiled as a launch would, with no GPU.",
        "Registers: ptxas' count at entry (the launch's cap), then the budget `setmaxnreg` gives each consumer",
        "warpgroup / the loader warp. Spill bytes: ptxas' spill stores in the main path / in the careful redo",
        "(the noinline functions that redo rows a non-finite value reached). Local memory in the loop: an STL or",
        "LDL inside a key loop of the main path (innermost loops with wgmma). wgmma and TMA: HGMMA and UTMALDG/UTMASTG",
        f"in the SASS. Shared memory in KiB, of {SHARED_MEMORY_LIMIT / 1024:.0f} KiB a block may use.",
        "",
        "| variant | D | dtype | registers (consumer / loader) | spill bytes (main / careful) | "
        "local memory in the loop | shared KiB | wgmma | TMA | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the section (the default)")
    parser.add_argument("--markdown-section", metavar="PATH", help="write the section into the page PATH instead")
    parser.add_argument("--variants", nargs="+", default=list(verify.VARIANTS), choices=list(verify.VARIANTS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(verify.HEAD_DIMS), choices=verify.HEAD_DIMS)
    parser.add_argument("--dtypes", nargs="+", default=list(verify.DTYPES), choices=list(DTYPES))
    args = parser.parse_args()
    lines = heading(sys.argv[1:])
    if not args.markdown_section:
        print("\n".join(lines), flush=True)
    for row in table_rows(args.variants, args.head_dims, args.dtypes):
        lines.append(row)
        if not args.markdown_section:
            print(row, flush=True)
    if args.markdown_section:
        from ..bench import report

        report.write_section(args.markdown_section, SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
