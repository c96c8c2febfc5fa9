"""inject_optimized_kernels on FLUX.1: tiny models on the CPU (as diffusers' own model tests build
them), the full-size configuration's report on the meta device, a full-size double + single block
pair on the GPU. The tests every model runs alike are in test_inject_models.py."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    FP8_VS_BF16,
    REL_L2_TOLERANCE,
    assert_matches_eager,
    assert_no_fused_buffers,
    assert_remove_restores,
    caller,
    count_ltx_ops,
    clone,
    eager_and_injected,
    fused_rows,
    gemms,
    inject_then_group_offload,
    output_of,
    randomize_norms,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from ltx_kernels.integration.flux import DOUBLE_ATTN, QKV_MLP, SINGLE_ATTN
from model_zoo.flux import expected_ops, image_ids, tiny_block, tiny_inputs, tiny_model

from diffusers import FluxTransformer2DModel  # noqa: E402  (inject_helpers skips without it)
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    FluxPosEmbed,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)


SINGLE_QKV_MLP = "fused projections (attn.to_q/attn.to_k/attn.to_v/proj_mlp)"


def report_for(double: int, single: int, fp8: bool = False) -> dict:
    """The report's patched counts; fp8: the single blocks' q/k/v join proj_mlp's GEMM."""
    return {
        "FluxTransformerBlock": double,
        "FluxSingleTransformerBlock": single,
        "AdaLayerNormZero": 2 * double,
        "AdaLayerNormZeroSingle": single,
        "AdaLayerNormContinuous": 1,
        DOUBLE_ATTN: double,
        SINGLE_ATTN: single,
        "fused projections (to_q/to_k/to_v)": double + (0 if fp8 else single),
        "fused projections (add_q_proj/add_k_proj/add_v_proj)": double,
        **({SINGLE_QKV_MLP: single} if fp8 else {}),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_flux_matches_eager_and_restores(dtype):
    model = tiny_model(dtype, num_layers=2, num_single_layers=2)
    call = caller(tiny_inputs(dtype))
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, dtype, "tiny FLUX")
    assert dict(report.patched) == report_for(2, 2)
    assert not report.skipped
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, 2, 2)
    assert_remove_restores(model, call, eager)


def test_tiny_flux_fp16():
    # fp16 is not in REL_L2_TOLERANCE: held to the bf16 bound (the C LayerNorm sums in another
    # order than PyTorch's, one ulp at some elements).
    model = tiny_model(torch.float16)
    eager, injected, _ = eager_and_injected(model, caller(tiny_inputs(torch.float16)))
    assert rel_l2(output_of(injected), output_of(eager)) <= REL_L2_TOLERANCE[torch.bfloat16]


def test_custom_processor_is_kept_and_reported():
    model = tiny_model(torch.float32)
    call = caller(tiny_inputs(torch.float32))

    class MyProcessor(FluxAttnProcessor):
        pass

    model.transformer_blocks[0].attn.set_processor(MyProcessor())
    eager, injected, report = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.float32, "custom processor")
    assert DOUBLE_ATTN not in report.patched and report.patched[SINGLE_ATTN] == 1
    [(name, reason)] = report.skipped[DOUBLE_ATTN]
    assert name == "transformer_blocks.0.attn" and "MyProcessor" in reason
    assert isinstance(model.transformer_blocks[0].attn.processor, MyProcessor)
    # The block itself stays fused; only that attention's q/k norm + RoPE runs as in diffusers.
    assert count_ltx_ops(lambda: call(model))["qk_rmsnorm_rope"] == 1


def test_rope_tables_of_another_shape_rotate_after_concatenation():
    # One broadcast row instead of [S_txt + S_img, Dh]: not split per stream; the fused norm runs
    # alone and RoPE is applied to the concatenated q/k, as diffusers does.
    block = randomize_norms(FluxTransformerBlock(32, 2, 16)).eval()
    hidden, text, temb = torch.randn(2, 16, 32), torch.randn(2, 5, 32), torch.randn(2, 32)
    tables = (torch.randn(1, 16), torch.randn(1, 16))
    call = lambda b: torch.cat(b(hidden, text, temb, tables), dim=1)  # noqa: E731
    eager, injected, _ = eager_and_injected(block, call)
    assert_matches_eager(eager, injected, torch.float32, "one-row tables")
    counts = count_ltx_ops(lambda: call(block))
    assert counts["qk_rmsnorm_rope"] == 2 and counts["rope"] == 2


