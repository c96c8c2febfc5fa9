"""Latent drift of a whole guided generation, for the video families scripts/generate_video.py
does not drive: Wan 2.1 (1.3B, 14B) and HunyuanVideo-1.5 480p, at their real configs with random
weights (configs/*.json) and random prompt embeddings, through their diffusers pipeline's
denoising loop (classifier-free guidance, the scheduler; no text encoders, output_type="latent":
no VAE). Every column runs the same generation (the same embeddings, the same initial noise) with
the transformer set up as transformer_cases.configured sets it up; each row gives the final
latents' relative L2 against the baseline column's, the time of the generation, and the ratio of
the drift to the bf16 noise floor: the baseline with another attention kernel (the same math, a
different rounding order).

Default columns: baseline `kernels+diffusers_attention` (our bf16 kernels, attention by diffusers'
backend: cuDNN on Hopper), floor `kernels+ltx_attention` (our bf16 attention op instead), then
8-bit attention (`kernels+int8_attention`), FP8 Linears (`kernels+fp8`, --fp8-linears picks the
preset) and the anchor a user would pick instead, torchao's float8 rowwise with compiled blocks
(`torchao-fp8+blocks`).

What random weights cannot show: whether a drift is visible. Random weights give near-uniform
attention and no content, so the drift here is how far each numerics change moves the same
computation (comparable between columns and against the floor), not a quality score of videos.

    python benchmarks/denoise_drift.py --model wan-14b --steps 10
    python benchmarks/denoise_drift.py --model hunyuanvideo-1.5 --steps 10 --fp8-linears ffn
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import bench_utils
import transformer_cases

BASELINE = "kernels+diffusers_attention"
FLOOR = "kernels+ltx_attention"
COLUMNS = (BASELINE, FLOOR, "kernels+int8_attention", "kernels+fp8", "torchao-fp8+blocks")
MODELS = ("wan-1.3b", "wan-14b", "hunyuanvideo-1.5")


def pipeline(name: str, transformer):
    """`transformer` in its diffusers pipeline with the family's flow-matching scheduler (Wan:
    UniPC with flow sigmas, shift 3 for 480p; HunyuanVideo-1.5: Euler, shift 5)."""
    import diffusers

    if name.startswith("wan"):
        scheduler = diffusers.UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
        )
    else:
        scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
    pipeline_class = getattr(diffusers, transformer_cases.PIPELINES[name])
    pipe = transformer_cases.denoising_pipeline(
        pipeline_class, transformer, guidance_scale=5.0, scheduler=scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generation(name: str, transformer, frames: int, height: int, width: int, steps: int, seed=0):
    """The keyword arguments of one generation of `frames` x `height` x `width` pixels in `steps`
    steps: random prompt embeddings of the pipeline's text lengths (Wan: 512 T5 tokens;
    HunyuanVideo-1.5: 1000 Qwen and 256 ByT5 tokens, padded after 120 and 20 in the prompt, 40
    and 10 in the negative prompt: the branches' key lengths differ), the initial noise's seed."""
    config, device = transformer.config, transformer.device
    generator = torch.Generator(device).manual_seed(seed + 1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(transformer.dtype)

    common = dict(
        num_frames=frames,
        height=height,
        width=width,
        num_inference_steps=steps,
        output_type="latent",
        return_dict=False,
    )
    if name.startswith("wan"):
        text = dict(
            prompt_embeds=randn(1, 512, config.text_dim),
            negative_prompt_embeds=randn(1, 512, config.text_dim),
        )
        return {**text, **common, "guidance_scale": 5.0}

    def mask(length, valid):
        return (torch.arange(length, device=device) < valid)[None].to(transformer.dtype)

    text = dict(
        prompt_embeds=randn(1, 1000, config.text_embed_dim),
        prompt_embeds_mask=mask(1000, 120),
        negative_prompt_embeds=randn(1, 1000, config.text_embed_dim),
        negative_prompt_embeds_mask=mask(1000, 40),
        prompt_embeds_2=randn(1, 256, config.text_embed_2_dim),
        prompt_embeds_mask_2=mask(256, 20),
        negative_prompt_embeds_2=randn(1, 256, config.text_embed_2_dim),
        negative_prompt_embeds_mask_2=mask(256, 10),
    )
    return {**text, **common}


def pixels(name: str, tokens: int, transformer) -> tuple[int, int, int]:
    """(frames, height, width) in pixels of the case's latent grid at `tokens` (Wan: VAE 4x
    temporal and 8x spatial, 2x2 patches; HunyuanVideo-1.5: 4x temporal, 16x spatial)."""
    patch = transformer.config.patch_size
    if name.startswith("wan"):
        frames, height, width = transformer_cases.WAN_GRIDS[tokens]
        return (frames - 1) * 4 + 1, height * patch[1] * 8, width * patch[2] * 8
    frames, height, width = transformer_cases.HUNYUAN15_GRIDS[tokens]
    return (frames - 1) * 4 + 1, height * patch * 16, width * patch * 16


def drift_rows(name: str, transformer, kwargs: dict, columns, seed: int = 0) -> list[dict]:
    """One generation per column (columns[0]: the baseline, columns[1]: the floor): each row's
    relative L2 of the final latents against the baseline's, its ratio to the floor's, and the
    generation's wall time (s). A column that fails gives its error instead."""
    rows, reference, floor = [], None, None
    for column in columns:
        with transformer_cases.configured(column, transformer) as target:
            if target is None:
                rows.append({"column": column, "error": "no repeated blocks to compile"})
                continue
            pipe = pipeline(name, target)
            call = {**kwargs, "generator": torch.Generator(transformer.device).manual_seed(seed)}
            try:
                start = time.perf_counter()
                with torch.inference_mode():
                    latents = pipe(**call)[0]
                if latents.is_cuda:
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - start
            except Exception as error:  # reported as the column's result
                rows.append({"column": column, "error": f"{type(error).__name__}: {error}"[:200]})
                continue
        if reference is None:
            reference = latents
        drift = bench_utils.rel_l2(latents, reference)
        if floor is None and column != columns[0]:
            floor = drift
        rows.append(
            {
                "column": column,
                "rel_l2": drift,
                "vs_floor": drift / floor if floor else None,
                "seconds": seconds,
            }
        )
    return rows


