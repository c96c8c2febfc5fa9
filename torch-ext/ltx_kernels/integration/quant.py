"""Quantized activations (inference: `inject_optimized_kernels(..., fp8=True)`): the rows a producer
hands a quantized GEMM, and which producer emits them.

A module class that takes quantized rows declares the format it takes in its `quant_input` class
attribute (a name of ltx_kernels.QUANT_FORMATS; linears.Fp8Linear takes "e4m3_row"). A step whose consumers
are known asks them (`input_format`): when they all take one format, and nothing hooks them or
the module the rows pass through, the step runs the quantized form of its op (`*_quant`,
`quantize`), which quantizes the step's value in the same pass, and hands them QuantRows;
otherwise the tensor, which each consumer quantizes itself (the same bits either way: the
quantized op quantizes exactly the value of its model-dtype op)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..ops import quantize
from .module_checks import has_hooks


class QuantRows(NamedTuple):
    """An activation [..., K] quantized per row in `format`: data [..., K] (float8_e4m3fn for
    "e4m3_row") and scale fp32 [...], value ~ data * scale[..., None]. What the quantized-output
    ops return, as the input of a module whose quant_input is `format`."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


def input_format(*consumers, through=None) -> str | None:
    """The format in which a step may hand its output to `consumers` (QuantRows): the one every
    consumer's class declares (quant_input), when none of them, nor the module the rows pass
    through on their way (an attention module, which must then run our processor: the caller
    checks that), carries a hook; None: hand them the tensor. (Read from the class: a class
    attribute lookup, not nn.Module.__getattr__'s failing one, on every block call.)"""
    format = getattr(type(consumers[0]), "quant_input", None) if consumers else None
    if format is None or any(
        getattr(type(m), "quant_input", None) != format or has_hooks(m) for m in consumers
    ):
        return None
    return None if through is not None and has_hooks(through) else format


def quantize_rows(
    x: torch.Tensor, format: str, activation: str = "none", approximate: str = "none"
) -> QuantRows:
    """x (or gelu(x, approximate): activation "gelu") quantized per row in `format`, one pass."""
    if x.dim() > 0 and x.size(-1) > 1 and x.stride(-1) != 1:
        x = x.contiguous()
    return QuantRows(*quantize(x, activation, approximate, format=format), format)


def rows_of(format: str | None, out):
    """A quantized-output op's (q, q_scale) as QuantRows (after h for the add_ ops); with format
    None (the model-dtype op ran), out as it is."""
    if format is None:
        return out
    return QuantRows(*out, format) if len(out) == 2 else (out[0], QuantRows(*out[1:], format))
