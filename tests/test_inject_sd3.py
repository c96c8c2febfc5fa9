"""inject_optimized_kernels on SD3 / SD3.5: tiny models on the CPU (as diffusers' own model tests
build them: a dual-attention layer, a plain layer, the context-pre-only last layer), the full-size
configurations' reports on the meta device. The tests every model runs alike are in
test_inject_models.py."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    REL_L2_TOLERANCE,
    assert_matches_eager,
    assert_remove_restores,
    caller,
    count_ltx_ops,
    eager_and_injected,
    output_of,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from ltx_kernels.integration.sd3 import DUAL_ATTN, JOINT_ATTN
from model_zoo.sd3 import SD3, SD35, TINY, expected_ops, layers, tiny_inputs, tiny_model

from diffusers import SD3Transformer2DModel  # noqa: E402  (inject_helpers skips without it)


def report_for(config) -> dict:
    kinds = layers(config)
    dual = sum(d for d, _ in kinds)
    report = {
        "JointTransformerBlock": len(kinds),
        "SD35AdaLayerNormZeroX": dual,
        "AdaLayerNormZero": 2 * len(kinds) - dual - 1,  # norm1 and norm1_context
        "AdaLayerNormContinuous": 2,
    }  # last block's norm1_context, norm_out
    if config.get("qk_norm"):
        report.update({JOINT_ATTN: len(kinds), DUAL_ATTN: dual})
    return {kind: n for kind, n in report.items() if n}


@pytest.mark.parametrize("variant", [SD35, SD3], ids=["sd35_rms_qk_norm", "sd3_no_qk_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_sd3_matches_eager_and_restores(dtype, variant):
    model = tiny_model(dtype, **variant)
    call = caller(tiny_inputs(dtype))
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, dtype, f"tiny SD3 {variant}")
    config = {**TINY, **variant}
    assert dict(report.patched) == report_for(config)
    if variant["qk_norm"]:
        assert not report.skipped
    else:  # nothing to fuse in SD3's attention: kept, and said why
        assert {kind: len(entries) for kind, entries in report.skipped.items()} == {
            JOINT_ATTN: 3,
            DUAL_ATTN: 1,
        }
        assert all(
            "no q/k norm" in reason for entries in report.skipped.values() for _, reason in entries
        )
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, config)
    assert_remove_restores(model, call, eager)


def test_forward_chunking_keeps_the_fused_feed_forward():
    model = tiny_model(torch.float32, **SD35)
    model.enable_forward_chunking(chunk_size=1, dim=0)  # one sample at a time: two chunks
    call = caller(tiny_inputs(torch.float32))
    eager, injected, _ = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.float32, "chunked feed-forward")
    assert count_ltx_ops(lambda: call(model)) == expected_ops(
        FUSIONS, {**TINY, **SD35}, ff_chunks=2
    )


def test_fused_qkv_processor_is_kept_and_reported():
    # (diffusers' fused processor cannot run the dual-attention attn2, so no dual layer here)
    model = tiny_model(torch.float32, **SD35, dual_attention_layers=())
    model.fuse_qkv_projections()
    call = caller(tiny_inputs(torch.float32))
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.float32, "fused QKV")
    assert JOINT_ATTN not in report.patched and report.patched["JointTransformerBlock"] == 3
    assert all("FusedJointAttnProcessor2_0" in reason for _, reason in report.skipped[JOINT_ATTN])
    assert "rmsnorm" not in count_ltx_ops(lambda: call(model))


def test_full_size_reports_on_meta():
    configs = {  # scripts/convert_sd3_to_diffusers.py
        "SD3-medium": dict(
            num_layers=24,
            num_attention_heads=24,
            caption_projection_dim=1536,
            pos_embed_max_size=192,
        ),
        "SD3.5-medium": dict(
            num_layers=24,
            num_attention_heads=24,
            caption_projection_dim=1536,
            pos_embed_max_size=384,
            qk_norm="rms_norm",
            dual_attention_layers=tuple(range(13)),
        ),
        "SD3.5-large": dict(
            num_layers=38,
            num_attention_heads=38,
            caption_projection_dim=2432,
            pos_embed_max_size=192,
            qk_norm="rms_norm",
        ),
    }
    for name, config in configs.items():
        with torch.device("meta"):
            model = SD3Transformer2DModel(**config)
        report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
        full = {"dual_attention_layers": (), **config}
        assert dict(report.patched) == report_for(full), name


def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    model = tiny_model(torch.float32, **SD35)
    model.enable_forward_chunking(chunk_size=1, dim=0)
    inputs = tiny_inputs(torch.float32)
    eager, _, _ = eager_and_injected(model, caller(inputs))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        compiled(**inputs)
        out = compiled(**inputs)
    assert rel_l2(output_of(out), output_of(eager)) <= REL_L2_TOLERANCE[torch.float32]
