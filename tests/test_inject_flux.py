"""inject_optimized_kernels on FLUX.1: tiny models on the CPU (as diffusers' own model tests build
them), the full-size configuration's report on the meta device, a full-size double + single block
pair on the GPU."""
import pytest
import torch

import ltx_kernels
from inject_helpers import (REL_L2_TOLERANCE, assert_backend_kept, assert_matches_eager,
                            assert_remove_restores, count_ltx_ops, eager_and_injected,
                            inject_then_group_offload, output_of, rel_l2)
from ltx_kernels.integration import FUSIONS
from ltx_kernels.integration.flux import DOUBLE_ATTN, SINGLE_ATTN

from diffusers import FluxTransformer2DModel  # noqa: E402  (inject_helpers skips without it)
from diffusers.models.transformers.transformer_flux import (FluxAttnProcessor, FluxPosEmbed,
                                                            FluxSingleTransformerBlock,
                                                            FluxTransformerBlock)

TINY = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8])
HEIGHT, WIDTH, TEXT = 4, 4, 5


def report_for(double: int, single: int) -> dict:
    return {"FluxTransformerBlock": double, "FluxSingleTransformerBlock": single,
            "AdaLayerNormZero": 2 * double, "AdaLayerNormZeroSingle": single,
            "AdaLayerNormContinuous": 1, DOUBLE_ATTN: double, SINGLE_ATTN: single}


def expected_ops(ops, double: int, single: int) -> dict:
    """ltx_kernels op calls per forward of a FLUX model with `ops` enabled: each step runs its op,
    or the op of its fallback (the unfused step's pieces)."""
    ops = set(ops)
    counts = dict.fromkeys(FUSIONS, 0)

    def norm_modulate(n):
        counts["layernorm_modulate"] += n * ("layernorm_modulate" in ops)

    def residual(n):
        counts["gated_residual"] += n * ("gated_residual" in ops)

    norm_modulate(2 * double + single + 1)  # norm1, norm1_context, single norm, norm_out
    if "add_layernorm_modulate" in ops:  # x + gate * attn, norm2 + modulation, both streams
        counts["add_layernorm_modulate"] += 2 * double
    else:
        residual(2 * double)
        norm_modulate(2 * double)
    residual(2 * double + single)  # FF residuals, single-block output
    attentions = 2 * double + single  # q/k norm + RoPE: one per stream
    if "qk_rmsnorm_rope" in ops:
        counts["qk_rmsnorm_rope"] += attentions
    elif "rope" in ops:
        counts["rope"] += 2 * attentions
    mlps = 2 * double + single
    if "linear_gelu" in ops:
        counts["linear_gelu"] += mlps
    elif "gelu" in ops:
        counts["gelu"] += mlps
    return {op: n for op, n in counts.items() if n}


def randomize_norms(module):
    with torch.no_grad():  # weights away from their init values, so a dropped weight shows
        for name, parameter in module.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0, 0.3)
    return module


def tiny_model(dtype, **config):
    return randomize_norms(FluxTransformer2DModel(**{**TINY, **config}).to(dtype).eval())


def image_ids(height, width, device="cpu"):
    rows, cols = torch.meshgrid(torch.arange(height, device=device),
                                torch.arange(width, device=device), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def tiny_inputs(dtype, batch=2):
    return dict(
        hidden_states=torch.randn(batch, HEIGHT * WIDTH, TINY["in_channels"], dtype=dtype),
        encoder_hidden_states=torch.randn(batch, TEXT, TINY["joint_attention_dim"], dtype=dtype),
        pooled_projections=torch.randn(batch, TINY["pooled_projection_dim"], dtype=dtype),
        timestep=torch.rand(batch, dtype=dtype),
        img_ids=image_ids(HEIGHT, WIDTH),
        # Text positions that differ, so text rows of the RoPE tables matter (FLUX uses zeros).
        txt_ids=torch.randint(0, 8, (TEXT, 3)).float(),
        return_dict=False)


def caller(inputs):
    return lambda model: model(**inputs)


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


def test_tiny_flux_bf16_is_bit_identical_on_cpu():
    model = tiny_model(torch.bfloat16)
    eager, injected, _ = eager_and_injected(model, caller(tiny_inputs(torch.bfloat16)))
    assert torch.equal(output_of(injected), output_of(eager))


def test_tiny_flux_fp16():
    # fp16 is not in REL_L2_TOLERANCE: held to the bf16 bound (the C LayerNorm sums in another
    # order than PyTorch's, one ulp at some elements).
    model = tiny_model(torch.float16)
    eager, injected, _ = eager_and_injected(model, caller(tiny_inputs(torch.float16)))
    assert rel_l2(output_of(injected), output_of(eager)) <= REL_L2_TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("disabled", FUSIONS)
def test_each_op_can_be_disabled_alone(disabled):
    model = tiny_model(torch.bfloat16)
    call = caller(tiny_inputs(torch.bfloat16))
    ops = [name for name in FUSIONS if name != disabled]
    eager, injected, report = eager_and_injected(model, call, ops=ops)
    assert disabled not in report.ops
    assert_matches_eager(eager, injected, torch.bfloat16, f"without {disabled}")
    assert count_ltx_ops(lambda: call(model)) == expected_ops(ops, 1, 1)


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


def test_attention_backend_is_kept():
    model = tiny_model(torch.float32)
    model.set_attention_backend("_native_math")
    call = caller(tiny_inputs(torch.float32))
    eager, injected, _ = eager_and_injected(model, call)
    assert_matches_eager(eager, injected, torch.float32, "math backend")
    assert_backend_kept([block.attn for block in (*model.transformer_blocks,
                                                  *model.single_transformer_blocks)],
                        "FluxKernelsAttnProcessor")


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


def test_compile_repeated_blocks_fullgraph_cpu():
    torch._dynamo.reset()
    model = tiny_model(torch.float32)
    inputs = tiny_inputs(torch.float32)
    eager, _, _ = eager_and_injected(model, caller(inputs))
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=1):
        model(**inputs)
        out = model(**inputs)
    assert rel_l2(output_of(out), output_of(eager)) <= REL_L2_TOLERANCE[torch.float32]


def test_full_size_flux_report_on_meta():
    with torch.device("meta"):
        model = FluxTransformer2DModel(guidance_embeds=True)  # FLUX.1-dev
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert dict(report.patched) == report_for(19, 38) and not report.skipped


# ------------------------------------------------------------------------------------------------
# Full size on the GPU
# ------------------------------------------------------------------------------------------------
def check_block_pair(device, dim, heads, head_dim, axes_dim, side, text):
    """One double and one single block, random weights, bf16, batch 1, FLUX RoPE tables for a
    side x side latent grid and `text` text tokens: injected vs eager."""
    with torch.device(device):
        blocks = torch.nn.ModuleList([FluxTransformerBlock(dim, heads, head_dim),
                                      FluxSingleTransformerBlock(dim, heads, head_dim)])
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
        "FluxTransformerBlock": 1, "FluxSingleTransformerBlock": 1, "AdaLayerNormZero": 2,
        "AdaLayerNormZeroSingle": 1, DOUBLE_ATTN: 1, SINGLE_ATTN: 1}
    expected = expected_ops(FUSIONS, 1, 1)
    expected["layernorm_modulate"] -= 1  # no output norm here
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
    print(f"full-size FLUX double + single block, 4096 + 512 tokens, bf16: relative L2 vs eager "
          f"{error:.2e}")
    assert error <= 1e-2
