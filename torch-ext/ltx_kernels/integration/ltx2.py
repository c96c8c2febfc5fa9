"""LTX-2, LTX-2.3 and LTX-2.5 (diffusers `transformer_ltx2.py`) on the fused ops.

Per block (`LTX2VideoTransformerBlock`), for the video and the audio stream each, with the
modulation diffusers' get_mod_params gives ([B, 1, D] per sample, [B, S, D] per token: image-to-
video and conditioning), every step rounded where the eager code rounds:
  norm1 + modulation                                   -> rmsnorm_modulate
  self-attention: q/k RMSNorm + RoPE                   -> qk_rmsnorm_rope (attention="int8":
                                                          qk_rmsnorm_rope_quant, q in 8 bits)
  x + attn * gate, norm2 (2.3+: text-query modulation) -> add_rmsnorm_modulate (one pass)
  text cross-attention: q/k RMSNorm                    -> qk_rmsnorm_rope without tables
  x + attn (2.3+: * gate), the audio-video norm with    -> add_rmsnorm_modulate, then
    the a2v and the v2a modulation                        rmsnorm_modulate for the second
  audio-video cross-attention: q/k RMSNorm             -> qk_rmsnorm_rope without tables
    RoPE, queries and keys with their own tables       -> rope, once per tensor
  x + gate * a2v (v2a), norm3 + modulation             -> add_rmsnorm_modulate
  FF up-projection + GELU-tanh (2.5: no bias)          -> linear_gelu
  x + ff * gate                                        -> gated_residual
Each residual is added in the pass of the norm that follows it (the eager code adds it, then
norms); the results are the same tensors. RoPE: "split" (every released checkpoint: the halves of
each head, [B, H, S, D/2] tables) and "interleaved" (pairs over the whole token, LTX-Video's form).
Model (`LTX2VideoTransformer3DModel`): the video and audio output LayerNorm + modulation ->
layernorm_modulate.

FP8 (fp8=True; FP8_PRESETS, default "all"): the video and audio FFs ("ffn"), with the
video and audio self-attention's q/k/v and out ("ffn+self_attn"), with the text cross-attentions'
q and out and the audio-to-video and video-to-audio attentions' q/k/v and out ("all"). Always
bf16: the text K/V, the per-head gate logits of 2.3+ (modulation), the modulation tables and
embedders, proj_in/proj_out. The norms before them hand an FP8 input its rows in their own pass
(norm1 to the self-attention's q/k/v, norm2 to the text query, the audio-video norm to each
cross-modal attention's query or K/V, norm3 to the FF), the FF's GELU hands them to the down
projection; where a bf16 gate-logits Linear reads the same input (2.3+), the norm hands over the
tensor and the attention quantizes it once for its FP8 q/k/v; the attention output is quantized
by to_out (one pass).

Run as in diffusers, reported at injection: the per-head attention gates of 2.3+
(`2 * sigmoid(to_gate_logits(x))`) and the text K/V modulation of 2.3+
(`text * (1 + scale) + shift`, no norm): no kernel fuses them. The STG processor
(`LTX2PerturbedAttnProcessor`, every attention of 2.3+) is replaced by its fused twin: perturbed
samples take the values, as in diffusers.

The patches reproduce diffusers 0.42.1's code; a block, processor or model whose code differs
(another diffusers version, a subclass) keeps it and is reported (REPRODUCED, diffusers_compat).
"""

from __future__ import annotations

from typing import Any

import torch

from . import attention as attention_seam, quant, recompute, steps
from .attention import attend
from .injector import FusedAttnProcessor
from .linears import attention_projections, ff_projections, fp8_presets
from .context_parallel import (
    context_parallel_config,
    gather_cross_attention_inputs,
    local_rope_tables,
    local_token_timesteps,
    plan_without_timestep,
    shard_sequence,
)
from .diffusers_compat import Reproduced, diffusers_modules, lora_scaled

# ------------------------------------------------------------------------------------------------
# Which diffusers code the patches reproduce
# ------------------------------------------------------------------------------------------------
#: The diffusers code the patches reproduce (diffusers_compat.Reproduced; the fingerprints are the
#: same under Python 3.11, 3.12 and 3.13).
REPRODUCED = Reproduced(
    "LTX-2",
    diffusers_modules("transformers.transformer_ltx2"),
    {
        "LTX2VideoTransformerBlock.forward": "8bd48f03fd087ee8",
        "LTX2AudioVideoAttnProcessor.__call__": "5dfc938d8d89d426",
        "LTX2PerturbedAttnProcessor.__call__": "9e60af959fb0229d",
        "LTX2VideoTransformer3DModel.forward": "1ab560b2ade200d5",
    },
)


# ------------------------------------------------------------------------------------------------
# Attention: q/k RMSNorm over the token, then RoPE ("split": per head; "interleaved": the token)
# ------------------------------------------------------------------------------------------------
def _split_view(t, cos):
    """t [B, S, D] as the rope op takes it with a split table: [B, S, H, D/H] for diffusers'
    [B, H, S, r] tables (H heads of 2r), itself for a [B, S, r] table (halves of the token)."""
    return t.unflatten(2, (cos.shape[1], -1)) if cos.dim() == 4 else t


def _split_tables(cos_sin):
    """diffusers' split tables as the rope op takes them: [B, H, S, r] -> [B, S, H, r] views."""
    return tuple(t.transpose(1, 2) if t.dim() == 4 else t for t in cos_sin)


def _diffusers_split_rope(x, cos_sin):
    """diffusers' apply_split_rotary_emb of x (a _split_view) with _split_tables cos_sin."""
    from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb

    cos, sin = _split_tables(cos_sin)  # (transposing back)
    return apply_split_rotary_emb(x.flatten(2), (cos, sin)).view(x.shape)


def _diffusers_interleaved_rope(x, cos_sin):
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb

    return apply_interleaved_rotary_emb(x, cos_sin)


