"""LTX-Video (diffusers `transformer_ltx.py`) on the fused ops.

Per block (`LTXVideoTransformerBlock`), with t = scale_shift_table + temb split in six:
  norm1 + modulation            -> rmsnorm_modulate       (diffusers RMSNorm, weight None or not)
  attn1: q/k/v projections      -> one GEMM               (fused_projections)
  attn1: q/k RMSNorm + RoPE     -> qk_rmsnorm_rope        (across heads, full-D interleaved RoPE)
                                   (attention="int8": qk_rmsnorm_rope_quant, q in 8 bits)
  x + attn1 * gate_msa          -> gated_residual
  attn2: q/k RMSNorm (no RoPE)  -> qk_rmsnorm_rope without tables
  x + attn2, norm2 + modulation -> add_rmsnorm_modulate   (one pass emits both)
  FF up-projection + GELU-tanh  -> linear_gelu            (GELU/GEGLU detected)
  x + ff * gate_mlp             -> gated_residual
Model (`LTXVideoTransformer3DModel`): output LayerNorm + modulation -> layernorm_modulate; the
RoPE tables computed once for the batch ([1, S, D]) when every sample has the same positions (no
video_coords): half the table traffic of the q/k kernels, the same values.

FP8 (fp8=True; FP8_PRESETS, default "all"): attn1's q/k/v (one FP8 GEMM) and out, attn2's q and
out, the FF's two projections ("ffn+self_attn": not attn2's; "ffn": the FF only); norm1 and norm2
emit their output as FP8 rows for attn1's q/k/v and the FF, the FF's GELU emits its output as FP8
rows for the down projection; attn2's text K/V stay bf16. Per-token modulation (LTX-Video 13B's
LTXConditionPipeline, [B, S] timesteps) takes the same path: the norm ops modulate per row.

Under diffusers' context parallelism attn2 attends to the whole text, attn1 under Ulysses runs
ulysses_attention (attention.py), and the patched model forward takes this rank's chunk of
per-token timesteps ([B, S], LTXConditionPipeline: context_parallel.local_token_timesteps).
"""

from __future__ import annotations

from typing import Any

import torch

from . import attention, quant, recompute, steps
from .attention import attend
from .diffusers_compat import Reproduced, diffusers_modules, lora_scaled
from .linears import self_cross_ff_fp8_presets
from .context_parallel import (
    gather_cross_attention_inputs,
    local_token_timesteps,
    plan_without_timestep,
)
from .injector import FusedAttnProcessor


def _diffusers_rope(x, cos_sin):
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    return apply_rotary_emb(x, cos_sin)


_diffusers_rope_heads = steps.rope_over_tokens(_diffusers_rope)


def qk_norm_rope(ops, attn, query, key, image_rotary_emb, query_format=None):
    """LTXVideoAttnProcessor's q/k path on [B, S, C]: torch.nn.RMSNorm over the token, then RoPE
    over the token (interleaved, tables [B or 1, S, C]) -> (query, key) split into heads
    [B, S, H, Dh]. With a query_format the query comes back quantized in it where our op runs the
    step: q/k and the tables go to the op split into heads (steps.qk_norm_rope_heads: q quantized
    per token and head); without one, as tokens (the default path's fewer host operations)."""
    norm_q, norm_k = attn.norm_q, attn.norm_k
    if query_format is None:
        query, key = steps.qk_norm_rope(
            ops, norm_q, norm_k, query, key, image_rotary_emb, _diffusers_rope, across_heads=True
        )
        return _heads(attn, query), _heads(attn, key)
    tables = None if image_rotary_emb is None else tuple(_heads(attn, t) for t in image_rotary_emb)
    return steps.qk_norm_rope_heads(
        ops, norm_q, norm_k, query, key, attn.heads, tables, _diffusers_rope_heads, query_format
    )


def _heads(attn, t):
    return t.unflatten(2, (attn.heads, -1))


