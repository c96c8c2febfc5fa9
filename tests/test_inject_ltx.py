"""inject_optimized_kernels on LTX-Video: tiny models on the CPU (as diffusers' own model tests build
them), the full-size transformer on the GPU; the API (report, ops selection, removal), hooks and
offloading, torch.compile. The tests every model runs alike are in test_inject_models.py."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    REL_L2_TOLERANCE,
    assert_matches_eager,
    assert_remove_restores,
    caller,
    clone,
    count_ltx_ops,
    eager_and_injected,
    group_offload,
    inject_then_group_offload,
    output_of,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from model_zoo.ltx import TINY, expected_counts, full_inputs, tiny_inputs, tiny_model

from diffusers import LTXVideoTransformer3DModel  # noqa: E402  (inject_helpers skips without it)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("affine", [False, True], ids=["norm_no_weight", "norm_weight"])
def test_tiny_ltx_matches_eager_and_restores(dtype, affine):
    model = tiny_model(dtype, norm_elementwise_affine=affine)
    call = caller(tiny_inputs(dtype))
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, dtype, "tiny LTX")
    assert dict(report.patched) == {
        "LTXVideoTransformerBlock": 2,
        "LTXAttention (self: q/k norm + RoPE)": 2,
        "LTXAttention (cross: q/k norm)": 2,
        "LTXVideoTransformer3DModel (output norm)": 1,
        "fused projections (to_q/to_k/to_v)": 2,
    }
    assert not report.skipped
    assert count_ltx_ops(lambda: call(model)) == expected_counts()
    assert_remove_restores(model, call, eager)


def test_disabling_rope_keeps_qk_norm_fused():
    model = tiny_model(torch.float32)
    call = caller(tiny_inputs(torch.float32))
    eager, injected, _ = eager_and_injected(model, call, ops=set(FUSIONS) - {"rope"})
    assert_matches_eager(eager, injected, torch.float32, "qk norm without rope")
    assert count_ltx_ops(lambda: call(model))["qk_rmsnorm_rope"] == 2 * TINY["num_layers"]


def test_unknown_op_names_are_rejected(monkeypatch):
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match=r"unknown op\(s\) \['rms'\] in ops; valid names: rmsnorm"):
        ltx_kernels.inject_optimized_kernels(model, ops=["rms"])
    monkeypatch.setenv("LTX_KERNELS_DISABLE", "rope,linear-gelu")
    with pytest.raises(ValueError, match=r"\['linear-gelu'\] in LTX_KERNELS_DISABLE"):
        ltx_kernels.inject_optimized_kernels(model)


def test_report_is_readable_and_double_injection_raises(capsys):
    model = tiny_model(torch.float32)
    report = ltx_kernels.inject_optimized_kernels(model, ops=set(FUSIONS) - {"gelu"})
    printed = capsys.readouterr().out
    assert printed.strip() == str(report)
    assert "9 modules patched" in printed and "disabled: gelu" in printed
    assert "LTXVideoTransformerBlock" in printed and "2 patched" in printed
    with pytest.raises(RuntimeError, match="already injected; call remove_optimized_kernels"):
        ltx_kernels.inject_optimized_kernels(model)
    with pytest.raises(TypeError, match="expects a diffusers pipeline or a torch.nn.Module"):
        ltx_kernels.inject_optimized_kernels(object())


def test_blocks_keep_their_class_name_and_state_dict():
    model = tiny_model(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    block = model.transformer_blocks[0]
    assert type(block).__name__ == "LTXVideoTransformerBlock"
    assert isinstance(block, type(block).__mro__[1])
    assert type(block.attn1.processor).__name__ == "LTXKernelsAttnProcessor"
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_custom_processor_is_kept_and_reported():
    model = tiny_model(torch.float32)

    class MyProcessor:
        def __call__(
            self,
            attn,
            hidden_states,
            encoder_hidden_states=None,
            attention_mask=None,
            image_rotary_emb=None,
        ):
            return hidden_states

    model.transformer_blocks[1].attn2.set_processor(MyProcessor())
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert report.patched["LTXAttention (cross: q/k norm)"] == 1
    [(name, reason)] = report.skipped["LTXAttention (cross: q/k norm)"]
    assert name == "transformer_blocks.1.attn2" and "MyProcessor" in reason
    assert isinstance(model.transformer_blocks[1].attn2.processor, MyProcessor)


def test_pipeline_injection_covers_its_transformer():
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    model = tiny_model(torch.float32)
    pipe = LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        transformer=model,
    )
    report = ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    assert report.patched["LTXVideoTransformerBlock"] == 2
    assert ltx_kernels.remove_optimized_kernels(pipe) == 7


# ------------------------------------------------------------------------------------------------
# Hooks and offloading
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_inject_then_group_offload(offload_type):
    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    inject_then_group_offload(model, call, offload_type)
    if offload_type == "leaf_level":
        # Hooks on the Linear layers: the FF step calls the hooked projection instead of reading
        # its weight, everything else stays fused.
        counts = count_ltx_ops(lambda: call(model))
        assert "linear_gelu" not in counts and counts["add_rmsnorm_modulate"] == 2
    with pytest.raises(RuntimeError, match="got a forward hook after injection"):
        ltx_kernels.remove_optimized_kernels(model)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offload_then_inject_raises_for_hooked_blocks(offload_type):
    # Both levels hook the blocks (leaf level for the parameters held by the block itself).
    model = tiny_model(torch.float32)
    group_offload(model, offload_type)
    with pytest.raises(
        RuntimeError,
        match=r"cannot patch transformer_blocks\.0 "
        r"\(LTXVideoTransformerBlock\): its forward is wrapped",
    ):
        ltx_kernels.inject_optimized_kernels(model, verbose=False)


def model_hooked_like_cpu_offload():
    """(tiny bf16 model, call, its eager output) with the top-level hook that
    enable_model_cpu_offload adds (accelerate's cpu_offload_with_hook)."""
    from accelerate import cpu_offload_with_hook

    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    with torch.no_grad():
        eager = output_of(call(model))
    cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
    return model, call, eager


def test_model_hook_then_inject_patches_blocks_and_reports_output_norm():
    model, call, eager = model_hooked_like_cpu_offload()
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert report.patched["LTXVideoTransformerBlock"] == 2
    [(name, reason)] = report.skipped["LTXVideoTransformer3DModel (output norm)"]
    assert name == "" and "wrapped by a hook" in reason
    with torch.no_grad():
        assert_matches_eager(eager, call(model), torch.bfloat16, "model hook, then inject")
    assert "layernorm_modulate" not in count_ltx_ops(lambda: call(model))


def test_hook_removed_then_inject_patches_everything():
    # pipe.remove_all_hooks() (accelerate's remove_hook_from_module) leaves the class's forward
    # bound on the instance; that is no hook, and it must not bypass the patched class.
    from accelerate import cpu_offload_with_hook
    from accelerate.hooks import remove_hook_from_module

    model, call, eager = model_hooked_like_cpu_offload()
    remove_hook_from_module(model, recurse=True)
    assert "forward" in vars(model)  # what accelerate leaves behind
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert not report.skipped and report.patched["LTXVideoTransformer3DModel (output norm)"] == 1
    assert "forward" not in vars(model)
    with torch.no_grad():
        assert_matches_eager(eager, call(model), torch.bfloat16, "hook removed, then inject")
    assert count_ltx_ops(lambda: call(model))["layernorm_modulate"] == 1
    # hooks again, removed again (what --cpu-offload in generate_video.py does), then remove
    cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
    remove_hook_from_module(model, recurse=True)
    assert ltx_kernels.remove_optimized_kernels(model) > 0 and "forward" not in vars(model)
    assert not count_ltx_ops(lambda: call(model))
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), eager)


