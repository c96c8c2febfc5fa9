"""FP8 micro-benchmark (bf16 models, H100/H200): what the opt-in FP8 path of
`inject_optimized_kernels(..., fp8=True)` costs and saves per op, at LTX-Video shapes.

    python benchmarks/benchmark_fp8.py [--tokens 2688,8064] [--out results]

1. FP8-output ops against their bf16-output twins (target: within 5% of the bf16 op's time) and
   against the alternative without them, the bf16 op followed by a separate rowwise quantization
   (torch.compile of `amax / 448`, `x / scale`, cast: what torchao's dynamic rowwise path runs):
   LTX norm1 (rmsnorm_modulate), attn2 residual + norm2 (add_rmsnorm_modulate), and the FF's
   GELU-tanh feeding the down projection (quantize(h, "gelu", "tanh") vs gelu).
2. GEMMs of an LTX block (M = batch x tokens): bf16 F.linear vs torch._scaled_mm with rowwise
   scales (bf16 out, bias in the epilogue), time and speedup, and each output's SQNR (dB) against
   the float64 product of the bf16 operands: the FP8 error next to bf16's own rounding. The FP8
   time is the GEMM alone: its activation comes quantized from an FP8-output op.

Times are medians of CUDA-graph replays over input sets larger than 4x L2 (bench_utils). Prints
markdown tables; writes JSON.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_utils  # noqa: E402

BF16 = torch.bfloat16
DIM, FF_DIM = 2048, 8192  # LTX-Video 2B
LTX_NORM_EPS = 1e-6
FP8_WITHIN = 1.05  # an FP8-output op's time / its bf16 twin's
# (N, K) of the block's GEMMs: fused QKV, one projection (q, k, v, out), FF up, FF down.
GEMMS = [
    ("qkv", 3 * DIM, DIM),
    ("proj", DIM, DIM),
    ("ff up", FF_DIM, DIM),
    ("ff down", DIM, FF_DIM),
]


def randn(*shape, std=1.0):
    return (std * torch.randn(*shape, device="cuda")).to(BF16)


def quantize_rows_torch(v):
    """Rowwise e4m3 quantization in plain PyTorch (compiled below): the separate pass."""
    scale = v.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (v.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def op_cases(ltx_kernels, batch, tokens):
    """(name, make, bf16 op, fp8 op, separate-pass alternative, bytes of the fp8 op)."""
    x = lambda: randn(batch, tokens, DIM)  # noqa: E731
    mod = lambda: randn(batch, 1, DIM, std=0.5)  # noqa: E731
    compiled_quant = torch.compile(quantize_rows_torch, fullgraph=True, dynamic=False)
    rows = batch * tokens
    return [
        (
            "norm1 (rmsnorm_modulate)",
            lambda: (x(), mod(), mod()),
            lambda x, s, t: ltx_kernels.rmsnorm_modulate(x, s, t, None, LTX_NORM_EPS),
            lambda x, s, t: ltx_kernels.rmsnorm_modulate_quant(x, s, t, None, LTX_NORM_EPS),
            lambda x, s, t: compiled_quant(
                ltx_kernels.rmsnorm_modulate(x, s, t, None, LTX_NORM_EPS)
            ),
            rows * DIM * 3 + rows * 4,
        ),
        (
            "attn2 + norm2 (add_rmsnorm_modulate)",
            lambda: (x(), x(), mod(), mod()),
            lambda x, y, s, t: ltx_kernels.add_rmsnorm_modulate(x, y, s, t, None, None),
            lambda x, y, s, t: ltx_kernels.add_rmsnorm_modulate_quant(x, y, s, t, None, None),
            lambda x, y, s, t: compiled_quant(
                ltx_kernels.add_rmsnorm_modulate(x, y, s, t, None, None)[1]
            ),
            rows * DIM * 7 + rows * 4,
        ),
        (
            "FF GELU-tanh (quantize)",
            lambda: (randn(batch, tokens, FF_DIM),),
            lambda h: ltx_kernels.gelu(h, "tanh"),
            lambda h: ltx_kernels.quantize(h, "gelu", "tanh"),
            lambda h: compiled_quant(ltx_kernels.gelu(h, "tanh")),
            rows * FF_DIM * 3 + rows * 4,
        ),
    ]


def sqnr_db(out, exact) -> float:
    noise = (out.double() - exact).pow(2).sum().item()
    return 10 * math.log10(exact.pow(2).sum().item() / max(noise, 1e-300))


def gemm_row(ltx_kernels, m, n, k, replays):
    x, w, bias = randn(m, k), randn(n, k, std=k**-0.5), randn(n, std=0.1)
    exact = x.double() @ w.double().T + bias.double()
    wq, ws = ltx_kernels.quantize(w)

    def fp8_gemm_only(xq, xs, wq, ws, bias, fast_accum=False):
        return torch._scaled_mm(
            xq,
            wq.T,
            scale_a=xs[:, None],
            scale_b=ws[None],
            bias=bias,
            out_dtype=BF16,
            use_fast_accum=fast_accum,
        )

    xq, xs = ltx_kernels.quantize(x)
    row = {
        "bf16_sqnr_db": sqnr_db(F.linear(x, w, bias), exact),
        "fp8_sqnr_db": sqnr_db(fp8_gemm_only(xq, xs, wq, ws, bias), exact),
        "fp8_fast_sqnr_db": sqnr_db(fp8_gemm_only(xq, xs, wq, ws, bias, True), exact),
    }
    del exact
    bf16_sets = bench_utils.input_sets(lambda: (randn(m, k), w, bias), m * k * 2)
    row["bf16_us"] = bench_utils.graph_time_us(F.linear, bf16_sets, replays=replays)

    def fp8_inputs():
        xq, xs = ltx_kernels.quantize(randn(m, k))
        return xq, xs, wq, ws, bias

    fp8_sets = bench_utils.input_sets(fp8_inputs, m * k)
    row["fp8_us"] = bench_utils.graph_time_us(fp8_gemm_only, fp8_sets, replays=replays)
    fast_sets = [(*s, True) for s in fp8_sets]
    row["fp8_fast_us"] = bench_utils.graph_time_us(fp8_gemm_only, fast_sets, replays=replays)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--tokens", default="2688,8064", help="tokens per sample (batch 2, CFG)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_fp8: needs a CUDA device")
        return 2
    import ltx_kernels

    env = bench_utils.environment()
    copy_tbs = bench_utils.copy_bandwidth()["best"]
    print(f"# FP8 | {env['device']} | torch {env['torch']} | copy {copy_tbs:.2f} TB/s")
    results = {"env": env, "ops": [], "gemms": []}
    print(
        "\n| op | tokens | bf16 op µs | fp8 op µs | fp8/bf16 | fp8 TB/s | bf16 op + separate quant µs |"
    )
    print("|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, make, bf16_op, fp8_op, separate, nbytes in op_cases(ltx_kernels, 2, tokens):
            sets = bench_utils.input_sets(make, sum(t.nbytes for t in make()))
            times = [
                bench_utils.graph_time_us(fn, sets, replays=args.replays)
                for fn in (bf16_op, fp8_op, separate)
            ]
            ratio = times[1] / times[0]
            verdict = "PASS" if ratio <= FP8_WITHIN else "MISS"
            print(
                f"| {name} | 2x{tokens} | {times[0]:.1f} | {times[1]:.1f} | {ratio:.3f} "
                f"({verdict}) | {nbytes / times[1] / 1e6:.2f} | {times[2]:.1f} |",
                flush=True,
            )
            results["ops"].append(
                {"op": name, "tokens": tokens, "bf16_us": times[0], "fp8_us": times[1],
                 "separate_us": times[2], "ratio": ratio}
            )  # fmt: skip
            del sets
            torch._dynamo.reset()
    print(
        "\n| GEMM | M x N x K | bf16 µs | fp8 µs | speedup | fp8 fast-accum µs | SQNR bf16 dB "
        "| SQNR fp8 dB | SQNR fp8 fast-accum dB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        m = 2 * tokens
        for name, n, k in GEMMS:
            row = gemm_row(ltx_kernels, m, n, k, args.replays)
            print(
                f"| {name} | {m}x{n}x{k} | {row['bf16_us']:.1f} | {row['fp8_us']:.1f} | "
                f"{row['bf16_us'] / row['fp8_us']:.2f}x | {row['fp8_fast_us']:.1f} | "
                f"{row['bf16_sqnr_db']:.1f} | {row['fp8_sqnr_db']:.1f} | "
                f"{row['fp8_fast_sqnr_db']:.1f} |",
                flush=True,
            )
            results["gemms"].append({"gemm": name, "m": m, "n": n, "k": k, **row})
    bench_utils.write_json(args.out / "benchmark_fp8.json", results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