class LTXKernelsAttnProcessor(FusedAttnProcessor):
    """`LTXVideoAttnProcessor` with the q/k RMSNorm (+ RoPE) in one launch. Same signature (LTXAttention
    filters its kwargs by it); backend and parallel config are copied from the replaced processor.
    Under context parallelism a cross-attention gathers the text and attends locally."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        encoder_hidden_states, attention_mask, parallel_config = gather_cross_attention_inputs(
            self._parallel_config, encoder_hidden_states, attention_mask
        )
        batch_size, sequence_length, _ = (  # (hidden_states may be QuantRows: see block_forward)
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(
                attention_mask, sequence_length, batch_size
            )
            attention_mask = attention_mask.view(
                batch_size, attn.heads, -1, attention_mask.shape[-1]
            )
        if encoder_hidden_states is None:
            query, key, value = steps.fused_projections(self.ops, attn, hidden_states)
        else:
            query = steps.linear(self.ops, attn.to_q, hidden_states)
            key = steps.linear(self.ops, attn.to_k, encoder_hidden_states)
            value = steps.linear(self.ops, attn.to_v, encoder_hidden_states)
        value = _heads(attn, value)
        query_format = attention.query_format(
            self,
            query,
            key,
            value,
            heads=attn.heads,
            mask=attention_mask,
            parallel_config=parallel_config,
            params=(getattr(attn.norm_q, "weight", None), getattr(attn.norm_k, "weight", None)),
        )
        query, key = qk_norm_rope(self.ops, attn, query, key, image_rotary_emb, query_format)
        hidden_states = attend(
            self, query, key, value, mask=attention_mask, parallel_config=parallel_config
        ).flatten(2)
        hidden_states = steps.linear(self.ops, attn.to_out[0], hidden_states)
        return attn.to_out[1](hidden_states)


@recompute.scoped
def block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`LTXVideoTransformerBlock.forward` on the fused ops (same arguments, same rounding points).
    With FP8 Linears, norm1 and norm2 hand attn1 and the FF their output as FP8 rows."""
    ops = self._ltx_kernels_ops
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = steps.modulation(
        ops, self.scale_shift_table, temb, hidden_states.size(0)
    )

    attn1 = self.attn1
    quant_attn1 = (
        quant.input_format(*(getattr(attn1, name) for name in steps.QKV), through=attn1)
        if isinstance(attn1.processor, LTXKernelsAttnProcessor)
        else None
    )
    norm_hidden_states = steps.norm_modulate(
        ops, self.norm1, hidden_states, scale_msa, shift_msa, quant=quant_attn1
    )
    attn_hidden_states = steps.attention(attn1, norm_hidden_states, None, None, image_rotary_emb)
    hidden_states = steps.residual(ops, hidden_states, attn_hidden_states, gate_msa)

    attn_hidden_states = steps.attention(
        self.attn2, hidden_states, encoder_hidden_states, encoder_attention_mask
    )
    hidden_states, norm_hidden_states = steps.add_norm_modulate(
        ops,
        self.norm2,
        hidden_states,
        attn_hidden_states,
        scale_mlp,
        shift_mlp,
        quant=steps.feed_forward_input_format(self.ff),
    )

    ff_output = steps.feed_forward(ops, self.ff, norm_hidden_states)
    return steps.residual(ops, hidden_states, ff_output, gate_mlp)


