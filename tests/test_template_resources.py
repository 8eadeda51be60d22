"""The forward template's instances compiled for sm90 here, with no GPU (Triton, ptxas, nvdisasm:
``attnfuse/kernels/resources.py``): every variant of ``verify.VARIANTS`` is served by the template and compiles
within a block's shared memory, on wgmma and TMA, with no local memory in its key loop. (The spill bytes outside
the loop, a few at head dims 128 and 256, are in docs/benchmarks.md's table: not yet none.)

Each case is one compile (seconds): bfloat16 at every head dim, float16 at head dim 128. The cases share no
state (each compiles in its own temporary directory), so pytest-xdist spreads them over its workers."""

import pytest

from attnfuse.errors import InputError
from attnfuse.kernels import verify
from attnfuse.kernels.resources import template_resources, variant_plan
from attnfuse.kernels.tiles import SHARED_MEMORY_LIMIT

CASES = [(v, d, "bfloat16") for v in verify.VARIANTS for d in verify.HEAD_DIMS]
CASES += [(v, 128, "float16") for v in verify.VARIANTS]


@pytest.mark.parametrize("variant,head_dim,dtype", CASES, ids=[f"{v}-D{d}-{t}" for v, d, t in CASES])
def test_instance_compiles_for_sm90_with_no_local_memory_in_its_loop(variant, head_dim, dtype):
    plan = variant_plan(variant, dtype, head_dim)
    spec = plan.templates.kernels.get("forward")
    if spec is None:
        pytest.fail(f"{variant} falls off the forward template: {plan.templates.reasons['forward']}")
    used = template_resources(spec, dtype, head_dim, plan.config.save_lse)
    problems = []  # every one of them, so that a failure names them all
    if used.shared_bytes > SHARED_MEMORY_LIMIT:
        problems.append(f"{used.shared_bytes} bytes of shared memory, above {SHARED_MEMORY_LIMIT}")
    if not (used.wgmma > 0 and used.tma > 0):
        problems.append(f"{used.wgmma} wgmma and {used.tma} TMA instructions in the SASS")
    if used.loop_local_memory:
        problems.append(f"local memory (STL/LDL) in the main loop ({used.spill_bytes} bytes spilled in the main path)")
    assert not problems, f"{spec.name}: " + "; ".join(problems) + f"\n{used}"


@pytest.mark.parametrize("dtype", ["float32", "float64", "bf16"])
def test_a_dtype_the_templates_do_not_compile_for_is_refused(dtype):
    spec = variant_plan("dense", "bfloat16", 64).templates.kernels["forward"]
    with pytest.raises(InputError, match=rf"dtype='{dtype}': the templates compile for float16 and bfloat16"):
        template_resources(spec, dtype, 64, save_lse=True)