_diffusers_interleaved_rope_heads = steps.rope_over_tokens(_diffusers_interleaved_rope)


def _rotate(ops, x, cos_sin, split: bool):
    """RoPE of x [B, S, D] with its own tables."""
    if not split:
        return steps.rotate(ops, x, cos_sin, _diffusers_interleaved_rope)
    view = _split_view(x, cos_sin[0])
    rotated = steps.rotate(ops, view, _split_tables(cos_sin), _diffusers_split_rope, False)
    return rotated.flatten(2)


def _heads(attn, t):
    """t [B, S, D] split into attn's heads; already split (a tensor or QuantRows) as it is."""
    return t.unflatten(2, (attn.heads, -1)) if len(t.shape) == 3 else t


def _same_tables(a, b) -> bool:
    """Whether two (cos, sin) pairs hold the same tensors (compared one by one: Dynamo does not
    trace `is` on tuples)."""
    return all(x is y for x, y in zip(a, b, strict=True))


def qk_norm_rope(ops, attn, query, key, query_rotary_emb, key_rotary_emb, query_format=None):
    """LTX2AudioVideoAttnProcessor's q/k path on [B, S, D]: torch.nn.RMSNorm over the token, then
    attn.rope_type's RoPE (none without a query table), the key rotated by its own table where it
    has one (audio-video cross-attention) and by the query's otherwise. With one table: norms and
    rotations in one launch; with two: the norms in one, each rotation in its own. Returns q/k
    [B, S, D], or split into heads [B, S, H, Dh] where a query_format (attention.query_format)
    applies: one table or none, q quantized per token and head in the pass where our op runs it
    (QuantRows; steps.qk_norm_rope)."""
    norm_q, norm_k = attn.norm_q, attn.norm_k
    if query_rotary_emb is None or attn.rope_type not in ("interleaved", "split"):
        if query_format is not None:
            return steps.qk_norm_rope_heads(
                ops, norm_q, norm_k, query, key, attn.heads, None, None, query_format
            )
        return steps.qk_norm_rope(ops, norm_q, norm_k, query, key, None, None, across_heads=True)
    split = attn.rope_type == "split"
    if key_rotary_emb is not None and not _same_tables(key_rotary_emb, query_rotary_emb):
        query, key = steps.qk_norm_rope(
            ops, norm_q, norm_k, query, key, None, None, across_heads=True
        )
        key = _rotate(ops, key, key_rotary_emb, split)
        return _rotate(ops, query, query_rotary_emb, split), key
    if not split:
        if query_format is not None:
            tables = tuple(t.unflatten(2, (attn.heads, -1)) for t in query_rotary_emb)
            return steps.qk_norm_rope_heads(
                ops,
                norm_q,
                norm_k,
                query,
                key,
                attn.heads,
                tables,
                _diffusers_interleaved_rope_heads,
                query_format,
            )
        return steps.qk_norm_rope(
            ops,
            norm_q,
            norm_k,
            query,
            key,
            query_rotary_emb,
            _diffusers_interleaved_rope,
            across_heads=True,
        )
    ops = steps.ops_for_step(ops, query, key, norm_q, norm_k, query_rotary_emb)
    if not steps.fuses_qk_norm(ops, norm_q, norm_k, query, key):
        # The shared step would norm the head views; these norms span the token (as Wan's).
        query, key, norm_q, norm_k = norm_q(query), norm_k(key), None, None
    cos = query_rotary_emb[0]
    heads_split = cos.dim() == 4  # (per-head tables: the views are [B, S, H, Dh])
    query, key = steps.qk_norm_rope(
        ops,
        norm_q,
        norm_k,
        _split_view(query, cos),
        _split_view(key, cos),
        _split_tables(query_rotary_emb),
        _diffusers_split_rope,
        across_heads=True,
        interleaved=False,
        query_format=query_format if heads_split else None,
    )
    if query_format is not None and heads_split:
        return query, key
    return query.flatten(2), key.flatten(2)


def attention(
    processor,
    attn,
    hidden_states,
    encoder_hidden_states=None,
    attention_mask=None,
    query_rotary_emb=None,
    key_rotary_emb=None,
    perturbation_mask=None,
    all_perturbed=None,
):
    """`LTX2PerturbedAttnProcessor.__call__` (= `LTX2AudioVideoAttnProcessor.__call__` without a
    perturbation mask) with the q/k norms and RoPE on our ops."""
    keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    parallel = processor._parallel_config  # each table's chunk: of the tokens its tensor holds
    query_rotary_emb = local_rope_tables(query_rotary_emb, hidden_states.shape[1], parallel)
    key_rotary_emb = local_rope_tables(key_rotary_emb, keys.shape[1], parallel)
    encoder_hidden_states, attention_mask, parallel_config = _context_parallel_inputs(
        processor, hidden_states, encoder_hidden_states, attention_mask
    )
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
    )
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
    gate_logits = None if attn.to_gate_logits is None else attn.to_gate_logits(hidden_states)
    if encoder_hidden_states is None:  # (FP8 q/k/v of one tensor: quantized once)
        encoder_hidden_states = hidden_states = _shared_rows(hidden_states, attn, steps.QKV)
    else:
        encoder_hidden_states = _shared_rows(encoder_hidden_states, attn, ("to_k", "to_v"))

    value = steps.linear(processor.ops, attn.to_v, encoder_hidden_states)
    if all_perturbed is None:
        all_perturbed = (
            torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
        )
    if all_perturbed:  # STG: the values, no attention
        hidden_states = value
    else:
        query = steps.linear(processor.ops, attn.to_q, hidden_states)
        key = steps.linear(processor.ops, attn.to_k, encoder_hidden_states)
        query_format = None  # (the audio-video attentions' own key tables: rotated apart)
        if (
            query_rotary_emb is None
            or key_rotary_emb is None
            or _same_tables(key_rotary_emb, query_rotary_emb)
        ):
            query_format = attention_seam.query_format(
                processor,
                query,
                key,
                value.unflatten(2, (attn.heads, -1)),
                heads=attn.heads,
                mask=attention_mask,
                parallel_config=parallel_config,
                params=(getattr(attn.norm_q, "weight", None), getattr(attn.norm_k, "weight", None)),
            )
        query, key = qk_norm_rope(
            processor.ops, attn, query, key, query_rotary_emb, key_rotary_emb, query_format
        )
        hidden_states = attend(
            processor,
            *(_heads(attn, t) for t in (query, key, value)),
            mask=attention_mask,
            parallel_config=parallel_config,
            whole_queries=processor.cp_role == "whole_queries",
        ).flatten(2)
        if perturbation_mask is not None:
            hidden_states = torch.lerp(value, hidden_states, perturbation_mask)

    if gate_logits is not None:  # per-head gates, 2 * sigmoid (1 at zero logits)
        gates = 2.0 * torch.sigmoid(gate_logits)
        hidden_states = hidden_states.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)
        hidden_states = hidden_states.flatten(2, 3)
    hidden_states = steps.linear(processor.ops, attn.to_out[0], hidden_states)
    return attn.to_out[1](hidden_states)


