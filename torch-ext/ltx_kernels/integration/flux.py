"""FLUX.1 (diffusers `transformer_flux.py`) on the fused ops.

AdaLN modules (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous): `adaln.py`.
Double block (`FluxTransformerBlock`), for the image and the text stream each:
  attention: per-head q/k RMSNorm + RoPE -> qk_rmsnorm_rope (image rows and text rows of the
             tables, one launch per stream; concatenated text first as diffusers does;
             attention="int8": qk_rmsnorm_rope_quant, q in 8 bits)
  x + gate * attn, norm2 + modulation -> add_layernorm_modulate (one pass emits both)
  FF up-projection + GELU-tanh        -> linear_gelu
  x + gate * ff                       -> gated_residual
Single block (`FluxSingleTransformerBlock`):
  proj_mlp + GELU-tanh                -> linear_gelu
  attention: q/k RMSNorm + RoPE       -> qk_rmsnorm_rope
  x + gate * proj_out(cat(attn, mlp)) -> gated_residual
  FP8: q/k/v and proj_mlp             -> one GEMM, N = 3 D + 4 D (fused_qkv_mlp), then gelu on
                                         its MLP part (bf16: linear_gelu's epilogue measured faster)
Each stream's q/k/v projections run as one GEMM (fused_projections).

FP8 (fp8=True; DOUBLE_ and SINGLE_FP8_PRESETS, default "all"): the image stream's Linears (q/k/v,
out, FF; the single block's q/k/v, proj_mlp and proj_out; "ffn": the FF, proj_mlp and proj_out
only); the text stream and the AdaLN linears stay bf16. The AdaLN norms hand their FP8
consumers their output as FP8 rows (adaln.call_norm): norm1 to the image q/k/v, the single
block's norm to its q/k/v + proj_mlp GEMM (one quantization, one GEMM); norm2 hands them to the
image FF, whose GELU hands them to the down projection. The attention output (to_out) and the
single block's cat(attention, GELU(mlp)) (proj_out: one scale per row over both parts) are
quantized by their Linear in one pass (quantize).
"""

from __future__ import annotations

from typing import Any

import torch

from . import adaln, attention, linears, quant, recompute, steps
from .attention import attend, cat_queries
from .diffusers_compat import Reproduced, diffusers_modules, rope_bshd
from .injector import FusedAttnProcessor
from .linears import attention_projections, ff_projections, fp8_presets
from .module_checks import has_hooks


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
def _rope_rows(cos_sin, text_len: int, total: int):
    """(text rows, image rows) of FLUX's [S_txt + S_img, Dh] cos/sin tables, as views; None when
    the tables are absent or in another form (RoPE is then applied after the concatenation)."""
    if (
        cos_sin is None
        or len(cos_sin) != 2
        or not all(
            isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == total for t in cos_sin
        )
    ):
        return None
    cos, sin = cos_sin
    return (cos[:text_len], sin[:text_len]), (cos[text_len:], sin[text_len:])


