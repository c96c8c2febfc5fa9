"""One denoising step of a full-size diffusers transformer, in one process, in these columns:
eager, eager + ltx_kernels (inject_optimized_kernels), torch.compile(fullgraph=True) with and
without the kernels, and compile_repeated_blocks(fullgraph=True) with and without the kernels;
with --columns also the opt-in FP8 path (`+fp8`: inject_optimized_kernels(..., fp8=True)) eager,
per block and whole-model compiled, and the anchor a user would pick instead, torchao's float8
dynamic rowwise quantization compiled per block or whole (`torchao-fp8+blocks`,
`torchao-fp8+compile`; needs torchao), and the kernels with our attention op
(`+ltx_attention`: inject_optimized_kernels(..., attention="ltx_kernels")) eager, per block and
whole-model compiled, and with 8-bit attention (`+int8_attention`: attention="int8", a numerics
change: its relative L2 against eager beside the bf16 columns') eager, per block, and per block
with FP8 Linears. attention="int8" attends in 8 bits only where the call's length reaches
injector.LTX_INT8_ATTENTION_FASTER ("auto" elsewhere): under the table, each eager 8-bit column
says how many of a step's attention calls ran in 8 bits (none: the column is "auto" there).

Models (--model; whole transformers at their real configs, configs/*.json, random weights,
bf16, with one denoising step's inputs at a typical resolution: transformer_cases.py lists them):
  ltx, ltx-13b (per-token modulation, LTXConditionPipeline), ltx2, ltx2.3, ltx2.5, wan-1.3b,
  wan-14b, flux (FLUX.1-dev, 19 double + 38 single blocks), sd3.5 (Large), hunyuanvideo-1.5;
  flux-pair  one FluxTransformerBlock + one FluxSingleTransformerBlock (dim 3072, 24x128 heads),
             batch 1, 4096 image + 512 text tokens (1024x1024).
--tokens picks among a model's shapes (ltx: 2688 = 49 frames 512x768, 8064 = 161 frames; the
others have one, the default).

--context-parallel ulysses|ring (LTX-Video, LTX-2, Wan and HunyuanVideo-1.5 models; launch with
torchrun --nproc_per_node N): diffusers' context parallelism over the N GPUs, in these columns:
1-GPU eager and kernels (each rank alone on its GPU), N-GPU stock diffusers (LTX: with the padded
text mask, which fails or is wrong in diffusers 0.42: reported, and without it; HunyuanVideo-1.5:
none, diffusers 0.42 has no plan for it), N-GPU with the kernels (injected before
enable_parallelism; HunyuanVideo-1.5 with its plan, integration.injected_plan: Ulysses only), and
(LTX-Video 2B, LTX-2) that with compile_repeated_blocks (LTX-Video 2B: also whole-model compiled);
under Ulysses the same with diffusers' Ulysses attention in place of ulysses_attention (the A/B;
not HunyuanVideo-1.5, whose text rows need ulysses_attention). --cp-columns keeps some of the
optional ones (stock, compile, blocks, diffusers-ulysses; the 1-GPU and N-GPU kernel columns
always run): each compile of the model on every rank costs minutes.
--cfg-parallel (the same models, N even; with --context-parallel inside each group when N > 2):
one guided denoising step (transformer_cases.guided_step: LTX-Video and LTX-2 one call on the
cond + uncond batch of 2, Wan and HunyuanVideo-1.5 one call a branch) with the kernels on one GPU,
under --context-parallel over all N GPUs, and under enable_cfg_parallel: the guidance branches on
two groups of N/2 GPUs; with --cp-columns compile (LTX-Video 2B, Ulysses) that last one also
with the whole model compiled. LTX-2: its CFG call only (LTX2Pipeline's STG and modality passes,
two more single-branch calls a step, are not timed). --profile adds the GPU kernel
time by category of the kernel columns; --graph the 1-GPU and N-GPU kernel columns replayed as one
CUDA graph per step (NCCL's kernels inside): the step's GPU time without host launch gaps, which
also keep one GPU waiting for the other in the collectives. Ring attention runs on cuDNN (`_native_cudnn`, every
column), the backend that returns the log-sum-exp ring attention needs and takes a mask. Rank 0
prints and writes.

Time per step: CUDA events around each call (the user-visible step time, CPU launch gaps included),
median of --reps calls after warm-up; compile time is the wall time of the first call. Each column's
output is compared with the eager output (relative L2). Peak memory: torch.cuda.max_memory_allocated
over one more step, its counter reset before (the weights, activations and workspaces the step holds
at once), and for an FP8 column against its bf16 column's (`kernels+fp8` against `kernels`,
`torchao-fp8+blocks` against `blocks`). The FP8 columns park the bf16 weights on the CPU
(keep_bf16_weights=True, to give them back to the next column), so the GPU holds what a model
injected without keeping them holds.

  python benchmarks/benchmark_transformer.py --model ltx --tokens 2688 8064 --out results/
  torchrun --nproc_per_node 2 benchmarks/benchmark_transformer.py --context-parallel ulysses
  torchrun --nproc_per_node 4 benchmarks/benchmark_transformer.py --cfg-parallel \
      --context-parallel ulysses --model wan-14b --tokens 75600 --reps 3
"""

