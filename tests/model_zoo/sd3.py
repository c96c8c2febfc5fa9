"""SD3 / SD3.5: the tiny transformer (as diffusers' own model tests build it: a dual-attention
layer, a plain layer, the context-pre-only last layer) with its inputs and the ltx_kernels ops one
injected forward runs."""

import torch
from diffusers import SD3Transformer2DModel

import step_inputs
from inject_helpers import randomize_norms
from ltx_kernels.integration import FUSIONS

TINY = dict(
    sample_size=8,
    patch_size=1,
    in_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=4,
    caption_projection_dim=32,
    joint_attention_dim=32,
    pooled_projection_dim=64,
    out_channels=4,
    pos_embed_max_size=16,
    dual_attention_layers=(0,),
)
SD35 = dict(qk_norm="rms_norm")
SD3 = dict(qk_norm=None)
TEXT = 5


def layers(config):
    """(dual attention, context pre-only) per layer."""
    n = config["num_layers"]
    return [(i in config["dual_attention_layers"], i == n - 1) for i in range(n)]


def expected_ops(ops, config, ff_chunks: int = 1) -> dict:
    """ltx_kernels op calls per forward with `ops` enabled: each step runs its op, or the op of
    its fallback (the unfused step's pieces)."""
    ops = set(ops)
    counts = dict.fromkeys(FUSIONS, 0)

    def count(op, n, fallback=None):
        if op in ops:
            counts[op] += n
        elif fallback:
            fallback(n)

    def residual(n):
        count("gated_residual", n)

    def norm_modulate(n):
        count("layernorm_modulate", n)

    def add_norm_modulate(n):
        residual(n)
        norm_modulate(n)

    norm_modulate(1)  # norm_out
    for dual, pre_only in layers(config):
        streams = 1 if pre_only else 2
        norm_modulate(2 + dual)  # norm1 (two modulations with dual attention), norm1_context
        residual(int(dual) + streams)  # image attention before attn2, FF residuals
        count("add_layernorm_modulate", streams, add_norm_modulate)
        count("linear_gelu", streams * ff_chunks, lambda n: count("gelu", n))
        if config.get("qk_norm"):
            count("rmsnorm", 4 + 2 * dual)  # q, k, added q, added k (+ attn2's q, k)
    return {op: n for op, n in counts.items() if n}


def tiny_model(dtype, **config):
    return randomize_norms(SD3Transformer2DModel(**{**TINY, **config}).to(dtype).eval())


def tiny_inputs(dtype, batch=2):
    """step_inputs.sd3 with random timesteps."""
    return step_inputs.sd3(
        TINY,
        lambda *shape: torch.randn(*shape, dtype=dtype),
        batch=batch,
        side=TINY["sample_size"],
        text=TEXT,
        timestep=lambda: torch.randint(0, 1000, (batch,)),
    )
