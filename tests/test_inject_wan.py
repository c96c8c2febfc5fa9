"""inject_optimized_kernels on Wan 2.x: tiny models on the CPU (diffusers' own test config), as
users load them (bf16 with `_keep_in_fp32_modules` kept fp32, through save/from_pretrained):
T2V, I2V (image-context attention), Wan 2.2 TI2V (per-token modulation), VACE, fused QKV
projections; exact op counts, the RoPE tables, hooks. Each op disabled alone and torch.compile:
test_inject_models.py."""

import tempfile

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
    inject_then_group_offload,
    output_of,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from ltx_kernels.integration.wan import WanKernelsAttnProcessor
from model_zoo.wan import (
    layers_of_1_3b,
    FRAMES,
    HEIGHT,
    I2V,
    LAYERS,
    TINY,
    WIDTH,
    expected_counts,
    load_as,
    randomize,
    tiny_inputs,
    tiny_model,
)

from diffusers import WanTransformer3DModel, WanVACETransformer3DModel  # noqa: E402

BLOCK_KINDS = {
    "WanAttention (self: q/k norm + RoPE)": LAYERS,
    "WanAttention (cross: q/k norm)": LAYERS,
    "fused projections (to_q/to_k/to_v)": LAYERS,
}
OUTPUT_NORM = "WanTransformer3DModel (output norm)"


def test_load_as():
    model = randomize(WanTransformer3DModel(**TINY))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    expected = {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}
    cast = load_as(model, torch.bfloat16)
    for name, tensor in [*cast.named_parameters(), *cast.named_buffers()]:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


# ------------------------------------------------------------------------------------------------
# Whole model against eager
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["t2v", "i2v", "ti2v"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tiny_wan_matches_eager_and_restores(dtype, variant):
    model = tiny_model(dtype, **(I2V if variant == "i2v" else {}))
    if dtype == torch.bfloat16:  # as users run it
        assert (
            model.blocks[0].norm2.weight.dtype
            == model.blocks[0].scale_shift_table.dtype
            == model.rope.freqs_cos.dtype
            == torch.float32
        )
        assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    call = caller(tiny_inputs(dtype, variant))
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, dtype, f"tiny Wan {variant}")
    assert dict(report.patched) == {"WanTransformerBlock": LAYERS, **BLOCK_KINDS}
    skipped = {kind: [name for name, _ in entries] for kind, entries in report.skipped.items()}
    expected_skips = {OUTPUT_NORM: [""]}
    if variant == "i2v":
        expected_skips["WanAttention (I2V image-context K norm)"] = [
            f"blocks.{i}.attn2" for i in range(LAYERS)
        ]
    assert skipped == expected_skips
    assert count_ltx_ops(lambda: call(model)) == expected_counts()
    assert_remove_restores(model, call, eager)


@pytest.mark.parametrize("variant", ["t2v", "i2v", "ti2v"])
def test_elementwise_ops_are_bit_identical_in_bf16(variant):
    # The ops without a reduction round exactly where Wan's bf16/fp32 code rounds, so they give
    # the eager bits at any seed (the norms differ from torch's in summation order only, which
    # flips an occasional bf16 ulp: covered by the relative L2 tests).
    model = tiny_model(torch.bfloat16, **(I2V if variant == "i2v" else {}))
    call = caller(tiny_inputs(torch.bfloat16, variant))
    ops = ["gated_residual", "rope", "linear_gelu"]  # RoPE after torch.nn.RMSNorm
    eager, injected, _ = eager_and_injected(model, call, ops=ops)
    assert torch.equal(output_of(injected), output_of(eager))
    assert count_ltx_ops(lambda: call(model)) == {
        "rope": 2 * LAYERS,
        "linear_gelu": LAYERS,
        "gated_residual": 2 * LAYERS,
    }