import argparse
import contextlib
import functools
import gc
import io
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils  # noqa: E402
import transformer_cases  # noqa: E402

import ltx_kernels  # noqa: E402
from ltx_kernels.integration import (  # noqa: E402
    FP8_PRESETS,
    FUSIONS,
    enable_cfg_parallel,
    injected_plan,
)


def time_step(fn, reps: int, warmup: int = 2):
    """(compile/first-call seconds, median ms per call, output): the first call, `warmup` more,
    then `reps` timed."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
    return first_s, statistics.median(times), out


def graph_step(fn, reps: int, warmup: int = 2):
    """(capture seconds, median ms per replay, output) of fn captured as one CUDA graph: the step's
    GPU time without host launch gaps (thread_local capture: NCCL's watchdog thread queries its
    events while a rank captures)."""
    with torch.no_grad():
        times_ms, (out,), capture_s = bench_utils.graph_replays(
            fn, [()], reps, warmup_replays=warmup, capture_error_mode="thread_local"
        )
    return capture_s, statistics.median(times_ms), out


def step_peak_bytes(fn) -> int:
    """torch.cuda.max_memory_allocated over one call of fn, the peak counter reset before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def run_column(column, model, call, reps, warmup):
    """(first call s, ms per step, output, peak bytes of a step, attention calls) of `column`, or
    None. Attention calls: for an eager column with 8-bit attention, bench_utils.attention_calls of
    one step (attention="int8" attends in 8 bits only where measured faster: a column may hold
    few such calls, or none); None for the others (a compiled column attends as its eager one)."""
    with transformer_cases.configured(column, model) as target:
        if target is None:
            return None
        timed = time_step(lambda: call(target), reps, warmup)
        parts = column.split("+")
        eager_int8 = "int8_attention" in parts and not {"blocks", "compile"} & set(parts)
        calls = bench_utils.attention_calls(lambda: call(target)) if eager_int8 else None
        return *timed, step_peak_bytes(lambda: call(target)), calls


def fp8_preset_runs(columns, presets) -> list:
    """(label, column, FP8 preset) of each run: an FP8 column (a `fp8` part) once per preset,
    labelled "column [preset]" when there are several; every other column once, preset None."""
    runs = []
    for column in columns:
        if "fp8" not in column.split("+"):
            runs.append((column, column, None))
            continue
        for preset in presets or [None]:
            label = f"{column} [{preset}]" if len(presets or ()) > 1 else column
            runs.append((label, column, preset))
    return runs


def bf16_column(column: str) -> str | None:
    """The bf16 column an FP8 column's peak memory is compared with: the same set-up without FP8
    (kernels+fp8 -> kernels, torchao-fp8+blocks -> blocks, torchao-fp8 -> eager); None for a
    bf16 column."""
    parts = column.split("+")
    bf16 = [p for p in parts if p not in ("fp8", "torchao-fp8")]
    return None if bf16 == parts else "+".join(bf16) or "eager"


