"""One LoRA fine-tuning step of LTX-Video 2B, as LTX-Video-Trainer runs it, in one process:
eager diffusers, eager + ltx_kernels, compile_repeated_blocks(fullgraph=True) with and without the
kernels; each without and with gradient checkpointing.

The step (bf16, batch 1, 49 frames 512x768 = 2688 latent tokens, 128 text tokens): the real
LTXVideoTransformer3DModel config with random weights, frozen; peft LoRA adapters of rank 32 on
to_q/to_k/to_v/to_out.0 (the trainer's targets); AdamW on the adapters; the rectified-flow loss
  x_t = (1 - s) x_0 + s n,  loss = mse(model(x_t, s), n - x_0)
on random latents x_0, noise n, text embeddings and sigma s. Every column starts from the same
adapter weights and inputs.

Columns per configuration: median ms per step (zero_grad + forward + backward + optimizer step,
CUDA events, after 3 warm-up steps; the first step, which compiles, is reported apart; the spread between
repetitions of one configuration on the same machine can reach 10-30%, so compare columns of one
run and repeat the run), speedup vs eager
and vs compile_repeated_blocks alone, peak GPU memory over the timed steps, and the relative L2
distance of the adapters' gradients (first step, all adapters concatenated) from eager's.

  python benchmarks/benchmark_training.py [--steps 10] [--rounds 1] [--tokens 2688] [--out results/]
      [--columns eager,kernels,kernels+no_lora_linear]  (the last: an A/B of lora_linear;
      kernels+no_recompute_norms: of recompute_norms)
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_utils  # noqa: E402
from transformer_cases import LTX_GRIDS, configured  # noqa: E402

COLUMNS = ("eager", "kernels", "blocks", "blocks+kernels")
# Also accepted by --columns: the kernel columns without lora_linear (peft's LoRA layers as they
# are) or without recompute_norms (every activation saved), for an A/B in one process.
EXTRA_COLUMNS = (
    "kernels+no_lora_linear",
    "blocks+kernels+no_lora_linear",
    "kernels+no_recompute_norms",
)
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
LORA_RANK = 32
TEXT_TOKENS = 128
# Targets of issue 11 (H100, bf16).
TARGET_KERNELS_VS_EAGER = 1.5
TARGET_KERNELS_VS_COMPILE = 1.05
TARGET_BOTH_VS_COMPILE = 1.1
TARGET_MEMORY_VS_EAGER = 0.85
TARGET_CHECKPOINTED_VS_EAGER = 1.3


def lora_model():
    """LTX-Video 2B (real config, random weights) in bf16, frozen, with rank-32 LoRA adapters."""
    from diffusers import LTXVideoTransformer3DModel
    from peft import LoraConfig

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LTXVideoTransformer3DModel().to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(
            r=LORA_RANK,
            lora_alpha=LORA_RANK,
            target_modules=LORA_TARGETS,
            init_lora_weights="gaussian",
        )
    )
    with torch.no_grad():  # a trained-looking adapter: lora_B away from zero, so every grad flows
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 1e-3)
    return model.train()


def batch_inputs(tokens: int):
    frames, height, width = LTX_GRIDS[tokens]
    g = torch.Generator("cuda").manual_seed(1)
    rand = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    latents, noise = rand(1, tokens, 128), rand(1, tokens, 128)
    sigma = torch.rand(1, generator=g, device="cuda")
    noisy = ((1 - sigma) * latents.float() + sigma * noise.float()).to(torch.bfloat16)
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.bool, device="cuda")
    mask[:, 80:] = False
    inputs = dict(
        hidden_states=noisy,
        encoder_hidden_states=rand(1, TEXT_TOKENS, 4096),
        timestep=sigma * 1000,
        encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )
    return inputs, (noise.float() - latents.float())


def adapter_parameters(model):
    return [p for p in model.parameters() if p.requires_grad]


def run_column(column, model, initial, inputs, target, steps, checkpointing):
    """(first step s, median ms/step, peak GiB, first-step gradients) of one configuration."""
    with torch.no_grad():
        for p, value in zip(adapter_parameters(model), initial):
            p.copy_(value)
    if checkpointing:
        model.enable_gradient_checkpointing()
    try:
        with configured(column, model) as target_model:
            if target_model is None:
                return None
            params = adapter_parameters(model)
            optimizer = torch.optim.AdamW(params, lr=1e-4)

            def gradients():
                optimizer.zero_grad(set_to_none=True)
                prediction = target_model(**inputs)[0]
                F.mse_loss(prediction.float(), target).backward()

            def step():
                gradients()
                optimizer.step()

            torch.cuda.synchronize()
            start = time.perf_counter()
            gradients()  # the first step compiles; its gradients are the comparison's
            torch.cuda.synchronize()
            first_s = time.perf_counter() - start
            # kept on the host, so that it is not counted in the next columns' peak memory
            grads = torch.cat([p.grad.float().flatten() for p in params]).cpu()
            optimizer.step()
            torch.cuda.reset_peak_memory_stats()
            ms = bench_utils.events_time_us(step, reps=steps) / 1000  # after 3 warm-up steps
            peak_gib = torch.cuda.max_memory_allocated() / 2**30
            return first_s, ms, peak_gib, grads
    finally:
        if checkpointing:
            model.disable_gradient_checkpointing()
        for p in model.parameters():
            p.grad = None


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2688, choices=sorted(LTX_GRIDS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the columns in turn this many times (median)"
    )
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    columns = bench_utils.parse_columns(parser, args.columns, COLUMNS + EXTRA_COLUMNS)
    if not torch.cuda.is_available():
        sys.exit("benchmark_training.py needs a CUDA GPU")
    env = bench_utils.environment()
    print(
        f"# LTX-Video 2B LoRA (rank {LORA_RANK}) training step: {env['device']}, torch "
        f"{env['torch']}, bf16, batch 1, {args.tokens} tokens, median of {args.steps} steps"
    )
    model = lora_model()
    initial = [p.detach().clone() for p in adapter_parameters(model)]
    inputs, target = batch_inputs(args.tokens)
    rows = {}
    # Rounds: the columns run in turn, `rounds` times; each column's figure is the median of its
    # rounds (the eager step is host-bound, and host speed drifts over a run).
    for round_index in range(args.rounds):
        for checkpointing in (False, True):
            for column in columns:
                measured = run_column(
                    column, model, initial, inputs, target, args.steps, checkpointing
                )
                if measured is None:
                    continue
                first_s, ms, peak, grads = measured
                row = rows.setdefault(
                    (column, checkpointing),
                    dict(rounds_ms=[], first_step_s=first_s, peak_gib=peak, grads=grads),
                )
                row["rounds_ms"].append(ms)
                row["ms"] = statistics.median(row["rounds_ms"])
                print(
                    f"  round {round_index + 1}: {column}, checkpointing "
                    f"{'on' if checkpointing else 'off'}: {ms:.1f} ms/step, peak {peak:.2f} GiB,"
                    f" first step {first_s:.1f} s",
                    flush=True,
                )
    for (column, checkpointing), row in rows.items():
        eager, blocks = rows.get(("eager", checkpointing)), rows.get(("blocks", checkpointing))
        row["vs_eager"] = eager["ms"] / row["ms"] if eager else float("nan")
        row["vs_blocks"] = blocks["ms"] / row["ms"] if blocks else float("nan")
        row["grad_rel_l2"] = (
            ((row["grads"] - eager["grads"]).norm() / eager["grads"].norm()).item()
            if eager
            else float("nan")
        )
    print(
        "\n| column | checkpointing | ms/step | rounds: min-max | vs eager | vs blocks | peak GiB |"
        " grad rel L2 vs eager | first step s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (column, checkpointing), row in rows.items():
        spread = f"{min(row['rounds_ms']):.1f}-{max(row['rounds_ms']):.1f}"
        print(
            f"| {column} | {'on' if checkpointing else 'off'} | {row['ms']:.1f} | {spread} | "
            f"{bench_utils.ratio_cell(row['vs_eager'])} | "
            f"{bench_utils.ratio_cell(row['vs_blocks'])} | {row['peak_gib']:.2f} | "
            f"{row['grad_rel_l2']:.2e} | {row['first_step_s']:.1f} |"
        )
    get = lambda column, ckpt=False: rows.get((column, ckpt))  # noqa: E731
    checks = []  # (label, value, met)
    if get("eager") and get("kernels"):
        speedup = get("kernels")["vs_eager"]
        checks.append(
            (
                f"kernels >= {TARGET_KERNELS_VS_EAGER}x over eager",
                f"{speedup:.2f}x",
                speedup >= TARGET_KERNELS_VS_EAGER,
            )
        )
        memory = get("kernels")["peak_gib"] / get("eager")["peak_gib"]
        checks.append(
            (
                f"peak memory without checkpointing <= {TARGET_MEMORY_VS_EAGER}x eager's",
                f"{memory:.2f}x",
                memory <= TARGET_MEMORY_VS_EAGER,
            )
        )
    if get("blocks") and get("kernels"):
        speedup = get("kernels")["vs_blocks"]
        checks.append(
            (
                f"kernels >= {TARGET_KERNELS_VS_COMPILE}x over compile (blocks)",
                f"{speedup:.2f}x",
                speedup >= TARGET_KERNELS_VS_COMPILE,
            )
        )
    if get("blocks") and get("blocks+kernels"):
        speedup = get("blocks+kernels")["vs_blocks"]
        checks.append(
            (
                f"blocks+kernels >= {TARGET_BOTH_VS_COMPILE}x over compile (blocks)",
                f"{speedup:.2f}x",
                speedup >= TARGET_BOTH_VS_COMPILE,
            )
        )
    if get("eager", True) and get("kernels", True):
        speedup = get("kernels", True)["vs_eager"]
        checks.append(
            (
                f"with checkpointing, kernels >= {TARGET_CHECKPOINTED_VS_EAGER}x over eager",
                f"{speedup:.2f}x",
                speedup >= TARGET_CHECKPOINTED_VS_EAGER,
            )
        )
    for label, value, met in checks:
        print(f"  [{verdict(met)}] {label}: {value}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        bench_utils.write_json(
            args.out / "training_ltx_lora.json",
            dict(
                environment=env,
                tokens=args.tokens,
                steps=args.steps,
                lora_rank=LORA_RANK,
                rows=[
                    dict(
                        column=c,
                        checkpointing=k,
                        **{key: v for key, v in r.items() if key != "grads"},
                    )
                    for (c, k), r in rows.items()
                ],
            ),
        )


if __name__ == "__main__":
    main()
