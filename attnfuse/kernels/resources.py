"""Registers, spills, shared memory and instruction counts of a template instance on an H100/H200, with no GPU.

``template_resources`` compiles an instance (the forward template's or the dK/dV template's) for sm_90a as a
launch would (Triton, then ptxas for its resource report, then nvdisasm for its SASS) and reads them back;
``tests/test_template_resources.py`` holds every variant within a block's shared memory, with no local memory
in the main loop (but for the dK/dV instances that spill there today, held to today's spill bytes).

    python -m attnfuse.kernels.resources --markdown                               # print the section
    python -m attnfuse.kernels.resources --markdown-section docs/benchmarks.md    # or rewrite it there

prints (or writes) the section "Template resources": every variant of ``verify.VARIANTS`` at each head dim and
dtype (the dK/dV template's at its head dims, ``verify.DKDV_HEAD_DIMS``), or the reason a variant falls off a
template.

The instance is compiled unspecialised: pointers not known to be 16-byte aligned, integers not known to be
multiples of 16 or 1 (a launch specialises on those, which only takes code away), a plugin's tensors float32.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import triton
from attrs import frozen

from ..errors import InputError
from ..triton_compat import GluonASTSource, GPUTarget, gl, knobs
from ..launch_spec import CONSTEXPR, SCALAR, TENSOR
from ..plan import DROPOUT_STATE, KernelSpec
from ..runtime.hopper import _ROW_LAYOUT, DKDV_BLOCK_M
from ..runtime.source_cache import load_function, write_source
from . import pipeline, verify
from .verify import variant_plan
from .tiles import SHARED_MEMORY_LIMIT

DTYPES = {  # dtype -> (Gluon's, Triton's)
    "float16": (gl.float16, "fp16"),
    "bfloat16": (gl.bfloat16, "bf16"),
    "float8_e4m3fn": (gl.float8e4nv, "fp8e4nv"),  # the forward's; its out is bfloat16
    "float8_e5m2": (gl.float8e5, "fp8e5"),
}
INDEX_LIKE = re.compile(r"(num|idx|index|count|active|lens|order)$")  # a plugin tensor's name read as int32
_LIST_SIZE = re.compile(r"^\s*list_size = (\w+)\b", re.M)  # the scalar a listing mask's block size names (listed.py)
SECTION = "template_resources"  # its marked section of docs/benchmarks.md (--markdown-section)
_CARRIED = {"Q", "K", "V", "Out"}  # the forward's tensors, in the call's dtype; Lse is float32
# a float8 forward's out, compiled as a call's default out_dtype
FP8_OUT = {"float8_e4m3fn": "bfloat16", "float8_e5m2": "bfloat16"}
_FACT_TENSORS = {"KvLens": "*i32", "CuQ": "*i32", "CuK": "*i32"}  # a call's key counts and document offsets
KERNELS = ("forward", "dkdv", "dq")  # the template kinds compiled here
GROUP_SUMS = ("none", "last", "atomic")  # how a dK/dV launch sums a GQA group's programs (hopper.group_split)
_SPILLS = re.compile(r"Function properties for (\S+)\n\s*\d+ bytes stack frame, (\d+) bytes spill stores")
_LOCAL = re.compile(r"\b(?:STL|LDL)\b")  # a store to or load from local memory (a spill, or a stack array)
_WGMMA = re.compile(r"\b[HQ]GMMA\.")  # float16/bfloat16 wgmma; float8 (QGMMA)
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
    loop: ``_loops``), and ``loops`` how many it has (one per consumer warpgroup: its key or step loop).
    ``compile_seconds``: Triton's compile and ptxas', from the source, with no cache."""

    registers: int
    spill_bytes: int
    careful_spill_bytes: int
    shared_bytes: int
    compile_seconds: float
    wgmma: int
    tma: int
    loop_local_memory: bool
    loops: int
    consumer_registers: int = pipeline.CONSUMER_REGISTERS
    loader_registers: int = pipeline.LOADER_REGISTERS


