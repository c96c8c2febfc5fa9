"""inject_optimized_kernels on HunyuanVideo and HunyuanVideo-1.5 (tiny models on the CPU): not mapped
yet beyond the generic AdaLN patches their blocks use, which must give eager's outputs. Regression
test: the patch embedding hands block 0 a transposed view [B, S, D] (last-dim stride S), which
layernorm_modulate rejects; the fused steps leave strided rows to the diffusers code."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    assert_matches_eager,
    caller,
    count_ltx_ops,
    eager_and_injected,
    output_of,
)
from model_zoo.hunyuan import tiny_inputs, tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video_1.5"])
def test_adaln_patches_match_eager(v15, dtype):
    model = tiny_model(dtype, v15)
    call = caller(tiny_inputs(dtype, v15))
    eager, injected, report = eager_and_injected(model, call)
    assert report.total_patched > 0 and any("AdaLayerNormZero" in k for k in report.patched)
    if dtype == torch.bfloat16:  # the fused AdaLN rounds where diffusers' does
        assert torch.equal(output_of(injected), output_of(eager))
    else:
        assert_matches_eager(eager, injected, dtype, "HunyuanVideo AdaLN")
    counts = count_ltx_ops(lambda: call(model))
    assert counts.get("layernorm_modulate", 0) > 0, counts
    ltx_kernels.remove_optimized_kernels(model)