def _shared_rows(x, attn, names):
    """x quantized once (QuantRows) when it is a tensor that attn's projections `names` all take
    as rows (FP8 projections of one input, which would each quantize it: the same bits); else x
    (rows already, or bf16 projections)."""
    format = quant.input_format(*(getattr(attn, n) for n in names))
    return quant.quantize_rows(x, format) if format and isinstance(x, torch.Tensor) else x


def _input_format(attn, names=("to_q",)) -> str | None:
    """The format in which attn takes its input to projections `names` as quantized rows (None: a
    tensor): our processor, and the one those projections take (quant.input_format); the query
    input also feeds the per-head gate logits of 2.3+ (bf16: then None)."""
    if not isinstance(
        attn.processor, (LTX2KernelsAttnProcessor, LTX2KernelsPerturbedAttnProcessor)
    ):
        return None
    consumers = [getattr(attn, name) for name in names]
    if "to_q" in names and attn.to_gate_logits is not None:
        consumers.append(attn.to_gate_logits)
    return quant.input_format(*consumers, through=attn)


# ------------------------------------------------------------------------------------------------
# Context parallelism: the video tokens (and the video's text) split over the GPUs, the audio whole
# ------------------------------------------------------------------------------------------------
#: What each attention of a block attends under context parallelism (the processor's cp_role).
#: The patched model's plan (_cp_plan) splits the video tokens, the video's text and its mask (the
#: patched forward: per-token timesteps and the keyframe mask); each processor takes the chunk of
#: the RoPE tables of the tokens it holds; the audio and its text stay whole on every GPU. So:
#: video self-attention runs diffusers' parallel attention (or ulysses_attention); the video's
#: text cross-attention gathers the text and attends locally;
#: audio-to-video attends this GPU's video queries to the whole audio, and the audio's self- and
#: text attention are whole: all three local; video-to-audio (audio queries, the whole audio on
#: every GPU, against split video keys) attends with whole queries (attention.attend: under
#: Ulysses, k/v to this GPU's heads, its heads of the queries, the output gathered over the heads;
#: otherwise diffusers' parallel attention): every GPU gets the full result.
CP_ROLES = {
    "attn1": "parallel",
    "attn2": "gather_text",
    "audio_attn1": "local",
    "audio_attn2": "local",
    "audio_to_video_attn": "local",
    "video_to_audio_attn": "whole_queries",
}


def _context_parallel_inputs(processor, hidden_states, encoder_hidden_states, attention_mask):
    """(encoder_hidden_states, attention_mask, parallel config to attend with) of one attention call
    under the processor's cp_role (CP_ROLES); the inputs unchanged without context parallelism."""
    parallel_config = processor._parallel_config
    if context_parallel_config(parallel_config) is None:
        return encoder_hidden_states, attention_mask, parallel_config
    if torch.is_grad_enabled() and getattr(hidden_states, "requires_grad", False):  # (QuantRows)
        raise NotImplementedError(
            "ltx_kernels: training LTX-2 under context parallelism is not supported (the audio "
            "stream runs whole on every GPU, so its gradients would be counted once per GPU); "
            "inference (no_grad) is"
        )
    role = processor.cp_role
    if role == "gather_text":
        return gather_cross_attention_inputs(parallel_config, encoder_hidden_states, attention_mask)
    if role == "local":
        return encoder_hidden_states, attention_mask, None
    if attention_mask is not None:  # the IC-LoRA video self-attention mask [B, S, S]
        raise NotImplementedError(
            "ltx_kernels: LTX-2's video_self_attention_mask under context parallelism is not "
            "supported (its query rows would have to be split with the tokens); run without "
            "enable_parallelism"
        )
    return encoder_hidden_states, attention_mask, parallel_config


def context_parallel_plan(cp_plan):
    """diffusers' LTX-2 `_cp_plan` without its RoPE entries (the processors take their chunk of
    the tables, local_rope_tables: the plan splits only 3-dim tables, not the [B, H, S, r] ones of
    the "split" layout of every released checkpoint) and without a timestep entry: the patched
    forward takes its chunk of per-token timesteps ([B, S], image-to-video; local_token_timesteps),
    as of the keyframe mask of 2.5 ([B, S, 1], an optional input, which a plan cannot name)."""
    if cp_plan is None:
        return None
    return plan_without_timestep({key: plan for key, plan in cp_plan.items() if key != "rope"})


class LTX2KernelsAttnProcessor(FusedAttnProcessor):
    """`LTX2AudioVideoAttnProcessor` with the q/k RMSNorm and RoPE on our ops. Same signature
    (LTX2Attention filters its kwargs by it); backend and parallel config are copied from the
    replaced processor; under context parallelism, cp_role (CP_ROLES) says what it attends."""

    cp_role = "parallel"

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return attention(
            self,
            attn,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            query_rotary_emb,
            key_rotary_emb,
        )


