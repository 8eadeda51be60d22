"""Experiment: forward speed of masked-value handling variants (sliding window, causal), each in its own process.
import os, subprocess, sys, tempfile

VARIANTS = ("current", "none", "reload_ones", "pv_screen")

def patched(variant):
    import attnfuse.passes.codegen.forward as F
    from attnfuse.passes.codegen.common import dv_mask, masked_load, precision
    from attnfuse.passes.codegen.operands import key_masked, key_offsets, operand, qk_product
    from attnfuse.passes.codegen.scores import masks_keys, normaliser_update, scores, with_bounds, masked_values
    def key_tile(kernel, masked, implied=None):
        masked = key_masked(kernel, masked)
        v = masked_load("v_base + v_off[:, None] + dv[None, :] * stride_vd", "k_ok[:, None]" if masked else "", dv_mask(kernel))
        score = scores(kernel, masked, implied=implied, fold=True) + normaliser_update(kernel)
        head = ("k_pos = start_n + tl.arange(0, BLOCK_N)\nk_ok = (k_pos < Nk) | EVEN_K\n" + key_offsets(kernel)
                + with_bounds(operand(kernel, "k", "k_base", "k_off[:, None]", "k_pos", "k_ok", "stride_kd", masked)
                              + qk_product(kernel) + score))
        pr = precision(kernel)
        dot = f"acc = tl.dot(p.to(V.dtype.element_ty), v, acc{pr})\n"
        guard = masks_keys(kernel, masked, implied)
        if variant == "current" or not guard:
            return head + f"v = {v}\n" + (masked_values(kernel) if guard else "") + dot
        if variant == "none":
            return head + f"v = {v}\n" + dot
        exact = (f"    v_raw = {v}\n"
                 "    v_finite = tl.abs(v_raw) < float(\"inf\")\n"
                 "    key_bad = tl.max(tl.where(v_finite, 0, 1), axis=1)\n"
                 "    row_bad = tl.max(tl.where(keep & (key_bad[None, :] > 0), 1, 0), axis=1)\n"
                 "    col_bad = tl.max(tl.where(v_finite, 0, 1), axis=0)\n"
                 "    acc = tl.where((row_bad[:, None] > 0) & (col_bad[None, :] > 0), float(\"nan\"), acc)\n"
                 f"    acc = tl.dot(p.to(V.dtype.element_ty), tl.where(v_finite, v_raw, 0.0), acc{pr})\n")
        if variant == "reload_ones":
            return (head + f"v = {v}\n"
                    f"if tl.max(tl.where(tl.abs(tl.dot(tl.full([16, BLOCK_N], 1.0, V.dtype.element_ty), v{pr})) < float(\"inf\"), 0, 1)) > 0:\n"
                    + exact + "else:\n    " + dot)
        return (head + f"v = {v}\npv = tl.dot(p.to(V.dtype.element_ty), v{pr})\n"
                "if tl.max(tl.where(tl.abs(pv) < float(\"inf\"), 0, 1)) > 0:\n" + exact + "else:\n    acc = acc + pv\n")
    F.key_tile = key_tile

def run(variant):
    patched(variant)
    import torch, attnfuse as af
    from triton.testing import do_bench
    @af.attention
    def window(q, k, v):
        return af.softmax(af.sliding_window(af.scaled_dot_product(q, k), 255, 0)) @ v
    @af.attention
    def causal(q, k, v):
        return af.softmax(af.causal(af.scaled_dot_product(q, k))) @ v
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    v[0, 1, 300, 7], v[1, 3, 100, 9], v[1, 3, 101, 9] = float("nan"), float("inf"), float("-inf")
    ok = []
    for prog in (window, causal):
        out, want = prog(q, k, v), prog.reference(q.double(), k.double(), v.double())
        ok.append(torch.equal(torch.isfinite(out), torch.isfinite(want)) and
                  (out.double() - want).nan_to_num().abs().max().item() < 2e-2)
    line = f"{variant:<12} nan-correct={ok}"
    for N in (4096, 16384):
        q = torch.randn(1, 32, N, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for name, prog in (("window", window), ("causal", causal)):
            ms = do_bench(lambda: prog(q, k, v), return_mode="median")
            line += f"  {name} N{N} {ms:.4f}"
    print(line, flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for variant in VARIANTS * 2:
            env = dict(os.environ, ATTNFUSE_CACHE_DIR=tempfile.mkdtemp())
            subprocess.run([sys.executable, __file__, variant], env=env, timeout=120)
