"""SD3 / SD3.5 (diffusers `JointTransformerBlock` in models/attention.py, `JointAttnProcessor2_0`)
on the fused ops.

AdaLN modules (AdaLayerNormZero; AdaLayerNormContinuous: context of the last, context-pre-only
block, and the output norm; SD35AdaLayerNormZeroX: dual-attention layers): `adaln.py`.
Per block, for the image stream (and the text stream unless context_pre_only):
  x + gate * attn (+ gate2 * attn2 on dual-attention layers), norm2 + modulation
                                       -> [gated_residual +] add_layernorm_modulate
  FF up-projection + GELU-tanh         -> linear_gelu (also under forward chunking)
  x + gate * ff                        -> gated_residual
Attention (SD3.5, qk_norm="rms_norm"): the per-head diffusers RMSNorm of q, k, added q, added k on
the [B, H, S, Dh] view -> rmsnorm; F.scaled_dot_product_attention is called as SD3 does (attention.attend with sdpa=True).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import recompute, steps
from .attention import attend
from .diffusers_compat import Reproduced, diffusers_modules
from .injector import FusedAttnProcessor


def _split_heads(x, heads: int, head_dim: int):
    """[B, S, H * Dh] -> the [B, H, S, Dh] view JointAttnProcessor2_0 works on."""
    return x.view(x.shape[0], -1, heads, head_dim).transpose(1, 2)


class SD3KernelsAttnProcessor(FusedAttnProcessor):
    """`JointAttnProcessor2_0` with each per-head q/k RMSNorm in one launch. Same signature (the
    Attention module filters its kwargs by it)."""

    def _norm(self, norm, x):
        return x if norm is None else steps.diffusers_rmsnorm(self.ops, norm, x)

    def __call__(
        self,
        attn,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        *args,
        **kwargs,
    ):
        residual = hidden_states
        batch_size = hidden_states.shape[0]

        query, key, value = steps.fused_projections(self.ops, attn, hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (_split_heads(t, attn.heads, head_dim) for t in (query, key, value))
        query = self._norm(attn.norm_q, query)
        key = self._norm(attn.norm_k, key)

        if encoder_hidden_states is not None:
            context_query, context_key, context_value = (
                _split_heads(projection, attn.heads, head_dim)
                for projection in steps.fused_projections(
                    self.ops, attn, encoder_hidden_states, "added_qkv", steps.ADDED_QKV
                )
            )
            context_query = self._norm(attn.norm_added_q, context_query)
            context_key = self._norm(attn.norm_added_k, context_key)
            query = torch.cat([query, context_query], dim=2)
            key = torch.cat([key, context_key], dim=2)
            value = torch.cat([value, context_value], dim=2)

        hidden_states = attend(  # [B, H, S, Dh] views -> [B, S, H, Dh], SDPA as SD3 calls it
            self, *(t.transpose(1, 2) for t in (query, key, value)), sdpa=True
        )
        hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = steps.linear(
                    self.ops, attn.to_add_out, encoder_hidden_states
                )
        hidden_states = steps.linear(self.ops, attn.to_out[0], hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def _feed_forward(block, ff, x):
    """steps.feed_forward, per chunk under `enable_forward_chunking` as diffusers does."""
    from diffusers.models.attention import _chunked_feed_forward

    fused = functools.partial(steps.feed_forward, block._ltx_kernels_ops, ff)
    if block._chunk_size is None:
        return fused(x)
    return _chunked_feed_forward(fused, x, block._chunk_dim, block._chunk_size)


@recompute.scoped
def block_forward(
    self,
    hidden_states: torch.FloatTensor,
    encoder_hidden_states: torch.FloatTensor,
    temb: torch.FloatTensor,
    joint_attention_kwargs: dict[str, Any] | None = None,
):
    """`JointTransformerBlock.forward` on the fused ops (same arguments, same rounding points)."""
    ops = self._ltx_kernels_ops
    joint_attention_kwargs = joint_attention_kwargs or {}
    norm_outputs = self.norm1(hidden_states, emb=temb)
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = norm_outputs[:5]
    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            self.norm1_context(encoder_hidden_states, emb=temb)
        )

    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        **joint_attention_kwargs,
    )
    if self.use_dual_attention:  # x + gate*attn, then + gate2*attn2 fused with norm2 below
        norm_hidden_states2, gate_msa2 = norm_outputs[5:]
        hidden_states = steps.residual(ops, hidden_states, attn_output, gate_msa[:, None])
        attn_output = self.attn2(hidden_states=norm_hidden_states2, **joint_attention_kwargs)
        gate_msa = gate_msa2

    hidden_states, norm_hidden_states = steps.add_norm_modulate(
        ops,
        self.norm2,
        hidden_states,
        attn_output,
        scale_mlp[:, None],
        shift_mlp[:, None],
        gate_msa[:, None],
    )
    ff_output = _feed_forward(self, self.ff, norm_hidden_states)
    hidden_states = steps.residual(ops, hidden_states, ff_output, gate_mlp[:, None])

    if self.context_pre_only:
        return None, hidden_states
    encoder_hidden_states, norm_encoder_hidden_states = steps.add_norm_modulate(
        ops,
        self.norm2_context,
        encoder_hidden_states,
        context_attn_output,
        c_scale_mlp[:, None],
        c_shift_mlp[:, None],
        c_gate_msa[:, None],
    )
    context_ff_output = _feed_forward(self, self.ff_context, norm_encoder_hidden_states)
    encoder_hidden_states = steps.residual(
        ops, encoder_hidden_states, context_ff_output, c_gate_mlp[:, None]
    )
    return encoder_hidden_states, hidden_states


#: The diffusers code the patches reproduce (diffusers_compat.Reproduced).
REPRODUCED = Reproduced(
    "SD3",
    diffusers_modules("attention", "attention_processor"),
    {
        "JointTransformerBlock.forward": "4fe778bab4d3b4a2",
        "JointAttnProcessor2_0.__call__": "cb4d3fadb6d9c451",
    },
)

JOINT_ATTN = "Attention (SD3 joint: per-head q/k RMSNorm)"
DUAL_ATTN = "Attention (SD3.5 dual self-attention: per-head q/k RMSNorm)"


def _patch_attention(name: str, attn, kind: str, injector) -> None:
    if not injector.has_stock_processor(
        name,
        attn,
        "JointAttnProcessor2_0",
        kind,
        "IP-adapter, fused QKV, PAG or user code",
        REPRODUCED.is_stock,
    ):
        return
    norms = [getattr(attn, n, None) for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    norms = [n for n in norms if n is not None]
    if not norms:
        injector.skip(kind, name, "no q/k norm (qk_norm=None, SD3): nothing to fuse")
    elif not all(steps.is_diffusers_rmsnorm(n) for n in norms):
        injector.skip(kind, name, f"q/k norm {type(norms[0]).__name__} has no fused kernel")
    else:
        injector.set_processor(name, attn, SD3KernelsAttnProcessor(), kind)


def patch_block(name: str, block, injector) -> None:
    reason = REPRODUCED.unpatched(type(block), "forward")
    if reason:
        injector.skip("JointTransformerBlock", name, reason)
        return
    injector.swap_forward(name, block, block_forward, "JointTransformerBlock")
    _patch_attention(f"{name}.attn", block.attn, JOINT_ATTN, injector)
    if block.attn2 is not None:
        _patch_attention(f"{name}.attn2", block.attn2, DUAL_ATTN, injector)
    for ff_name in ("ff", "ff_context"):
        ff = getattr(block, ff_name)
        reason = ff is not None and steps.feed_forward_fusable(ff)
        if reason:
            injector.skip("JointTransformerBlock feed-forward", f"{name}.{ff_name}", reason)


PATCHERS = {
    "JointTransformerBlock": patch_block,
}
