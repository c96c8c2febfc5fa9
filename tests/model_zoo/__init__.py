"""The tiny diffusers models the injection and training tests run on the CPU: one module per model
family (`ltx`, `ltx2`, `flux`, `wan`, `sd3`, `hunyuan`: config, model, inputs, the ltx_kernels ops one
injected forward runs), and MODELS, the table of model variants that the tests parametrized over
models (test_inject_models.py, test_training.py) take."""

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("diffusers", reason="diffusers is not installed")
# benchmarks/step_inputs.py: the one input builder per family, shared with the benchmarks
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from ltx_kernels.integration import FUSIONS  # noqa: E402

from . import flux, hunyuan, ltx, ltx2, sd3, wan  # noqa: E402


@dataclasses.dataclass(frozen=True)
class TinyModel:
    """A tiny model variant: how to build it and its inputs, and what injection does to it."""

    build: Callable  # dtype -> the model (eval mode)
    inputs: Callable  # dtype -> the keyword arguments of one forward
    op_counts: Callable  # disabled op or None -> {op: calls} of one forward with every other op
    processor: str | None  # class name of our attention processor (None: none installed)
    compile_backend: str = "aot_eager"  # of compile_repeated_blocks (inductor: ~20 s a model)
    bit_identical_without: tuple = ()  # ops left out of the bf16 bit-identity test


def _every_op_but(disabled) -> list:
    return [name for name in FUSIONS if name != disabled]


def _sd3(variant: dict, processor: str | None) -> TinyModel:
    # SD3.5's per-head q/k RMSNorm is left out of the bit-identity test: diffusers computes it as
    # `x * torch.rsqrt(var + eps)`, and under torch 2.15 (not 2.11) the CPU's vectorized rsqrt can
    # be one fp32 ulp off the correctly rounded one our op uses; where x * rsqrt lands on a bf16
    # rounding tie the two then round apart (seen: 1 element of 4096 at head_dim 8). The rmsnorm
    # op itself is checked against float64 (correct rounding) in test_rmsnorm.py, and with every
    # op this model matches eager within REL_L2_TOLERANCE
    # (test_inject_sd3.py::test_tiny_sd3_matches_eager_and_restores).
    config = {**sd3.TINY, **variant}
    return TinyModel(
        functools.partial(sd3.tiny_model, **variant),
        sd3.tiny_inputs,
        lambda disabled: sd3.expected_ops(_every_op_but(disabled), config),
        processor,
        bit_identical_without=("rmsnorm",),
    )


def _hunyuan(v15: bool, variant: str | None = None, **config) -> TinyModel:
    full = {**(hunyuan.HUNYUAN_VIDEO_15 if v15 else hunyuan.HUNYUAN_VIDEO), **config}
    double, single = full["num_layers"], full.get("num_single_layers", 0)
    return TinyModel(
        functools.partial(hunyuan.tiny_model, v15=v15, **config),
        functools.partial(hunyuan.tiny_inputs, v15=v15, variant=variant),
        lambda disabled: hunyuan.expected_ops(_every_op_but(disabled), double, single),
        "HunyuanVideo15KernelsAttnProcessor" if v15 else "HunyuanVideoKernelsAttnProcessor",
    )


def _ltx2(release: str, variant: str | None = None) -> TinyModel:
    return TinyModel(
        functools.partial(ltx2.tiny_model, release=release),
        functools.partial(ltx2.inputs, release=release, variant=variant),
        lambda disabled: ltx2.expected_ops(_every_op_but(disabled), release, variant=variant),
        "LTX2KernelsPerturbedAttnProcessor"
        if ltx2.RELEASES[release]["perturbed_attn"]
        else "LTX2KernelsAttnProcessor",
    )


_WAN = TinyModel(wan.tiny_model, wan.tiny_inputs, wan.expected_counts, "WanKernelsAttnProcessor")