def test_fp16_output_is_clipped_as_diffusers_does():
    block = randomize_norms(FluxSingleTransformerBlock(32, 2, 16)).half().eval()
    with torch.no_grad():
        block.proj_out.weight.mul_(1e4)  # overflows the residual: clipped to +-65504
    hidden, text = torch.randn(2, 16, 32).half(), torch.randn(2, 5, 32).half()
    temb = torch.randn(2, 32).half()
    call = lambda b: torch.cat(b(hidden, text, temb), dim=1)  # noqa: E731
    eager, injected, _ = eager_and_injected(block, call)
    assert torch.isfinite(injected).all() and (injected.abs() == 65504).any()
    assert torch.equal(injected.abs() == 65504, eager.abs() == 65504)


def test_inject_then_leaf_offload_calls_the_hooked_modules():
    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    inject_then_group_offload(model, call, "leaf_level")
    # Hooks on every module with weights (Linear, q/k RMSNorm): the steps reading those weights
    # call the hooked modules (q/k: RMSNorm, then our RoPE; single-block MLP: Linear, then our
    # GELU; steps.feed_forward runs the whole FF as diffusers does); the weightless AdaLN
    # LayerNorms and the residuals stay fused.
    expected = expected_ops(set(FUSIONS) - {"linear_gelu", "qk_rmsnorm_rope"}, 1, 1)
    assert count_ltx_ops(lambda: call(model)) == {**expected, "gelu": 1}


def test_full_size_flux_report_on_meta():
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True)  # FLUX.1-dev
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert dict(report.patched) == report_for(19, 38) and not report.skipped


# ------------------------------------------------------------------------------------------------
# FP8: the single block's q/k/v and proj_mlp as one GEMM (fused_qkv_mlp)
# ------------------------------------------------------------------------------------------------
BF16 = torch.bfloat16


def test_single_block_qkv_mlp_is_one_fp8_gemm_and_restores():
    block, call = tiny_block("single", BF16)
    unfused = clone(block)
    params = dict(block.named_parameters())
    state = {k: v.clone() for k, v in block.state_dict().items()}
    eager, injected, report = eager_and_injected(block, call, fp8=True, keep_bf16_weights=True)
    assert report.patched[SINGLE_QKV_MLP] == 1
    assert "fused projections (to_q/to_k/to_v)" not in report.patched  # replaced by the larger
    # the members' FP8 weights are row blocks of one storage, q/k/v with proj_mlp
    fused = fused_rows([block.get_submodule(name) for name in QKV_MLP], "weight_fp8")
    assert fused.shape == (3 * 32 + 128, 32) and fused.dtype == torch.float8_e4m3fn
    assert_no_fused_buffers(block)
    assert dict(block.named_parameters()) == params  # the same objects
    after = block.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    counts = count_ltx_ops(lambda: call(block))
    assert counts["gelu"] == 1 and "linear_gelu" not in counts
    _, unfused_out, _ = eager_and_injected(
        unfused, call, ops=set(FUSIONS) - {"fused_qkv_mlp"}, fp8=True
    )
    # the same FP8 rows (one quantization of the normed rows for the four) and the same products
    assert torch.equal(injected, unfused_out)
    # norm.linear, q/k/v + proj_mlp, proj_out; without the fusion: q/k/v, then proj_mlp
    assert gemms(lambda: call(block)) == 3 and gemms(lambda: call(unfused)) == 4
    ltx_kernels.remove_optimized_kernels(block)
    assert dict(block.named_parameters()) == params
    after = block.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(call(block), eager)


def test_single_block_qkv_mlp_is_fp8_only():
    """In bf16 the single block keeps proj_mlp on linear_gelu (its GELU epilogue measured faster
    than the wider GEMM and a gelu pass) and fuses q/k/v alone."""
    block, call = tiny_block("single", BF16)
    eager, injected, report = eager_and_injected(block, call)
    assert torch.equal(injected, eager)
    assert SINGLE_QKV_MLP not in report.patched
    assert report.patched["fused projections (to_q/to_k/to_v)"] == 1
    assert count_ltx_ops(lambda: call(block))["linear_gelu"] == 1


def test_single_block_activation_hook_sees_its_call():
    """A forward hook registered on the single block's act_mlp (bf16: proj_mlp + GELU is one
    linear_gelu) sees its call: the step runs proj_mlp and act_mlp as themselves."""
    block, call = tiny_block("single", BF16)
    eager, injected, _ = eager_and_injected(block, call)
    seen = []
    hook = block.act_mlp.register_forward_hook(lambda m, args, out: seen.append(m))
    assert count_ltx_ops(lambda: call(block)).get("linear_gelu", 0) == 0
    assert len(seen) == 1
    with torch.no_grad():
        assert torch.equal(call(block), eager)
    hook.remove()
    assert count_ltx_ops(lambda: call(block))["linear_gelu"] == 1


