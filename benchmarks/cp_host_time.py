"""Host time of one LTX-Video or LTX-2 transformer step under context parallelism, on the CPU
(gloo): the Python and dispatcher time to issue a step, the eager step's floor on GPUs where a
rank's GPU work is shorter (LTX-Video 2B at 2x8064 on 4 GPUs: ~45 ms of GPU work a step; NOTES.md).
The transformer has the real structure (--model ltx: the 2B's 28 blocks; ltx2: LTX-2's 48 blocks,
image-to-video as benchmark_transformer.py runs it; --blocks) at tiny widths (8 heads of 4
channels, 32 video tokens, 8 text tokens with a padded prompt; LTX-2: also 8 audio heads of 4, 5
audio latents), so its compute is negligible and a step's time is host overhead.

For each world size in --worlds, that many gloo processes (1: no parallelism) run the columns
(--columns), each on a fresh model:
  stock                        diffusers as it is (more than one process: without the text mask,
                               which diffusers 0.42 fails on under Ulysses)
  kernels                      inject_optimized_kernels, then enable_parallelism with
                               ContextParallelConfig(ulysses_degree=N) (ulysses_attention)
  kernels-diffusers-ulysses    the same without ulysses_attention (diffusers' Ulysses attention)
Per column (rank 0): host ms per step (its thread's CPU time, median and min of --steps: gloo's
waits and the other processes' time excluded; with more processes than cores, contention inflates
it: the min is the steadier figure on a busy machine); per
block (a step's counts over its blocks, the model's own few ops included) the ops dispatched from
Python (torch.profiler: aten, ltx_kernels and c10d ops, not those they call), those of them that
launch work on a GPU (one or more kernels: not views, allocations or no-ops, NO_LAUNCH; a
collective counts as one) and the collectives; --cprofile adds rank 0's host functions by own
time (profile_step.host_profile).

  python benchmarks/cp_host_time.py --worlds 1 2 4 --cprofile 2
  python benchmarks/cp_host_time.py --model ltx2 --worlds 1 4
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils  # noqa: E402
import step_inputs  # noqa: E402

COLUMNS = ("stock", "kernels", "kernels-diffusers-ulysses")
#: LTX-Video 2B's structure (configs/ltx-video-0.9.1.json) at tiny widths.
TINY_2B = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=8,
    attention_head_dim=4,
    cross_attention_dim=32,
    caption_channels=16,
)
#: LTX-2 2.0's structure (configs/ltx-2.json) at tiny widths.
TINY_LTX2 = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=8,
    attention_head_dim=4,
    cross_attention_dim=32,
    audio_in_channels=8,
    audio_out_channels=8,
    audio_num_attention_heads=8,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=32,
    caption_channels=16,
)
#: --model -> its real config's name (configs/), tiny widths and default block count.
MODELS = {"ltx": ("ltx-video-0.9.1", TINY_2B, 28), "ltx2": ("ltx-2", TINY_LTX2, 48)}
#: The ops torch.profiler records that count: dispatched from Python (a parent of another kind).
OP_PREFIXES = ("aten::", "ltx_kernels::", "c10d::", "_c10d_functional::")
NOT_COLLECTIVES = ("_c10d_functional::wait_tensor", "_c10d_functional::_wrap_tensor_autograd")
#: The ops that launch nothing on a GPU themselves: views, allocations, and what are no-ops on
#: these tensors unless they call an op that does (an eval Dropout, a cast to the same dtype,
#: contiguous() of a contiguous tensor).
NO_LAUNCH = {
    f"aten::{name}"
    for name in (
        "view alias as_strided reshape _reshape_alias flatten unflatten permute transpose "
        "select slice narrow unbind split split_with_sizes chunk movedim unsqueeze squeeze "
        "expand detach empty empty_like empty_strided new_empty dropout to contiguous"
    ).split()
}


def build(column: str, world: int, blocks: int, model_name: str = "ltx"):
    """(model, its step's keyword arguments) for a column."""
    import diffusers
    import ltx_kernels
    from diffusers import ContextParallelConfig
    from ltx_kernels.integration import FUSIONS, injected_plan

    name, tiny, _ = MODELS[model_name]
    transformer = bench_utils.model_config(name)["transformer"]
    model_config = {**transformer["config"], **tiny, "num_layers": blocks}
    torch.manual_seed(0)
    model = getattr(diffusers, transformer["class"])(**model_config).eval()
    if column != "stock":
        ops = set(FUSIONS) - {"ulysses_attention"} if column.endswith("diffusers-ulysses") else None
        ltx_kernels.inject_optimized_kernels(model, verbose=False, ops=ops)
    if world > 1:
        config = ContextParallelConfig(ulysses_degree=world)
        model.enable_parallelism(config=config, cp_plan=injected_plan(model))
    generator = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=generator)  # noqa: E731
    grid = dict(batch=2, frames=2, height=4, width=4, text=8, device="cpu")
    if model_name == "ltx2":
        timestep = torch.full((2,), 500.0)
        inputs = step_inputs.ltx2(
            model_config, randn, **grid, audio_frames=5, valid_text=6, timestep=timestep,
            image_to_video=True,
        )  # fmt: skip
    else:
        inputs = step_inputs.ltx_video(
            tiny, randn, **grid, mask=step_inputs.text_mask(2, 8, 6, "cpu")
        )
    if column == "stock" and world > 1:
        inputs["encoder_attention_mask"] = None
        inputs.pop("audio_encoder_attention_mask", None)
    return model, inputs