MODELS = {
    "ltx": TinyModel(
        ltx.tiny_model,
        ltx.tiny_inputs,
        ltx.expected_counts,
        "LTXKernelsAttnProcessor",
        compile_backend="inductor",
    ),
    # LTX-Video 0.9.5+ through LTXConditionPipeline: per-token timesteps and modulation. Its q/k
    # norm is left out of the bf16 bit-identity test: with this test's inputs one normalized k
    # element lies 4.7e-8 beyond a bf16 rounding midpoint (exact -1.14453129708, midpoint
    # -1.14453125), and torch 2.11's CPU torch.nn.RMSNorm rounds it to the far neighbour, our op
    # to the correctly rounded one (seen on torch 2.11, not on 2.15). qk_rmsnorm_rope is checked
    # against float64 in test_rope.py, and this model matches eager with every op in the other
    # tests.
    "ltx_per_token": TinyModel(
        ltx.tiny_model,
        functools.partial(ltx.tiny_inputs, per_token=True),
        functools.partial(ltx.expected_counts, per_token=True),
        "LTXKernelsAttnProcessor",
        bit_identical_without=("qk_rmsnorm_rope",),
    ),
    # LTX-2.x: video and audio streams, split RoPE; image-to-video with per-token timesteps;
    # 2.3 with gates, text cross-attention modulation and the STG processor; 2.5 without video FF
    # biases, image-to-video with the keyframe mask.
    "ltx2": _ltx2("2.0"),
    "ltx2_i2v": _ltx2("2.0", "i2v"),
    "ltx23": _ltx2("2.3"),
    "ltx25_i2v": _ltx2("2.5", "i2v"),
    "flux": TinyModel(
        flux.tiny_model,
        flux.tiny_inputs,
        lambda disabled: flux.expected_ops(_every_op_but(disabled), 1, 1),
        "FluxKernelsAttnProcessor",
    ),
    "wan": _WAN,
    "wan_ti2v": dataclasses.replace(
        _WAN, inputs=functools.partial(wan.tiny_inputs, variant="ti2v")
    ),
    "skyreels_v2": dataclasses.replace(
        _WAN, build=wan.tiny_skyreels, processor="SkyReelsKernelsAttnProcessor"
    ),
    "skyreels_v2_df": dataclasses.replace(
        _WAN,
        build=wan.tiny_skyreels,
        inputs=functools.partial(wan.tiny_inputs, variant="diffusion_forcing"),
        processor="SkyReelsKernelsAttnProcessor",
    ),
    # ChronoEdit: diffusers' copies of WanTransformerBlock / WanAttention / WanAttnProcessor (same
    # class names, same code), patched as Wan's; image-conditioned as Wan 2.1 I2V.
    "chronoedit": dataclasses.replace(
        _WAN,
        build=wan.tiny_chronoedit,
        inputs=functools.partial(wan.tiny_inputs, variant="i2v"),
        op_counts=wan.chronoedit_counts,
    ),
    # Wan-Animate: the same copies, with pose/face conditioning and face adapters left stock.
    "wan_animate": dataclasses.replace(
        _WAN, build=wan.tiny_wan_animate, inputs=wan.tiny_animate_inputs
    ),
    "sd35": _sd3(sd3.SD35, "SD3KernelsAttnProcessor"),
    "sd3": _sd3(sd3.SD3, None),  # no q/k norm: the attention is left as it is
    "hunyuan_video": _hunyuan(v15=False),
    # HunyuanVideo I2V (latent_concat). Its per-head q/k norm (diffusers RMSNorm, as SD3.5's) is
    # left out of the bf16 bit-identity test for the reason given at _sd3: with these inputs one
    # element lies 4e-8 beyond a bf16 rounding midpoint and the CPU's fp32 rsqrt is one ulp low.
    "hunyuan_video_i2v": dataclasses.replace(
        _hunyuan(False, "latent_concat", **hunyuan.LATENT_CONCAT),
        bit_identical_without=("rmsnorm",),
    ),
    "hunyuan_video15": _hunyuan(v15=True),
    "hunyuan_video15_i2v": _hunyuan(v15=True, variant="i2v"),
}
