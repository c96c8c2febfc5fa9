"""Injection into a model quantized by torchao (float8 dynamic rowwise, the Float8Tensor weights a
user gets from `quantize_`), on the GPU at real widths: no crash, the steps that would hand a
quantized weight to our ops fall back and the report says so, the output is the quantized stock
model's within bf16 noise, with fp8=True too (its FP8 Linears skip weights that are not plain)."""

import sys
from pathlib import Path

import pytest
import torch

import ltx_kernels
from inject_helpers import REL_L2_TOLERANCE, rel_l2

pytest.importorskip("diffusers", reason="diffusers is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import transformer_cases  # noqa: E402

ONE_BLOCK = {
    "ltx": dict(num_layers=1),
    "flux": dict(num_layers=1, num_single_layers=1),
    "wan-1.3b": dict(num_layers=1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", list(ONE_BLOCK))
def test_inject_into_torchao_float8_model_gpu(name, fp8):
    quantization = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    model, call, _ = transformer_cases.build(name, None, **ONE_BLOCK[name])
    quantization.quantize_(  # the bf16 Linears: torchao's PerRow takes no others (Wan keeps some
        model,  # in float32, as from_pretrained loads it)
        quantization.Float8DynamicActivationFloat8WeightConfig(granularity=quantization.PerRow()),
        filter_fn=lambda m, _: isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16,
    )
    subclasses = {
        type(m.weight).__name__
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and type(m.weight) is not torch.nn.Parameter
    }
    assert subclasses, "torchao quantized no weight: the test would not test anything"
    with torch.no_grad():
        stock = call(model)
        report = ltx_kernels.inject_optimized_kernels(model, verbose=False, fp8=fp8)
        injected = call(model)
    skipped = report.skipped.get("quantized weights", [])
    assert skipped and all(any(s in reason for s in subclasses) for _, reason in skipped)
    assert "quantized weights" in str(report)
    assert not any(
        isinstance(m, ltx_kernels.integration.linears.Fp8Linear) for m in model.modules()
    )
    assert torch.isfinite(injected).all()
    assert rel_l2(injected, stock) <= REL_L2_TOLERANCE[torch.bfloat16]
    ltx_kernels.remove_optimized_kernels(model)
    with torch.no_grad():
        assert rel_l2(call(model), stock) <= REL_L2_TOLERANCE[torch.bfloat16]
