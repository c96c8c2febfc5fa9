"""LTX-2, LTX-2.3 and LTX-2.5: tiny transformers (diffusers' own test sizes: video 2 heads of 8,
audio 2 heads of 4) with each release's flags, their inputs (text-to-video; image-to-video with
per-token timesteps and, for 2.5, the keyframe mask; spatio-temporal guidance) and the
ltx_kernels ops one injected forward runs; the release configs at full size."""

import torch
from diffusers import LTX2VideoTransformer3DModel

import step_inputs
from inject_helpers import randomize_norms
from ltx_kernels.integration import FUSIONS

TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=2,
    caption_channels=16,
)
# What sets each release apart, from diffusers' converter (scripts/convert_ltx2_to_diffusers.py,
# get_ltx2_transformer_config("2.0" / "2.3" / "2.5"), huggingface/diffusers at 58eb52c):
# 2.3 adds per-head attention gates, the text cross-attention modulation (9 parameters, the text
# K/V table), the STG processor on every attention and moves the caption projection out of the
# transformer; 2.5 drops the video FF biases and adds the keyframe embedding.
LTX_2 = dict(
    gated_attn=False,
    audio_gated_attn=False,
    cross_attn_mod=False,
    audio_cross_attn_mod=False,
    rope_type="split",
    rope_double_precision=True,
    use_prompt_embeddings=True,
    perturbed_attn=False,
)
LTX_2_3 = dict(
    LTX_2,
    gated_attn=True,
    audio_gated_attn=True,
    cross_attn_mod=True,
    audio_cross_attn_mod=True,
    use_prompt_embeddings=False,
    perturbed_attn=True,
)
LTX_2_5 = dict(LTX_2_3, ff_bias=False, use_keyframes_abs_pos_embedding=True)
RELEASES = {"2.0": LTX_2, "2.3": LTX_2_3, "2.5": LTX_2_5}
# The dimensions all three releases share (the same converter; Lightricks/LTX-2, -2.3, -2.5).
FULL = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
)
# Widths FP8 takes (multiples of 16: torch._scaled_mm): video 2 heads of 16, audio 2 heads of 8.
FP8_WIDTHS = dict(
    attention_head_dim=16,
    cross_attention_dim=32,
    audio_attention_head_dim=8,
    audio_cross_attention_dim=16,
)
FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, TEXT = 2, 4, 4, 5, 6


def config(release: str, full: bool = False, **overrides) -> dict:
    return {**(FULL if full else TINY), **RELEASES[release], **overrides}


def tiny_model(dtype, release="2.0", **overrides):
    # Seed 1: no element of these tiny models lands within fp32 rounding of a bf16 midpoint, where
    # torch's CPU kernels and ours may round apart (seed 0 had such ties: LTX-2.5 I2V with torch
    # 2.11's rsqrt, LTX-2.3's q/k norm with torch 2.15's RMSNorm). Every release and variant is
    # then bf16 bit-identical to eager under torch 2.11 and 2.15; the ops are checked against
    # float64 in their own tests.
    torch.manual_seed(1)
    model = LTX2VideoTransformer3DModel(**config(release, **overrides)).to(dtype).eval()
    return randomize_norms(model, tables=True)


def inputs(
    dtype,
    release="2.0",
    variant=None,
    batch=2,
    frames=FRAMES,
    height=HEIGHT,
    width=WIDTH,
    audio_frames=AUDIO_FRAMES,
    text=TEXT,
    full=False,
    device="cpu",
    **overrides,
):
    """One forward's keyword arguments (step_inputs.ltx2, as benchmarks/transformer_cases.py's),
    random timesteps; a text sample is padded. variant: None (text-to-video); "i2v": per-token
    video timesteps [B, S] with the first frame's tokens at 0 (the conditioning image, as
    LTX2ImageToVideoPipeline passes them) and, for 2.5, the keyframe mask on them; "stg":
    spatio-temporal guidance at block 1, perturbing the second sample.
    full: the full-size model's widths (TINY's otherwise); overrides: the model's (config)."""
    generator = torch.Generator(device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    timestep = torch.rand(batch, generator=generator, device=device) * 1000
    kwargs = step_inputs.ltx2(
        config(release, full, **overrides),
        randn,
        batch=batch,
        frames=frames,
        height=height,
        width=width,
        audio_frames=audio_frames,
        text=text,
        valid_text=text - 2,
        timestep=timestep,
        image_to_video=variant == "i2v",
        device=device,
    )
    if variant == "stg":
        kwargs.update(
            spatio_temporal_guidance_blocks=[1],
            perturbation_mask=torch.tensor([1.0, 0.0], device=device).to(dtype),
        )
    return kwargs


def expected_ops(
    ops,
    release="2.0",
    layers=TINY["num_layers"],
    audio_video=True,
    stg_layers=0,
    variant=None,
):
    """ltx_kernels op calls per forward of a model with `layers` blocks and `ops` enabled: each step
    runs its op, or the ops of its fallback (the unfused step's pieces). audio_video=False:
    isolate_modalities (no audio-video cross-attention); stg_layers: blocks whose self-attention
    STG skips for every sample (all_perturbed); variant: that of inputs() ("i2v": per-token video
    modulation tables, summed by gated_residual)."""
    ops = set(ops)
    counts = dict.fromkeys(FUSIONS, 0)

    def count(op, n, fallback=None):
        if op in ops:
            counts[op] += n
        elif fallback:
            fallback(n)

    def add_norm(modulated):  # x + y * gate, then the norm: its two steps
        def fallback(n):
            count("gated_residual", n)
            count("rmsnorm_modulate" if modulated else "rmsnorm", n)

        return fallback

    streams = 2 * layers  # video and audio: one of each step per stream and block
    if variant == "i2v":  # the a2v tables too where their timestep is the video's (2.0's default)
        per_token_ca = audio_video and not RELEASES[release]["cross_attn_mod"]
        count("gated_residual", layers * (3 if per_token_ca else 1))
    attended = 2 * (layers - stg_layers)
    count("rmsnorm_modulate", streams)  # norm1
    # self-attention: torch.nn.RMSNorm, then our RoPE of q and k without the fused op
    count("qk_rmsnorm_rope", attended, lambda n: count("rope", 2 * n))
    # x + attn * gate, norm2 (modulated by the text-query parameters in 2.3+)
    count("add_rmsnorm_modulate", streams, add_norm(RELEASES[release]["cross_attn_mod"]))
    count("qk_rmsnorm_rope", streams)  # text cross-attention (torch.nn.RMSNorm without the op)
    if audio_video:
        count("add_rmsnorm_modulate", streams, add_norm(True))  # x + attn2, the a2v-modulated norm
        count("rmsnorm_modulate", streams)  # the v2a-modulated norm
        count("qk_rmsnorm_rope", streams)  # a2v and v2a: the norms...
        count("rope", 2 * streams)  # ...then q and k rotated by their own tables
    count("add_rmsnorm_modulate", streams, add_norm(True))  # x + gate * attn, norm3
    count("linear_gelu", streams, lambda n: count("gelu", n))
    count("gated_residual", streams)  # x + ff * gate
    count("layernorm_modulate", 2)  # the video and audio output norms
    return {op: n for op, n in counts.items() if n}
