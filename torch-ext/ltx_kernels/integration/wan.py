"""Wan 2.x (diffusers `transformer_wan.py`) on the fused ops.

Per block (`WanTransformerBlock`, also its verbatim copies in transformer_wan_animate.py and
transformer_chronoedit.py, `WanVACETransformerBlock`, and SkyReels-V2's
`SkyReelsV2TransformerBlock`: Wan's math with a self-attention mask and diffusion forcing's
per-token temb [B, 6, S, D]), with t = scale_shift_table + temb.float() split in six (fp32
[B, 1, D], or per token [B, S, D] with Wan 2.2 TI2V's temb):
  (norm1(x.float()) * (1 + s) + b).type_as(x)          -> layernorm_modulate (upcast)
  attn1: q/k RMSNorm over the token, RoPE per head       -> qk_rmsnorm_rope on [B, S, H, Dh]
  x = (x.float() + a1 * g).type_as(x); norm2(x.float())  -> add_layernorm_modulate (upcast, affine
                                                            norm2, no modulation; one pass)
  attn2: q/k RMSNorm (no RoPE)                           -> qk_rmsnorm_rope without tables
  x = x + a2; (norm3(x.float()) * (1 + s) + b)           -> add_layernorm_modulate (upcast)
  FF up-projection + GELU-tanh                           -> linear_gelu
  (x.float() + ff.float() * g).type_as(x)                -> gated_residual (upcast)
Every step rounds where the eager code does (each `type_as`, the q/k norm output, the RoPE output).
Self-attention's q/k/v projections run as one GEMM (fused_projections).

FP8 (fp8=True; FP8_PRESETS, default "ffn+self_attn"): attn1's q/k/v (one GEMM) and out, the FF;
"all" adds attn2's q and out; the text (and I2V image-context) K/V stay bf16. norm1, norm2 and
norm3 hand attn1's q/k/v, attn2's q (where FP8) and the FF their output as FP8 rows (the upcast
ops' FP8 twins), the FF's GELU hands them to the down projection. Wan 2.2's two experts are two
models of the pipeline (transformer, transformer_2): each is injected alike.
I2V's image-context attention runs as in diffusers (its K norm is one torch kernel already).
Not patched: the model's output norm is inline in `WanTransformer3DModel.forward`; fusing it means
copying that whole forward for one LayerNorm per call (reported as skipped).
"""

from __future__ import annotations

import torch

from . import attention, quant, recompute, steps
from .attention import attend
from .diffusers_compat import Reproduced, diffusers_modules
from .injector import FusedAttnProcessor
from .linears import self_cross_ff_fp8_presets

#: The diffusers code the patches reproduce (diffusers_compat.Reproduced): the modules with Wan's
#: blocks and processors (diffusers 0.42: the animate and ChronoEdit copies are verbatim).
REPRODUCED = Reproduced(
    "Wan",
    diffusers_modules(
        "transformers.transformer_wan",
        "transformers.transformer_wan_animate",
        "transformers.transformer_chronoedit",
        "transformers.transformer_wan_vace",
        "transformers.transformer_skyreels_v2",
    ),
    {
        "WanTransformerBlock.forward": "b1c3724d168a629e",
        "WanVACETransformerBlock.forward": "34bb448aedb81d11",
        "SkyReelsV2TransformerBlock.forward": "c9729294314b3533",
        "WanAttnProcessor.__call__": "208aa377a101147b",
        "SkyReelsV2AttnProcessor.__call__": "080fec37c8a87d6a",
    },
)