class LTX2KernelsPerturbedAttnProcessor(FusedAttnProcessor):
    """`LTX2PerturbedAttnProcessor` (spatio-temporal guidance: perturbed samples take the values
    instead of the attention) with the q/k RMSNorm and RoPE on our ops. Same signature."""

    cp_role = "parallel"

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        perturbation_mask: torch.Tensor | None = None,
        all_perturbed: bool | None = None,
    ) -> torch.Tensor:
        return attention(
            self,
            attn,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            query_rotary_emb,
            key_rotary_emb,
            perturbation_mask,
            all_perturbed,
        )


# ------------------------------------------------------------------------------------------------
# Block
# ------------------------------------------------------------------------------------------------
def _attention(attn, *args, **kwargs):
    """attn(*args, **kwargs) as the block calls it (LTX2Attention.forward), our processor called
    directly where nothing hooks attn (steps.attention: six calls a block), except STG's arguments
    to a processor that does not take them, which the module's forward drops."""
    if "perturbation_mask" in kwargs and not isinstance(
        attn.processor, LTX2KernelsPerturbedAttnProcessor
    ):
        return attn(*args, **kwargs)
    return steps.attention(attn, *args, **kwargs)


def _add_norms(ops, norm, x, pending, modulations):
    """x plus the pending residual (y, gate) (None: nothing to add; gate None: x + y), then
    norm(x) modulated by each (scale, shift, quant) of `modulations`, the first in the residual's
    pass (quant: the format its consumers take it in, as QuantRows where the op runs; None: a
    tensor). Returns (x, [the modulated norms])."""
    (scale, shift, first_quant), *others = modulations
    if pending is None:
        first = steps.norm_modulate(ops, norm, x, scale, shift, first_quant)
    else:
        y, gate = pending
        x, first = steps.add_norm_modulate(ops, norm, x, y, scale, shift, gate, first_quant)
    return x, [first, *(steps.norm_modulate(ops, norm, x, s, b, q) for s, b, q in others)]


def _text_kv(block, table, temb_prompt, text, batch_size):
    """The text K/V modulation of 2.3+ (prompt_scale_shift_table), as diffusers computes it:
    text * (1 + scale) + shift (no norm, no kernel)."""
    if temb_prompt is not None:
        shift, scale = block.get_mod_params(table, temb_prompt, batch_size)
    else:  # use_prompt_adaln_single=False: the static per-layer table
        shift, scale = table[None, None].to(device=text.device, dtype=text.dtype).unbind(dim=2)
    return text * (1 + scale) + shift


