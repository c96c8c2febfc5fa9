"""Text-to-video with ltx_kernels on diffusers' LTX pipelines: generate a video, or benchmark the
whole pipeline.

  python scripts/generate_video.py                         # kernels on, 161 frames 512x768, 50 steps
  python scripts/generate_video.py --no-optimized-kernels --compile
  python scripts/generate_video.py --use-optimized-kernels --compile     # both together
  python scripts/generate_video.py --compare --num-frames 49 --steps 30  # the four rows in one process
  python scripts/generate_video.py --fp8 --compile                        # opt-in FP8 GEMMs
  python scripts/generate_video.py --weights random --model-id Lightricks/LTX-2 --compare
  torchrun --nproc_per_node 2 scripts/generate_video.py --context-parallel ulysses --compare
  torchrun --nproc_per_node 4 scripts/generate_video.py --cfg-parallel --context-parallel ulysses

Models (--model-id, a hub id or the name of its configs/*.json): Lightricks/LTX-Video (0.9.0/0.9.1)
and Lightricks/LTX-Video-0.9.5 (2B) through LTXPipeline; Lightricks/LTX-Video-0.9.7-dev and
-0.9.8-13B-distilled (13B) through LTXConditionPipeline, as image-to-video from a random first
frame, so that the transformer gets the per-token timesteps [B, S] those checkpoints run with;
Lightricks/LTX-2, -2.3 and -2.5 (19B, video and audio) through LTX2Pipeline. A checkpoint's
recommended call (0.9.7-dev, 0.9.8 distilled, LTX-2.x: steps or a distilled schedule, guidance,
decode noise; "call" in its configs/*.json) applies unless --steps / --guidance-scale are given.

Weights (--weights): `hub` loads --model-id with diffusers (from the local cache, else downloaded;
any diffusers LTX checkpoint); `random` builds the pipeline offline from the checkpoint's real
configs (configs/*.json: the transformer, VAE and scheduler, and for LTX-2 the audio VAE, vocoder
and text connectors) with random weights, and random text embeddings of the real text encoder's
width in place of T5-XXL (4.7B) or Gemma (12B): the timings are those of the real architecture,
the video is noise. `auto` (default) loads the hub pipeline when it can and otherwise falls back to
`random`, saying why.

Timing: wall clock of whole pipeline calls (prompt handling, denoising loop, VAE decode; the frames
come back as a tensor on the GPU, and writing the file is not timed), synchronized, median of
--runs calls after --warmup-iterations calls. The first warm-up call of a compiled configuration
is its compile time, reported apart. it/s is the rate of the denoising loop alone (from the end of
its first step to the end of its last); decode is the time from the end of the loop to the frames.
Every configuration starts from the same seed, so their final latents are compared with the
baseline's (relative L2), and their decoded frames too (PSNR in dB, frames in [0, 1]), and LTX-2's
audio (relative L2); the rows that keep bf16 numerics (kernels, compile, and
kernels+ltx_attention: our bf16 attention op in place of cuDNN's) give the noise floor the FP8
and 8-bit attention (kernels+int8_attention: attention="int8") rows are read against.

Caches (--cache first-block|pyramid-attention-broadcast): diffusers' cache on the transformer,
added after the kernels (inject first, then cache, as docs/injection.md says), configured below
(CACHE_CONFIGS); with --compare it adds the rows "Baseline + cache" (stock diffusers with the same
cache, the peer to compare with) and "Optimized kernels + cache". The latent drift and PSNR of a
cached row include what the cache skips. LTX-Video only (Family.no_cache says why not LTX-2).

FP8 (--fp8, or the --compare configurations kernels+fp8 and kernels+fp8+compile): the kernels with
inject_optimized_kernels(..., fp8=True), the opt-in FP8 path (docs/fp8.md; --fp8-linears picks the
preset of which Linears run FP8; a model without an FP8 path stays bf16 and the row's note says
so). torchao-fp8+compile is the path a user would pick instead: torchao's float8 dynamic rowwise
quantization of every Linear of the transformer (torchao from PyPI), compiled; torchao replaces
the weights, the bf16 ones wait on the CPU and come back after the row.

Attention (--attention, the kernels' rows): what the patched attention processors attend with,
inject_optimized_kernels' attention= ("auto" by default; "ltx_kernels": our attention op where it
applies; "diffusers": diffusers' backend; "int8": 8-bit attention where it applies and measured
faster, a numerics change measured by --compare's rows). Baseline rows attend as diffusers does.

Several GPUs (--context-parallel ulysses|ring, launched by torchrun, one process per GPU; every
checkpoint): the transformer runs under diffusers' context parallelism (enable_parallelism), the
kernels injected on top. The text mask every LTXPipeline call passes fails (Ulysses) or silently
goes wrong (ring) in stock diffusers 0.42, and its plan does not split LTXConditionPipeline's
per-token timesteps; ltx_kernels' attention processors and patched plan handle both, so the
baseline rows run the diffusers code through them (inject_optimized_kernels(ops=())) and stay
comparable. --compare adds a first row: the kernels on one GPU (every rank alone). Compiling is
per block there by default; under Ulysses alone --compile-scope full compiles the whole model (not
fullgraph: torch 2.11 breaks its graph once, in diffusers' output gather), the fastest LTX-Video
2B step on 4 GPUs (benchmarks/NOTES.md). Ring attention runs on cuDNN (the backend that returns
the log-sum-exp ring attention needs and takes the mask). Rank 0 prints and writes
the outputs. --cfg-parallel (guidance on) runs the two classifier-free-guidance branches on two
halves of the GPUs (ltx_kernels.integration.enable_cfg_parallel; LTX-2's STG and modality passes
side by side too), each half under --context-parallel when given (4 GPUs: 2 x Ulysses 2), else
one GPU a branch (2 GPUs); --cfg-parallel 4 (LTX-2, STG and modality isolation on, its default)
runs its four passes a step on four groups (4 GPUs: one pass each, no collective inside the
model).

Outputs: the video (--output: .mp4, .mov, .mkv, .avi or .gif, .mp4 when no extension is given;
the extension and the folders are checked before the run; written by diffusers' export_to_video,
which needs imageio + imageio-ffmpeg or OpenCV, else an animated GIF beside it), LTX-2's audio (a
.wav beside the video, muxed into the mp4 with imageio-ffmpeg's ffmpeg), a JSON of the results
(--json) and, with --compare, a PNG chart (--chart, needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import json
import os
import statistics
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import ltx_kernels
from ltx_kernels.integration import ATTENTION_CHOICES, FP8_PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_utils  # noqa: E402  (configs/*.json, random_model, the torchao anchor)

CONFIGS = ("baseline", "kernels", "compile", "kernels+compile")
FP8_CONFIGS = ("kernels+fp8", "kernels+fp8+compile", "torchao-fp8+compile")
#: The kernels attending with our bf16 attention op (attention="ltx_kernels": another bf16 backend,
#: the noise floor the 8-bit row is read against) and with 8-bit attention (attention="int8").
ATTENTION_CONFIGS = ("kernels+ltx_attention", "kernels+int8_attention")
CACHE_ROWS = ("cache", "kernels+cache")  # with --cache
#: The --output extensions export_to_video writes (imageio: ffmpeg, or Pillow for .gif).
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".avi", ".gif")
CONFIG_TITLES = {
    "kernels-1gpu": "Optimized kernels, 1 GPU",
    "baseline": "Baseline (diffusers eager)",
    "kernels": "Optimized kernels",
    "compile": "Baseline + torch.compile",
    "kernels+compile": "Optimized kernels + torch.compile",
    "kernels+fp8": "Optimized kernels, FP8",
    "kernels+ltx_attention": "Optimized kernels, ltx_kernels bf16 attention",
    "kernels+int8_attention": "Optimized kernels, 8-bit attention",
    "kernels+fp8+compile": "Optimized kernels, FP8 + torch.compile",
    "torchao-fp8+compile": "torchao float8 rowwise + torch.compile",
    "cache": "Baseline + cache",
    "kernels+cache": "Optimized kernels + cache",
}


def cache_config(name: str, pipe):
    """The diffusers cache config --cache names, for an LTX pipeline: FirstBlockCache with
    diffusers' documented threshold range's low end (skips the later blocks while the first
    block's output changes by less than 5%), or PyramidAttentionBroadcast reusing spatial
    attention every other block between timesteps 100 and 800 (the pipeline's current one)."""
    import diffusers

    if name == "first-block":
        return diffusers.FirstBlockCacheConfig(threshold=0.05)
    return diffusers.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(100, 800),
        current_timestep_callback=lambda: pipe.current_timestep,
    )


CACHES = ("first-block", "pyramid-attention-broadcast")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_PROMPT = (
    "A woman with long brown hair and light skin smiles at another woman with long blonde "
    "hair. The woman with brown hair wears a black jacket and has a small, barely "
    "noticeable mole on her right cheek. The camera angle is a close-up, focused on the "
    "woman with brown hair's face. The lighting is warm and natural, likely from the "
    "setting sun, casting a soft glow on the scene. The scene appears to be real-life "
    "footage."
)
DEFAULT_NEGATIVE_PROMPT = "worst quality, inconsistent motion, blurry, jittery, distorted"


@dataclass(frozen=True)
class Family:
    """What this script does differently per diffusers pipeline class."""

    components: tuple[str, ...]  # configs/*.json sections built as models (the pipeline's keywords)
    text_tokens: int  # the pipeline's default max_sequence_length (random embeddings' length)
    frame_rate: float  # the pipeline's default frame_rate
    left_padded_text: bool  # Gemma pads prompts on the left, T5 on the right
    first_frame: bool  # condition on a first frame: per-token timesteps [B, S] in the transformer
    no_cache: str | None  # why --cache does not apply, if it does not
    tiny: dict  # --tiny: section -> config overrides (a value, or a function of the real one)


_narrow = lambda widths: [width // 16 for width in widths]  # keeps the ratios the upsamplers need
_one_each = lambda counts: [1] * len(counts)  # as many blocks, one layer each
LTX_TINY = {
    "transformer": dict(
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=2,
        caption_channels=32,
    ),
    "vae": dict(
        latent_channels=8,
        block_out_channels=_narrow,
        decoder_block_out_channels=_narrow,
        layers_per_block=_one_each,
        decoder_layers_per_block=_one_each,
    ),
}
LTX2_TINY = {
    # video 2 heads of 8, audio 2 heads of 8; text 16 wide (3 "layers" of 16 from the encoder);
    # audio latents 2 channels x 16 mel bins = the audio VAE's base_channels (its latents_mean)
    "transformer": dict(
        in_channels=8,
        out_channels=8,
        audio_in_channels=32,
        audio_out_channels=32,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_num_attention_heads=2,
        audio_attention_head_dim=8,
        audio_cross_attention_dim=16,
        num_layers=2,
        caption_channels=16,
    ),
    "vae": LTX_TINY["vae"],
    "audio_vae": dict(base_channels=32, latent_channels=2, num_res_blocks=1),
    "vocoder": dict(  # one resnet per stage: the full output sample rate is what costs
        hidden_channels=64,
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1]],
        bwe_hidden_channels=32,
        bwe_resnet_kernel_sizes=[3],
        bwe_resnet_dilations=[[1]],
    ),
    "connectors": dict(
        caption_channels=16,
        text_proj_in_factor=3,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=8,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=8,
        video_hidden_dim=16,
        audio_hidden_dim=16,
    ),
}
FAMILIES = {
    "LTXPipeline": Family(
        components=("transformer", "vae"),
        text_tokens=128,
        frame_rate=25,
        left_padded_text=False,
        first_frame=False,
        no_cache=None,
        tiny=LTX_TINY,
    ),
    "LTXConditionPipeline": Family(
        components=("transformer", "vae"),
        text_tokens=256,
        frame_rate=25,
        left_padded_text=False,
        first_frame=True,
        no_cache=None,
        tiny=LTX_TINY,
    ),
    "LTX2Pipeline": Family(
        components=("transformer", "vae", "audio_vae", "vocoder", "connectors"),
        text_tokens=1024,
        frame_rate=24.0,
        left_padded_text=True,
        first_frame=False,
        no_cache="diffusers 0.42's FirstBlockCache has no LTX-2 block registered, and "
        "PyramidAttentionBroadcast replays the guidance pass's attention in the STG and modality "
        "passes, whose batch differs, and fails",
        tiny=LTX2_TINY,
    ),
}