# ------------------------------------------------------------------------------------------------
# Attention: q/k RMSNorm over the token, then Wan's RoPE per head
# ------------------------------------------------------------------------------------------------
def wan_rope(hidden_states, cos_sin):
    """WanAttnProcessor's rotary (a closure there), verbatim: pair (2i, 2i+1) rotated by
    freqs_cos[2i] and freqs_sin[2i + 1]."""
    freqs_cos, freqs_sin = cos_sin
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def _rope_operands(ops, rotary_emb):
    """(ops, tables) for steps.qk_norm_rope. Our rope reads cos and sin at each element's own
    index, so Wan's freqs_cos[2i] and freqs_sin[2i + 1] are repeated over each pair (two copies of
    a [1, S, 1, Dh] table; WanRotaryPosEmbed's tables already repeat per pair, but a processor
    cannot tell where its tables come from). Wan rotates in fp32 only with fp32 tables (16-bit ones
    round every product): then the rope op is left out and Wan's own code runs."""
    if rotary_emb is None:
        return ops, None
    freqs_cos, freqs_sin = rotary_emb
    if "rope" not in ops or not all(
        isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in rotary_emb
    ):
        return ops - {"rope"}, rotary_emb
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return ops, (torch.stack((cos, cos), -1).flatten(-2), torch.stack((sin, sin), -1).flatten(-2))


def _heads(attn, t):
    return t.unflatten(2, (attn.heads, -1))


def qk_norm_rope(ops, attn, query, key, rotary_emb, query_format=None):
    """WanAttnProcessor's q/k path: torch.nn.RMSNorm over the token, split into heads
    [B, S, H, Dh], RoPE per head (none without rotary_emb). Returns (query, key) split, the query
    quantized in `query_format` where our op runs the step (steps.qk_norm_rope)."""
    ops = steps.ops_for_step(ops, query, key, attn.norm_q, attn.norm_k, rotary_emb)
    ops, tables = _rope_operands(ops, rotary_emb)
    return steps.qk_norm_rope_heads(
        ops, attn.norm_q, attn.norm_k, query, key, attn.heads, tables, wan_rope, query_format
    )


class WanKernelsAttnProcessor(FusedAttnProcessor):
    """`WanAttnProcessor` with the q/k RMSNorm (+ RoPE) in one launch. Same signature; backend and
    parallel config are copied from the replaced processor and passed where diffusers passes
    them (attention.attend: self-attention under Ulysses runs ulysses_attention). The
    q/k/v projections are the attention module's own module's helpers."""

    # Whether cross-attention (and I2V's image context) also gets the parallel config: Wan's
    # processor passes it to self-attention only, SkyReels-V2's to every attention.
    parallel_cross_attention = False

    def __init__(self, attn):
        # The q/k/v projection helpers of attn's module, found once here (not traceable per call).
        # The functions, not their module: copy.deepcopy and pickle take functions by reference,
        # and cannot copy a module object.
        helpers = _projection_helpers(attn)
        self.get_qkv_projections = helpers._get_qkv_projections
        self.get_added_kv_projections = helpers._get_added_kv_projections

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        def attend_query(key, value, attn_mask, parallel_config):  # heads-shaped k/v -> [B, S, C]
            return attend(
                self, query, key, value, mask=attn_mask, parallel_config=parallel_config
            ).flatten(2)

        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # 512 is the context length of the text encoder, hardcoded (as in diffusers)
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]

        if encoder_hidden_states is None and not attn.fused_projections:
            query, key, value = steps.fused_projections(self.ops, attn, hidden_states)
        else:  # (hidden_states may be QuantRows: to_q takes them)
            query, key, value = self.get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        value = _heads(attn, value)
        self_attention = encoder_hidden_states is None
        parallel_config = (
            self._parallel_config if self_attention or self.parallel_cross_attention else None
        )
        query_format = None
        if encoder_hidden_states_img is None:  # (I2V attends the query twice: left a tensor)
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
        query, key = qk_norm_rope(self.ops, attn, query, key, rotary_emb, query_format)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:  # I2V
            key_img, value_img = self.get_added_kv_projections(attn, encoder_hidden_states_img)
            key_img = _heads(attn, attn.norm_added_k(key_img))
            cross_parallel = self._parallel_config if self.parallel_cross_attention else None
            hidden_states_img = attend_query(key_img, _heads(attn, value_img), None, cross_parallel)

        hidden_states = attend_query(key, value, attention_mask, parallel_config)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        hidden_states = steps.linear(self.ops, attn.to_out[0], hidden_states)
        return attn.to_out[1](hidden_states)