def table(rows) -> str:
    lines = [
        "| column | latent rel L2 vs baseline | x floor | generation (s) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['column']} | {row['error']} | | |")
            continue
        ratio = "-" if row["vs_floor"] is None else f"{row['vs_floor']:.2f}"
        lines.append(f"| {row['column']} | {row['rel_l2']:.3e} | {ratio} | {row['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=MODELS, default="wan-14b")
    parser.add_argument("--tokens", type=int, default=None, help="the case's latent tokens")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--columns",
        default=",".join(COLUMNS),
        help=f"comma-separated (the first: the baseline, the second: the floor), from "
        f"{', '.join(transformer_cases.ALL_COLUMNS + (BASELINE,))}",
    )
    parser.add_argument("--fp8-linears", choices=("ffn", "ffn+self_attn", "all"), default=None)
    parser.add_argument("--out", default=None, help="a JSON file for the rows and the environment")
    args = parser.parse_args(argv)
    columns = bench_utils.parse_columns(
        parser, args.columns, transformer_cases.ALL_COLUMNS + (BASELINE,)
    )
    if len(columns) < 2:
        parser.error("--columns: a baseline and a floor at least")
    transformer_cases.FP8_LINEARS = args.fp8_linears
    transformer, _, tokens = transformer_cases.build(args.model, args.tokens)
    frames, height, width = pixels(args.model, tokens, transformer)
    kwargs = generation(args.model, transformer, frames, height, width, args.steps)
    print(
        f"# {args.model}: {frames} frames {height}x{width} ({tokens} latent tokens), "
        f"{args.steps} steps, guidance 5; {torch.cuda.get_device_name()}, torch {torch.__version__}"
    )
    rows = drift_rows(args.model, transformer, kwargs, columns)
    print(table(rows))
    if args.out:
        payload = {"model": args.model, "tokens": tokens, "steps": args.steps, "rows": rows}
        bench_utils.write_json(Path(args.out), {**payload, **bench_utils.environment()})


if __name__ == "__main__":
    main()