def test_plain_bf16_cast_without_cross_attn_norm():
    # Plain .to(bf16) on everything (norm tables and RoPE in bf16: Wan then rotates in bf16, so the
    # rope op must step aside) and norm2 = nn.Identity.
    model = randomize(WanTransformer3DModel(**{**TINY, "cross_attn_norm": False}))
    model = model.to(torch.bfloat16).eval()
    call = caller(tiny_inputs(torch.bfloat16))
    eager, injected, _ = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.bfloat16, "plain bf16 cast")
    # norm2 is an Identity: attn1's residual is gated_residual alone
    assert count_ltx_ops(lambda: call(model)) == {
        "layernorm_modulate": LAYERS,
        "qk_rmsnorm_rope": 2 * LAYERS,
        "add_layernorm_modulate": LAYERS,
        "linear_gelu": LAYERS,
        "gated_residual": 2 * LAYERS,
    }


def test_fused_qkv_projections():
    # to_qkv / to_kv chunks: q and k are row-strided views.
    model = tiny_model(torch.bfloat16, **I2V)
    model.fuse_qkv_projections()
    assert model.blocks[0].attn1.fused_projections
    call = caller(tiny_inputs(torch.bfloat16, "i2v"))
    eager, injected, _ = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.bfloat16, "fused projections")
    assert count_ltx_ops(lambda: call(model)) == expected_counts()


def test_vace():
    model = tiny_model(
        torch.bfloat16, WanVACETransformer3DModel, vace_layers=[0, 1], vace_in_channels=6
    )
    inputs = tiny_inputs(torch.bfloat16)
    inputs["control_hidden_states"] = torch.randn(2, 6, FRAMES, HEIGHT, WIDTH, dtype=torch.bfloat16)
    call = caller(inputs)
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.bfloat16, "VACE")
    assert dict(report.patched) == {
        "WanTransformerBlock": LAYERS,
        "WanVACETransformerBlock": 2,
        **{kind: 2 * n for kind, n in BLOCK_KINDS.items()},
    }
    assert list(report.skipped) == ["WanVACETransformer3DModel (output norm)"]
    assert count_ltx_ops(lambda: call(model)) == expected_counts(layers=LAYERS + 2)
    assert_remove_restores(model, call, eager)


# ------------------------------------------------------------------------------------------------
# Ops selection
# ------------------------------------------------------------------------------------------------
def test_no_ops_is_the_diffusers_code():
    model = tiny_model(torch.float32)
    call = caller(tiny_inputs(torch.float32))
    eager, injected, _ = eager_and_injected(model, call, ops=[])
    assert torch.equal(output_of(injected), output_of(eager))
    assert count_ltx_ops(lambda: call(model)) == {}


# ------------------------------------------------------------------------------------------------
# Attention processor and RoPE tables
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ops", [FUSIONS, ["rope"]], ids=["all", "rope_only"])
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_processor_matches_wan_on_any_tables(dtype, table_dtype, ops):
    # Tables that do not repeat per pair: the processor still rotates exactly as Wan (which reads
    # freqs_cos[2i] and freqs_sin[2i + 1]); bf16 tables (bf16 math in Wan) skip the rope op.
    # The rope op alone (after torch.nn.RMSNorm) is elementwise: the same bits as Wan.
    from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

    attn = randomize(WanAttention(dim=48, heads=4, dim_head=12, processor=WanAttnProcessor()))
    attn.to(dtype)
    x = torch.randn(2, 20, 48, dtype=dtype)
    theta = torch.rand(1, 20, 1, 12) * 20
    tables = (theta.cos().to(table_dtype), theta.sin().to(table_dtype))
    processor = WanKernelsAttnProcessor(attn)
    processor.ops = frozenset(ops)
    with torch.no_grad():
        eager = attn(x, None, None, tables)
        attn.set_processor(processor)
        counts = count_ltx_ops(lambda: attn(x, None, None, tables))
        fused = attn(x, None, None, tables)
    if ops == ["rope"]:
        assert torch.equal(fused, eager)
        assert counts == ({"rope": 2} if table_dtype == torch.float32 else {})
    else:
        assert_matches_eager(eager, fused, dtype, "attention")
        assert counts == {"qk_rmsnorm_rope": 1}