class FluxKernelsAttnProcessor(FusedAttnProcessor):
    """`FluxAttnProcessor` with each stream's per-head q/k RMSNorm + RoPE in one launch. Same
    signature (FluxAttention filters its kwargs by it); backend and parallel config are copied
    from the replaced processor."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections

        if attn.fused_projections:  # diffusers' own fusion (attn.fuse_projections())
            query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
                attn, hidden_states, encoder_hidden_states
            )
        else:
            query, key, value = steps.fused_projections(self.ops, attn, hidden_states)
            encoder_query = encoder_key = encoder_value = None
            if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
                encoder_query, encoder_key, encoder_value = steps.fused_projections(
                    self.ops, attn, encoder_hidden_states, "added_qkv", steps.ADDED_QKV
                )
        hidden_states = self.attend(
            attn,
            query,
            key,
            value,
            attention_mask,
            image_rotary_emb,
            (encoder_query, encoder_key, encoder_value),
        )
        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [text_len, hidden_states.shape[1] - text_len], dim=1
        )
        hidden_states = steps.linear(self.ops, attn.to_out[0], hidden_states.contiguous())
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = steps.linear(
            self.ops, attn.to_add_out, encoder_hidden_states.contiguous()
        )
        return hidden_states, encoder_hidden_states

    def attend(
        self,
        attn,
        query,
        key,
        value,
        attention_mask=None,
        image_rotary_emb=None,
        encoder_qkv=(None, None, None),
    ):
        """The attention of projected q/k/v [B, S, H*Dh] (text stream's encoder_qkv for a joint
        one), before any output projection: [B, S_txt + S, H*Dh]. A single block whose fused
        q/k/v/MLP GEMM projected them calls it directly (what __call__ does past its
        projections)."""
        encoder_query, encoder_key, encoder_value = encoder_qkv
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        joint = attn.added_kv_proj_dim is not None
        text_len = encoder_query.shape[1] if joint else 0
        rows = _rope_rows(image_rotary_emb, text_len, text_len + query.shape[1])
        text_rope, image_rope = rows if rows is not None else (None, None)
        q_format = None  # (q quantized in the norms' passes where 8-bit attention takes it)
        if rows is not None or image_rotary_emb is None:  # (else rotated after the concatenation)
            norms = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
            q_format = attention.query_format(
                self,
                query,
                key,
                value,
                mask=attention_mask,
                parallel_config=self._parallel_config,
                # (a joint call also attends the text stream's q/k/v: autograd may record there)
                params=(
                    *(getattr(getattr(attn, n, None), "weight", None) for n in norms),
                    *(encoder_qkv if joint else ()),
                ),
            )

        query, key = steps.qk_norm_rope(
            self.ops,
            attn.norm_q,
            attn.norm_k,
            query,
            key,
            image_rope,
            rope_bshd,
            across_heads=False,
            query_format=q_format,
        )
        if joint:
            encoder_query, encoder_key, encoder_value = (
                t.unflatten(-1, (-1, attn.head_dim))
                for t in (encoder_query, encoder_key, encoder_value)
            )
            encoder_query, encoder_key = steps.qk_norm_rope(
                self.ops,
                attn.norm_added_q,
                attn.norm_added_k,
                encoder_query,
                encoder_key,
                text_rope,
                rope_bshd,
                across_heads=False,
                query_format=q_format,
            )
            query = cat_queries([encoder_query, query])
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if rows is None and image_rotary_emb is not None:  # tables not split: rotate the whole
            query, key = steps.qk_norm_rope(
                self.ops,
                None,
                None,
                query,
                key,
                image_rotary_emb,
                rope_bshd,
                across_heads=False,
            )

        hidden_states = attend(
            self, query, key, value, mask=attention_mask, parallel_config=self._parallel_config
        )
        return hidden_states.flatten(2, 3)


# ------------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------------
def _clip_fp16(x: torch.Tensor) -> torch.Tensor:
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def _runs_our_processor(attn) -> bool:
    """attn runs FluxKernelsAttnProcessor on its own q/k/v modules (not diffusers' fused ones)."""
    return isinstance(attn.processor, FluxKernelsAttnProcessor) and not attn.fused_projections


def _qkv_input_format(attn, *linears) -> str | None:
    """The format in which attn's input may come as quantized rows (None: a tensor): our
    processor projects it with attn's q/k/v, which with `linears` (the other consumers of the
    input) all take that format (quant.input_format)."""
    if not _runs_our_processor(attn):
        return None
    qkv = (getattr(attn, name) for name in steps.QKV)
    return quant.input_format(*qkv, *linears, through=attn)


def _attention(attn, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs):
    """self.attn(...) as the blocks call it; our processor directly (steps.attention) when no
    joint_attention_kwargs are passed (FluxAttention's forward only filters them)."""
    if kwargs:
        return attn(
            hidden_states=hidden_states,
            encoder_hidden_states=encoder_hidden_states,
            image_rotary_emb=image_rotary_emb,
            **kwargs,
        )
    return steps.attention(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)


@recompute.scoped
def double_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
):
    """`FluxTransformerBlock.forward` on the fused ops (same arguments, same rounding points).
    With FP8 image q/k/v, norm1 hands them its output as FP8 rows."""
    ops = self._ltx_kernels_ops
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln.call_norm(
        self.norm1, hidden_states, emb=temb, quant=_qkv_input_format(self.attn)
    )
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        self.norm1_context(encoder_hidden_states, emb=temb)
    )
    attention_outputs = _attention(
        self.attn,
        norm_hidden_states,
        norm_encoder_hidden_states,
        image_rotary_emb,
        joint_attention_kwargs,
    )
    attn_output, context_attn_output = attention_outputs[:2]  # a third: IP-adapter output

    hidden_states = steps.gated_attention_feed_forward(
        ops,
        self.norm2,
        self.ff,
        hidden_states,
        attn_output,
        gate_msa,
        shift_mlp,
        scale_mlp,
        gate_mlp,
    )
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + attention_outputs[2]
    encoder_hidden_states = steps.gated_attention_feed_forward(
        ops,
        self.norm2_context,
        self.ff_context,
        encoder_hidden_states,
        context_attn_output,
        c_gate_msa,
        c_shift_mlp,
        c_scale_mlp,
        c_gate_mlp,
    )
    return _clip_fp16(encoder_hidden_states), hidden_states


#: The single block's projections of its normed input, one GEMM ("fused_qkv_mlp").
QKV_MLP = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


