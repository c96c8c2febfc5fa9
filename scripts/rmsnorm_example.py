"""Use ltx_kernels.rmsnorm in place of diffusers' RMSNorm modules, and check that it matches.

    python scripts/rmsnorm_example.py [--device cuda] [--tokens 8064] [--hidden 2048]

Builds diffusers' RMSNorm with and without a weight (LTX-Video's norm1/norm2 have none), runs the
module and the kernel on the same input, and prints the output dtype, how many elements differ
(they round at the same points, so only where the two fp32 sums of squares round apart) and, on a
GPU, the time of each.
"""

import argparse

import torch
from diffusers.models.normalization import RMSNorm

import ltx_kernels


def gpu_time_us(fn, reps: int = 50) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8064)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    x = torch.randn(2, args.tokens, args.hidden, device=args.device, dtype=torch.bfloat16)
    for affine in (False, True):
        module = RMSNorm(args.hidden, eps=1e-6, elementwise_affine=affine).to(
            args.device, torch.bfloat16
        )
        if affine:
            with torch.no_grad():
                module.weight.normal_(1.0, 0.2)
        # The drop-in: module.weight is None for elementwise_affine=False, and the kernel takes None.
        expected = module(x)
        out = ltx_kernels.rmsnorm(x, module.weight, module.eps)
        differ = (out != expected).sum().item()
        line = (
            f"RMSNorm(elementwise_affine={affine}): out {out.dtype}, {differ} of {out.numel()} "
            f"elements differ, max |diff| {(out.float() - expected.float()).abs().max().item():.2e}"
        )
        if args.device == "cuda":
            eager = gpu_time_us(lambda: module(x))
            kernel = gpu_time_us(lambda: ltx_kernels.rmsnorm(x, module.weight, module.eps))
            line += (
                f"; diffusers {eager:.1f} µs, ltx_kernels {kernel:.1f} µs ({eager / kernel:.1f}x)"
            )
        print(line)


if __name__ == "__main__":
    main()
