"""RMSNorm micro-benchmark: diffusers' eager RMSNorm, torch.nn.functional.rms_norm, torch.compile of
the diffusers formula, Liger-Kernel (if installed) and ltx_kernels.rmsnorm, at LTX-Video / Wan shapes.

    python benchmarks/benchmark_rmsnorm.py [--weight bf16|fp32|none] [--out results]

Prints µs per call, TB/s (bytes read + written) and % of the copy bandwidth measured in the same
process, the speedup of ltx_kernels over each column, and the targets; writes JSON and a PNG chart.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import bench_utils  # noqa: E402

import ltx_kernels  # noqa: E402

SHAPES = [
    (1, 1024, 2048),
    (2, 1024, 2048),
    (4, 1024, 2048),
    (2, 4096, 3072),
    (4, 4096, 3072),
    (2, 8064, 2048),
    (2, 32760, 5120),
]
TARGET_SHAPES = [(2, 8064, 2048), (4, 4096, 3072), (2, 32760, 5120)]  # >= 90% of copy bandwidth
TARGET_FRACTION = 0.90
OURS = "ltx_kernels"


def diffusers_rmsnorm_formula(x, weight, eps: float):
    """diffusers.models.normalization.RMSNorm.forward (non-NPU branch), for torch.compile."""
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    if weight is None:
        return x.to(input_dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        x = x.to(weight.dtype)
    return x * weight


def columns(hidden: int, weight, eps: float):
    cols = {}
    try:
        from diffusers.models.normalization import RMSNorm

        module = RMSNorm(hidden, eps=eps, elementwise_affine=weight is not None).cuda()
        if weight is not None:
            module.weight.data = weight
        cols["diffusers eager"] = module
    except ImportError:
        cols["diffusers formula eager"] = lambda x: diffusers_rmsnorm_formula(x, weight, eps)
    cols["F.rms_norm"] = lambda x: F.rms_norm(x, (hidden,), weight, eps)
    compiled = torch.compile(diffusers_rmsnorm_formula, fullgraph=True, dynamic=False)
    cols["torch.compile"] = lambda x: compiled(x, weight, eps)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        if weight is not None:
            cols["Liger"] = lambda x: LigerRMSNormFunction.apply(
                x, weight, eps, 0.0, "llama", False
            )
    except ImportError:
        pass
    cols[OURS] = lambda x: ltx_kernels.rmsnorm(x, weight, eps)
    return cols


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--weight", default="bf16", choices=["bf16", "fp16", "fp32", "none"])
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmark_rmsnorm: needs a CUDA device")
        return 2
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dtype = dtypes[args.dtype]
    w_dtype = None if args.weight == "none" else dtypes[args.weight]
    env = bench_utils.environment()
    copy = bench_utils.copy_bandwidth()
    copy_tbs = copy["best"]
    print(
        f"# RMSNorm, x {args.dtype}, weight {args.weight} | {env['device']} | torch {env['torch']} "
        f"| copy bandwidth {copy_tbs:.2f} TB/s (best of "
        + ", ".join(f"{k} {v:.2f}" for k, v in copy.items() if k != "best")
        + ")"
    )
    rows, tbs_by_shape, names = [], {}, []
    for shape in SHAPES:
        hidden = shape[-1]
        weight = (
            None if w_dtype is None else (1 + 0.1 * torch.randn(hidden, device="cuda")).to(w_dtype)
        )
        out_dtype = w_dtype or dtype
        elems = shape[0] * shape[1] * hidden
        nbytes = elems * (dtype.itemsize + out_dtype.itemsize) + (
            hidden * w_dtype.itemsize if w_dtype else 0
        )
        sets = bench_utils.input_sets(
            lambda: (torch.randn(shape, device="cuda").to(dtype),), elems * dtype.itemsize
        )
        cols = columns(hidden, weight, args.eps)
        reference = cols[OURS](sets[0][0]).float()
        label = "x".join(map(str, shape))
        tbs_by_shape[label] = {}
        times = {}
        for name, fn in cols.items():
            err = ((fn(sets[0][0]).float() - reference).norm() / reference.norm()).item()
            us = bench_utils.graph_time_us(fn, sets, replays=args.replays)
            times[name] = us
            tbs = nbytes / (us * 1e-6) / 1e12
            tbs_by_shape[label][name] = tbs
            rows.append(
                {
                    "shape": list(shape),
                    "column": name,
                    "us": us,
                    "tbs": tbs,
                    "pct_copy": 100 * tbs / copy_tbs,
                    "rel_l2_vs_ours": err,
                }
            )
            if name not in names:
                names.append(name)
        line = " | ".join(
            f"{n} {times[n]:8.1f} µs {tbs_by_shape[label][n]:5.2f} TB/s "
            f"({100 * tbs_by_shape[label][n] / copy_tbs:3.0f}%)"
            for n in cols
        )
        print(f"{label:>14}: {line}")
    print()
    print("| shape | " + " | ".join(names) + " | ours vs best other |")
    print("|---|" + "---|" * (len(names) + 1))
    verdicts = []
    for shape in SHAPES:
        label = "x".join(map(str, shape))
        entry = {r["column"]: r for r in rows if tuple(r["shape"]) == shape}
        cells = [
            f"{entry[n]['us']:.1f} µs / {entry[n]['tbs']:.2f} TB/s ({entry[n]['pct_copy']:.0f}%)"
            for n in names
        ]
        others = [entry[n]["us"] for n in names if n != OURS]
        speedup = min(others) / entry[OURS]["us"]
        print(f"| {label} | " + " | ".join(cells) + f" | {speedup:.2f}x |")
        verdicts.append((f"fastest at {label}", speedup > 1.0))
        if shape in TARGET_SHAPES:
            frac = entry[OURS]["tbs"] / copy_tbs
            verdicts.append(
                (
                    f">= {TARGET_FRACTION:.0%} of copy bandwidth at {label} ({frac:.1%})",
                    frac >= TARGET_FRACTION,
                )
            )
    print()
    for what, ok in verdicts:
        print(f"  [{'PASS' if ok else 'MISS'}] {what}")
    stem = f"benchmark_rmsnorm_{args.dtype}_w{args.weight}"
    bench_utils.write_json(
        args.out / f"{stem}.json",
        {
            "environment": env,
            "copy_tbs": copy,
            "dtype": args.dtype,
            "weight": args.weight,
            "rows": rows,
            "targets": verdicts,
        },
    )
    bench_utils.bar_chart(
        args.out / f"{stem}.png",
        f"RMSNorm x {args.dtype}, weight {args.weight} — {env['device']}, torch {env['torch']}",
        list(tbs_by_shape),
        names,
        tbs_by_shape,
        copy_tbs,
    )
    print(f"wrote {args.out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