def family_of(pipe) -> Family:
    return FAMILIES[type(pipe).__name__]


def checkpoints() -> dict[str, str]:
    """--model-id values with a real config (configs/*.json with a "pipeline" section) -> the
    config's name: its hub id (model_id), its diffusers-format repo where that differs
    (pipeline.hub_repo) and the name itself."""
    ids = {}
    for path in sorted(bench_utils.CONFIGS.glob("*.json")):
        spec = bench_utils.model_config(path.stem)
        if "pipeline" in spec:
            for key in (spec["model_id"], spec["pipeline"].get("hub_repo"), path.stem):
                if key:
                    ids[key] = path.stem
    return ids


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    kernels = parser.add_mutually_exclusive_group()
    kernels.add_argument(
        "--use-optimized-kernels",
        dest="kernels",
        action="store_true",
        default=True,
        help="run the transformer on ltx_kernels' fused ops (default)",
    )
    kernels.add_argument(
        "--no-optimized-kernels",
        dest="kernels",
        action="store_false",
        help="run diffusers' own code (the baseline)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the transformer (fullgraph, but the whole model under "
        "--context-parallel); stacks with the kernels",
    )
    parser.add_argument(
        "--compile-scope",
        choices=("full", "blocks"),
        default=None,
        help="full (default; blocks under --context-parallel or --cfg-parallel): torch.compile "
        "of the whole transformer; blocks: compile_repeated_blocks (compiles in seconds, about "
        "as fast)",
    )
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode, e.g. max-autotune-no-cudagraphs (default: default)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="with the kernels: FP8 GEMMs (inject_optimized_kernels(..., fp8=True), opt-in)",
    )
    parser.add_argument(
        "--fp8-linears",
        choices=FP8_PRESETS,
        default=None,
        help="with FP8: which Linears run FP8 (default: the model family's preset)",
    )
    parser.add_argument(
        "--fp8-bf16-blocks",
        type=int,
        default=0,
        help="with FP8: keep the first and last N transformer blocks in bf16",
    )
    parser.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="with the kernels: what the attention processors attend with "
        "(inject_optimized_kernels(..., attention=); docs/injection.md)",
    )
    parser.add_argument(
        "--cache",
        choices=CACHES,
        default=None,
        help="a diffusers cache on the transformer, added after the kernels (with --compare: "
        "rows with the cache on stock diffusers and on the kernels)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run baseline, kernels, compile and kernels+compile in one process and "
        "print the comparison table (--configs picks a subset, FP8 rows included)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="configurations for --compare, comma-separated from "
        f"{', '.join(CONFIGS + FP8_CONFIGS + ATTENTION_CONFIGS)}",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="videos per prompt")
    parser.add_argument("--num-frames", type=int, default=161, help="8k+1 frames")
    parser.add_argument("--height", type=int, default=512, help="multiple of 32")
    parser.add_argument("--width", type=int, default=768, help="multiple of 32")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="denoising steps, at least 2 (default: the checkpoint's recommended steps or "
        "timesteps, else 50)",
    )
    parser.add_argument(
        "--warmup-iterations",
        type=int,
        default=2,
        help="untimed pipeline calls per configuration (the first one compiles)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="timed pipeline calls per configuration"
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="classifier-free guidance (default: the checkpoint's recommended one, else 3.0)",
    )
    parser.add_argument(
        "--frame-rate",
        type=float,
        default=None,
        help="frames per second (default: the pipeline's, 25 for LTX-Video, 24 for LTX-2)",
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--negative-prompt", default=DEFAULT_NEGATIVE_PROMPT)
    parser.add_argument(
        "--weights",
        choices=("auto", "hub", "random"),
        default="auto",
        help="auto: the hub pipeline if it can be loaded, else random weights",
    )
    parser.add_argument(
        "--model-id",
        default="Lightricks/LTX-Video",
        help="the checkpoint: a hub id or the name of its configs/*.json (random weights: "
        f"{', '.join(sorted(k for k, v in checkpoints().items() if '/' in k))}); --weights hub "
        "also loads any other diffusers LTX checkpoint",
    )
    parser.add_argument(
        "--cpu-offload",
        action="store_true",
        help="enable_model_cpu_offload() (needs a CUDA device)",
    )
    parser.add_argument(
        "--attention-backend",
        default=None,
        help="diffusers attention backend for every configuration, e.g. "
        "_native_cudnn or flash_hub (default: diffusers' default, native SDPA)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("ltx_video.mp4"),
        help=f"video file: {', '.join(VIDEO_SUFFIXES)}; .mp4 when it has no extension (default: "
        "ltx_video.mp4)",
    )
    parser.add_argument("--no-video", action="store_true", help="do not write the video")
    parser.add_argument("--json", type=Path, default=None, help="results (default: <output>.json)")
    parser.add_argument(
        "--chart",
        type=Path,
        default=None,
        help="comparison chart, with --compare (default: <output>_compare.png)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--context-parallel",
        choices=("ulysses", "ring"),
        default=None,
        help="split the transformer's sequence over the GPUs of a torchrun launch "
        "(torchrun --nproc_per_node N scripts/generate_video.py --context-parallel ulysses)",
    )
    parser.add_argument(
        "--cfg-parallel",
        nargs="?",
        type=int,
        const=2,
        default=None,
        choices=(2, 4),
        metavar="GROUPS",
        help="the two guidance branches on two halves of the GPUs of a torchrun launch, each "
        "half under --context-parallel when given (torchrun --nproc_per_node 4 "
        "scripts/generate_video.py --cfg-parallel --context-parallel ulysses); --cfg-parallel 4 "
        "(LTX-2): its four passes a step (the branches, STG, modality isolation) on four groups",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random model (2 blocks, small VAE) for smoke tests on any device",
    )
    args = parser.parse_args(argv)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.configs != parser.get_default("configs") and not args.compare:
        parser.error("--configs: only with --compare (otherwise the flags pick one configuration)")
    known = CONFIGS + FP8_CONFIGS + ATTENTION_CONFIGS + (CACHE_ROWS if args.cache else ())
    unknown = sorted(set(configs) - set(known))
    if unknown:
        parser.error(
            f"--configs: unknown {unknown}; choose from {', '.join(known)}"
            + ("" if args.cache else " (cache, kernels+cache: with --cache)")
        )
    if not configs:
        parser.error("--configs: give at least one configuration")
    if args.fp8 and (args.compare or not args.kernels):
        parser.error(
            "--fp8: with the kernels, one configuration (--compare: --configs kernels+fp8)"
        )
    if args.fp8_bf16_blocks < 0:
        parser.error("--fp8-bf16-blocks: must be >= 0")
    if args.compare:
        if args.cache and args.configs == parser.get_default("configs"):
            configs += CACHE_ROWS
        args.configs = [c for c in known if c in configs]
    elif args.cache:
        if args.fp8 or args.compile:
            parser.error("--cache: with the kernels or without, not with --fp8 or --compile")
        args.configs = ["kernels+cache" if args.kernels else "cache"]
    elif args.fp8:
        args.configs = ["kernels+fp8+compile" if args.compile else "kernels+fp8"]
    else:
        args.configs = [
            ("kernels+compile" if args.compile else "kernels")
            if args.kernels
            else ("compile" if args.compile else "baseline")
        ]
    resolve_checkpoint(args, parser.error)
    if args.steps < 2:
        parser.error("--steps: at least 2 (LTX's scheduler gives NaN timesteps for one step)")
    if args.num_frames < 1 or (args.num_frames - 1) % 8:
        parser.error(f"--num-frames: must be 8k+1 (1, 9, ..., 49, ..., 161), got {args.num_frames}")
    for name in ("height", "width"):
        if getattr(args, name) <= 0 or getattr(args, name) % 32:
            parser.error(f"--{name}: must be a positive multiple of 32, got {getattr(args, name)}")
    for name in ("batch_size", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1")
    compiles = any("compile" in config for config in args.configs)
    if args.warmup_iterations < (1 if compiles else 0):
        parser.error(
            f"--warmup-iterations: must be at least {int(compiles)}"
            + (
                " with torch.compile (the first call compiles, outside the timed runs)"
                if compiles
                else ""
            )
        )
    for name in ("compile_scope", "compile_mode"):
        if getattr(args, name) is not None and not compiles:
            parser.error(f"--{name.replace('_', '-')}: no effect without --compile (or --compare)")
    args.parallel = " ".join(
        option
        for option, given in (
            ("--cfg-parallel" + (" 4" if args.cfg_parallel == 4 else ""), args.cfg_parallel),
            (f"--context-parallel {args.context_parallel}", args.context_parallel),
        )
        if given
    )  # the parallel flags, "" on one GPU
    if args.parallel:
        if "WORLD_SIZE" not in os.environ:
            parser.error(
                f"{args.parallel}: launch with torchrun, one process per GPU: torchrun "
                f"--nproc_per_node N scripts/generate_video.py {args.parallel} ..."
            )
        if args.cpu_offload:
            parser.error(f"{args.parallel}: not with --cpu-offload (each GPU holds the model)")
        if args.compile_scope == "full" and (
            args.context_parallel != "ulysses" or args.cfg_parallel
        ):
            parser.error(
                f"{args.parallel}: --compile-scope full compiles the whole model under "
                "--context-parallel ulysses alone (not tested under ring attention or "
                "--cfg-parallel); compile per block there (--compile-scope blocks, the default)"
            )
        world, groups = int(os.environ["WORLD_SIZE"]), args.cfg_parallel
        if groups and (world % groups or (world > groups and not args.context_parallel)):
            parser.error(
                f"--cfg-parallel: {world} GPUs; launch 2 (one guidance branch each), or an even "
                "number with --context-parallel (each half splits the sequence)"
                + ("; LTX-2 on 4: --cfg-parallel 4" if args.pipeline == "LTX2Pipeline" else "")
                if groups == 2
                else f"--cfg-parallel {groups}: {world} GPUs; launch {groups} (one pass each), "
                f"or a multiple of {groups} with --context-parallel"
            )
        if groups and args.context_parallel and world == groups:
            parser.error(
                f"{args.parallel}: {world} GPUs are one a guidance group, none left to split "
                f"the sequence; launch a multiple of {groups} above it, or drop --context-parallel"
            )
        if groups == 4 and args.pipeline not in ("LTX2Pipeline", None):
            parser.error(
                f"--cfg-parallel 4: LTX-2 only (its four passes a step); {args.model_id} is "
                f"{args.pipeline}: --cfg-parallel"
            )
        if args.cfg_parallel and args.guidance_scale <= 1:
            parser.error(
                f"--cfg-parallel: needs classifier-free guidance (--guidance-scale > 1; "
                f"{args.model_id} runs with {args.guidance_scale})"
            )
        args.compile_scope = args.compile_scope or "blocks"
        if args.compare:
            args.configs = (
                ["kernels-1gpu", *args.configs] if "kernels" in args.configs else args.configs
            )
    args.compile_scope = args.compile_scope or "full"
    if args.cpu_offload and compiles and args.compile_scope == "full":
        parser.error(
            "--cpu-offload with torch.compile: use --compile-scope blocks (the offload "
            "hook on the transformer wraps the module that a full compile would trace)"
        )
    if args.cpu_offload and not torch.cuda.is_available():
        parser.error("--cpu-offload: needs a CUDA device")
    if args.tiny and args.weights == "hub":
        parser.error("--tiny builds a random model; it cannot be combined with --weights hub")
    if not args.output.suffix:
        args.output = args.output.with_name(args.output.name + ".mp4")
    if not args.no_video and args.output.suffix.lower() not in VIDEO_SUFFIXES:
        parser.error(
            f"--output: {args.output}: unknown video extension {args.output.suffix!r}; use "
            f"{', '.join(VIDEO_SUFFIXES)} (none: .mp4)"
        )
    args.json = args.json or args.output.with_suffix(".json")
    args.chart = args.chart or args.output.with_name(args.output.stem + "_compare.png")
    for option, path, written in (
        ("--output", args.output, not args.no_video),
        ("--json", args.json, True),
        ("--chart", args.chart, args.compare),
    ):
        why = unwritable(path) if written else None
        if why:
            parser.error(f"{option}: cannot write {path}: {why}")
    return args


def unwritable(path: Path) -> str | None:
    """Why a file cannot be written at `path` (its missing folders created), or None."""
    if path.is_dir():
        return "it is a folder"
    if path.exists():
        return None if os.access(path, os.W_OK) else "the file is read-only"
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None


def resolve_checkpoint(args, error) -> None:
    """Sets args.checkpoint (its configs/*.json name; None for an id only the hub knows),
    args.pipeline (the pipeline class name; None: the hub's model_index.json says) and args.call
    (the checkpoint's recommended call arguments), and fills --steps, --guidance-scale and
    --frame-rate left unset. A given --steps replaces a recommended timestep or sigma schedule."""
    ids = checkpoints()
    args.checkpoint = ids.get(args.model_id)
    if args.checkpoint is None and (args.weights != "hub" or args.tiny):
        known = ", ".join(sorted(k for k in ids if "/" in k))
        error(
            f"--model-id: no real config for {args.model_id!r} to build random weights from; "
            f"known: {known} (or their configs/*.json names); --weights hub loads any other "
            "diffusers LTX checkpoint"
        )
    pipeline = bench_utils.model_config(args.checkpoint)["pipeline"] if args.checkpoint else {}
    args.pipeline = pipeline.get("class")
    call = dict(pipeline.get("call", {}))
    schedule = [key for key in ("timesteps", "sigmas") if key in call]
    steps = call.pop("num_inference_steps", 50)
    if args.steps is None:
        args.steps = len(call[schedule[0]]) if schedule else steps
    else:
        for key in schedule:
            del call[key]
    guidance = call.pop("guidance_scale", 3.0)
    args.guidance_scale = guidance if args.guidance_scale is None else args.guidance_scale
    args.call = call
    if args.pipeline:
        check_family(args, FAMILIES[args.pipeline], error)


def check_family(args, family: Family, error) -> None:
    """The options the pipeline family cannot run, as errors naming the option; fills
    --frame-rate with the pipeline's default."""
    if args.frame_rate is None:
        args.frame_rate = family.frame_rate
    name = f"{args.pipeline} ({args.model_id})"
    if args.cache and family.no_cache:
        error(f"--cache: not with {name}: {family.no_cache}")


# ------------------------------------------------------------------------------------------------
# The pipeline: loaded from the hub, or built with random weights from the real configs.


def diffusers_class(name: str):
    """A diffusers class by name (LTX-2's vocoders and text connectors live in its pipeline
    package)."""
    import diffusers
    from diffusers.pipelines import ltx2

    return getattr(diffusers, name, None) or getattr(ltx2, name)


def tiny_config(config: dict, overrides: dict) -> dict:
    """`config` with the overrides of the keys it has (a function gets the real value)."""
    tiny = dict(config)
    for key, value in overrides.items():
        if key in config:
            tiny[key] = value(config[key]) if callable(value) else value
    return tiny


def build_random_pipeline(
    checkpoint: str,
    dtype: torch.dtype,
    device: torch.device | str,
    tiny: bool = False,
    seed: int = 0,
):
    """The checkpoint's pipeline with random weights from its real configs
    (configs/<checkpoint>.json: each model its family builds, by bench_utils.random_model on
    `device` in `dtype`, and the scheduler), without text encoder or tokenizer (text embeddings
    are passed in). tiny: the same components, narrow and shallow (Family.tiny), for smoke tests."""
    spec = bench_utils.model_config(checkpoint)
    family = FAMILIES[spec["pipeline"]["class"]]
    models = {}
    for index, section in enumerate(family.components):
        config = spec[section]["config"]
        if tiny:
            config = tiny_config(config, family.tiny.get(section, {}))
        cls = diffusers_class(spec[section]["class"])
        models[section] = bench_utils.random_model(cls, config, dtype, device, seed=seed + index)
    scheduler = diffusers_class(spec["scheduler"]["class"])(**spec["scheduler"]["config"])
    return diffusers_class(spec["pipeline"]["class"])(
        scheduler=scheduler, text_encoder=None, tokenizer=None, **models
    )


def load_pipeline(args, device: torch.device, dtype: torch.dtype):
    """(pipeline, weights description). --weights auto falls back to random weights with one line.
    Random weights come from --seed: the same on every rank of a --context-parallel launch."""
    target = "cpu" if args.cpu_offload else device
    if args.weights == "random" or args.tiny:
        pipe = build_random_pipeline(args.checkpoint, dtype, target, tiny=args.tiny, seed=args.seed)
        return pipe, "random" + (" (tiny model)" if args.tiny else "")
    import diffusers

    spec = bench_utils.model_config(args.checkpoint)["pipeline"] if args.checkpoint else {}
    repo = spec.get("hub_repo", args.model_id)
    try:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() not in (
            "",
            "0",
            "false",
            "no",
            "off",
        )
        pipe = _load_hub_pipeline(
            getattr(diffusers, spec.get("class", "DiffusionPipeline")),
            repo,
            dtype,
            try_download=args.weights == "hub" or not offline,
        )
    except Exception as error:  # noqa: BLE001  (any failure to load means: fall back)
        if args.weights == "hub":
            raise
        print(
            f"weights: {repo} could not be loaded ({one_line(error, 160)}); "
            "falling back to random weights (--weights random): timings are real, the video is noise"
        )
        pipe = build_random_pipeline(args.checkpoint, dtype, target, seed=args.seed)
        return pipe, "random (hub unavailable)"
    if args.pipeline is None:  # an id only the hub knows: its model_index.json named the class
        if type(pipe).__name__ not in FAMILIES:
            raise SystemExit(
                f"--model-id {args.model_id}: loads a {type(pipe).__name__}; generate_video runs "
                f"{', '.join(FAMILIES)}"
            )
        args.pipeline = type(pipe).__name__

        def error(message):
            raise SystemExit(message)

        check_family(args, family_of(pipe), error)
    if not args.cpu_offload:
        pipe.to(device)
    return pipe, f"hub:{repo}"


def _load_hub_pipeline(pipeline_class, model_id: str, dtype: torch.dtype, try_download: bool):
    """From the local cache first; from the hub when that fails and downloads are allowed."""

    def load(**kwargs):
        with (
            warnings.catch_warnings()
        ):  # newer diffusers prefer dtype=; older ones know only torch_dtype
            warnings.simplefilter("ignore", FutureWarning)
            return pipeline_class.from_pretrained(model_id, torch_dtype=dtype, **kwargs)

    try:
        return load(local_files_only=True)
    except Exception:  # noqa: BLE001
        if not try_download:
            raise
    return load()


def text_width(pipe) -> int:
    """The width of the text embeddings the pipeline takes: T5-XXL's output (the transformer's
    caption_channels), or for LTX-2 Gemma's hidden states of every layer stacked (the text
    connectors' caption_channels x text_proj_in_factor)."""
    connectors = getattr(pipe, "connectors", None)
    if connectors is not None:
        return connectors.config.caption_channels * connectors.config.text_proj_in_factor
    return pipe.transformer.config.caption_channels


def first_frame(args):
    """The seeded random image LTXConditionPipeline starts the video from (an RGB frame of the
    output's size)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(args.seed).integers(0, 256, (args.height, args.width, 3))
    return Image.fromarray(pixels.astype("uint8"))


def pipeline_inputs(pipe, args, device: torch.device, dtype: torch.dtype) -> dict:
    """Keyword arguments of every pipeline call except the generator: the flags, the checkpoint's
    recommended call (args.call), LTXConditionPipeline's first frame. A pipeline without a text
    encoder gets seeded random text embeddings [batch, tokens, text_width(pipe)] and masks (as
    long as the prompt's words, roughly its token count; padded on the text encoder's side), one
    row per video, as the encoder would give for one prompt and --batch-size videos."""
    family = family_of(pipe)
    inputs = dict(
        height=args.height,
        width=args.width,
        num_frames=args.num_frames,
        frame_rate=args.frame_rate,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance_scale,
        max_sequence_length=family.text_tokens,
        output_type="pt",
        **args.call,
    )
    if family.first_frame:
        inputs["image"] = first_frame(args)
    if pipe.text_encoder is not None:
        return dict(
            inputs,
            prompt=args.prompt,
            negative_prompt=args.negative_prompt,
            num_videos_per_prompt=args.batch_size,
        )
    generator = torch.Generator("cpu").manual_seed(args.seed)
    tokens, width = family.text_tokens, text_width(pipe)

    def embeds_and_mask(text: str):
        embeds = torch.randn(1, tokens, width, generator=generator).to(device, dtype)
        mask = torch.zeros(1, tokens, dtype=torch.long, device=device)
        length = min(tokens, len(text.split()) * 4 // 3 + 1)
        if family.left_padded_text:
            mask[:, tokens - length :] = 1
        else:
            mask[:, :length] = 1
        # The pipelines do not repeat given embeddings per video: the batch comes from them.
        return embeds.expand(args.batch_size, -1, -1), mask.expand(args.batch_size, -1)

    inputs["prompt_embeds"], inputs["prompt_attention_mask"] = embeds_and_mask(args.prompt)
    # Negative embeddings are needed whenever guidance is on (the pipeline would call the encoder).
    inputs["negative_prompt_embeds"], inputs["negative_prompt_attention_mask"] = embeds_and_mask(
        args.negative_prompt
    )
    return inputs


# ------------------------------------------------------------------------------------------------
# Configurations and timing.


def apply_config(pipe, config: str, args) -> str:
    """Switch the pipeline to `config` (from the baseline state); returns a note for the table.
    With --cpu-offload the offload hooks come off while the kernels go in, so the kernels patch
    the bare modules (as after loading) and the hooks then wrap them. Under context parallelism
    the baseline runs the diffusers code through our processors (module docstring)."""
    notes = []
    parts = config.split("+")
    parallel = args.parallel and config != "kernels-1gpu"
    if config.startswith("kernels") or parallel:
        if args.cpu_offload:
            pipe.remove_all_hooks()
        ops = None if config.startswith("kernels") else ()
        fp8 = "fp8" in parts
        attention = {"ltx_attention": "ltx_kernels", "int8_attention": "int8"}.get(
            parts[-1], args.attention
        )
        report = ltx_kernels.inject_optimized_kernels(
            pipe,
            ops=ops,
            verbose=False,
            fp8=fp8,
            fp8_linears=args.fp8_linears if fp8 else None,
            fp8_bf16_blocks=args.fp8_bf16_blocks if fp8 else 0,
            attention=attention if ops is None else "diffusers",
            keep_bf16_weights=fp8,  # (restore_baseline restores them exactly for the next row)
        )
        if args.cpu_offload:
            pipe.enable_model_cpu_offload()
        print(report)
        if ops == ():
            notes.append("diffusers code; ltx_kernels processors for the text mask")
        else:
            notes.append(f"{report.total_patched} modules on ltx_kernels ops")
            if attention != "auto":
                notes.append(f"attention={attention}")
        if fp8:  # the patchers that have an FP8 path swap Linears for Fp8Linear
            from ltx_kernels.integration.linears import Fp8Linear

            linears = sum(isinstance(m, Fp8Linear) for m in pipe.transformer.modules())
            kept = args.fp8_bf16_blocks
            notes.append(
                f"FP8 GEMMs in {linears} Linears"
                + (f" (first/last {kept} blocks bf16)" if kept else "")
                if linears
                else "FP8 asked, no FP8 path for this model: bf16"
            )
        if report.skipped:
            notes.append(f"{sum(len(entries) for entries in report.skipped.values())} skipped")
    if "cache" in parts:  # after the kernels: the cache's hooks wrap the fused blocks
        transformer = pipe.transformer
        transformer.enable_cache(cache_config(args.cache, pipe))
        _UNDO.callback(transformer.disable_cache)
        notes.append(f"diffusers cache: {args.cache}")
    if "torchao-fp8" in parts:
        _UNDO.enter_context(bench_utils.torchao_fp8_rowwise(pipe.transformer))
        notes.append("torchao Float8DynamicActivationFloat8WeightConfig(PerRow), every Linear")
    if parallel:
        notes.append(parallel_layout(args))
    if parts[-1] == "compile":
        torch._dynamo.reset()
        # (the whole model under Ulysses: torch 2.11 breaks its graph once, in diffusers' output
        # gather; test_context_parallel's whole-model case)
        fullgraph = args.compile_scope == "blocks" or not parallel
        options = dict(fullgraph=fullgraph, mode=args.compile_mode)
        if args.compile_scope == "blocks":
            pipe.transformer.compile_repeated_blocks(**options)
        else:
            pipe.transformer.compile(**options)
        mode = f", mode={args.compile_mode}" if args.compile_mode else ""
        notes.append(f"torch.compile ({args.compile_scope}{', fullgraph' * fullgraph}{mode})")
    return "; ".join(notes) or "reference"


#: What apply_config set up that restore_baseline undoes besides the kernels (torchao's weights).
_UNDO = contextlib.ExitStack()


def restore_baseline(pipe, args) -> None:
    """Undo apply_config: drop compiled call paths, the cache, torchao's weights and the kernels."""
    _UNDO.close()
    for module in pipe.transformer.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
    if args.cpu_offload:
        pipe.remove_all_hooks()
    ltx_kernels.remove_optimized_kernels(pipe)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload()
    torch._dynamo.reset()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Call:
    """One timed pipeline call (wall seconds): the whole call, the denoising loop from the end
    of its first step to the end of its last, and what follows the loop (unpacking, VAE decode)."""

    total_s: float
    loop_s: float
    decode_s: float
    latents: torch.Tensor  # final packed latents [B, S, C], fp32, on the CPU
    frames: torch.Tensor  # decoded video [B, F, 3, H, W] in [0, 1], on the CPU
    audio: torch.Tensor | None = None  # LTX-2's waveforms [B, channels, samples], fp32, on the CPU


def call_pipeline(pipe, inputs: dict, args, device: torch.device) -> Call:
    marks = {}

    def on_step_end(_pipe, step, _timestep, tensors):
        if step in (0, args.steps - 1):  # loop rate between the two; the rest is the decode
            synchronize(device)
            marks[step] = time.perf_counter()
        if step == args.steps - 1:
            marks["latents"] = tensors["latents"].detach().clone()
        return {}

    generator = torch.Generator(device).manual_seed(args.seed)
    synchronize(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = pipe(**inputs, generator=generator, callback_on_step_end=on_step_end)
    synchronize(device)
    end = time.perf_counter()
    last = marks[args.steps - 1]
    audio = getattr(output, "audio", None)
    return Call(
        total_s=end - start,
        loop_s=last - marks[0],
        decode_s=end - last,
        latents=marks["latents"].float().cpu(),
        frames=output.frames.cpu(),
        audio=None if audio is None else audio.float().cpu(),
    )


@dataclass
class Row:
    """One configuration's results (seconds; medians over the timed runs)."""

    config: str
    notes: str
    total_s: float
    it_per_s: float  # denoising steps per second inside the loop
    decode_s: float
    warmup_s: list = field(default_factory=list)  # the first one of a compiled row is its compile
    runs_s: list = field(default_factory=list)
    peak_gib: float | None = None
    speedup: float | None = None
    vs_compile: float | None = None
    rel_l2: float | None = None
    psnr_db: float | None = None  # decoded frames vs the baseline's
    audio_rel_l2: float | None = None  # LTX-2's waveforms vs the baseline's


def measure(pipe, config: str, inputs: dict, args, device: torch.device) -> tuple[Row, Call]:
    """Warm-up calls, then --runs timed calls. Returns the row and the last call (all calls start
    from the same seed, so their latents agree; its frames are the ones saved)."""
    notes = apply_config(pipe, config, args)
    progress = _progress(args)
    warmup_s = []
    for i in progress(
        range(args.warmup_iterations),
        desc=f"{config}: warm-up" + (" (the first call compiles)" if "compile" in config else ""),
    ):
        pipe.set_progress_bar_config(
            desc=f"{config} warm-up {i + 1}", leave=False, disable=args.no_progress
        )
        warmup_s.append(call_pipeline(pipe, inputs, args, device).total_s)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    calls = []
    for i in range(args.runs):
        pipe.set_progress_bar_config(
            desc=f"{config} run {i + 1}/{args.runs}", leave=False, disable=args.no_progress
        )
        calls.append(call_pipeline(pipe, inputs, args, device))
    loop_s = statistics.median(c.loop_s for c in calls)
    row = Row(
        config=config,
        notes=notes,
        total_s=statistics.median(c.total_s for c in calls),
        it_per_s=(args.steps - 1) / loop_s,
        decode_s=statistics.median(c.decode_s for c in calls),
        warmup_s=warmup_s,
        runs_s=[c.total_s for c in calls],
        peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
    )
    return row, calls[-1]


def _progress(args):
    if args.no_progress:
        return lambda iterable, desc: iterable
    from tqdm.auto import tqdm

    return lambda iterable, desc: tqdm(iterable, desc=desc, leave=False)


def relative_l2(x: torch.Tensor, reference: torch.Tensor) -> float:
    return ((x.double() - reference.double()).norm() / reference.double().norm()).item()


def psnr_db(frames: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR of frames in [0, 1] against reference frames (inf when identical)."""
    mse = (frames.double() - reference.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(1 / mse)


def finish_rows(rows: list[Row], calls: dict) -> None:
    """Speedups over the baseline and over compile alone; latent and frame drift from the
    baseline (calls: config -> its last Call)."""
    by_config = {row.config: row for row in rows}
    for row in rows:
        if "baseline" in by_config:
            baseline = calls["baseline"]
            row.speedup = by_config["baseline"].total_s / row.total_s
            row.rel_l2 = relative_l2(calls[row.config].latents, baseline.latents)
            row.psnr_db = psnr_db(calls[row.config].frames, baseline.frames)
            if baseline.audio is not None:
                row.audio_rel_l2 = relative_l2(calls[row.config].audio, baseline.audio)
        if "compile" in by_config:
            row.vs_compile = by_config["compile"].total_s / row.total_s


# ------------------------------------------------------------------------------------------------
# Reporting.


def environment(device: torch.device) -> dict:
    import diffusers

    info = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        diffusers=diffusers.__version__,
        ltx_kernels=ltx_kernels.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    )
    return info


def one_line(error: BaseException, limit: int) -> str:
    """`Type: first line of the message`, for one-line explanations."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_table(rows: list[Row]) -> str:
    """The seed's table (time, it/s, speedup, notes) with the comparison's extra columns. Decode:
    from the end of the loop to the frames (LTX-2: and the audio); first call: a compiled row's
    compile warm-up. LTX-2 adds the audio's drift from the baseline's."""
    audio = any(row.audio_rel_l2 is not None for row in rows)
    lines = [
        "| Configuration | Time (s) | it/s | Speedup | vs compile | Decode (s) | Peak GiB "
        "| Latent rel L2 | Frames PSNR (dB) |"
        + (" Audio rel L2 |" if audio else "")
        + " First call (s) | Notes |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|"
        + ("---:|" if audio else "")
        + "---:|:---|",
    ]
    for row in rows:
        first_call = row.warmup_s[0] if "compile" in row.config and row.warmup_s else None
        lines.append(
            f"| {CONFIG_TITLES[row.config]} | {row.total_s:.2f} | {row.it_per_s:.2f} | "
            f"{_fmt(row.speedup, '.2f', 'x')} | {_fmt(row.vs_compile, '.2f', 'x')} | "
            f"{row.decode_s:.3f} | {_fmt(row.peak_gib, '.1f')} | {_fmt(row.rel_l2, '.1e')} | "
            f"{_fmt(row.psnr_db, '.1f')} | "
            + (f"{_fmt(row.audio_rel_l2, '.1e')} | " if audio else "")
            + f"{_fmt(first_call, '.1f')} | {row.notes} |"
        )
    return "\n".join(lines)


def describe(args, env: dict, weights: str) -> str:
    return (
        f"Model: {args.model_id} ({args.pipeline}) | Device: {env['device']} | torch "
        f"{env['torch']} | diffusers {env['diffusers']} | "
        f"precision: {args.dtype} | resolution: {args.width}x{args.height} | frames: "
        f"{args.num_frames} | steps: {args.steps} | guidance: {args.guidance_scale} | batch: "
        f"{args.batch_size} | weights: {weights}"
        + (f" | parallel: {parallel_layout(args)}" if args.parallel else "")
    )


def write_json(
    path: Path,
    args,
    env: dict,
    weights: str,
    rows: list[Row],
    video: str | None,
    audio: str | None = None,
) -> None:
    settings = {
        key: (str(value) if isinstance(value, Path) else value)
        for key, value in vars(args).items()
        if key not in ("prompt", "negative_prompt")
    }
    payload = dict(
        environment=env,
        weights=weights,
        settings=settings,
        prompt=args.prompt,
        video=video,
        audio=audio,
        results=[row.__dict__ for row in rows],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def write_chart(path: Path, rows: list[Row], title: str) -> bool:
    """Horizontal bars of end-to-end seconds per configuration, labelled with the speedup."""
    try:
        import matplotlib
    except ImportError:
        print(f"chart: matplotlib is not installed (pip install matplotlib); {path} not written")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The title spans the figure, each line wrapped to its width (set over the axes, a long first
    # line ran off the right edge); constrained layout makes room for it.
    width_in, fontsize = 8, 9
    chars = int(width_in * 72 / (0.6 * fontsize))  # DejaVu Sans averages under 0.6 em a character
    lines = [
        wrapped
        for line in title.splitlines()
        for wrapped in textwrap.wrap(line, chars, break_on_hyphens=False) or [""]
    ]
    fig, ax = plt.subplots(
        figsize=(width_in, 1.2 + 0.6 * len(rows) + 0.15 * len(lines)), layout="constrained"
    )
    fig.suptitle("\n".join(lines), fontsize=fontsize)
    labels = [CONFIG_TITLES[row.config] for row in rows][::-1]
    seconds = [row.total_s for row in rows][::-1]
    bars = ax.barh(
        labels,
        seconds,
        color=["#4c72b0" if "kernels" in row.config else "#999999" for row in rows][::-1],
    )
    for bar, row in zip(bars, rows[::-1]):
        speedup = f"  {row.total_s:.2f} s" + (f" ({row.speedup:.2f}x)" if row.speedup else "")
        ax.text(
            bar.get_width(), bar.get_y() + bar.get_height() / 2, speedup, va="center", fontsize=9
        )
    ax.set_xlim(0, max(seconds) * 1.3)
    ax.set_xlabel("end-to-end seconds per video (lower is better)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")  # (no text cut off, whatever its length)
    plt.close(fig)
    return True


def save_video(frames, path: Path, fps: int) -> str:
    """The first video of the batch as mp4 (diffusers' export_to_video); when no encoder is
    installed (imageio + imageio-ffmpeg, or OpenCV), an animated GIF beside it."""
    from diffusers.utils import export_to_gif, export_to_video

    video = list(frames[0].permute(0, 2, 3, 1).float().cpu().numpy())  # [H, W, 3] frames in [0, 1]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return export_to_video(video, str(path), fps=fps)
    except (ImportError, AttributeError, ModuleNotFoundError) as error:
        import numpy as np
        from PIL import Image

        gif = path.with_suffix(".gif")
        print(
            f"video: no mp4 encoder ({one_line(error, 120)}); "
            f"writing {gif} instead (pip install imageio imageio-ffmpeg for mp4)"
        )
        images = [
            Image.fromarray((np.clip(frame, 0, 1) * 255).round().astype("uint8")) for frame in video
        ]
        return export_to_gif(images, str(gif), fps=fps)


def save_audio(audio: torch.Tensor, sample_rate: int, video: Path) -> tuple[str, str]:
    """The first waveform of the batch ([channels, samples] in [-1, 1]) as a 16-bit .wav beside the
    video, muxed into the video when it is an mp4 (AAC, by the ffmpeg imageio-ffmpeg ships, the one
    export_to_video uses). Returns (the file that holds the audio, why not the video, or "")."""
    import subprocess
    import wave

    wav = video.with_suffix(".wav")
    pcm = (audio[0].clamp(-1, 1) * 32767).round().to(torch.int16)
    with wave.open(str(wav), "wb") as file:
        file.setnchannels(pcm.shape[0])
        file.setsampwidth(2)
        file.setframerate(sample_rate)
        file.writeframes(pcm.T.contiguous().numpy().tobytes())  # interleaved samples
    if video.suffix != ".mp4":
        return str(wav), f"a {video.suffix} holds no audio"
    try:
        import imageio_ffmpeg

        ffmpeg = imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as error:  # noqa: BLE001  (the .wav is written)
        why = f"no ffmpeg ({one_line(error, 100)}; pip install imageio-ffmpeg)"
        return str(wav), f"not muxed into {video}: {why}"
    muxed = video.with_name(video.stem + ".muxing.mp4")
    command = [ffmpeg, "-y", "-loglevel", "error", "-i", str(video), "-i", str(wav)]
    result = subprocess.run(
        [*command, "-c:v", "copy", "-c:a", "aac", str(muxed)], capture_output=True, text=True
    )
    if result.returncode:
        return str(wav), f"not muxed into {video}: ffmpeg: {result.stderr.strip()[:200]}"
    muxed.replace(video)
    return str(video), ""


# ------------------------------------------------------------------------------------------------
# Several GPUs.


def start_distributed() -> tuple[torch.device, int]:
    """(this process's device, rank) of a torchrun launch: one GPU per process, NCCL (gloo on a
    machine without GPUs, for tests)."""
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("cpu:gloo")
    return device, rank


def parallel_layout(args) -> str:
    """How the GPUs of a parallel launch split the work, e.g. "ulysses x 2 GPUs", "cfg x 2
    GPUs", "cfg 2 x ulysses 2 GPUs"."""
    world = torch.distributed.get_world_size()
    if not args.cfg_parallel:
        return f"{args.context_parallel} x {world} GPUs"
    if not args.context_parallel:
        return f"cfg x {world} GPUs"
    groups = args.cfg_parallel
    return f"cfg {groups} x {args.context_parallel} {world // groups} GPUs"


def enable_parallel(pipe, args) -> None:
    """--context-parallel: diffusers' context parallelism on the transformer, after checking that
    the GPUs (of each guidance half, with --cfg-parallel) divide what it splits: the video tokens,
    the text tokens and (Ulysses) the attention heads. --cfg-parallel: enable_cfg_parallel."""
    from diffusers import ContextParallelConfig

    degree = torch.distributed.get_world_size() // (args.cfg_parallel or 1)
    config = None  # each half's ContextParallelConfig
    if args.context_parallel:
        vae = pipe.vae
        tokens = (
            ((args.num_frames - 1) // vae.temporal_compression_ratio + 1)
            * (args.height // vae.spatial_compression_ratio)
            * (args.width // vae.spatial_compression_ratio)
        )
        splits = {"video tokens": tokens, "text tokens": family_of(pipe).text_tokens}
        if args.context_parallel == "ulysses":
            splits["attention heads"] = pipe.transformer.config.num_attention_heads
        for what, count in splits.items():
            if count % degree:
                raise SystemExit(
                    f"{args.parallel}: {degree} GPUs do not divide the {count} {what}; use a "
                    "GPU count that does (or change the size)"
                )
        if args.context_parallel == "ring" and not args.attention_backend:
            pipe.transformer.set_attention_backend("_native_cudnn")
        name = "ulysses_degree" if args.context_parallel == "ulysses" else "ring_degree"
        config = ContextParallelConfig(**{name: degree})
    if args.cfg_parallel:
        from ltx_kernels.integration import enable_cfg_parallel

        enable_cfg_parallel(pipe, config, groups=args.cfg_parallel)
    else:
        pipe.transformer.enable_parallelism(config=config)


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> list[Row]:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank = 0
    if args.parallel:
        device, rank = start_distributed()
        if rank:  # rank 0 reports
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
            args.no_progress, args.no_video = True, True
    try:
        return _generate(args, device, rank)
    finally:
        if args.parallel:
            if rank:
                sys.stdout.close()
                sys.stdout = sys.__stdout__
            torch.distributed.destroy_process_group()


def _generate(args, device: torch.device, rank: int) -> list[Row]:
    dtype = DTYPES[args.dtype]
    if ltx_kernels.load_error is not None and any("kernels" in c for c in args.configs):
        raise SystemExit(
            f"ltx_kernels failed to load ({ltx_kernels.load_error}); build it with "
            "`pip install -e . --no-build-isolation`, or pass --no-optimized-kernels"
        )
    pipe, weights = load_pipeline(args, device, dtype)
    if weights.startswith("random"):
        print(
            f"weights: random, from the real configs of {args.model_id} (configs/"
            f"{args.checkpoint}.json; timings are real, the video is noise)"
            if not args.tiny
            else "weights: random, tiny model (smoke test; timings mean nothing)"
        )
    if args.attention_backend:
        pipe.transformer.set_attention_backend(args.attention_backend)
    if args.cpu_offload:
        pipe.enable_model_cpu_offload()
    env = environment(device)
    header = describe(args, env, weights)
    print(header)
    inputs = pipeline_inputs(pipe, args, device, dtype)

    rows, calls, last = [], {}, None
    parallel = False  # whether enable_parallel ran
    for config in args.configs:
        if args.parallel and config != "kernels-1gpu" and not parallel:
            enable_parallel(pipe, args)  # (once: diffusers cannot undo it)
            parallel = True
        print(f"\n== {CONFIG_TITLES[config]}", flush=True)
        try:
            row, last = measure(pipe, config, inputs, args, device)
        finally:
            restore_baseline(pipe, args)
        calls[config] = last
        rows.append(row)
        print(
            f"{config}: {row.total_s:.2f} s ({row.it_per_s:.2f} it/s, decode {row.decode_s:.3f} s)"
            + (
                f", warm-up {', '.join(f'{s:.1f}' for s in row.warmup_s)} s" if row.warmup_s else ""
            ),
            flush=True,
        )
    finish_rows(rows, calls)

    print(f"\n{header}\n")
    print(format_table(rows))
    by_config = {row.config: row for row in rows}
    if "kernels-1gpu" in by_config and "kernels" in by_config:
        world = torch.distributed.get_world_size()
        scaling = by_config["kernels-1gpu"].total_s / by_config["kernels"].total_s
        print(f"\nkernels on {world} GPUs vs 1 GPU: {scaling:.2f}x")
    video = audio = None
    if rank:
        return rows
    if not args.no_video:
        try:
            video = save_video(last.frames, args.output, args.frame_rate)
            print(f"\nvideo ({CONFIG_TITLES[rows[-1].config]}): {video}")
            if last.audio is not None:
                rate = pipe.vocoder.config.output_sampling_rate
                audio, why_not = save_audio(last.audio, rate, Path(video))
                print(f"audio ({rate} Hz): {audio}" + (f" ({why_not})" if why_not else ""))
        except Exception as error:  # noqa: BLE001  (the measurements are still written)
            print(f"\nvideo: could not write {args.output} ({one_line(error, 200)})")
    write_json(args.json, args, env, weights, rows, video, audio)
    print(f"results: {args.json}")
    title = (
        f"{args.model_id}, {args.num_frames} frames {args.width}x{args.height}, {args.steps} "
        f"steps, {args.dtype}, {weights} weights\n{env['device']}, torch {env['torch']}, "
        f"{env['date']}"
    )
    if args.compare and write_chart(args.chart, rows, title):
        print(f"chart: {args.chart}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
