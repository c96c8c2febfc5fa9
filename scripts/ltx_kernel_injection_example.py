"""Minimal integration example: LTX-Video's transformer on ltx_kernels' fused ops.

Runs offline: the transformer is built from its real default config (LTX-Video 2B) with random
weights, so the timings are real and the output is noise. With a CUDA GPU it runs the full-size
model in bf16 at 49 frames 512x768 (2 x 2688 tokens, CFG batch); on the CPU a 2-layer model at a
small size, to show the API.

  python scripts/ltx_kernel_injection_example.py [--layers N] [--compile] [--disable rope,linear_gelu]

With a downloaded pipeline it is the same three lines:

  pipe = LTXPipeline.from_pretrained("Lightricks/LTX-Video", torch_dtype=torch.bfloat16).to("cuda")
  report = ltx_kernels.inject_optimized_kernels(pipe)   # after loading, before offload/compile
  pipe.transformer.compile_repeated_blocks(fullgraph=True)   # optional, stacks with the kernels
"""

import argparse
import statistics
import time

import torch

import ltx_kernels


def build_transformer(device, dtype, layers):
    from diffusers import LTXVideoTransformer3DModel

    config = {} if layers is None else {"num_layers": layers}
    if device == "cpu":  # a small model, so the example finishes in seconds
        config.update(
            num_attention_heads=4,
            attention_head_dim=32,
            cross_attention_dim=128,
            caption_channels=256,
            num_layers=layers or 2,
        )
    with torch.device(device):
        return LTXVideoTransformer3DModel(**config).to(dtype).eval()


def make_inputs(model, device, dtype, frames, height, width, text_tokens=128):
    """One denoising step's inputs: latents in the packed [B, F*H*W, C] layout of LTXPipeline,
    prompt embeddings and mask for a CFG batch of 2 (negative, positive)."""
    config = model.config
    batch = 2
    mask = torch.ones(batch, text_tokens, dtype=torch.bool, device=device)
    mask[0, text_tokens // 4 :] = False  # a short negative prompt
    return dict(
        hidden_states=torch.randn(
            batch, frames * height * width, config.in_channels, device=device, dtype=dtype
        ),
        encoder_hidden_states=torch.randn(
            batch, text_tokens, config.caption_channels, device=device, dtype=dtype
        ),
        timestep=torch.full((batch,), 500.0, device=device),
        encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )


def step_time_ms(fn, device, reps):
    """Median wall time of one step (synchronized), after two warm-up steps."""

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    times = []
    with torch.no_grad():
        for i in range(reps + 2):
            sync()
            start = time.perf_counter()
            out = fn()
            sync()
            if i >= 2:
                times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="blocks (default: the config's 28)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time compile_repeated_blocks(fullgraph=True) on the injected model",
    )
    parser.add_argument(
        "--disable", default="", help="comma-separated ops to leave on diffusers code"
    )
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = build_transformer(device, dtype, args.layers)
    frames, height, width = (7, 16, 24) if device == "cuda" else (2, 8, 8)
    inputs = make_inputs(model, device, dtype, frames, height, width)
    tokens = frames * height * width
    print(
        f"LTX-Video transformer, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params, "
        f"{device}, bf16, batch 2 x {tokens} tokens, random weights"
    )

    base_ms, base_out = step_time_ms(lambda: model(**inputs)[0], device, args.reps)

    ops = [name for name in ltx_kernels.integration.FUSIONS if name not in args.disable.split(",")]
    report = ltx_kernels.inject_optimized_kernels(model, ops=ops)  # prints the report
    fused_ms, fused_out = step_time_ms(lambda: model(**inputs)[0], device, args.reps)
    error = ((fused_out.float() - base_out.float()).norm() / base_out.float().norm()).item()

    print(f"\n{'configuration':<34}{'ms/step':>10}{'speedup':>10}")
    print(f"{'diffusers eager':<34}{base_ms:>10.2f}{1.0:>9.2f}x")
    print(f"{'ltx_kernels (eager)':<34}{fused_ms:>10.2f}{base_ms / fused_ms:>9.2f}x")
    if args.compile:
        model.compile_repeated_blocks(fullgraph=True)
        start = time.perf_counter()
        with torch.no_grad():
            model(**inputs)
        compile_s = time.perf_counter() - start
        compiled_ms, _ = step_time_ms(lambda: model(**inputs)[0], device, args.reps)
        print(
            f"{'ltx_kernels + compile_repeated_blocks':<34}{compiled_ms:>10.2f}"
            f"{base_ms / compiled_ms:>9.2f}x   (compile {compile_s:.1f} s)"
        )
    print(f"\nrelative L2 difference of the output, kernels vs eager: {error:.2e}")
    print(
        f"{report.total_patched} modules patched; ltx_kernels.remove_optimized_kernels(model) "
        "restores the original modules."
    )


if __name__ == "__main__":
    main()