class SkyReelsKernelsAttnProcessor(WanKernelsAttnProcessor):
    """`SkyReelsV2AttnProcessor` (Wan's, with the parallel config on every attention)."""

    parallel_cross_attention = True


def _projection_helpers(attn):
    """The module holding `_get_qkv_projections` for `attn`'s class (each Wan copy has its own;
    VACE's attention is transformer_wan's)."""
    import importlib

    module = importlib.import_module(type(attn).__module__)
    if hasattr(module, "_get_qkv_projections"):
        return module
    return importlib.import_module("diffusers.models.transformers.transformer_wan")


# ------------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------------
def _input_format(attn, names=("to_q",)) -> str | None:
    """The format in which attn takes its input as quantized rows (None: a tensor): our
    processor, and the one its projections `names` (those of the input) take (quant.input_format)."""
    if not isinstance(attn.processor, WanKernelsAttnProcessor):
        return None
    return quant.input_format(*(getattr(attn, name) for name in names), through=attn)


def _layer(self, hidden_states, encoder_hidden_states, modulation, rotary_emb, attention_mask=None):
    """Self-attention, cross-attention and FF of a Wan block; modulation = the six fp32 chunks."""
    ops = self._ltx_kernels_ops
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = modulation
    if hidden_states.stride(-1) != 1:  # VACE and ChronoEdit pass the patch embedding transposed;
        hidden_states = hidden_states.contiguous()  # our ops read rows (same values)

    norm_hidden_states = steps.norm_modulate_fp32(
        ops,
        self.norm1,
        hidden_states,
        scale_msa,
        shift_msa,
        quant=_input_format(self.attn1, steps.QKV),
    )
    attn_output = steps.attention(self.attn1, norm_hidden_states, None, attention_mask, rotary_emb)
    hidden_states, norm_hidden_states = steps.add_norm_modulate_fp32(
        ops, self.norm2, hidden_states, attn_output, gate=gate_msa, quant=_input_format(self.attn2)
    )

    attn_output = steps.attention(self.attn2, norm_hidden_states, encoder_hidden_states)
    hidden_states, norm_hidden_states = steps.add_norm_modulate_fp32(
        ops,
        self.norm3,
        hidden_states,
        attn_output,
        c_scale_msa,
        c_shift_msa,
        quant=steps.feed_forward_input_format(self.ffn),
    )

    ff_output = steps.feed_forward(ops, self.ffn, norm_hidden_states)
    return steps.residual_fp32(ops, hidden_states, ff_output, c_gate_msa)


@recompute.scoped
def block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    """`WanTransformerBlock.forward` on the fused ops (same arguments, same rounding points)."""
    if temb.ndim == 4:  # Wan 2.2 TI2V: temb [B, S, 6, D], modulation per token
        modulation = [
            t.squeeze(2)
            for t in (self.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        ]
    else:  # temb [B, 6, D]
        modulation = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
    return _layer(self, hidden_states, encoder_hidden_states, modulation, rotary_emb)


@recompute.scoped
def skyreels_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """`SkyReelsV2TransformerBlock.forward` on the fused ops: Wan's layer with the self-attention
    mask; diffusion forcing's temb [B, 6, S, D] gives per-token modulation."""
    if temb.dim() == 3:  # [B, 6, D]
        modulation = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
    else:  # [B, 6, S, D]
        modulation = [
            t.squeeze(1)
            for t in (self.scale_shift_table.unsqueeze(2) + temb.float()).chunk(6, dim=1)
        ]
    return _layer(
        self, hidden_states, encoder_hidden_states, modulation, rotary_emb, attention_mask
    )


@recompute.scoped
def vace_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    control_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
):
    """`WanVACETransformerBlock.forward` on the fused ops: the Wan layer on the control stream."""
    if self.proj_in is not None:
        control_hidden_states = self.proj_in(control_hidden_states)
        control_hidden_states = control_hidden_states + hidden_states
    modulation = (self.scale_shift_table.to(temb.device) + temb.float()).chunk(6, dim=1)
    control_hidden_states = _layer(
        self, control_hidden_states, encoder_hidden_states, modulation, rotary_emb
    )
    conditioning_states = None
    if self.proj_out is not None:
        conditioning_states = self.proj_out(control_hidden_states)
    return conditioning_states, control_hidden_states