def signature(spec: KernelSpec, dtype: str, head_dim: int, save_lse: bool, group_sum: str = "none") -> dict[str, str]:
    """Triton's types of the parameters of ``spec`` (a forward, dK/dV or dQ instance) for tensors of ``dtype`` and
    ``head_dim``, as the runtime launches it (``kernels/launch.py``); the types ``_launch_types`` does not name
    are the launch spec's kinds: a plugin's tensors float32 (int32 where their names say they hold indices or
    counts, ``INDEX_LIKE``, as a block list's), its scalars float32 (int32: a listing mask's block size, which
    the instance divides rows by), its strides and sizes int32; dropout's state int64."""
    kinds = {CONSTEXPR: "constexpr", SCALAR: "fp32", TENSOR: "*fp32"}
    named = {DROPOUT_STATE: "*i64", **_launch_types(spec, dtype, head_dim, save_lse, group_sum)}
    named |= {name: "i32" for name in _LIST_SIZE.findall(spec.source)}

    def plugin_type(name: str, kind: str) -> str:
        return "*i32" if kind == TENSOR and INDEX_LIKE.search(name) else kinds.get(kind, "i32")

    return {p.name: named.get(p.name) or plugin_type(p.name, p.kind) for p in spec.launch.params}


def _launch_types(spec: KernelSpec, dtype: str, head_dim: int, save_lse: bool, group_sum: str) -> dict[str, str]:
    """The types of the template's own parameters of ``spec``, by its kind: TMA descriptors of (1, 1, rows,
    head_dim) tiles, float32 rows of lse and delta in [DKDV_BLOCK_M] tiles (``hopper.describe_rows``;
    None, a constexpr, where the dK/dV instance reads none: ``save_lse`` False), and the call's tensors."""
    gluon_dtype, short = DTYPES[dtype]

    def tiles(rows: int, columns: int = head_dim, of: tuple = (gluon_dtype, short)) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, columns], of[0])
        return f"tensordesc<{of[1]}[1, 1, {rows}, {columns}],{layout!r}>"

    rows = pipeline.ROWS.value
    if spec.kind == "forward" and dtype in FP8_OUT:  # float8: Vᵀ's tiles (fp8_pipeline), out in bfloat16
        block_n, out = spec.tiles.block_n, DTYPES[FP8_OUT[dtype]]
        return {"q_desc": tiles(rows), "o_desc": tiles(rows, of=out), "k_desc": tiles(block_n),
                "v_desc": tiles(head_dim, block_n), "Lse": "*fp32", **{n: f"*{short}" for n in ("Q", "K", "V")},
                "Out": f"*{out[1]}", **_FACT_TENSORS}  # fmt: skip
    if spec.kind == "forward":
        block_n = spec.tiles.block_n
        return {"q_desc": tiles(rows), "o_desc": tiles(rows), "k_desc": tiles(block_n), "v_desc": tiles(block_n),
                "Lse": "*fp32", **{n: f"*{short}" for n in _CARRIED}, **_FACT_TENSORS}  # fmt: skip
    if spec.kind == "dkdv":
        if group_sum not in GROUP_SUMS:
            raise InputError(f"group_sum={group_sum!r}: the dK/dV template sums a group as one of {GROUP_SUMS}")
        row = f"tensordesc<fp32[{DKDV_BLOCK_M}],{_ROW_LAYOUT!r}>" if save_lse else "constexpr"
        grads = f"*{short}"  # dk and dv, in the call's dtype
        parts = grads if group_sum == "none" else "*fp32"  # hopper.group_split's buffers: dk and dv, or float32
        return {**{n: tiles(rows) for n in ("q_desc", "do_desc", "k_desc", "v_desc")}, "lse_desc": row,
                "delta_desc": row, "DKey": grads, "DValue": grads, "dk_part": parts, "dv_part": parts,
                "counts": "*i32" if group_sum == "last" else grads}  # fmt: skip
    if spec.kind == "dq":
        block_n = spec.tiles.block_n
        return {**{n: tiles(rows) for n in ("q_desc", "do_desc", "o_desc")}, "k_desc": tiles(block_n),
                "v_desc": tiles(block_n), "O": f"*{short}", "DQuery": f"*{short}",
                **{n: "*fp32" for n in ("Lse", "DLse", "Delta")}}  # fmt: skip
    raise InputError(f"spec.kind={spec.kind!r}: template instances are of kinds {', '.join(KERNELS)}")