def launches(event) -> bool:
    """Whether a profiled op or an op it calls launches work on a GPU (is not NO_LAUNCH): a
    reshape or contiguous() that copies does, a cast to another dtype does."""
    if event.name.startswith(OP_PREFIXES) and event.name not in NO_LAUNCH | set(NOT_COLLECTIVES):
        return True
    return any(launches(child) for child in event.cpu_children)


def op_counts(step) -> dict:
    """The ops one call of step dispatches from Python (OP_PREFIXES), those that launch on a GPU
    (not NO_LAUNCH) and the collectives."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = dict(ops=0, launches=0, collectives=0)
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(OP_PREFIXES):
            parent = parent.cpu_parent
        if event.name.startswith(OP_PREFIXES) and parent is None:
            counts["ops"] += 1
            counts["launches"] += launches(event)
            counts["collectives"] += "c10d" in event.name and event.name not in NOT_COLLECTIVES
    return counts


def measure(column, world, rank, args) -> dict:
    model, inputs = build(column, world, args.blocks, args.model)

    def step():
        return model(**inputs)

    with torch.no_grad():
        for _ in range(3):
            step()
        host = []
        for _ in range(args.steps):
            if world > 1:
                dist.barrier()
            start = time.thread_time()
            step()
            host.append((time.thread_time() - start) * 1000)
        counts = op_counts(step)
        if rank == 0 and args.cprofile:
            import profile_step

            print(f"\n## {column}, {world} process(es)")
            profile_step.host_profile(step, args.cprofile)
        elif args.cprofile:
            step()  # (the collectives of rank 0's profiled step)
    return dict(host_ms=statistics.median(host), host_min_ms=min(host), **counts)


def worker(rank, world, port, args, queue):
    bench_utils.one_thread_one_device()
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    for column in args.columns:
        if world == 1 and column == "kernels-diffusers-ulysses":
            continue
        try:
            result = measure(column, world, rank, args)
        except RuntimeError as error:  # stock LTX-2 under Ulysses: diffusers 0.42 fails
            result = f"fails: {str(error).splitlines()[0][:120]}"
            if world > 1:  # (the other ranks may wait in a collective the failed one never joins)
                dist.barrier()
        if rank == 0:
            queue.put((world, column, result))
    if world > 1:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", choices=tuple(MODELS), default="ltx")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--blocks", type=int, default=None, help="default: the model's")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cprofile", type=int, default=0, help="rank 0's top N host functions")
    args = parser.parse_args()
    args.columns = bench_utils.parse_columns(parser, args.columns, COLUMNS)
    args.blocks = args.blocks or MODELS[args.model][2]
    queue = mp.get_context("spawn").SimpleQueue()
    rows = []
    for world in args.worlds:
        mp.spawn(worker, args=(world, bench_utils.free_port(), args, queue), nprocs=world)
        while not queue.empty():
            rows.append(queue.get())
    print(f"\n# {args.model}, {args.blocks} blocks at tiny widths, torch {torch.__version__}, CPU")
    print("| processes | column | host ms / step (min) | per block: ops | launches | collectives |")
    print("|---|---|---|---|---|---|")
    for world, column, r in rows:
        if isinstance(r, str):
            print(f"| {world} | {column} | {r} | | | |")
            continue
        cells = [f"{r['host_ms']:.1f} ({r['host_min_ms']:.1f})"]
        cells += [f"{r[key] / args.blocks:.1f}" for key in ("ops", "launches", "collectives")]
        print(f"| {world} | {column} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
