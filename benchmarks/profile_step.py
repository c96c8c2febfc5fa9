"""Where one denoising step (--model: any of benchmark_transformer.py's) spends its GPU time, per
column of benchmark_transformer.py:
torch.profiler over --steps calls after warm-up, kernel time summed per category (GEMM, attention,
ltx_kernels ops, Inductor/Triton, other), the top kernels by total time, and how long the host
takes to issue one step against its wall time; with --graph also the step replayed as one CUDA
graph (its GPU time without host gaps), with --cprofile the host functions that take the most time
issuing one step.

  python benchmarks/profile_step.py --tokens 2688 --columns kernels,compile+kernels
  python benchmarks/profile_step.py --model hunyuanvideo-1.5 --steps 1 --columns kernels,blocks
"""

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils  # noqa: E402
import transformer_cases  # noqa: E402
from transformer_cases import configured  # noqa: E402

CATEGORIES = (  # first match wins; names are lower-cased CUDA kernel names
    ("attention", ("flash", "fmha", "attention", "cudnn", "attn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90_")),
    (
        "ltx_kernels",
        (
            "norm_modulate_",
            "gated_residual_",
            "qk_norm_rope_",
            "gelu_kernel",
            "rmsnorm_",
            "quantize_cached",
            "quantize_streaming",
        ),
    ),
    ("inductor/triton", ("triton_",)),
    ("nccl", ("nccl",)),
    ("copies", ("copy", "elementwise_kernel")),
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, needles in CATEGORIES:
        if any(needle in lowered for needle in needles):
            return label
    return "other"


def host_times(step, reps=5):
    """Median (host ms to issue one step's kernels, wall ms until they finish). Issue close to
    wall means the host, not the GPU, sets the pace (launch overhead or a hidden sync)."""
    issue, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        issue.append((issued - start) * 1000)
        wall.append((time.perf_counter() - start) * 1000)
    return statistics.median(issue), statistics.median(wall)


def host_profile(step, top):
    """The host functions taking the most time (cProfile, own time) while one step is issued (on
    the GPU, or on the CPU: cp_host_time.py)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    sync()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]
    print(f"  host, own time per function over one step (total {stats.total_tt * 1000:.1f} ms):")
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(path).name}:{line}({name})" if path != "~" else name
        print(f"    {own * 1000:7.2f} ms own {cumulative * 1000:7.2f} ms cum x{calls:5d}  {where}")


def profile_column(column, model, call, steps, top, graph=False, cprofile=False):
    with configured(column, model) as target, torch.no_grad():
        if target is None:
            print(f"\n## {column}: the model has no repeated blocks")
            return
        for _ in range(3):
            call(target)
        issue_ms, wall_ms = host_times(lambda: call(target))
        if graph:
            graph_ms = bench_utils.graph_time_us(lambda: call(target), [()], replays=10) / 1000
            print(f"\n## {column}: one step as a CUDA graph {graph_ms:.2f} ms")
        if cprofile:
            host_profile(lambda: call(target), top)
        kernel_breakdown(
            lambda: call(target),
            steps,
            top,
            f"{column}: wall {wall_ms:.2f} ms, of which the host issues the calls in "
            f"{issue_ms:.2f} ms",
        )


def kernel_breakdown(step, steps, top, title):
    """Prints the GPU kernel time of one call of `step` (torch.profiler over `steps` calls): the
    total, per category and the `top` kernels. Kernels that overlap (NCCL beside compute) count
    in full, so the total can exceed the wall time."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = collections.Counter()
    counts = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time / steps
            counts[event.name] += 1 / steps
    totals = collections.Counter()
    for name, us in kernels.items():
        totals[category(name)] += us
    print(f"\n## {title}; GPU kernel time per step {sum(totals.values()) / 1000:.2f} ms")
    print("  " + ", ".join(f"{label} {us / 1000:.2f} ms" for label, us in totals.most_common()))
    for name, us in kernels.most_common(top):
        print(f"  {us / 1000:7.3f} ms  x{counts[name]:5.0f}  [{category(name)}] {name[:110]}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", choices=(*transformer_cases.CASES, "flux-pair"), default="ltx")
    parser.add_argument("--tokens", type=int, default=None, help="the model's default shape")
    parser.add_argument("--columns", default="eager,kernels,compile,compile+kernels")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--graph", action="store_true", help="also time the step as a CUDA graph")
    parser.add_argument("--cprofile", action="store_true", help="host functions by time")
    args = parser.parse_args()
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    allowed = transformer_cases.ALL_COLUMNS
    unknown = set(columns) - set(allowed)
    if unknown:
        parser.error(f"unknown columns {sorted(unknown)}; choose from {', '.join(allowed)}")
    model, call, tokens = transformer_cases.model_case(args.model, args.tokens)
    print(
        f"# {args.model}, {tokens} tokens, {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    for column in columns:
        profile_column(column, model, call, args.steps, args.top, args.graph, args.cprofile)


if __name__ == "__main__":
    main()