# ------------------------------------------------------------------------------------------------
# Patching
# ------------------------------------------------------------------------------------------------
SELF_ATTENTION = "WanAttention (self: q/k norm + RoPE)"
CROSS_ATTENTION = "WanAttention (cross: q/k norm)"
IMAGE_CONTEXT = "WanAttention (I2V image-context K norm)"


#: The Linears that run in FP8 with fp8=True, per preset (module docstring), and the default:
#: "ffn+self_attn" (FP8 on every attention and FFN projection of Wan 2.2 is on record collapsing
#: long videos where FFN-only stayed stable: the cross-attention stays bf16 until measured).
FP8_PRESETS = self_cross_ff_fp8_presets("ffn")
FP8_DEFAULT = "ffn+self_attn"


def _block_patcher(forward, stock_processor="WanAttnProcessor", processor=WanKernelsAttnProcessor):
    def patch(name: str, block, injector) -> None:
        kind = type(block).__name__
        reason = REPRODUCED.unpatched(type(block), "forward")
        if reason:
            injector.skip(kind, name, reason)
            return
        injector.swap_forward(name, block, forward, kind)
        injector.fp8_linears(name, block, "Wan", FP8_PRESETS, FP8_DEFAULT)
        for attn_name, attn_kind in (("attn1", SELF_ATTENTION), ("attn2", CROSS_ATTENTION)):
            attn = getattr(block, attn_name)
            if not injector.has_stock_processor(
                f"{name}.{attn_name}",
                attn,
                stock_processor,
                attn_kind,
                "LoRA/IP adapters or user code",
                is_stock=REPRODUCED.is_stock,
            ):
                continue
            injector.set_processor(f"{name}.{attn_name}", attn, processor(attn), attn_kind)
            if attn_name == "attn1":
                injector.fuse_projections(f"{name}.attn1", attn, "qkv", steps.QKV)
            if attn.add_k_proj is not None:
                injector.skip(
                    IMAGE_CONTEXT,
                    f"{name}.{attn_name}",
                    "norm_added_k stays "
                    "torch.nn.RMSNorm (one kernel, no RoPE or partner norm to fuse)",
                )
        reason = steps.feed_forward_fusable(block.ffn)
        if reason:
            injector.skip(f"{kind} feed-forward", f"{name}.ffn", reason)

    return patch


def patch_model(name: str, model, injector) -> None:
    injector.skip(
        f"{type(model).__name__} (output norm)",
        name,
        "inline in the model forward; fusing it would copy the whole forward for one "
        "LayerNorm per call",
    )


PATCHERS = {
    "WanTransformerBlock": _block_patcher(block_forward),
    "WanVACETransformerBlock": _block_patcher(vace_block_forward),
    "WanTransformer3DModel": patch_model,
    "WanVACETransformer3DModel": patch_model,
    "SkyReelsV2TransformerBlock": _block_patcher(
        skyreels_block_forward, "SkyReelsV2AttnProcessor", SkyReelsKernelsAttnProcessor
    ),
    "SkyReelsV2Transformer3DModel": patch_model,
}