def test_custom_processor_is_kept_and_reported():
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    class MyProcessor(WanAttnProcessor):
        pass

    model = tiny_model(torch.float32)
    model.blocks[1].attn1.set_processor(MyProcessor())
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    kind = "WanAttention (self: q/k norm + RoPE)"
    assert report.patched[kind] == LAYERS - 1
    [(name, reason)] = report.skipped[kind]
    assert name == "blocks.1.attn1" and "MyProcessor" in reason
    assert isinstance(model.blocks[1].attn1.processor, MyProcessor)


def test_same_named_class_from_elsewhere_is_left_alone():
    from diffusers.models.transformers import transformer_wan

    class WanTransformerBlock(transformer_wan.WanTransformerBlock):  # a user's fork
        pass

    block = WanTransformerBlock(24, 32, 2, cross_attn_norm=True)
    report = ltx_kernels.inject_optimized_kernels(block, verbose=False)
    assert not report.patched
    [(name, reason)] = report.skipped["WanTransformerBlock"]
    assert name == "" and "not a diffusers Wan module" in reason


# ------------------------------------------------------------------------------------------------
# Hooks
# ------------------------------------------------------------------------------------------------
def test_inject_then_leaf_offload_falls_back_where_hooked():
    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    inject_then_group_offload(model, call, "leaf_level")
    # Hooked: the Linear layers (FF), norm2 (affine) and the q/k norms. Not hooked: norm1, norm3
    # (no parameters), so their fused steps stay.
    assert count_ltx_ops(lambda: call(model)) == {
        "layernorm_modulate": LAYERS,
        "add_layernorm_modulate": LAYERS,
        "gated_residual": 2 * LAYERS,
        "rope": 2 * LAYERS,
    }


def test_injecting_after_its_context_parallel_split_hook_says_so():
    # Wan's _cp_plan hooks blocks.0 itself (diffusers' split of the hidden states): injected after
    # enable_parallelism, that block cannot be patched beneath the hook, and the error names the
    # context-parallel hook and the order that works, not offloading or caching. Nothing is
    # patched by the failed call. (The hook as enable_parallelism registers it, without a process
    # group: only its name and its wrapping of the forward count here.)
    from diffusers.hooks import HookRegistry, ModelHook

    model = tiny_model(torch.float32)
    HookRegistry.check_if_exists_or_initialize(model.blocks[0]).register_hook(
        ModelHook(), "cp_input---blocks.0"
    )
    with pytest.raises(RuntimeError, match="context-parallel hook.*before enable_parallelism"):
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    assert type(model) is WanTransformer3DModel
    assert all(type(block) is WanTransformerBlock for block in model.blocks)


# ------------------------------------------------------------------------------------------------
# Real sizes on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_wan_1_3b_layers_gpu():
    # Wan 2.1 1.3B dimensions (2 of its 30 layers), 81 frames at 480x832: 32760 tokens.
    torch.manual_seed(0)
    model, inputs = layers_of_1_3b(torch.bfloat16)
    call = caller(inputs)
    eager, injected, report = eager_and_injected(model, call)
    assert dict(report.patched) == {"WanTransformerBlock": 2, **BLOCK_KINDS}
    error = rel_l2(output_of(injected), output_of(eager))
    print(f"Wan 1.3B dims, 2 layers, 32760 tokens, bf16: relative L2 vs eager {error:.2e}")
    assert error <= REL_L2_TOLERANCE[torch.bfloat16]
    expected = expected_counts()
    if torch.cuda.get_device_capability() == (9, 0):  # "auto": our op from 4608 tokens at hd128
        expected["attention"] = LAYERS  # (the self-attention; the 512-token text's stays cuDNN's)
    assert count_ltx_ops(lambda: call(model)) == expected
    assert_remove_restores(model, call, eager)