def context_parallel_columns(args, tokens, rank, world):
    """{column: (first call s, ms, output) or an error string} for one LTX shape under diffusers'
    context parallelism (module docstring)."""
    from diffusers import ContextParallelConfig

    degree = "ulysses_degree" if args.context_parallel == "ulysses" else "ring_degree"
    backend = "_native_cudnn" if args.context_parallel == "ring" else None
    family = transformer_cases.CASES[args.model].family
    measured = {}

    def build():
        model, call, _ = transformer_cases.model_case(args.model, tokens)
        if backend:
            model.set_attention_backend(backend)
        return model, call

    def attempt(column, fn, timer=time_step):
        try:
            measured[column] = timer(fn, args.reps, args.warmup)
        except Exception as error:  # reported as the column's result
            measured[column] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"

    def one_gpu_then_stock(model, call):
        for column in ("eager", "kernels"):
            with transformer_cases.configured(column, model) as target:
                attempt(f"1 GPU {column}", lambda: call(target))
                if args.graph and column == "kernels":
                    attempt("1 GPU kernels, CUDA graph", lambda: call(target), graph_step)
        if "stock" not in args.cp_columns:
            return
        if family == "HunyuanVideo-1.5":
            measured["N GPU eager"] = "diffusers 0.42 has no context-parallel plan for it"
            return
        model.enable_parallelism(config=ContextParallelConfig(**{degree: world}))
        if family == "Wan":  # (no text mask)
            attempt("N GPU eager", lambda: call(model))
            return
        attempt("N GPU eager (mask)", lambda: call(model))
        attempt("N GPU eager (no mask)", lambda: call(model, mask=False))

    def with_kernels(model, call, ops=None, label="N GPU kernels"):
        ltx_kernels.inject_optimized_kernels(model, verbose=False, ops=ops)
        model.enable_parallelism(
            config=ContextParallelConfig(**{degree: world}), cp_plan=injected_plan(model)
        )
        attempt(label, lambda: call(model))
        if args.graph:
            attempt(f"{label}, CUDA graph", lambda: call(model), graph_step)
        if args.profile:
            import profile_step

            step = lambda: call(model)  # noqa: E731
            quiet = (
                contextlib.nullcontext() if rank == 0 else contextlib.redirect_stdout(io.StringIO())
            )
            with torch.no_grad(), quiet:  # every rank steps (the collectives), rank 0 prints
                profile_step.kernel_breakdown(step, 3, 12, f"{label}, rank {rank}")
        mode = f" ({args.compile_mode})" if args.compile_mode else ""
        if args.model == "ltx" and "compile" in args.cp_columns:
            # the whole model compiled (torch 2.11: a graph break at its end)
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=args.compile_mode)
            attempt(label.replace("kernels", "compile+kernels") + mode, lambda: call(compiled))
        if args.model in ("ltx", "ltx2") and "blocks" in args.cp_columns:
            # (the 13B: its compile time is not worth a device run)
            torch._dynamo.reset()
            model.compile_repeated_blocks(fullgraph=True, mode=args.compile_mode)
            attempt(label.replace("kernels", "blocks+kernels") + mode, lambda: call(model))

    phases = [one_gpu_then_stock, with_kernels]
    ab = degree == "ulysses_degree" and family != "HunyuanVideo-1.5"  # ulysses_attention's A/B
    if ab and "diffusers-ulysses" in args.cp_columns:
        phases.append(
            functools.partial(
                with_kernels,
                ops=set(FUSIONS) - {"ulysses_attention"},
                label="N GPU kernels (diffusers Ulysses)",
            )
        )
    for phase in phases:
        phase(*build())  # a fresh model each: enable_parallelism cannot be undone
        torch.cuda.empty_cache()
    return measured


