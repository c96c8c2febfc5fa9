"""HunyuanVideo and HunyuanVideo-1.5 (diffusers `transformer_hunyuan_video.py`,
`transformer_hunyuan_video15.py`; FramePack reuses HunyuanVideo's blocks) on the fused ops.

AdaLN modules (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous): `adaln.py`.
Everything runs in the model dtype (upcast=False). Sequences are image rows first, text last.
Double block (`HunyuanVideoTransformerBlock`, `HunyuanVideo15TransformerBlock`: the same code),
for the image and the text stream each:
  attention: per-head q/k RMSNorm              -> rmsnorm (one launch per tensor)
             RoPE of the image q/k             -> rope (text rows are not rotated)
  x + gate * attn, norm2 + modulation          -> add_layernorm_modulate (one pass emits both)
  FF up-projection + GELU-tanh                 -> linear_gelu
  x + gate * ff                                -> gated_residual
Single block (`HunyuanVideoSingleTransformerBlock`, on cat(image, text)):
  proj_mlp + GELU-tanh                         -> linear_gelu
  attention: q/k RMSNorm of every row          -> rmsnorm
             RoPE of the image rows only       -> rope
  x + gate * proj_out(cat(attn, mlp))          -> gated_residual
Patch embedding (`HunyuanVideoPatchEmbed`, `HunyuanVideo15PatchEmbed`): returns its transposed
conv output contiguous, so block 0 gets rows like the other blocks (fused, and no second
compilation of it under compile_repeated_blocks).

The q/k norm is diffusers' RMSNorm, which rounds twice with a 16-bit weight
(`(x * rsqrt).to(w.dtype) * w`); qk_rmsnorm_rope rounds once (torch.nn.RMSNorm), one ulp apart at
some elements, so the norm is the rmsnorm op and the rotation the rope op.
Attention masks (they hide padded text keys) become key lengths (attention.py): the padded keys
are dropped where every batch element has as many ("drop_padded_keys"), otherwise the lengths go
to our attention op (inject_optimized_kernels' attention=) or become a broadcast [B, 1, 1, S] key
mask; HunyuanVideo-1.5's [B, 1, S, S] pair mask is never built (its padded query
rows come out zero, as SDPA gives them under it). Under context parallelism (HunyuanVideo-1.5,
context_parallel_plan: diffusers has none) the image rows are split and the text is whole on every
GPU; the attention runs Ulysses with the text rows replicated and the whole sequence's key lengths.
FP8 (fp8=True; FP8_PRESETS, default "all", for the double blocks of HunyuanVideo-1.5
and HunyuanVideo): the image stream's FF ("ffn") and its q/k/v and out ("ffn+self_attn"); "all"
adds the text stream's (its q/k/v, out and FF: as large as the image stream's, on a few hundred
tokens: the weight memory more than the time). The AdaLN linears, embedders and proj_in/proj_out
stay bf16. norm1 (norm1_context: the AdaLayerNormZero, adaln.call_norm) hands the image (text)
q/k/v their input as FP8 rows, norm2 (norm2_context) the FF, whose GELU hands them to the down
projection; the attention outputs are quantized by to_out / to_add_out (one pass each).
HunyuanVideo's single blocks stay bf16.
Left stock: the token refiner and the text/image projections (a few hundred text tokens, once per
forward); the I2V token-replace blocks (`HunyuanVideoTokenReplace*`: first-frame rows with their
own modulation) run the diffusers code and are reported as skipped; their attention is patched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import adaln, quant, recompute, steps
from .attention import attend, our_attention, padded_key_lengths
from .context_parallel import context_parallel_config
from .diffusers_compat import Reproduced, diffusers_modules, rope_bshd
from .injector import FusedAttnProcessor
from .linears import attention_projections, ff_projections, fp8_presets

#: The diffusers code the patches reproduce (diffusers_compat.Reproduced); FramePack
#: (transformer_hunyuan_video_framepack.py) imports transformer_hunyuan_video's blocks.
REPRODUCED = Reproduced(
    "HunyuanVideo",
    diffusers_modules(
        "transformers.transformer_hunyuan_video", "transformers.transformer_hunyuan_video15"
    ),
    {
        "HunyuanVideoTransformerBlock.forward": "9cbe883692b53bf5",
        "HunyuanVideoSingleTransformerBlock.forward": "3c49d97d8a76da0b",
        "HunyuanVideo15TransformerBlock.forward": "9cbe883692b53bf5",
        "HunyuanVideoPatchEmbed.forward": "cc038fb47212815d",
        "HunyuanVideo15PatchEmbed.forward": "cc038fb47212815d",
        "HunyuanVideoAttnProcessor2_0.__call__": "6d78c997f1d3d454",
        "HunyuanVideo15AttnProcessor2_0.__call__": "9525039276556a04",
        # not patched: the forward context_parallel_plan's plan is written for
        "HunyuanVideo15Transformer3DModel.forward": "1387c21027607822",
    },
)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
def _heads(attn, t):
    return t.unflatten(2, (attn.heads, -1))


def _norm(ops, norm, x):
    return x if norm is None else steps.diffusers_rmsnorm(ops, norm, x)


def _qk_norm_rope(ops, norm_q, norm_k, query, key, cos_sin=None, rows=None):
    """The per-head q/k norm, then RoPE of the first `rows` rows (all rows by default; the single
    block's text rows are not rotated), as diffusers slices, rotates and concatenates."""
    query, key = _norm(ops, norm_q, query), _norm(ops, norm_k, key)
    if cos_sin is None:
        return query, key
    if rows is None:
        return steps.qk_norm_rope(
            ops, None, None, query, key, cos_sin, rope_bshd, across_heads=False
        )
    image_query, image_key = steps.qk_norm_rope(
        ops,
        None,
        None,
        query[:, :rows],
        key[:, :rows],
        cos_sin,
        rope_bshd,
        across_heads=False,
    )
    query = torch.cat([image_query, query[:, rows:]], dim=1)
    key = torch.cat([image_key, key[:, rows:]], dim=1)
    return query, key


def _key_lengths(ops, valid):
    """The key lengths of a boolean key mask ([B, S] or [B, 1, 1, S]) when "drop_padded_keys" is
    enabled and every batch element's valid keys lead (attention.padded_key_lengths), else
    None."""
    return padded_key_lengths(valid) if "drop_padded_keys" in ops else None


class HunyuanVideoKernelsAttnProcessor(FusedAttnProcessor):
    """`HunyuanVideoAttnProcessor2_0` (double and single blocks) with the q/k norms and the RoPE
    on our ops. Same signature (Attention filters its kwargs by it); backend and parallel config
    are copied from the replaced processor."""

    def _attend(self, query, key, value, attention_mask):
        """HunyuanVideo's attention: the model's [B, 1, 1, S] key mask (image rows and the
        unpadded text) as key lengths (attend: the padded keys dropped where every batch element
        has as many, else the lengths to our attention op or the same key mask). Under context
        parallelism (a user's plan: diffusers has none) the mask, to diffusers' parallel
        attention as in stock."""
        key_mask = (
            attention_mask is not None
            and attention_mask.dtype == torch.bool
            and attention_mask.shape[1:3] == (1, 1)
            and context_parallel_config(self._parallel_config) is None
        )
        lengths = _key_lengths(self.ops, attention_mask) if key_mask else None
        if lengths is not None:
            return attend(self, query, key, value, key_lengths=lengths)
        return attend(
            self, query, key, value, mask=attention_mask, parallel_config=self._parallel_config
        )

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        ops = self.ops
        single = attn.add_q_proj is None and encoder_hidden_states is not None
        if single:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query, key, value = (
            _heads(attn, projection)
            for projection in steps.fused_projections(ops, attn, hidden_states)
        )
        image_rows = query.shape[1] - encoder_hidden_states.shape[1] if single else None
        query, key = _qk_norm_rope(
            ops, attn.norm_q, attn.norm_k, query, key, image_rotary_emb, image_rows
        )
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            encoder_query, encoder_key, encoder_value = (
                _heads(attn, projection)
                for projection in steps.fused_projections(
                    ops, attn, encoder_hidden_states, "added_qkv", steps.ADDED_QKV
                )
            )
            encoder_query, encoder_key = _qk_norm_rope(
                ops, attn.norm_added_q, attn.norm_added_k, encoder_query, encoder_key
            )
            query = torch.cat([query, encoder_query], dim=1)
            key = torch.cat([key, encoder_key], dim=1)
            value = torch.cat([value, encoder_value], dim=1)

        hidden_states = self._attend(query, key, value, attention_mask).flatten(2, 3)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            hidden_states, encoder_hidden_states = (
                hidden_states[:, :-text_len],
                hidden_states[:, -text_len:],
            )
            if getattr(attn, "to_out", None) is not None:
                hidden_states = attn.to_out[1](steps.linear(ops, attn.to_out[0], hidden_states))
            if getattr(attn, "to_add_out", None) is not None:
                encoder_hidden_states = steps.linear(ops, attn.to_add_out, encoder_hidden_states)
        return hidden_states, encoder_hidden_states


class HunyuanVideo15KernelsAttnProcessor(HunyuanVideoKernelsAttnProcessor):
    """`HunyuanVideo15AttnProcessor2_0`: the double path, attending as diffusers' [B, 1, S, S]
    mask of valid (image and unpadded text) query/key pairs does, without building it."""

    def _attend(self, query, key, value, attention_mask):
        """diffusers repeats the [B, S] row mask to [B, 1, S, S] and ANDs it with its transpose:
        a valid query attends to the valid keys, a padded one to none (SDPA gives it zeros). The
        same here from the row mask: where every batch element has the same number of leading
        valid rows (the model puts its padded text last), the padded queries and keys are
        dropped and their output rows are zeros; otherwise the per-batch key lengths (attend:
        our attention op takes them, else a broadcast [B, 1, 1, S] key mask; where they cannot
        be read, that key mask), the padded query rows set to zero. Under torch.compile
        ("drop_padded_keys" enabled), where the lengths cannot be read on the host, an attention
        op of ours (attention.our_attention, instead_of_key_mask: "ltx_kernels" or "int8" where it
        applies, and "auto" on a Hopper GPU, where the key mask to cuDNN cost 1.4x the op) takes
        them as a tensor counted on the device: the model puts every element's valid rows first
        (its forward reorders the text valid-first), which an asynchronous check asserts (a mask
        whose valid keys do not lead fails loudly, never attends wrongly). (At 480p, 121 frames,
        1x16x49290 with 700 padded keys on an H100: dense mask 77.3 ms, key mask 47.8, dropped
        33.1.)"""
        seq_len, image_rows = query.shape[1], query.shape[1] - attention_mask.shape[1]
        cp_config = context_parallel_config(self._parallel_config)
        if cp_config is not None:
            return self._attend_context_parallel(query, key, value, attention_mask, cp_config)
        text_lengths = _key_lengths(self.ops, attention_mask.bool())
        if text_lengths is not None and len(set(text_lengths)) == 1:
            rows = image_rows + text_lengths[0]
            out = attend(self, query[:, :rows], key, value, key_lengths=(rows,) * len(query))
            return F.pad(out, (0, 0, 0, 0, 0, seq_len - rows))
        valid = F.pad(attention_mask, (image_rows, 0), value=True).bool()
        compiled = torch.compiler.is_compiling() and "drop_padded_keys" in self.ops
        ours = (
            our_attention(self, query, key, value, instead_of_key_mask=True) if compiled else None
        )
        if text_lengths is None and ours is not None:
            lengths = valid.sum(-1, dtype=torch.int32)
            leading = torch.arange(seq_len, device=valid.device) < lengths[:, None]
            torch._assert_async(
                (leading == valid).all(),
                "ltx_kernels: HunyuanVideo-1.5's text mask must have its valid keys first",
            )
            out = ours(query, key, value, lengths)
        elif text_lengths is not None:
            lengths = tuple(image_rows + n for n in text_lengths)
            out = attend(self, query, key, value, key_lengths=lengths)
        else:
            out = attend(
                self,
                query,
                key,
                value,
                mask=valid[:, None, None, :],
                parallel_config=self._parallel_config,
            )
        return out.masked_fill(~valid[:, :, None, None], 0)

    def _attend_context_parallel(self, query, key, value, attention_mask, cp_config):
        """Under context parallelism (context_parallel_plan): q/k/v are this rank's image rows and
        the whole text. Ulysses with the text rows replicated (attention.attend): each rank
        attends its heads over the whole sequence, image then text as on one GPU, with the
        per-element key lengths of the whole sequence; the padded query rows set to zero."""
        text = attention_mask.shape[1]
        image_rows = query.shape[1] - text  # this rank's
        valid = attention_mask.bool()
        lengths = padded_key_lengths(valid)
        if lengths is None:
            raise NotImplementedError(
                "ltx_kernels: HunyuanVideo-1.5 under context parallelism attends with the text's "
                "key lengths, which cannot be read here (under torch.compile or CUDA-graph "
                "capture, or a text mask whose valid tokens do not lead); run the attention eager"
            )
        image = image_rows * cp_config.ulysses_degree  # the whole sequence's image rows
        out = attend(
            self,
            query,
            key,
            value,
            key_lengths=tuple(image + length for length in lengths),
            parallel_config=self._parallel_config,
            replicated=text,
        )
        valid = F.pad(valid, (image_rows, 0), value=True)
        return out.masked_fill(~valid[:, :, None, None], 0)


def context_parallel_plan(model):
    """HunyuanVideo-1.5's context-parallel plan (diffusers 0.42 has none), for
    `model.enable_parallelism(config=..., cp_plan=context_parallel_plan(model))` on an injected
    model: the image tokens (the patch embedding's output) and their RoPE tables are split over
    the GPUs and gathered at proj_out; the text stays whole on every GPU (its stream runs on
    each), and the attention attends the whole sequence per head group (_attend_context_parallel:
    Ulysses only). Raises unless every block's attention runs our processor (stock diffusers'
    would attend a rank's chunk as if it were the sequence)."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    reason = REPRODUCED.unpatched(type(model), "forward")
    if reason:
        raise RuntimeError(f"ltx_kernels: no HunyuanVideo-1.5 context-parallel plan: {reason}")
    stock = [
        name
        for name, block in model.named_modules()
        if type(block).__name__ == "HunyuanVideo15TransformerBlock"
        and not isinstance(block.attn.processor, HunyuanVideo15KernelsAttnProcessor)
    ]
    if stock:
        raise RuntimeError(
            f"ltx_kernels: HunyuanVideo-1.5 context parallelism needs the injected attention "
            f"processors (inject_optimized_kernels first); {stock[0]} runs "
            f"{type(model.get_submodule(stock[0]).attn.processor).__name__}"
        )
    rows = ContextParallelInput(split_dim=0, expected_dims=2, split_output=True)  # RoPE [S, r]
    return {
        "x_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "rope": {0: rows, 1: rows},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


# ------------------------------------------------------------------------------------------------
# Blocks
# ------------------------------------------------------------------------------------------------
def _qkv_input_format(attn, names=steps.QKV) -> str | None:
    """The format in which attn's image input (text input: names = steps.ADDED_QKV) may come as
    quantized rows (None: a tensor): our processor, and the one those q/k/v take
    (quant.input_format)."""
    if not isinstance(attn.processor, HunyuanVideoKernelsAttnProcessor):
        return None
    return quant.input_format(*(getattr(attn, name) for name in names), through=attn)


@recompute.scoped
def double_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    freqs_cis: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args,
    **kwargs,
):
    """`HunyuanVideoTransformerBlock.forward` (= `HunyuanVideo15TransformerBlock.forward`) on the
    fused ops (same arguments, same rounding points). Returns (hidden_states, encoder_states).
    With FP8 image q/k/v, norm1 hands them its output as FP8 rows."""
    ops = self._ltx_kernels_ops
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = adaln.call_norm(
        self.norm1, hidden_states, emb=temb, quant=_qkv_input_format(self.attn)
    )
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = adaln.call_norm(
        self.norm1_context,
        encoder_hidden_states,
        emb=temb,
        quant=_qkv_input_format(self.attn, steps.ADDED_QKV),
    )
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        attention_mask=attention_mask,
        image_rotary_emb=freqs_cis,
    )

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
    return hidden_states, encoder_hidden_states


@recompute.scoped
def single_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    *args,
    **kwargs,
):
    """`HunyuanVideoSingleTransformerBlock.forward` on the fused ops (same arguments, rounding)."""
    ops = self._ltx_kernels_ops
    text_seq_length = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)

    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = steps.linear_act(ops, self.proj_mlp, self.act_mlp, norm_hidden_states)
    attn_output, context_attn_output = self.attn(
        hidden_states=norm_hidden_states[:, :-text_seq_length],
        encoder_hidden_states=norm_hidden_states[:, -text_seq_length:],
        attention_mask=attention_mask,
        image_rotary_emb=image_rotary_emb,
    )
    attn_output = torch.cat([attn_output, context_attn_output], dim=1)

    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    hidden_states = steps.residual(ops, residual, self.proj_out(hidden_states), gate[:, None])
    return hidden_states[:, :-text_seq_length], hidden_states[:, -text_seq_length:]


def patch_embed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """`HunyuanVideo(15)PatchEmbed.forward` with a contiguous [B, N, C] output (diffusers returns
    the transposed view of the conv output; same values)."""
    return self.proj(hidden_states).flatten(2).transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------------------
# Patch functions
# ------------------------------------------------------------------------------------------------
DOUBLE_ATTN = "HunyuanVideo Attention (double: q/k norm + RoPE on image)"
SINGLE_ATTN = "HunyuanVideo Attention (single: q/k norm + RoPE on image rows)"
V15_ATTN = "HunyuanVideo-1.5 Attention (q/k norm + RoPE on image)"
PATCH_EMBED = "HunyuanVideo patch embedding (contiguous output)"


def _patch_attention(name: str, attn, kind: str, injector, v15: bool = False) -> None:
    stock = "HunyuanVideo15AttnProcessor2_0" if v15 else "HunyuanVideoAttnProcessor2_0"
    if injector.has_stock_processor(
        name, attn, stock, kind, "LoRA/IP adapters or user code", is_stock=REPRODUCED.is_stock
    ):
        processor = HunyuanVideo15KernelsAttnProcessor if v15 else HunyuanVideoKernelsAttnProcessor
        injector.set_processor(name, attn, processor(), kind)


def _report_unfused_activations(name: str, block, kind: str, injector) -> None:
    if hasattr(block, "ff"):  # double block
        for ff_name in ("ff", "ff_context"):
            reason = steps.feed_forward_fusable(getattr(block, ff_name))
            if reason:
                injector.skip(f"{kind} feed-forward", f"{name}.{ff_name}", reason)
    else:
        reason = steps.linear_act_fusable(block.act_mlp)
        if reason:
            injector.skip(f"{kind} MLP", f"{name}.act_mlp", reason)


#: The double block's Linears that run in FP8 with fp8=True, per preset (module docstring), and
#: the default: "all", measured (HunyuanVideo-1.5 480p, H100, one step against our bf16 kernels:
#: 2442 ms -> ffn+self_attn 2303, all 2295; relative L2 from eager 1.22e-2 for both; peak memory
#: 0.86x and 0.71x; benchmarks/NOTES.md).
FP8_PRESETS = fp8_presets(
    ff_projections("ff"),
    attention_projections("attn"),
    (
        *attention_projections("attn", (*steps.ADDED_QKV, "to_add_out")),
        *ff_projections("ff_context"),
    ),
)
FP8_DEFAULT = "all"


def _block_patcher(forward, attn_kind: str, v15: bool = False, fp8: bool = False):
    """Patch function of a block class; forward None: the block stays stock (token replace),
    only its attention is patched; fp8: its FP8_PRESETS Linears run in FP8 with fp8=True."""

    def patch(name: str, block, injector) -> None:
        kind = type(block).__name__
        reason = REPRODUCED.unpatched(type(block), "forward")
        if reason:
            injector.skip(kind, name, reason)
            return
        if forward is None:
            injector.skip(
                kind,
                name,
                "first-frame token-replace modulation not mapped: the block runs the diffusers "
                "code (its attention is patched)",
            )
        else:
            injector.swap_forward(name, block, forward, kind)
            if fp8:
                injector.fp8_linears(name, block, "HunyuanVideo", FP8_PRESETS, FP8_DEFAULT)
            _report_unfused_activations(name, block, kind, injector)
        _patch_attention(f"{name}.attn", block.attn, attn_kind, injector, v15)

    return patch


def patch_embed(name: str, module, injector) -> None:
    reason = REPRODUCED.unpatched(type(module), "forward")
    if reason:
        injector.skip(PATCH_EMBED, name, reason)
    else:
        injector.swap_forward(name, module, patch_embed_forward, PATCH_EMBED, required=False)


PATCHERS = {
    "HunyuanVideoTransformerBlock": _block_patcher(double_block_forward, DOUBLE_ATTN, fp8=True),
    "HunyuanVideoSingleTransformerBlock": _block_patcher(single_block_forward, SINGLE_ATTN),
    "HunyuanVideo15TransformerBlock": _block_patcher(
        double_block_forward, V15_ATTN, v15=True, fp8=True
    ),
    "HunyuanVideoTokenReplaceTransformerBlock": _block_patcher(None, DOUBLE_ATTN),
    "HunyuanVideoTokenReplaceSingleTransformerBlock": _block_patcher(None, SINGLE_ATTN),
    "HunyuanVideoPatchEmbed": patch_embed,
    "HunyuanVideo15PatchEmbed": patch_embed,
}
