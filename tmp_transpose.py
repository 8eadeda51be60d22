import torch
from triton.testing import do_bench
from attnfuse.kernels.launch_fp8 import transposed_values
for N in (4096, 8192, 16384):
    v = torch.randn(1, 8, N, 128, device="cuda").to(torch.float8_e4m3fn)
    a = do_bench(lambda: transposed_values(v), return_mode="median")
    b = do_bench(lambda: v.view(torch.uint8).transpose(2, 3).contiguous(), return_mode="median")
    c = do_bench(lambda: v.transpose(2, 3).contiguous(), return_mode="median")
    print(N, f"transposed_values {a*1e3:.1f} us, uint8 contiguous {b*1e3:.1f} us, fp8 contiguous {c*1e3:.1f} us", flush=True)