@pytest.mark.parametrize(
    "hooked, op",
    [
        ("transformer_blocks.0.attn1.norm_q", "qk_rmsnorm_rope"),
        ("transformer_blocks.0.norm2", "add_rmsnorm_modulate"),
    ],
)
def test_a_hook_registered_on_a_fused_norm_sees_its_call(hooked, op):
    """A forward hook registered (register_forward_hook, not a replaced forward) on a norm our ops
    fuse sees its call: that step runs the norm as itself, within the tolerance of eager; the op
    again once the hook is removed."""
    model = tiny_model(torch.float32)
    call = caller(tiny_inputs(torch.float32))
    eager, _, _ = eager_and_injected(model, call)
    fused = count_ltx_ops(lambda: call(model))
    seen = []
    hook = model.get_submodule(hooked).register_forward_hook(lambda m, args, out: seen.append(m))
    assert count_ltx_ops(lambda: call(model)).get(op, 0) == fused[op] - 1
    assert seen == [model.get_submodule(hooked)]
    with torch.no_grad():
        assert_matches_eager(eager, call(model), torch.float32, hooked)
    hook.remove()
    assert count_ltx_ops(lambda: call(model)) == fused


def test_layerwise_casting_after_inject_falls_back_where_hooked():
    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        reference = output_of(call(clone(model)))
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        out = output_of(call(model))  # fp8-stored Linear weights: the FF step must use the hook
    assert torch.isfinite(out).all() and rel_l2(out, reference) < 0.2
    assert "linear_gelu" not in count_ltx_ops(lambda: call(model))


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
def test_compile_fullgraph_no_recompile_cpu():
    torch._dynamo.reset()
    model = tiny_model(torch.float32)
    inputs = tiny_inputs(torch.float32)
    eager, _, _ = eager_and_injected(model, caller(inputs))
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            out = compiled(**{**inputs, "timestep": torch.randint(0, 1000, (2,))})
        out = compiled(**inputs)
    assert rel_l2(output_of(out), output_of(eager)) <= REL_L2_TOLERANCE[torch.float32]


# ------------------------------------------------------------------------------------------------
# Full size on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_full_size_ltx_gpu():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LTXVideoTransformer3DModel().to(torch.bfloat16).eval()
    call = caller(full_inputs(2, 7, 16, 24, "cuda"))  # 49 frames 512x768: 2688 tokens
    eager, injected, report = eager_and_injected(model, call)
    assert report.patched["LTXVideoTransformerBlock"] == 28
    error = rel_l2(output_of(injected), output_of(eager))
    print(f"full-size LTX-Video, 2x2688 tokens, bf16: relative L2 vs eager {error:.2e}")
    assert error <= REL_L2_TOLERANCE[torch.bfloat16]
    assert_remove_restores(model, call, eager)


def test_inject_registers_inductor_fallbacks():
    # Without them Inductor (torch 2.11) hangs on a 28-block LTX graph: it formats the IR of an
    # op first met after the blocks (the output norm) into a log string, exponentially long.
    from torch._inductor.lowering import lowerings

    ltx_kernels.inject_optimized_kernels(tiny_model(torch.float32), verbose=False)
    for name in ltx_kernels.OPS:
        assert getattr(torch.ops.ltx_kernels, name).default in lowerings, name
