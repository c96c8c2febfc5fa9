"""The AdaLN norm modules of diffusers (`models/normalization.py`) on the fused ops. FLUX, SD3 and
many other diffusers transformers share them; each is patched itself, wherever it appears.

AdaLayerNormZero / AdaLayerNormZeroSingle / AdaLayerNormContinuous: norm + modulation
                                -> layernorm_modulate (rmsnorm_modulate for a diffusers RMSNorm)
SD35AdaLayerNormZeroX (SD3.5's dual-attention layers): the one norm with its two modulations
                                -> layernorm_modulate twice

Quantized rows: a block whose AdaLayerNormZero / AdaLayerNormZeroSingle output feeds only modules
taking quantized rows (FLUX's image stream with fp8=True) calls it through `call_norm(...,
quant=format)`: the normed output then comes as QuantRows from the quantized form of the op, in
the same pass.
"""

from __future__ import annotations

import torch

from . import steps
from .diffusers_compat import Reproduced, diffusers_modules
from .module_checks import has_hooks

#: The diffusers code the patches reproduce (diffusers_compat.Reproduced).
REPRODUCED = Reproduced(
    "AdaLN",
    diffusers_modules("normalization"),
    {
        "AdaLayerNormZero.forward": "51382d7ba9537d28",
        "AdaLayerNormZeroSingle.forward": "b33be1820cb44f10",
        "AdaLayerNormContinuous.forward": "1b32b8d4f70c2ca6",
        "SD35AdaLayerNormZeroX.forward": "035d8c5960425428",
    },
)


# ------------------------------------------------------------------------------------------------
# n = norm(x) * (1 + scale) + shift, with scale/shift chunks of Linear(SiLU(emb))
# ------------------------------------------------------------------------------------------------
def _modulate(module, x, emb, scale, shift, quant: str | None = None):
    """steps.norm_modulate for [B, S, D] x and a per-sample [B, k*D] embedding; other layouts run
    the diffusers expression (no ops)."""
    ops = module._ltx_kernels_ops if x.dim() == 3 and emb.dim() == 2 else frozenset()
    return steps.norm_modulate(ops, module.norm, x, scale[:, None], shift[:, None], quant)


def ada_norm_zero_forward(
    self,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
    *,
    quant: str | None = None,
):
    """`AdaLayerNormZero.forward` with the norm and modulation fused (quant: call_norm)."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = _modulate(self, x, emb, scale_msa, shift_msa, quant)
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def ada_norm_zero_single_forward(
    self, x: torch.Tensor, emb: torch.Tensor | None = None, *, quant: str | None = None
):
    """`AdaLayerNormZeroSingle.forward` with the norm and modulation fused (quant: call_norm)."""
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    return _modulate(self, x, emb, scale_msa, shift_msa, quant), gate_msa


def call_norm(norm, x: torch.Tensor, *, quant: str | None, **kwargs):
    """norm(x, **kwargs) of an AdaLayerNormZero or AdaLayerNormZeroSingle. quant (a format: its
    normed output feeds only modules taking it, quant.input_format): that output as QuantRows (its
    other outputs as they are) when norm runs our forward and carries no hook, which would see the
    rows; else the module call, whose tensor each consumer quantizes (the same bits: the quantized
    op quantizes exactly the bf16 op's value)."""
    forward = type(norm).forward
    if quant is not None and forward in _QUANT_FORWARDS and not has_hooks(norm):
        return forward(norm, x, quant=quant, **kwargs)
    return norm(x, **kwargs)


_QUANT_FORWARDS = (ada_norm_zero_forward, ada_norm_zero_single_forward)


def ada_norm_continuous_forward(self, x: torch.Tensor, conditioning_embedding: torch.Tensor):
    """`AdaLayerNormContinuous.forward` with the norm and modulation fused."""
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return _modulate(self, x, emb, scale, shift)


def sd35_ada_norm_zero_x_forward(
    self, hidden_states: torch.Tensor, emb: torch.Tensor | None = None
):
    """`SD35AdaLayerNormZeroX.forward`: both modulations of the one norm fused."""
    emb = self.linear(self.silu(emb))
    (
        shift_msa,
        scale_msa,
        gate_msa,
        shift_mlp,
        scale_mlp,
        gate_mlp,
        shift_msa2,
        scale_msa2,
        gate_msa2,
    ) = emb.chunk(9, dim=1)
    norm_hidden_states = _modulate(self, hidden_states, emb, scale_msa, shift_msa)
    norm_hidden_states2 = _modulate(self, hidden_states, emb, scale_msa2, shift_msa2)
    return (
        norm_hidden_states,
        gate_msa,
        shift_mlp,
        scale_mlp,
        gate_mlp,
        norm_hidden_states2,
        gate_msa2,
    )


# ------------------------------------------------------------------------------------------------
# Patch functions
# ------------------------------------------------------------------------------------------------
def norm_unfusable(norm) -> str | None:
    """None when steps.norm_modulate fuses `norm`, else why not (for the report)."""
    if steps.is_plain_layernorm(norm) or steps.is_diffusers_rmsnorm(norm):
        return None
    return f"norm {type(norm).__name__} has no fused kernel; it runs as in diffusers"


def ada_norm_patcher(forward, kind: str):
    """Patch function for an AdaLN module class whose forward is `forward`. A hooked AdaLN module
    is skipped (reported): diffusers' own forward is always a correct fallback."""

    def patch(name: str, module, injector) -> None:
        reason = REPRODUCED.unpatched(type(module), "forward") or norm_unfusable(module.norm)
        if reason:
            injector.skip(kind, name, reason)
        else:
            injector.swap_forward(name, module, forward, kind, required=False)

    return patch


PATCHERS = {
    "AdaLayerNormZero": ada_norm_patcher(ada_norm_zero_forward, "AdaLayerNormZero"),
    "AdaLayerNormZeroSingle": ada_norm_patcher(
        ada_norm_zero_single_forward, "AdaLayerNormZeroSingle"
    ),
    "AdaLayerNormContinuous": ada_norm_patcher(
        ada_norm_continuous_forward, "AdaLayerNormContinuous"
    ),
    "SD35AdaLayerNormZeroX": ada_norm_patcher(
        sd35_ada_norm_zero_x_forward, "SD35AdaLayerNormZeroX"
    ),
}
