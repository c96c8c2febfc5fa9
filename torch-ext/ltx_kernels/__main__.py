"""`python -m ltx_kernels`: an environment report to paste into bug reports.

Prints the Python, torch and CUDA versions, each visible GPU with its compute capability, how the
extension was built (torch and nvcc versions, compiled architectures), and whether every op loads
and agrees with its reference on a small random input on each available device.
"""

import platform
import sys

import torch

import ltx_kernels
from ltx_kernels import reference


def smoke_inputs(device: str) -> dict:
    """Op name -> small random bf16 arguments of that op (LTX-like: D = 96 = 3 heads x 32)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape, dtype=torch.bfloat16: torch.randn(*shape, generator=g).to(device, dtype)
    x, y, mod = rand(2, 5, 96), rand(2, 5, 96), rand(2, 1, 96)
    cos, sin = rand(5, 32, dtype=torch.float32), rand(5, 32, dtype=torch.float32)
    q = rand(2, 5, 3, 32)
    return {
        "rmsnorm": (rand(5, 96), rand(96), 1e-6),
        "rmsnorm_modulate": (x, mod, mod),
        "layernorm_modulate": (x, mod, mod),
        "add_rmsnorm_modulate": (x, y, mod, mod, mod),
        "add_layernorm_modulate": (x, y, mod, mod, mod),
        "gated_residual": (x, y, mod),
        "rope": (q, cos, sin),
        "qk_rmsnorm_rope": (q, q, rand(96), rand(96), cos, sin),
        "gelu": (x, "tanh"),
        "geglu": (x, "none"),
        "linear_gelu": (x, rand(64, 96), rand(64)),
        "lora_linear": (x, rand(64, 96), rand(64), [rand(4, 96)], [rand(32, 4)], [0.5], [16]),
        "rmsnorm_modulate_quant": (x, mod, mod),
        "layernorm_modulate_quant": (x, mod, mod),
        "add_rmsnorm_modulate_quant": (x, y, mod, mod, mod),
        "add_layernorm_modulate_quant": (x, y, mod, mod, mod),
        "quantize": (x, "gelu", "tanh"),
        "qk_rmsnorm_rope_quant": (q, q, rand(96), rand(96), cos, sin),
        # (head_dim 64, the CUDA kernel's; batch element 1 attends its first 4 keys)
        "attention": (
            rand(2, 5, 3, 64),
            rand(2, 7, 3, 64),
            rand(2, 7, 3, 64),
            torch.tensor([7, 4], dtype=torch.int32, device=device),
        ),
        # (8-bit operands as the contract has them: v8 transposed, 7 keys in 16 columns)
        "attention_int8": (
            torch.randint(-127, 128, (2, 5, 3, 64), generator=g, dtype=torch.int8).to(device),
            rand(2, 5, 3, dtype=torch.float32).abs() * 1e-2,
            torch.randint(-127, 128, (2, 7, 3, 64), generator=g, dtype=torch.int8).to(device),
            rand(2, 3, 1, dtype=torch.float32).abs() * 1e-2,
            rand(2, 3, 64, 16, dtype=torch.float32).to(device, torch.float8_e4m3fn),
            rand(2, 3, 64, dtype=torch.float32).abs(),
            torch.tensor([7, 4], dtype=torch.int32, device=device),
        ),
        "quantize_attention_k": (rand(2, 130, 3, 64),),
        "quantize_attention_v": (rand(2, 130, 3, 64),),
    }


def _check_op(op: str, device: str) -> str:
    try:
        args = smoke_inputs(device)[op]
        outs = getattr(ltx_kernels, op)(*args)
        # (the quantized ops' reference quantizes their model-dtype value: no float64 form)
        exact = {} if op in ltx_kernels.QUANT_OPS else {"compute_dtype": torch.float64}
        refs = getattr(reference, op)(*args, **exact)
        outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
        err = max(
            ((o.double() - r.double()).norm() / r.double().norm()).item()
            for o, r in zip(outs, refs)
        )
        # (attention_int8's CUDA kernel rounds the probabilities to e4m3: 3 mantissa bits)
        bound = 5e-2 if op == "attention_int8" and device == "cuda" else 1e-2
        return (
            f"ok (rel. L2 error vs reference {err:.1e})"
            if err < bound
            else f"WRONG (rel. L2 {err:.1e})"
        )
    except Exception as error:  # the report must finish whatever fails
        return f"FAILED: {type(error).__name__}: {str(error).splitlines()[0]}"


def main() -> int:
    print("ltx_kernels environment report")
    print(f"  ltx_kernels      {ltx_kernels.__version__} ({ltx_kernels.__file__})")
    print(f"  python           {sys.version.split()[0]} ({platform.platform()})")
    print(
        f"  torch            {torch.__version__} (CUDA {torch.version.cuda}, "
        f"cuDNN {torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None})"
    )
    try:
        from ltx_kernels import _build_info as build

        print(f"  built against    torch {build.TORCH_VERSION}, nvcc {build.NVCC_VERSION}")
        print(f"  compiled archs   {build.CUDA_ARCHS}  ({' '.join(build.GENCODE_FLAGS)})")
        if build.TORCH_VERSION != torch.__version__:
            print("  WARNING          the extension was built against another torch: rebuild it")
    except ImportError:
        print("  built against    unknown (no _build_info: not built with setup.py)")
    devices = ["cpu"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(
                f"  cuda:{i}           {p.name}, compute capability {p.major}.{p.minor}, "
                f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB"
            )
            if (p.major, p.minor) < (9, 0):
                print(
                    "                   this GPU predates Hopper: the kernels are built for sm_90a"
                )
        devices.append("cuda")
    else:
        print("  cuda             no CUDA device visible")
    if ltx_kernels.load_error is not None:
        print(f"  extension        FAILED TO LOAD: {ltx_kernels.load_error}")
        return 1
    print("  extension        loaded")
    failures = 0
    for op in ltx_kernels.OPS + ltx_kernels.QUANT_OPS + ltx_kernels.ATTENTION_OPS:
        for device in devices:
            status = _check_op(op, device)
            failures += not status.startswith("ok")
            print(f"  op {op:<28} {device:<5} {status}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