def template_resources(
    spec: KernelSpec, dtype: str, head_dim: int, save_lse: bool, group_sum: str = "none"
) -> Resources:
    """Compile ``spec`` for sm_90a with tensors of ``dtype`` (one of ``DTYPES``, else InputError) and
    ``head_dim``; what it uses. ``spec``: a forward instance (``plan.templates.kernels["forward"]``), writing lse
    if ``save_lse``, or a dK/dV instance (``["dkdv"]`` of the training plan), reading the forward's lse and
    delta rows if ``save_lse`` (the plan's ``config.save_lse``), summing a GQA group's programs as ``group_sum``
    says ("none": one program a group, the launch of a grid that fills the GPU; "last" or "atomic":
    ``hopper.group_split``), or a dQ instance (``["dq"]`` of the training plan), as a call with no dLSE
    launches it. Raises whatever Triton raises on an instance that does not compile, and
    RuntimeError if ptxas or nvdisasm fails. One compile per instance and arguments in a process (``_COMPILED``):
    the figures of a compile do not change."""
    key = (spec.source, spec.name, tuple(sorted(spec.launch.constants.items())), dtype, head_dim, save_lse, group_sum)
    if key not in _COMPILED:
        _COMPILED[key] = _compile_resources(spec, dtype, head_dim, save_lse, group_sum)
    return _COMPILED[key]


_COMPILED: dict[tuple, Resources] = {}


def _compile_resources(spec: KernelSpec, dtype: str, head_dim: int, save_lse: bool, group_sum: str) -> Resources:
    """``template_resources``, compiled."""
    if dtype not in DTYPES or (dtype in FP8_OUT and spec.kind != "forward"):
        raise InputError(
            f"dtype={dtype!r}: the templates compile for float16 and bfloat16, and the forward template for "
            f"{', '.join(FP8_OUT)} too ({spec.kind} instance given)"
        )
    types = signature(spec, dtype, head_dim, save_lse, group_sum)
    launch = {"forward": {"SAVE_LSE": save_lse}, "dkdv": {"GROUP_SUM": group_sum}, "dq": {"HAS_DLSE": False}}
    launch = launch[spec.kind]
    rows = {name: None for name in ("lse_desc", "delta_desc") if types.get(name) == "constexpr"}
    fn = load_function(spec.source, spec.name, write_source(spec.name, spec.source))
    source = GluonASTSource(fn, types, {**spec.launch.constants, **launch, **rows})
    start = time.perf_counter()
    compiled, report = compile_sm90(source, {"num_warps": 4, "maxnreg": pipeline.LAUNCH_REGISTERS})
    seconds = time.perf_counter() - start
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = run_tool([str(Path(knobs.nvidia.ptxas.path).with_name("nvdisasm")), "-c", cubin.name]).stdout
    spills = {name: int(n) for name, n in _SPILLS.findall(report)}
    registers = re.search(rf"Compiling entry function '{re.escape(spec.name)}'.*?Used (\d+) registers", report, re.S)
    if spec.name not in spills or registers is None:
        raise RuntimeError(f"ptxas' report names no entry function {spec.name}:\n{report}")
    entry = _function(sass, spec.name)
    loops = _loops(entry)
    return Resources(
        registers=int(registers[1]),
        spill_bytes=spills[spec.name],
        careful_spill_bytes=sum(n for name, n in spills.items() if name != spec.name and "_careful" in name),
        shared_bytes=compiled.metadata.shared,
        compile_seconds=seconds,
        wgmma=len(_WGMMA.findall(sass)),
        tma=len(_TMA.findall(sass)),
        loop_local_memory=any(_LOCAL.search(line) for start, end in loops for line in entry[start:end]),
        loops=len(loops),
    )


def compile_sm90(source, options: dict) -> tuple[Any, str]:
    """``source`` (a Triton or Gluon ``ASTSource``) compiled for sm_90a with ``options`` (Triton's compiled kernel),
    from the source (no cache hit), and ptxas' ``-v`` report of that compile: Triton's own ptxas run, its log
    captured, so the figures are those of the cubin Triton made (with the ptxas it runs; torch.compile may point
    TRITON_PTXAS_PATH at its own). Typed ``Any``: the compiled kernel's class is private Triton, and naming it in
    ``triton_compat`` would rename every template instance (their keys hash that module)."""
    log = io.StringIO()
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas' log
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, log.getvalue()