def _model_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    encoder_attention_mask: torch.Tensor,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    rope_interpolation_scale=None,
    video_coords: torch.Tensor | None = None,
    attention_kwargs: dict[str, Any] | None = None,
    return_dict: bool = True,
):
    """`LTXVideoTransformer3DModel.forward` (diffusers 0.36-0.42) with the output norm fused. The
    lines marked `# ours:` differ from diffusers'; every other line is diffusers' code as it is
    (reformatted, its docstring left out)."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput  # ours:

    # ours: per-token timesteps take this rank's chunk under context parallelism (no plan entry)
    timestep = local_token_timesteps(timestep, hidden_states.shape[1], self._parallel_config)
    # ours: one table for the batch unless the samples have their own positions (video_coords)
    positions = hidden_states if video_coords is not None else hidden_states[:1]
    image_rotary_emb = self.rope(
        positions, num_frames, height, width, rope_interpolation_scale, video_coords
    )
    if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
        encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

    batch_size = hidden_states.size(0)
    hidden_states = self.proj_in(hidden_states)
    temb, embedded_timestep = self.time_embed(
        timestep.flatten(), batch_size=batch_size, hidden_dtype=hidden_states.dtype
    )
    temb = temb.view(batch_size, -1, temb.size(-1))
    embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))
    encoder_hidden_states = self.caption_projection(encoder_hidden_states)
    encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

    for block in self.transformer_blocks:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            hidden_states = self._gradient_checkpointing_func(
                block,
                hidden_states,
                encoder_hidden_states,
                temb,
                image_rotary_emb,
                encoder_attention_mask,
            )
        else:
            hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                encoder_attention_mask=encoder_attention_mask,
            )

    scale_shift_values = self.scale_shift_table[None, None] + embedded_timestep[:, :, None]
    shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
    hidden_states = steps.norm_modulate(  # ours: norm_out, then * (1 + scale) + shift, one pass
        self._ltx_kernels_ops, self.norm_out, hidden_states, scale, shift
    )
    output = self.proj_out(hidden_states)
    if not return_dict:
        return (output,)
    return Transformer2DModelOutput(sample=output)


model_forward = lora_scaled(_model_forward)


#: The block's Linears that run in FP8 with fp8=True, per preset (linears.FP8_PRESETS), and the
#: default: "all", measured on LTX-Video 2B (docs/fp8.md); the 13B (per-token modulation) runs
#: the same blocks.
FP8_PRESETS = self_cross_ff_fp8_presets("ff")
FP8_DEFAULT = "all"


#: The diffusers code the patches reproduce (diffusers_compat.Reproduced).
REPRODUCED = Reproduced(
    "LTX-Video",
    diffusers_modules("transformers.transformer_ltx"),
    {
        "LTXVideoTransformerBlock.forward": "a758b6f1ea788030",
        "LTXVideoAttnProcessor.__call__": "0e15ffdea54d47e4",
        "LTXVideoTransformer3DModel.forward": "bc16618faa9376c7",
    },
)


def patch_block(name: str, block, injector) -> None:
    reason = REPRODUCED.unpatched(type(block), "forward")
    if reason:
        injector.skip("LTXVideoTransformerBlock", name, reason)
        return
    injector.swap_forward(name, block, block_forward, "LTXVideoTransformerBlock")
    injector.fp8_linears(name, block, "LTX-Video", FP8_PRESETS, FP8_DEFAULT)
    for attn_name, kind in (
        ("attn1", "LTXAttention (self: q/k norm + RoPE)"),
        ("attn2", "LTXAttention (cross: q/k norm)"),
    ):
        attn = getattr(block, attn_name)
        if injector.has_stock_processor(
            f"{name}.{attn_name}",
            attn,
            "LTXVideoAttnProcessor",
            kind,
            "LoRA/IP adapters or user code",
            is_stock=REPRODUCED.is_stock,
        ):
            injector.set_processor(f"{name}.{attn_name}", attn, LTXKernelsAttnProcessor(), kind)
            if attn_name == "attn1":
                injector.fuse_projections(f"{name}.attn1", attn, "qkv", steps.QKV)
    reason = steps.feed_forward_fusable(block.ff)
    if reason:
        injector.skip("LTXVideoTransformerBlock feed-forward", f"{name}.ff", reason)


def patch_model(name: str, model, injector) -> None:
    kind = "LTXVideoTransformer3DModel (output norm)"
    reason = REPRODUCED.unpatched(type(model), "forward")
    if reason:
        injector.skip(kind, name, reason)
        return
    injector.swap_forward(
        name, model, model_forward, kind, required=False, replan=plan_without_timestep
    )


PATCHERS = {
    "LTXVideoTransformerBlock": patch_block,
    "LTXVideoTransformer3DModel": patch_model,
}