@pytest.mark.parametrize("hooked", ["attn.to_q", "proj_mlp", "attn"])
def test_single_block_qkv_mlp_falls_back_to_the_modules_under_a_hook(hooked):
    block, call = tiny_block("single", BF16)
    _, injected, _ = eager_and_injected(block, call, fp8=True)
    seen = []
    hook = block.get_submodule(hooked).register_forward_hook(lambda m, args, out: seen.append(m))
    # norm.linear, q, k, v, proj_mlp, proj_out: the hooked module sees its call
    assert gemms(lambda: call(block)) == 6
    assert len(seen) == 1
    with torch.no_grad():  # each FP8 Linear quantizes the same rows itself: the same bits
        assert torch.equal(call(block), injected)
    hook.remove()
    assert gemms(lambda: call(block)) == 3


@pytest.mark.parametrize("target", ["proj_mlp", "to_q"])
def test_single_block_qkv_mlp_with_lora_adapters(target):
    """peft LoRA on proj_mlp or the q projections, loaded before an FP8 injection: the adapted
    Linears stay bf16 (reported), the q/k/v/MLP group is not formed (reported) and the q/k/v
    group takes its place where its members are plain; the output is the stock model's within
    the FP8 drift."""
    from peft import LoraConfig

    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=[target]))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a non-zero adapter
    eager, injected, report = eager_and_injected(model, call, fp8=True)
    assert rel_l2(output_of(injected), output_of(eager)) <= FP8_VS_BF16
    assert SINGLE_QKV_MLP not in report.patched
    skipped = [name for name, _ in report.skipped["fused projections"]]
    assert "single_transformer_blocks.0" in skipped
    qkv_groups = report.patched.get("fused projections (to_q/to_k/to_v)", 0)
    assert qkv_groups == (2 if target == "proj_mlp" else 0)  # the double's and the single's


# ------------------------------------------------------------------------------------------------
# Full size on the GPU
# ------------------------------------------------------------------------------------------------
def check_block_pair(device, dim, heads, head_dim, axes_dim, side, text):
    """One double and one single block, random weights, bf16, batch 1, FLUX RoPE tables for a
    side x side latent grid and `text` text tokens: injected vs eager."""
    with torch.device(device):
        blocks = torch.nn.ModuleList(
            [
                FluxTransformerBlock(dim, heads, head_dim),
                FluxSingleTransformerBlock(dim, heads, head_dim),
            ]
        )
        blocks = randomize_norms(blocks.to(torch.bfloat16)).eval()
        ids = torch.cat([torch.zeros(text, 3), image_ids(side, side, device)])
        rope = FluxPosEmbed(theta=10000, axes_dim=axes_dim)(ids)  # fp32 [text + side^2, Dh]
        hidden = torch.randn(1, side * side, dim, dtype=torch.bfloat16)
        encoder = torch.randn(1, text, dim, dtype=torch.bfloat16)
        temb = torch.randn(1, dim, dtype=torch.bfloat16)

    def call(modules):
        double, single = modules
        encoder_out, hidden_out = double(hidden, encoder, temb, rope)
        return torch.cat(single(hidden_out, encoder_out, temb, rope), dim=1)

    eager, injected, report = eager_and_injected(blocks, call)
    assert dict(report.patched) == {
        "FluxTransformerBlock": 1,
        "FluxSingleTransformerBlock": 1,
        "AdaLayerNormZero": 2,
        "AdaLayerNormZeroSingle": 1,
        DOUBLE_ATTN: 1,
        SINGLE_ATTN: 1,
        "fused projections (to_q/to_k/to_v)": 2,
        "fused projections (add_q_proj/add_k_proj/add_v_proj)": 1,
    }
    expected = expected_ops(FUSIONS, 1, 1)
    expected["layernorm_modulate"] -= 1  # no output norm here
    if (
        device == "cuda"
        and torch.cuda.get_device_capability() == (9, 0)
        and side * side + text >= 4608
    ):
        expected["attention"] = 2  # "auto": our op at head_dim 128 from 4608 tokens
    assert count_ltx_ops(lambda: call(blocks)) == expected
    assert torch.isfinite(injected).all()
    error = rel_l2(injected, eager)
    assert_remove_restores(blocks, call, eager)
    return error


def test_flux_block_pair_cpu():
    error = check_block_pair("cpu", 64, 2, 32, [8, 12, 12], 4, 6)
    assert error <= REL_L2_TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_full_size_flux_block_pair_gpu():
    # FLUX.1 sizes: 3072 = 24 x 128, RoPE axes 16/56/56, a 1024^2 image (64 x 64 latent tokens
    # after 2x2 packing) + 512 text tokens; about 1 GB of bf16 weights.
    torch.manual_seed(0)
    error = check_block_pair("cuda", 3072, 24, 128, [16, 56, 56], 64, 512)
    print(
        f"full-size FLUX double + single block, 4096 + 512 tokens, bf16: relative L2 vs eager "
        f"{error:.2e}"
    )
    assert error <= 1e-2