@recompute.scoped
def block_forward(
    self,
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    audio_encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    temb_audio: torch.Tensor,
    temb_ca_scale_shift: torch.Tensor,
    temb_ca_audio_scale_shift: torch.Tensor,
    temb_ca_gate: torch.Tensor,
    temb_ca_audio_gate: torch.Tensor,
    temb_prompt: torch.Tensor | None = None,
    temb_prompt_audio: torch.Tensor | None = None,
    video_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    audio_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ca_video_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ca_audio_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    audio_encoder_attention_mask: torch.Tensor | None = None,
    self_attention_mask: torch.Tensor | None = None,
    audio_self_attention_mask: torch.Tensor | None = None,
    a2v_cross_attention_mask: torch.Tensor | None = None,
    v2a_cross_attention_mask: torch.Tensor | None = None,
    use_a2v_cross_attention: bool = True,
    use_v2a_cross_attention: bool = True,
    perturbation_mask: torch.Tensor | None = None,
    all_perturbed: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`LTX2VideoTransformerBlock.forward` (diffusers 0.42.1) on the fused ops: same arguments,
    same rounding points. Returns (hidden_states, audio_hidden_states)."""
    ops = self._ltx_kernels_ops
    batch_size = hidden_states.size(0)
    video = steps.modulation(ops, self.scale_shift_table, temb, batch_size)
    audio = steps.modulation(ops, self.audio_scale_shift_table, temb_audio, batch_size)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = video[:6]
    a_shift_msa, a_scale_msa, a_gate_msa, a_shift_mlp, a_scale_mlp, a_gate_mlp = audio[:6]
    # 2.3+: the modulation of the text cross-attention's queries (shift, scale) and its gate.
    text_q = video[6:8] if self.video_cross_attn_adaln else (None, None)
    a_text_q = audio[6:8] if self.audio_cross_attn_adaln else (None, None)
    text_gate = video[8] if self.video_cross_attn_adaln else None
    a_text_gate = audio[8] if self.audio_cross_attn_adaln else None
    perturbation = (
        {"perturbation_mask": perturbation_mask, "all_perturbed": all_perturbed}
        if self.perturbed_attn
        else {}
    )

    # 1. Self-attention
    norm_hidden_states = steps.norm_modulate(
        ops,
        self.norm1,
        hidden_states,
        scale_msa,
        shift_msa,
        quant=_input_format(self.attn1, steps.QKV),
    )
    attn_hidden_states = _attention(
        self.attn1,
        hidden_states=norm_hidden_states,
        encoder_hidden_states=None,
        query_rotary_emb=video_rotary_emb,
        attention_mask=self_attention_mask,
        **perturbation,
    )
    norm_audio_hidden_states = steps.norm_modulate(
        ops,
        self.audio_norm1,
        audio_hidden_states,
        a_scale_msa,
        a_shift_msa,
        quant=_input_format(self.audio_attn1, steps.QKV),
    )
    attn_audio_hidden_states = _attention(
        self.audio_attn1,
        hidden_states=norm_audio_hidden_states,
        encoder_hidden_states=None,
        query_rotary_emb=audio_rotary_emb,
        attention_mask=audio_self_attention_mask,
        **perturbation,
    )

    # 2. Text cross-attention: x + attn * gate with norm2 (2.3+: modulated) in one pass
    hidden_states, norm_hidden_states = _add_norm_maybe_modulated(
        ops,
        self.norm2,
        hidden_states,
        attn_hidden_states,
        gate_msa,
        *text_q,
        quant=_input_format(self.attn2),
    )
    audio_hidden_states, norm_audio_hidden_states = _add_norm_maybe_modulated(
        ops,
        self.audio_norm2,
        audio_hidden_states,
        attn_audio_hidden_states,
        a_gate_msa,
        *a_text_q,
        quant=_input_format(self.audio_attn2),
    )
    if self.cross_attn_adaln:
        encoder_hidden_states = _text_kv(
            self, self.prompt_scale_shift_table, temb_prompt, encoder_hidden_states, batch_size
        )
        audio_encoder_hidden_states = _text_kv(
            self,
            self.audio_prompt_scale_shift_table,
            temb_prompt_audio,
            audio_encoder_hidden_states,
            batch_size,
        )
    attn_hidden_states = _attention(
        self.attn2,
        norm_hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        query_rotary_emb=None,
        attention_mask=encoder_attention_mask,
    )
    attn_audio_hidden_states = _attention(
        self.audio_attn2,
        norm_audio_hidden_states,
        encoder_hidden_states=audio_encoder_hidden_states,
        query_rotary_emb=None,
        attention_mask=audio_encoder_attention_mask,
    )
    # The residuals still to add (x + y * gate), each in the pass of the next norm.
    pending = (attn_hidden_states, text_gate)
    audio_pending = (attn_audio_hidden_states, a_text_gate)

    # 3. Audio-to-video (Q video, K/V audio) and video-to-audio (Q audio, K/V video)
    # cross-attention: one norm per stream, modulated for each attention.
    if use_a2v_cross_attention or use_v2a_cross_attention:
        video_ca = steps.modulation(
            ops, self.video_a2v_cross_attn_scale_shift_table[:4, :], temb_ca_scale_shift, batch_size
        )
        a2v_gate = steps.modulation(
            ops, self.video_a2v_cross_attn_scale_shift_table[4:, :], temb_ca_gate, batch_size
        )[0].squeeze(2)
        audio_ca = steps.modulation(
            ops,
            self.audio_a2v_cross_attn_scale_shift_table[:4, :],
            temb_ca_audio_scale_shift,
            batch_size,
        )
        v2a_gate = steps.modulation(
            ops, self.audio_a2v_cross_attn_scale_shift_table[4:, :], temb_ca_audio_gate, batch_size
        )[0].squeeze(2)
        # (scale, shift) of the a2v and of the v2a attention, of the ones in use, and the format
        # of the rows they feed: a2v takes the video as query and the audio as K/V, v2a the reverse
        used = [i for i, use in ((0, use_a2v_cross_attention), (2, use_v2a_cross_attention)) if use]
        a2v, v2a, kv = self.audio_to_video_attn, self.video_to_audio_attn, ("to_k", "to_v")
        video_quant = {0: _input_format(a2v), 2: _input_format(v2a, kv)}
        audio_quant = {0: _input_format(a2v, kv), 2: _input_format(v2a)}
        hidden_states, video_norms = _add_norms(
            ops,
            self.audio_to_video_norm,
            hidden_states,
            pending,
            [(video_ca[i].squeeze(2), video_ca[i + 1].squeeze(2), video_quant[i]) for i in used],
        )
        audio_hidden_states, audio_norms = _add_norms(
            ops,
            self.video_to_audio_norm,
            audio_hidden_states,
            audio_pending,
            [(audio_ca[i].squeeze(2), audio_ca[i + 1].squeeze(2), audio_quant[i]) for i in used],
        )
        pending = audio_pending = None
        if use_a2v_cross_attention:
            a2v_attn_hidden_states = _attention(
                self.audio_to_video_attn,
                video_norms[0],
                encoder_hidden_states=audio_norms[0],
                query_rotary_emb=ca_video_rotary_emb,
                key_rotary_emb=ca_audio_rotary_emb,
                attention_mask=a2v_cross_attention_mask,
            )
            pending = (a2v_attn_hidden_states, a2v_gate)
        if use_v2a_cross_attention:
            v2a_attn_hidden_states = _attention(
                self.video_to_audio_attn,
                audio_norms[-1],
                encoder_hidden_states=video_norms[-1],
                query_rotary_emb=ca_audio_rotary_emb,
                key_rotary_emb=ca_video_rotary_emb,
                attention_mask=v2a_cross_attention_mask,
            )
            audio_pending = (v2a_attn_hidden_states, v2a_gate)

    # 4. Feed-forward: the pending residual with norm3 + modulation in one pass
    hidden_states, [norm_hidden_states] = _add_norms(
        ops,
        self.norm3,
        hidden_states,
        pending,
        [(scale_mlp, shift_mlp, steps.feed_forward_input_format(self.ff))],
    )
    ff_output = steps.feed_forward(ops, self.ff, norm_hidden_states)
    hidden_states = steps.residual(ops, hidden_states, ff_output, gate_mlp)

    audio_hidden_states, [norm_audio_hidden_states] = _add_norms(
        ops,
        self.audio_norm3,
        audio_hidden_states,
        audio_pending,
        [(a_scale_mlp, a_shift_mlp, steps.feed_forward_input_format(self.audio_ff))],
    )
    audio_ff_output = steps.feed_forward(ops, self.audio_ff, norm_audio_hidden_states)
    audio_hidden_states = steps.residual(ops, audio_hidden_states, audio_ff_output, a_gate_mlp)
    return hidden_states, audio_hidden_states


def _add_norm_maybe_modulated(ops, norm, x, y, gate, shift=None, scale=None, quant=None):
    """h = x + y * gate and norm(h), modulated when shift and scale are given (quant: n as
    QuantRows where the op runs). Returns (h, n)."""
    if scale is None:
        return steps.add_norm(ops, norm, x, y, gate, quant)
    return steps.add_norm_modulate(ops, norm, x, y, scale, shift, gate, quant)


# ------------------------------------------------------------------------------------------------
# Model: the video and audio output norms
# ------------------------------------------------------------------------------------------------
def _model_forward(
    self,
    hidden_states: torch.Tensor,
    audio_hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    audio_encoder_hidden_states: torch.Tensor,
    timestep: torch.LongTensor,
    audio_timestep: torch.LongTensor | None = None,
    sigma: torch.Tensor | None = None,
    audio_sigma: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    audio_encoder_attention_mask: torch.Tensor | None = None,
    num_frames: int | None = None,
    height: int | None = None,
    width: int | None = None,
    fps: float = 24.0,
    audio_num_frames: int | None = None,
    video_coords: torch.Tensor | None = None,
    audio_coords: torch.Tensor | None = None,
    isolate_modalities: bool = False,
    spatio_temporal_guidance_blocks: list[int] | None = None,
    perturbation_mask: torch.Tensor | None = None,
    use_cross_timestep: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    video_self_attention_mask: torch.Tensor | None = None,
    video_keyframes_mask: torch.Tensor | None = None,
    return_dict: bool = True,
):
    """`LTX2VideoTransformer3DModel.forward` (diffusers 0.42.1) with the output norms fused. The
    lines marked `# ours:` differ from diffusers'; every other line is diffusers' code as it is
    (reformatted, its docstring left out; REPRODUCED checks the diffusers side)."""
    from diffusers.models.transformers.transformer_ltx2 import AudioVisualModelOutput  # ours:

    # ours: per-token timesteps take this rank's chunk under context parallelism (no plan entry)
    timestep = local_token_timesteps(timestep, hidden_states.shape[1], self._parallel_config)
    # Determine timestep for audio.
    audio_timestep = audio_timestep if audio_timestep is not None else timestep
    audio_sigma = audio_sigma if audio_sigma is not None else sigma

    # convert encoder_attention_mask to a bias the same way we do for attention_mask
    if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
        encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
        encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

    if audio_encoder_attention_mask is not None and audio_encoder_attention_mask.ndim == 2:
        audio_encoder_attention_mask = (
            1 - audio_encoder_attention_mask.to(audio_hidden_states.dtype)
        ) * -10000.0
        audio_encoder_attention_mask = audio_encoder_attention_mask.unsqueeze(1)

    # Convert video_self_attention_mask from multiplicative mask ([0, 1]) to additive bias form (0 / -10000)
    # matching the encoder_attention_mask convention above. Shape is preserved: (B, T_v, T_v).
    if video_self_attention_mask is not None:
        video_self_attention_mask = (
            1 - video_self_attention_mask.to(hidden_states.dtype)
        ) * -10000.0

    batch_size = hidden_states.size(0)

    # 1. Prepare RoPE positional embeddings
    if video_coords is None:
        video_coords = self.rope.prepare_video_coords(
            batch_size, num_frames, height, width, hidden_states.device, fps=fps
        )
    if audio_coords is None:
        audio_coords = self.audio_rope.prepare_audio_coords(
            batch_size, audio_num_frames, audio_hidden_states.device
        )

    video_rotary_emb = self.rope(video_coords, device=hidden_states.device)
    audio_rotary_emb = self.audio_rope(audio_coords, device=audio_hidden_states.device)

    video_cross_attn_rotary_emb = self.cross_attn_rope(
        video_coords[:, 0:1, :], device=hidden_states.device
    )
    audio_cross_attn_rotary_emb = self.cross_attn_audio_rope(
        audio_coords[:, 0:1, :], device=audio_hidden_states.device
    )

    # 2. Patchify input projections
    hidden_states = self.proj_in(hidden_states)
    audio_hidden_states = self.audio_proj_in(audio_hidden_states)

    # 2.1. Mark tokens whose latent encodes a single pixel frame (causal first frame, generated keyframe slots).
    if self.config.use_keyframes_abs_pos_embedding and video_keyframes_mask is not None:
        # ours: this rank's chunk of the mask under context parallelism (the plan cannot split
        # an optional input)
        if video_keyframes_mask.shape[1] != hidden_states.shape[1]:
            video_keyframes_mask = shard_sequence(video_keyframes_mask, 1, self._parallel_config)
        marker = (video_keyframes_mask > 0).to(dtype=hidden_states.dtype)
        hidden_states = hidden_states + marker * self.keyframes_abs_pos_embedding.to(
            dtype=hidden_states.dtype
        )

    # 3. Prepare timestep embeddings and modulation parameters
    timestep_cross_attn_gate_scale_factor = (
        self.config.cross_attn_timestep_scale_multiplier / self.config.timestep_scale_multiplier
    )

    # 3.1. Prepare global modality (video and audio) timestep embedding and modulation parameters
    # temb is used in the transformer blocks (as expected), while embedded_timestep is used for the output layer
    # modulation with scale_shift_table (and similarly for audio)
    temb, embedded_timestep = self.time_embed(
        timestep.flatten(),
        batch_size=batch_size,
        hidden_dtype=hidden_states.dtype,
    )
    temb = temb.view(batch_size, -1, temb.size(-1))
    embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))

    temb_audio, audio_embedded_timestep = self.audio_time_embed(
        audio_timestep.flatten(),
        batch_size=batch_size,
        hidden_dtype=audio_hidden_states.dtype,
    )
    temb_audio = temb_audio.view(batch_size, -1, temb_audio.size(-1))
    audio_embedded_timestep = audio_embedded_timestep.view(
        batch_size, -1, audio_embedded_timestep.size(-1)
    )

    if self.prompt_modulation and self.config.use_prompt_adaln_single:
        # LTX-2.3
        temb_prompt, _ = self.prompt_adaln(
            sigma.flatten(), batch_size=batch_size, hidden_dtype=hidden_states.dtype
        )
        temb_prompt_audio, _ = self.audio_prompt_adaln(
            audio_sigma.flatten(), batch_size=batch_size, hidden_dtype=audio_hidden_states.dtype
        )
        temb_prompt = temb_prompt.view(batch_size, -1, temb_prompt.size(-1))
        temb_prompt_audio = temb_prompt_audio.view(batch_size, -1, temb_prompt_audio.size(-1))
    else:
        temb_prompt = temb_prompt_audio = None

    # 3.2. Prepare global modality cross attention modulation parameters
    video_ca_timestep = audio_sigma.flatten() if use_cross_timestep else timestep.flatten()
    video_cross_attn_scale_shift, _ = self.av_cross_attn_video_scale_shift(
        video_ca_timestep,
        batch_size=batch_size,
        hidden_dtype=hidden_states.dtype,
    )
    video_cross_attn_a2v_gate, _ = self.av_cross_attn_video_a2v_gate(
        video_ca_timestep * timestep_cross_attn_gate_scale_factor,
        batch_size=batch_size,
        hidden_dtype=hidden_states.dtype,
    )
    video_cross_attn_scale_shift = video_cross_attn_scale_shift.view(
        batch_size, -1, video_cross_attn_scale_shift.shape[-1]
    )
    video_cross_attn_a2v_gate = video_cross_attn_a2v_gate.view(
        batch_size, -1, video_cross_attn_a2v_gate.shape[-1]
    )

    audio_ca_timestep = sigma.flatten() if use_cross_timestep else audio_timestep.flatten()
    audio_cross_attn_scale_shift, _ = self.av_cross_attn_audio_scale_shift(
        audio_ca_timestep,
        batch_size=batch_size,
        hidden_dtype=audio_hidden_states.dtype,
    )
    audio_cross_attn_v2a_gate, _ = self.av_cross_attn_audio_v2a_gate(
        audio_ca_timestep * timestep_cross_attn_gate_scale_factor,
        batch_size=batch_size,
        hidden_dtype=audio_hidden_states.dtype,
    )
    audio_cross_attn_scale_shift = audio_cross_attn_scale_shift.view(
        batch_size, -1, audio_cross_attn_scale_shift.shape[-1]
    )
    audio_cross_attn_v2a_gate = audio_cross_attn_v2a_gate.view(
        batch_size, -1, audio_cross_attn_v2a_gate.shape[-1]
    )

    # 4. Prepare prompt embeddings (LTX-2.0)
    if self.config.use_prompt_embeddings:
        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

        audio_encoder_hidden_states = self.audio_caption_projection(audio_encoder_hidden_states)
        audio_encoder_hidden_states = audio_encoder_hidden_states.view(
            batch_size, -1, audio_hidden_states.size(-1)
        )

    # 5. Run transformer blocks
    spatio_temporal_guidance_blocks = spatio_temporal_guidance_blocks or []
    if len(spatio_temporal_guidance_blocks) > 0 and perturbation_mask is None:
        # If STG is being used and perturbation_mask is not supplied, default to perturbing all batch elements.
        perturbation_mask = torch.zeros((batch_size,))
    if perturbation_mask is not None and perturbation_mask.ndim == 1:
        perturbation_mask = perturbation_mask[
            :, None, None
        ]  # unsqueeze to 3D to broadcast with hidden_states
    all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
    stg_blocks = set(spatio_temporal_guidance_blocks)

    for block_idx, block in enumerate(self.transformer_blocks):
        block_perturbation_mask = perturbation_mask if block_idx in stg_blocks else None
        block_all_perturbed = all_perturbed if block_idx in stg_blocks else False

        if torch.is_grad_enabled() and self.gradient_checkpointing:
            hidden_states, audio_hidden_states = self._gradient_checkpointing_func(
                block,
                hidden_states,
                audio_hidden_states,
                encoder_hidden_states,
                audio_encoder_hidden_states,
                temb,
                temb_audio,
                video_cross_attn_scale_shift,
                audio_cross_attn_scale_shift,
                video_cross_attn_a2v_gate,
                audio_cross_attn_v2a_gate,
                temb_prompt,
                temb_prompt_audio,
                video_rotary_emb,
                audio_rotary_emb,
                video_cross_attn_rotary_emb,
                audio_cross_attn_rotary_emb,
                encoder_attention_mask,
                audio_encoder_attention_mask,
                video_self_attention_mask,  # self_attention_mask (video-only)
                None,  # audio_self_attention_mask
                None,  # a2v_cross_attention_mask
                None,  # v2a_cross_attention_mask
                not isolate_modalities,  # use_a2v_cross_attention
                not isolate_modalities,  # use_v2a_cross_attention
                block_perturbation_mask,
                block_all_perturbed,
            )
        else:
            hidden_states, audio_hidden_states = block(
                hidden_states=hidden_states,
                audio_hidden_states=audio_hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                audio_encoder_hidden_states=audio_encoder_hidden_states,
                temb=temb,
                temb_audio=temb_audio,
                temb_ca_scale_shift=video_cross_attn_scale_shift,
                temb_ca_audio_scale_shift=audio_cross_attn_scale_shift,
                temb_ca_gate=video_cross_attn_a2v_gate,
                temb_ca_audio_gate=audio_cross_attn_v2a_gate,
                temb_prompt=temb_prompt,
                temb_prompt_audio=temb_prompt_audio,
                video_rotary_emb=video_rotary_emb,
                audio_rotary_emb=audio_rotary_emb,
                ca_video_rotary_emb=video_cross_attn_rotary_emb,
                ca_audio_rotary_emb=audio_cross_attn_rotary_emb,
                encoder_attention_mask=encoder_attention_mask,
                audio_encoder_attention_mask=audio_encoder_attention_mask,
                self_attention_mask=video_self_attention_mask,
                audio_self_attention_mask=None,
                a2v_cross_attention_mask=None,
                v2a_cross_attention_mask=None,
                use_a2v_cross_attention=not isolate_modalities,
                use_v2a_cross_attention=not isolate_modalities,
                perturbation_mask=block_perturbation_mask,
                all_perturbed=block_all_perturbed,
            )

    # 6. Output layers (including unpatchification)
    ops = self._ltx_kernels_ops  # ours:
    scale_shift_values = self.scale_shift_table[None, None] + embedded_timestep[:, :, None]
    shift, scale = scale_shift_values[:, :, 0], scale_shift_values[:, :, 1]
    # ours: LayerNorm + modulation in one pass (diffusers: norm_out, then * (1 + scale) + shift)
    hidden_states = steps.norm_modulate(ops, self.norm_out, hidden_states, scale, shift)
    output = self.proj_out(hidden_states)

    audio_scale_shift_values = (
        self.audio_scale_shift_table[None, None] + audio_embedded_timestep[:, :, None]
    )
    audio_shift, audio_scale = audio_scale_shift_values[:, :, 0], audio_scale_shift_values[:, :, 1]
    audio_hidden_states = steps.norm_modulate(  # ours: the same for the audio
        ops, self.audio_norm_out, audio_hidden_states, audio_scale, audio_shift
    )
    audio_output = self.audio_proj_out(audio_hidden_states)

    if not return_dict:
        return (output, audio_output)
    return AudioVisualModelOutput(sample=output, audio_sample=audio_output)


model_forward = lora_scaled(_model_forward)


# ------------------------------------------------------------------------------------------------
# Patch functions
# ------------------------------------------------------------------------------------------------
BLOCK = "LTX2VideoTransformerBlock"
MODEL = "LTX2VideoTransformer3DModel (output norms)"
SELF_ATTN = "LTX2Attention (self: q/k norm + RoPE)"
TEXT_ATTN = "LTX2Attention (text cross: q/k norm)"
AV_ATTN = "LTX2Attention (audio-video cross: q/k norm + RoPE per tensor)"
GATES = "LTX2Attention per-head gates"
TEXT_KV = "LTX2VideoTransformerBlock text K/V modulation"
_ATTENTION = {
    "attn1": SELF_ATTN,
    "audio_attn1": SELF_ATTN,
    "attn2": TEXT_ATTN,
    "audio_attn2": TEXT_ATTN,
    "audio_to_video_attn": AV_ATTN,
    "video_to_audio_attn": AV_ATTN,
}
# diffusers' processor class name -> ours
_PROCESSORS = {
    "LTX2AudioVideoAttnProcessor": LTX2KernelsAttnProcessor,
    "LTX2PerturbedAttnProcessor": LTX2KernelsPerturbedAttnProcessor,
}


def _patch_attention(name: str, attn, kind: str, cp_role: str, injector) -> None:
    processor = attn.processor
    ours = _PROCESSORS.get(type(processor).__name__)
    if ours is None:
        injector.skip(
            kind,
            name,
            f"custom processor {type(processor).__name__} kept (LoRA/IP adapters or user code)",
        )
    elif reason := REPRODUCED.unpatched(type(processor), "__call__"):
        injector.skip(kind, name, reason)
    else:
        injector.set_processor(name, attn, ours(), kind)
        attn.processor.cp_role = cp_role
    if attn.to_gate_logits is not None:
        injector.skip(
            GATES, name, "2 * sigmoid(to_gate_logits(x)) has no kernel; runs as in diffusers"
        )


#: The block's Linears that run in FP8 with fp8=True, per preset (module docstring), and the
#: default: "all", measured (H100, 2x6144 video tokens with audio, one step against our bf16
#: kernels: ffn+self_attn 1.27x, all 1.38x; relative L2 from eager 1.34e-2 and 2.13e-2, inside
#: the 4.3e-2 to 5.8e-2 of torchao's float8 rowwise on Wan 14B and LTX-Video 13B; peak memory
#: 0.71x and 0.60x; benchmarks/NOTES.md).
FP8_PRESETS = fp8_presets(
    (*ff_projections("ff"), *ff_projections("audio_ff")),
    (*attention_projections("attn1"), *attention_projections("audio_attn1")),
    (
        *attention_projections("attn2", ("to_q", "to_out.0")),
        *attention_projections("audio_attn2", ("to_q", "to_out.0")),
        *attention_projections("audio_to_video_attn"),
        *attention_projections("video_to_audio_attn"),
    ),
)
FP8_DEFAULT = "all"


def patch_block(name: str, block, injector) -> None:
    reason = REPRODUCED.unpatched(type(block), "forward")
    if reason:
        injector.skip(BLOCK, name, reason)
    else:
        injector.swap_forward(name, block, block_forward, BLOCK)
        injector.fp8_linears(name, block, "LTX-2", FP8_PRESETS, FP8_DEFAULT)
        if block.cross_attn_adaln:
            injector.skip(
                TEXT_KV,
                name,
                "text * (1 + scale) + shift (no norm) has no kernel; runs as in diffusers",
            )
        for ff_name in ("ff", "audio_ff"):
            reason = steps.feed_forward_fusable(getattr(block, ff_name))
            if reason:
                injector.skip(f"{BLOCK} feed-forward", f"{name}.{ff_name}", reason)
    for attn_name, kind in _ATTENTION.items():
        attn = getattr(block, attn_name)
        _patch_attention(f"{name}.{attn_name}", attn, kind, CP_ROLES[attn_name], injector)


def patch_model(name: str, model, injector) -> None:
    reason = REPRODUCED.unpatched(type(model), "forward")
    if reason:
        injector.skip(MODEL, name, reason)
    else:
        injector.swap_forward(
            name, model, model_forward, MODEL, required=False, replan=context_parallel_plan
        )


PATCHERS = {
    "LTX2VideoTransformerBlock": patch_block,
    "LTX2VideoTransformer3DModel": patch_model,
}