@recompute.scoped
def single_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
):
    """`FluxSingleTransformerBlock.forward` on the fused ops (same arguments and rounding). With
    FP8 Linears, q/k/v and proj_mlp run as one GEMM (fused_qkv_mlp, formed with fp8=True only) when
    the attention can take projected q/k/v (our processor, no hook, no joint_attention_kwargs),
    and the norm hands them its output as FP8 rows (one quantization for all four)."""
    ops = self._ltx_kernels_ops
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

    residual = hidden_states
    attn = self.attn
    norm_hidden_states, gate = adaln.call_norm(
        self.norm, hidden_states, emb=temb, quant=_qkv_input_format(attn, self.proj_mlp)
    )
    direct = not joint_attention_kwargs and _runs_our_processor(attn) and not has_hooks(attn)
    projected = (
        linears.fused_outputs(self, "qkv_mlp", norm_hidden_states)
        if direct and "fused_qkv_mlp" in ops
        else None
    )
    if projected is not None:
        query, key, value, mlp_hidden_states = projected
        # GELU of the rounded GEMM output, as diffusers (linear_gelu's epilogue skips that rounding)
        mlp_hidden_states = steps.activation(ops, self.act_mlp, mlp_hidden_states)
        attn_output = attn.processor.attend(attn, query, key, value, None, image_rotary_emb)
    else:
        mlp_hidden_states = steps.linear_act(ops, self.proj_mlp, self.act_mlp, norm_hidden_states)
        attn_output = _attention(
            attn, norm_hidden_states, None, image_rotary_emb, joint_attention_kwargs
        )

    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    hidden_states = steps.residual(ops, residual, self.proj_out(hidden_states), gate[:, None])
    hidden_states = _clip_fp16(hidden_states)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


# ------------------------------------------------------------------------------------------------
# Patch functions
# ------------------------------------------------------------------------------------------------
DOUBLE_ATTN = "FluxAttention (double: q/k norm + RoPE per stream)"
SINGLE_ATTN = "FluxAttention (single: q/k norm + RoPE)"


#: The Linears that run in FP8 with fp8=True, per preset: the image stream's (module docstring);
#: the single block's proj_out (its attention output and MLP down projection in one) counts as
#: FF. The default "all" (= "ffn+self_attn" here) is what was measured (docs/fp8.md).
DOUBLE_FP8_PRESETS = fp8_presets(ff_projections("ff"), attention_projections("attn"))
SINGLE_FP8_PRESETS = fp8_presets(("proj_mlp", "proj_out"), attention_projections("attn", steps.QKV))
FP8_DEFAULT = "all"


#: The diffusers code the patches reproduce (diffusers_compat.Reproduced).
REPRODUCED = Reproduced(
    "FLUX",
    diffusers_modules("transformers.transformer_flux"),
    {
        "FluxTransformerBlock.forward": "ea4a84124122e8f7",
        "FluxSingleTransformerBlock.forward": "b1d5042d7e994482",
        "FluxAttnProcessor.__call__": "84ba590b98a5f55b",
    },
)


def _patch_attention(name: str, attn, kind: str, injector) -> bool:
    """Gives attn our processor unless it runs a custom one; True when it did."""
    if not injector.has_stock_processor(
        name, attn, "FluxAttnProcessor", kind, "IP-adapter or user code", REPRODUCED.is_stock
    ):
        return False
    injector.set_processor(name, attn, FluxKernelsAttnProcessor(), kind)
    return True


def _reproduces(name: str, block, injector) -> bool:
    """Whether block's forward is the diffusers code ours reproduces; otherwise reported."""
    reason = REPRODUCED.unpatched(type(block), "forward")
    if reason:
        injector.skip(type(block).__name__, name, reason)
    return reason is None


def patch_double_block(name: str, block, injector) -> None:
    if not _reproduces(name, block, injector):
        return
    injector.swap_forward(name, block, double_block_forward, "FluxTransformerBlock")
    injector.fp8_linears(name, block, "FLUX", DOUBLE_FP8_PRESETS, FP8_DEFAULT)
    if _patch_attention(f"{name}.attn", block.attn, DOUBLE_ATTN, injector):
        injector.fuse_projections(f"{name}.attn", block.attn, "qkv", steps.QKV)
        injector.fuse_projections(f"{name}.attn", block.attn, "added_qkv", steps.ADDED_QKV)
    for ff_name in ("ff", "ff_context"):
        reason = steps.feed_forward_fusable(getattr(block, ff_name))
        if reason:
            injector.skip("FluxTransformerBlock feed-forward", f"{name}.{ff_name}", reason)


def patch_single_block(name: str, block, injector) -> None:
    if not _reproduces(name, block, injector):
        return
    injector.swap_forward(name, block, single_block_forward, "FluxSingleTransformerBlock")
    injector.fp8_linears(name, block, "FLUX", SINGLE_FP8_PRESETS, FP8_DEFAULT)
    if _patch_attention(f"{name}.attn", block.attn, SINGLE_ATTN, injector):
        # FP8: q/k/v with proj_mlp (named first: where it fuses, it replaces the q/k/v group), one
        # quantization and one GEMM for the four. Not in bf16, where linear_gelu's GELU epilogue
        # beats the wider GEMM and a gelu pass (FLUX.1-dev step, H100: 135.4 vs 139.6 ms).
        injector.fuse_projections(name, block, "qkv_mlp", QKV_MLP, "fused_qkv_mlp", fp8_only=True)
        injector.fuse_projections(f"{name}.attn", block.attn, "qkv", steps.QKV)
    reason = steps.linear_act_fusable(block.act_mlp)
    if reason:
        injector.skip("FluxSingleTransformerBlock MLP", f"{name}.act_mlp", reason)


PATCHERS = {
    "FluxTransformerBlock": patch_double_block,
    "FluxSingleTransformerBlock": patch_single_block,
}
