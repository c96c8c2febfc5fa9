"""8-bit attention operand quantization micro-benchmark: at issue 34's six attention shapes, the
time of each quantization the 8-bit attention needs, against one cuDNN bf16 attention call of the
same shape timed in the same process (the issue's bound: all three <= 3% of the attention time):

  q      ltx_kernels.quantize(q, format="i8_row"): int8 per token and head, for a q that no
         qk_rmsnorm_rope produces (one pass: read q, write codes and scales);
  qk     ltx_kernels.qk_rmsnorm_rope(q, k, ...) (across heads, rotate-halves, fp32 tables), the
         bf16 op; qk+q8: qk_rmsnorm_rope_quant, the same with q quantized in its pass. Their
         difference ("fused q") is what quantizing q costs where the model normalizes q and k;
  k      ltx_kernels.quantize_attention_k(k): the per-head mean pass, then the smoothed int8
         codes per block of 128 keys (reads k twice, writes codes);
  v      ltx_kernels.quantize_attention_v(v): the per-channel amax pass, then the transposed e4m3
         codes (reads v twice, writes codes).
"share" is (fused q + k + v) / attention and (q + k + v) / attention.

    python benchmarks/benchmark_attention_quant.py [--cases a,b] [--replays 30] [--out results]
    python benchmarks/benchmark_attention_quant.py --device cpu --scale 64   # smoke run

Times: GPU time of CUDA-graph replays over enough input sets to defeat L2 (bench_utils), median of
--replays, per call. GB/s counts the bytes each op's passes move through DRAM (reads of every pass
+ code and scale writes); "copy" is a device-to-device copy's rate in the same process, the
ceiling. The smoke run on the CPU checks only that each op runs and matches its reference.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
import bench_utils  # noqa: E402
import benchmark_attention  # noqa: E402

import ltx_kernels  # noqa: E402
from ltx_kernels import reference  # noqa: E402

#: name -> (batch, heads, sequence, head_dim): issue 34's cases, benchmark_attention.CASES without
#: their padding
CASES = {name: case[:4] for name, case in benchmark_attention.CASES.items()}


def _q(q):
    return ltx_kernels.quantize(q, format="i8_row")


#: column -> (the call on a [B, S, H, D] bf16 tensor, its DRAM bytes for (B, H, S, D), reference)
OPS = {
    "q": (_q, lambda b, h, s, d: 3 * b * s * h * d + 4 * b * s * h, lambda x: _ref_q(x)),
    "k": (
        ltx_kernels.quantize_attention_k,
        lambda b, h, s, d: 5 * b * s * h * d + 4 * b * h * -(-s // 128),
        reference.quantize_attention_k,
    ),
    "v": (
        ltx_kernels.quantize_attention_v,
        lambda b, h, s, d: 4 * b * s * h * d + b * h * d * (-(-s // 16) * 16) + 4 * b * h * d,
        reference.quantize_attention_v,
    ),
}


def _ref_q(q):
    return reference.quantize_rows(q, "i8_row")


def _tables(q):
    """cos, sin [1, S, 1, D] fp32 (Wan's form) for q [B, S, H, D]."""
    theta = torch.rand(1, q.shape[1], 1, q.shape[-1], device=q.device) * 6.28
    return theta.cos(), theta.sin()


def _qk(q, k, cos, sin):
    return ltx_kernels.qk_rmsnorm_rope(q, k, None, None, cos, sin, 1e-6, True, False)


def _qk_q8(q, k, cos, sin):
    return ltx_kernels.qk_rmsnorm_rope_quant(q, k, None, None, cos, sin, 1e-6, True, False)


def _attention(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        )


def _input(case, device, seed):
    batch, heads, tokens, head_dim = case
    generator = torch.Generator(device).manual_seed(seed)
    shape = (batch, tokens, heads, head_dim)
    return torch.randn(shape, device=device, generator=generator).to(torch.bfloat16)


def run_case(name, case, device, replays: int) -> dict:
    batch, heads, tokens, head_dim = case
    x = _input(case, device, 0)
    row = {"case": name}
    for column, (fn, nbytes, ref) in OPS.items():
        got, want = fn(x), ref(x)
        if column != "k" or device == "cpu":  # (CUDA's k mean is summed in fp32: codes within 1)
            assert all(
                torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
                for a, b in zip(got, want)
            ), column
        if device == "cuda":
            per_set = x.numel() * x.element_size()
            sets = bench_utils.input_sets(lambda: (_input(case, device, len(row)),), per_set)
            us = bench_utils.graph_time_us(fn, sets, replays=replays)
            del sets
            row[column] = {
                "ms": us / 1000,
                "gbs": nbytes(batch, heads, tokens, head_dim) / us / 1e3,
            }
    if device == "cuda":
        per_set = 3 * x.numel() * x.element_size()
        sets = bench_utils.input_sets(
            lambda: tuple(_input(case, device, i) for i in range(3)), per_set
        )
        row["attention_ms"] = bench_utils.graph_time_us(_attention, sets, replays=replays) / 1000
        del sets
        sets = bench_utils.input_sets(
            lambda: (*(_input(case, device, i) for i in range(2)), *_tables(x)), 2 * per_set // 3
        )
        for column, fn in (("qk", _qk), ("qk+q8", _qk_q8)):
            row[column] = bench_utils.graph_time_us(fn, sets, replays=replays) / 1000
        del sets
        row["share"] = sum(row[c]["ms"] for c in OPS) / row["attention_ms"]
        fused_q = max(row["qk+q8"] - row["qk"], 0.0)
        row["share_fused"] = (fused_q + row["k"]["ms"] + row["v"]["ms"]) / row["attention_ms"]
    return row


def _line(row) -> str:
    if "attention_ms" not in row:
        return f"{row['case']:>28} | ok (matches the reference)"
    cells = " | ".join(f"{c} {row[c]['ms']:7.3f} ms {row[c]['gbs']:5.0f} GB/s" for c in OPS)
    return (
        f"{row['case']:>28} | {cells} | qk {row['qk']:7.3f} ms, qk+q8 {row['qk+q8']:7.3f} ms | "
        f"cuDNN {row['attention_ms']:7.3f} ms | fused q+k+v {100 * row['share_fused']:5.1f}%, "
        f"q+k+v {100 * row['share']:5.1f}%"
    )


def main(argv=None) -> int:
    parsed = benchmark_attention.case_arguments(argv, "benchmark_attention_quant", __doc__)
    if parsed is None:
        return 2
    args, names = parsed
    header = f"# 8-bit attention operands, bf16 [B, S, H, D] | {args.device}"
    if args.device == "cuda":
        env = bench_utils.environment()
        copy = bench_utils.copy_bandwidth()["best"]
        header += f" {env['device']} | torch {env['torch']} | copy {1000 * copy:.0f} GB/s"
    print(header)
    rows = []
    for name in names:
        batch, heads, tokens, head_dim = CASES[name]
        case = (batch, heads, max(tokens // args.scale, 8), head_dim)
        rows.append(run_case(name, case, args.device, args.replays))
        print(_line(rows[-1]))
    if args.out is not None:
        payload = {"scale": args.scale, "rows": rows}
        if args.device == "cuda":
            payload["environment"] = bench_utils.environment()
        bench_utils.write_json(args.out / "attention_quant.json", payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