def run_tool(command: list[str]) -> subprocess.CompletedProcess:
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
    body holds wgmma and no smaller such loop (the key loops; not the partitions' dispatch around them). A
    range that starts inside another and ends past it is no loop: its branch back comes from a block ptxas
    placed after the function's body (the retry of an mbarrier wait in the loop), not from the loop's end."""
    labels = {m[1]: i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = [
        (labels[m[1]], i)
        for i, line in enumerate(lines)
        if (m := _BRANCH.search(line)) and labels.get(m[1], len(lines)) < i
    ]
    gemm = [(a, b) for a, b in loops if any(_WGMMA.search(line) for line in lines[a:b])]
    nested = [(a, b) for a, b in gemm if not any(c < a < d < b for c, d in gemm)]
    return [(a, b) for a, b in nested if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in nested)]


def table_rows(variants: list[str], head_dims: list[int], dtypes: list[str], kernels: list[str]):
    """The table's rows, one per kernel x variant x head dim x dtype (the backward templates' head dims only,
    ``verify.DKDV_HEAD_DIMS``), each printed as soon as it is compiled."""
    for kernel in kernels:
        served = [d for d in head_dims if kernel == "forward" or d in verify.DKDV_HEAD_DIMS]
        for variant in variants:
            for head_dim in served:
                for dtype in dtypes:
                    plan = variant_plan(variant, dtype, head_dim)
                    spec = plan.templates.kernels.get(kernel)
                    what = f"| {kernel} | {variant} | {head_dim} | {dtype} |"
                    if spec is None:
                        yield f"{what} falls back: {plan.templates.reasons[kernel]} |" + " |" * 6
                        continue
                    r = template_resources(spec, dtype, head_dim, plan.config.save_lse)
                    yield (
                        f"{what} {r.registers} ({r.consumer_registers} / {r.loader_registers}) | {r.spill_bytes} / "
                        f"{r.careful_spill_bytes} | {'yes' if r.loop_local_memory else 'no'} | "
                        f"{r.shared_bytes / 1024:.1f} | {r.wgmma} | {r.tma} | {r.compile_seconds:.1f} |"
                    )


def heading(arguments: list[str]) -> list[str]:
    """The section's heading, versions, the command that printed it (with ``arguments``) and what it shows."""
    ptxas = run_tool([knobs.nvidia.ptxas.path, "--version"]).stdout
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
        "Each template instance of each variant (GQA group 2), compiled as a launch would, with no GPU: the forward",
        "template's (kernel `forward`) at every head dim, the dK/dV template's (kernel `dkdv`, of the training plan,",
        'which saves the lse it reads; a GQA group summed in one program, GROUP_SUM "none") and the dQ template\'s',
        "(kernel `dq`, of the training plan, as a call with no dLSE launches it) at the head dims they serve.",
        "Registers: ptxas' count at entry (the launch's cap), then the budget `setmaxnreg` gives each consumer",
        "warpgroup / the loader warp. Spill bytes: ptxas' spill stores in the main path / in the careful redo (the",
        "forward's noinline functions that redo rows a non-finite value reached; the dK/dV and dQ templates have",
        "none: 0). Local memory in the loop: an STL or LDL inside a key loop (forward, dQ) or step loop (dK/dV) of",
        "the main path (innermost loops with wgmma). wgmma and TMA: HGMMA and UTMALDG/UTMASTG in the SASS. Shared",
        f"memory in KiB, of {SHARED_MEMORY_LIMIT / 1024:.0f} KiB a block may use.",
        "",
        "No row spills in its main path. `tests/test_template_resources.py` holds each instance (these, and the",
        "listed variants', float8 ones, those with attention dropout and those of calls with a fact, not in this",
        "table) to the spill bytes its `KNOWN_SPILLS` lists (a known defect, to be driven to zero: some float8 ones,",
        "some of calls with a fact, and softcap's dK/dV with attention dropout), every other to none; no main loop to",
        "local memory but the one `KNOWN_LOOP_SPILLS` names (that dK/dV, at head dim 128); and every forward",
        "instance to no spill in its careful redo (`KNOWN_CAREFUL_SPILLS` but one).",
        "",
        "| kernel | variant | D | dtype | registers (consumer / loader) | spill bytes (main / careful) | "
        "local memory in the loop | shared KiB | wgmma | TMA | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the section (the default)")
    parser.add_argument("--markdown-section", metavar="PATH", help="write the section into the page PATH instead")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(verify.VARIANTS),
        choices=list(verify.FORWARD_VARIANTS),
        help="default: verify.VARIANTS; the listed ones (verify.LISTED_VARIANTS) by name",
    )
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(verify.HEAD_DIMS), choices=verify.HEAD_DIMS)
    parser.add_argument("--dtypes", nargs="+", default=list(verify.DTYPES), choices=list(DTYPES))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    args = parser.parse_args()
    lines = heading(sys.argv[1:])
    if not args.markdown_section:
        print("\n".join(lines), flush=True)
    for row in table_rows(args.variants, args.head_dims, args.dtypes, args.kernels):
        lines.append(row)
        if not args.markdown_section:
            print(row, flush=True)
    if args.markdown_section:
        from ..bench import report

        report.write_section(args.markdown_section, SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
