"""Registers, spills and shared memory of a generated Triton kernel on an H100/H200, with no GPU.

Compiles the kernel with Triton as a launch would (with the usual specialisations: unit strides on the head
dim, 16-divisible sizes and pointers) and reads ptxas' resource report. ``benchmarks/kernel_resources.py``
weeds tile candidates out with it; ``attnfuse show --resources`` reports a plan's generated kernels with it
(the template instances: ``resources.template_resources``).
"""

from __future__ import annotations

import re

import triton
from attrs import frozen

from ..plan import DROPOUT_P, DROPOUT_SCALE, DROPOUT_STATE, Plan, TileConfig
from ..passes.codegen.fp8 import UPCAST
from ..runtime.fp8 import upcast_dtype
from ..runtime.kernel import smaller_tiles
from ..runtime.source_cache import load_function, write_source
from ..triton_compat import ASTSource
from .resources import DTYPES, INDEX_LIKE, compile_sm90

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
    "Q_OFFSET",
    "K_OFFSET",
    "N_SEQ",
    "DOCS",
    "SEARCH_STEPS",
}
_FLOAT32 = {"Lse", "Delta", "PartOut", "PartLse", "DLse", "PartDKV", "QDescale", "KDescale", "VDescale"}
_INT32 = {"KvLens", "BlockTable", "SplitCount", "CuQ", "CuK"}
_INT64 = {DROPOUT_STATE}  # attention dropout's seed and counter offset
_FLOAT32_SCALARS = {DROPOUT_P, DROPOUT_SCALE}
_SHORT = {  # dtype -> Triton's
    **{dtype: short for dtype, (_, short) in DTYPES.items()},
    "float32": "fp32",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}
_INPUTS = {"Q", "K", "V"}  # of the call's dtype; a float8 call's other tensors are bfloat16 (its out_dtype's default)


@frozen
class KernelResources:
    """ptxas' report of one compiled kernel: ``registers`` a thread, ``spill_bytes`` stored and
    ``spill_load_bytes`` loaded a thread, ``shared_bytes`` a block, with ``tiles``."""

    registers: int
    spill_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    tiles: TileConfig


def signature(fn, tensors: dict[str, int], dtype: str) -> tuple[dict, dict, dict]:
    """Triton's (signature, specialised values, attributes) for a generated kernel's runtime parameters.
    ``tensors``: the plugins' tensor arguments and their ranks (index-like names are int32, others
    float32; their last dim is contiguous); ``dtype``: Triton's name of the call's dtype ("bf16"; a float8
    one's q, k, v, with bfloat16 for its output and gradients)."""
    others = "bf16" if dtype.startswith("fp8") else dtype
    unit = {f"{name}_s{rank - 1}" for name, rank in tensors.items()}
    types, values, attributes = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            types[p.name] = "constexpr"
        elif p.name in tensors:
            types[p.name] = "*i32" if INDEX_LIKE.search(p.name) else "*fp32"
            attributes[(i,)] = [["tt.divisibility", 16]]
        elif p.name in _FLOAT32_SCALARS:
            types[p.name] = "fp32"
        elif p.name[0].isupper() and p.name not in _SIZES:
            pointee = (
                "i64" if p.name in _INT64 else "i32" if p.name in _INT32 else dtype if p.name in _INPUTS else others
            )
            types[p.name] = "*" + ("fp32" if p.name in _FLOAT32 else pointee)
            attributes[(i,)] = [["tt.divisibility", 16]]
        elif re.fullmatch(r"stride_\w*d", p.name) or p.name in unit:  # unit strides, as Triton specialises
            types[p.name], values[p.name] = "constexpr", 1
        else:
            types[p.name] = "i32"
            attributes[(i,)] = [["tt.divisibility", 16]]
    return types, values, attributes


def generated_resources(
    plan: Plan, kind: str, tiles: TileConfig | None = None, shared_limit: int | None = None
) -> KernelResources:
    """Compile ``plan``'s generated kernel ``kind`` for sm_90a with ``tiles`` (default: the plan's for it), for
    tensors of the plan's dtype; ptxas' report of it (``KernelResources``). With ``shared_limit`` (bytes a
    block may use), tiles that need more shrink as a launch's do (``runtime.kernel.smaller_tiles``) until they
    fit. Raises whatever Triton raises on a kernel that does not compile, and RuntimeError if ptxas fails or
    reports no figures."""
    spec = plan.kernels[kind]
    tiles = tiles or spec.tiles
    used = _compile(plan, kind, tiles)
    while shared_limit is not None and used.shared_bytes > shared_limit:
        tiles = smaller_tiles(tiles)
        used = _compile(plan, kind, tiles)
    return used


def _compile(plan: Plan, kind: str, tiles: TileConfig) -> KernelResources:
    spec = plan.kernels[kind]
    fn = triton.jit(load_function(spec.source, spec.name, write_source(spec.name, spec.source)))
    tensors = {f"{call.prefix}_{t.name}": t.rank for call in plan.plugin_calls for t in call.apply.declaration.tensors}
    types, values, attributes = signature(fn, tensors, _SHORT[plan.config.dtype])
    values.update(spec.launch.constants, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
    values.update({name: True for name in ("EVEN_K", "EVEN_M") if name in fn.arg_names})
    values[UPCAST] = upcast_dtype(interpreted=False)  # a float8 kernel's, as a GPU launch gives it
    values = {k: v for k, v in values.items() if k in fn.arg_names}
    options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.max_registers is not None:
        options["maxnreg"] = tiles.max_registers  # as a launch compiles it (``runtime.kernel``)
    compiled, report = compile_sm90(ASTSource(fn, types, values, attributes), options)
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas' report of {spec.name} names no registers or spills:\n{report}")
    return KernelResources(int(registers[1]), int(spills[1]), int(spills[2]), compiled.metadata.shared, tiles)