def cfg_parallel_columns(args, tokens, world):
    """{column: (first call s, ms, output) or an error string} of one guided denoising step
    (module docstring: --cfg-parallel)."""
    import diffusers
    from diffusers import ContextParallelConfig

    pipeline_class = getattr(diffusers, transformer_cases.PIPELINES[args.model])
    mode = args.context_parallel
    measured = {}

    def pipeline():  # a fresh injected model each: enable_parallelism cannot be undone
        model, call, _ = transformer_cases.model_case(args.model, tokens)
        if mode == "ring":
            model.set_attention_backend("_native_cudnn")
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        pipe = transformer_cases.denoising_pipeline(pipeline_class, model)
        return pipe, lambda: transformer_cases.guided_step(pipe, call)

    def attempt(column, setup):
        try:
            pipe, step = pipeline()
            setup(pipe)
            measured[column] = time_step(step, args.reps, args.warmup)
        except Exception as error:  # reported as the column's result
            measured[column] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        gc.collect()  # (the pipeline, its model and the hooks' references to them)
        torch.cuda.empty_cache()

    def config(degree):
        key = "ulysses_degree" if mode == "ulysses" else "ring_degree"
        return None if degree == 1 else ContextParallelConfig(**{key: degree})

    attempt("1 GPU kernels", lambda pipe: None)
    if mode:
        attempt(
            f"{mode} x {world} GPUs kernels",
            lambda pipe: pipe.transformer.enable_parallelism(
                config=config(world), cp_plan=injected_plan(pipe.transformer)
            ),
        )
    layout = f"cfg 2 x {mode} {world // 2}" if world > 2 else "cfg x 2"  # (2: no inner split)
    attempt(f"{layout} GPUs kernels", lambda pipe: enable_cfg_parallel(pipe, config(world // 2)))
    if args.model == "ltx" and mode == "ulysses" and "compile" in args.cp_columns:

        def compiled(pipe):  # (not fullgraph: torch 2.11 breaks once, in the output gather)
            enable_cfg_parallel(pipe, config(world // 2))
            torch._dynamo.reset()
            pipe.transformer.compile()

        attempt(f"{layout} GPUs, the whole model compiled + kernels", compiled)
    return measured


def _distributed(parser, args, flag):
    """(rank, world, say) of this torchrun process, its GPU set and the NCCL group joined; `say`
    prints on rank 0 only."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        parser.error(f"{flag} runs under torchrun --nproc_per_node N (N GPUs)")
    if args.model not in transformer_cases.PIPELINES:
        parser.error(f"{flag}: --model {', '.join(transformer_cases.PIPELINES)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    say = print if rank == 0 else (lambda *a, **k: None)
    return rank, world, say


#: The default --tokens under context parallelism, issue 36's shapes: LTX-Video 2B 161 frames, the
#: 13B at 2x12672, Wan 81 frames 720p, HunyuanVideo-1.5 480p in a grid 4 GPUs divide (480x832);
#: the others: the case's own shape.
PARALLEL_TOKENS = {"ltx": 8064, "ltx-13b": 12672, "wan-14b": 75600, "hunyuanvideo-1.5": 48360}
#: The optional column groups of --context-parallel (--cp-columns): stock diffusers on N GPUs,
#: the whole model compiled, compiled blocks, diffusers' Ulysses attention in place of ours.
CP_OPTIONAL_COLUMNS = ("stock", "compile", "blocks", "diffusers-ulysses")
#: The batch of a case's call: one guidance branch (Wan, HunyuanVideo-1.5) or both.
ONE_BRANCH = ("Wan", "HunyuanVideo-1.5")


def parallel_tables(args, say, columns, reference: str) -> list:
    """For each --tokens, the table of `columns(tokens)` ({column: (first s, ms, output) or an
    error}): ms, the speedup over "1 GPU kernels" (a CUDA-graph column over its graph) and the
    relative L2 against the `reference` column; returns the rows per shape."""
    family = transformer_cases.CASES[args.model].family
    results = []
    default = PARALLEL_TOKENS.get(args.model, transformer_cases.CASES[args.model].shapes[0])
    for tokens in args.tokens or [default]:
        batch = 1 if family in ONE_BRANCH else 2
        masked = ", padded text mask" if family != "Wan" else ""
        say(f"\n## {args.model}, batch {batch} x {tokens} tokens{masked}")
        say(f"| column | ms/step | vs 1 GPU kernels | first call s | rel L2 vs {reference} |")
        say("|---|---|---|---|---|", flush=True)
        measured = columns(tokens)
        rows = {}
        for column, value in measured.items():
            if isinstance(value, str):
                rows[column] = dict(error=value)
                say(f"| {column} | fails: {value} | | | |", flush=True)
                continue
            first_s, ms, out = value
            graphed = ", CUDA graph" if column.endswith(", CUDA graph") else ""
            base = measured.get(f"1 GPU kernels{graphed}")  # a graph against a graph
            ref = measured.get(reference)
            row = rows[column] = dict(ms=ms, first_call_s=first_s)
            row["speedup_vs_1gpu_kernels"] = base[1] / ms if isinstance(base, tuple) else None
            row["rel_l2"] = bench_utils.rel_l2(out, ref[2]) if isinstance(ref, tuple) else None
            say(
                f"| {column} | {ms:.2f} | {bench_utils.ratio_cell(row['speedup_vs_1gpu_kernels'])} "
                f"| {first_s:.1f} | {_rel_l2_cell(row['rel_l2'])} |",
                flush=True,
            )
        results.append(dict(tokens=tokens, columns=rows))
    return results


def context_parallel_main(parser, args):
    import torch.distributed as dist

    rank, world, say = _distributed(parser, args, "--context-parallel")
    env = bench_utils.environment()
    say(
        f"# {args.model}, context parallel {args.context_parallel} x {world}: {env['device']}, "
        f"torch {env['torch']}, bf16, median of {args.reps} steps (CUDA events, rank 0)"
    )
    results = parallel_tables(
        args,
        say,
        lambda tokens: context_parallel_columns(args, tokens, rank, world),
        "1 GPU eager",
    )
    if args.out and rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        bench_utils.write_json(
            args.out / f"transformer_{args.model}_cp_{args.context_parallel}{world}.json",
            dict(
                environment=env,
                model=args.model,
                context_parallel=args.context_parallel,
                world_size=world,
                results=results,
            ),
        )
    dist.destroy_process_group()


def cfg_parallel_main(parser, args):
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", 0))
    if world % 2 or world < 2 or (world > 2 and not args.context_parallel):
        parser.error(
            f"--cfg-parallel: {world} GPUs; launch 2 (one guidance branch each), or an even "
            "number with --context-parallel (inside each half)"
        )
    rank, world, say = _distributed(parser, args, "--cfg-parallel")
    env = bench_utils.environment()
    inner = f", {args.context_parallel} inside each group" if args.context_parallel else ""
    say(
        f"# {args.model}, CFG parallel on {world} GPUs{inner}: {env['device']}, torch "
        f"{env['torch']}, bf16, one guided denoising step, median of {args.reps} steps (CUDA "
        "events, rank 0)"
    )
    results = parallel_tables(
        args, say, lambda tokens: cfg_parallel_columns(args, tokens, world), "1 GPU kernels"
    )
    if args.out and rank == 0:
        suffix = f"_{args.context_parallel}" if args.context_parallel else ""
        bench_utils.write_json(
            args.out / f"transformer_{args.model}_cfg{world}{suffix}.json",
            dict(
                environment=env,
                model=args.model,
                cfg_parallel=True,
                context_parallel=args.context_parallel,
                world_size=world,
                results=results,
            ),
        )
    dist.destroy_process_group()


def attention_calls_note(calls: dict) -> str:
    """One step's attention calls by kind (bench_utils.attention_calls), for the note under the
    table: "8-bit attention in 24 of 56 calls (ours bf16 0, sdpa 32)"; with none in 8 bits the
    column is not 8-bit attention at this shape, and says so."""
    total = sum(calls.values())
    others = ", ".join(f"{kind} {n}" for kind, n in calls.items() if kind != "8-bit")
    note = f"8-bit attention in {calls['8-bit']} of {total} calls ({others})"
    if calls["8-bit"] == 0:
        note += ": no call long enough (LTX_INT8_ATTENTION_FASTER), the column attends as 'auto'"
    return note


def table_header(vs_compile: bool) -> str:
    """The markdown header of a model's table; the "vs compile" column only when the compile
    column was asked for."""
    cells = ["column", "ms/step", "vs eager", "first call (compile) s", "rel L2 vs eager"]
    cells += ["peak GiB", "peak vs bf16"]
    if vs_compile:
        cells.insert(3, "vs compile")
    return f"| {' | '.join(cells)} |\n|{'---|' * len(cells)}"


def table_row(column: str, row: dict, vs_compile: bool) -> str:
    """A column's row under table_header(vs_compile). A ratio whose reference was not asked for
    (eager) or not measured yet (compile, asked for after this column) is "-"."""
    cells = [
        column,
        f"{row['ms']:.2f}",
        bench_utils.ratio_cell(row["speedup_vs_eager"]),
        f"{row['first_call_s']:.1f}",
        _rel_l2_cell(row["rel_l2"]),
        f"{row['peak_gib']:.2f}",
        bench_utils.ratio_cell(row["peak_vs_bf16"]),
    ]
    if vs_compile:
        cells.insert(3, bench_utils.ratio_cell(row["speedup_vs_compile"]))
    return f"| {' | '.join(cells)} |"


def _rel_l2_cell(value) -> str:
    return "-" if value is None else f"{value:.2e}"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", choices=(*transformer_cases.CASES, "flux-pair"), default="ltx")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument(
        "--columns",
        default=",".join(transformer_cases.COLUMNS),
        help=f"comma-separated, from {', '.join(transformer_cases.ALL_COLUMNS)}",
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed calls after the first, before the timed ones (the large models: 0 or 1)",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode, e.g. reduce-overhead (CUDA graphs); --context-parallel: of "
        "the compiled-blocks column",
    )
    parser.add_argument(
        "--fp8-linears",
        choices=FP8_PRESETS,
        nargs="+",
        default=None,
        help="the fp8 columns: which Linears run FP8 (default: the model family's preset); "
        "several: each fp8 column once per preset, labelled 'column [preset]'",
    )
    parser.add_argument("--context-parallel", choices=("ulysses", "ring"), default=None)
    parser.add_argument(
        "--cp-columns",
        type=lambda s: set(s.split(",")) - {""},
        default=set(CP_OPTIONAL_COLUMNS),
        help="--context-parallel: the optional columns to run, comma-separated, from "
        f"{', '.join(CP_OPTIONAL_COLUMNS)} (default: all; the kernel columns always run); "
        "--cfg-parallel: compile only",
    )
    parser.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="one guided step with the guidance branches on two GPU groups (enable_cfg_parallel)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--context-parallel: also the GPU kernel time by category of the kernel columns",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="--context-parallel: also the kernel columns replayed as one CUDA graph per step",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    unknown = args.cp_columns - set(CP_OPTIONAL_COLUMNS)
    if unknown:
        parser.error(f"--cp-columns: unknown {', '.join(sorted(unknown))}")
    if args.cfg_parallel:
        return cfg_parallel_main(parser, args)
    if args.context_parallel:
        return context_parallel_main(parser, args)
    columns = bench_utils.parse_columns(parser, args.columns, transformer_cases.ALL_COLUMNS)
    transformer_cases.COMPILE_MODE = args.compile_mode
    runs = fp8_preset_runs(columns, args.fp8_linears)
    tokens_list = args.tokens or ([2688, 8064] if args.model == "ltx" else [None])
    env = bench_utils.environment()
    print(
        f"# {args.model}: {env['device']}, torch {env['torch']}, bf16, "
        f"median of {args.reps} steps (CUDA events)"
    )
    results = []
    for tokens in tokens_list:
        model, call, tokens = transformer_cases.model_case(args.model, tokens)
        rows = {}
        print(f"\n## {args.model}, {tokens} tokens", flush=True)
        vs_compile = "compile" in columns
        print(table_header(vs_compile), flush=True)
        notes = []
        for label, column, preset in runs:
            transformer_cases.FP8_LINEARS = preset
            measured = run_column(column, model, call, args.reps, args.warmup)
            if measured is None:
                continue
            first_s, ms, out, peak, calls = measured
            # (outputs kept on the CPU: the next columns' peaks do not hold them)
            row = rows[label] = dict(ms=ms, first_call_s=first_s, out=out.float().cpu())
            del measured, out
            if calls is not None:
                row["attention_calls"] = calls
                notes.append(f"{label}: {attention_calls_note(calls)}")
            row["peak_gib"] = peak / 2**30
            bf16 = rows.get(bf16_column(column))
            row["peak_vs_bf16"] = row["peak_gib"] / bf16["peak_gib"] if bf16 else None
            eager = rows.get("eager")
            row["speedup_vs_eager"] = eager["ms"] / ms if eager else None
            row["speedup_vs_compile"] = rows["compile"]["ms"] / ms if "compile" in rows else None
            row["rel_l2"] = bench_utils.rel_l2(row["out"], eager["out"]) if eager else None
            print(table_row(label, row, vs_compile), flush=True)
        for note in notes:
            print(f"- {note}", flush=True)
        results.append(
            dict(
                tokens=tokens,
                columns={c: {k: v for k, v in r.items() if k != "out"} for c, r in rows.items()},
            )
        )
        del model, rows
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        bench_utils.write_json(
            args.out / f"transformer_{args.model}.json",
            dict(environment=env, model=args.model, results=results),
        )


if __name__ == "__main__":
    main()
