"""The Linear layers of injected models (integration/linears.py): q/k/v projections fused into one
GEMM, and the opt-in FP8 path (inject_optimized_kernels(..., fp8=True)) of every family that has
one (LTX-Video, LTX-2, FLUX, Wan, HunyuanVideo) and its presets (fp8_linears). Tiny models
on the CPU (the FP8 GEMM dequantizes there; everything up to it is the GPU's code path), the
full-size model on the GPU."""

import pytest
import torch
import torch.utils._pytree as pytree

import ltx_kernels
from inject_helpers import (
    FP8_VS_BF16,
    assert_matches_eager,
    assert_no_fused_buffers,
    caller,
    clone,
    count_ltx_ops,
    eager_and_injected,
    fused_rows,
    gemms,
    output_of,
    rel_l2,
)
from ltx_kernels import reference
from ltx_kernels.integration import (
    FP8_PRESETS,
    FUSIONS,
    flux,
    hunyuan,
    injector,
    linears,
    ltx,
    ltx2,
    wan,
)
from model_zoo import flux as flux_zoo
from model_zoo import hunyuan as hunyuan_zoo
from model_zoo import ltx2 as ltx2_zoo
from model_zoo import wan as wan_zoo
from model_zoo.ltx import TINY, full_inputs, tiny_inputs, tiny_model

from diffusers import (  # noqa: E402  (inject_helpers skips without it)
    HunyuanVideo15Transformer3DModel,
    LTX2VideoTransformer3DModel,
    LTXVideoTransformer3DModel,
)

BF16 = torch.bfloat16
QKV = ("to_q", "to_k", "to_v")
FP8_LINEARS = ltx.FP8_PRESETS[ltx.FP8_DEFAULT]  # LTX-Video's block


def attn1s(model):
    return [block.attn1 for block in model.transformer_blocks]


def fp8_injected(model, **kwargs):
    with torch.no_grad():
        report = ltx_kernels.inject_optimized_kernels(model, verbose=False, fp8=True, **kwargs)
    return report


# ------------------------------------------------------------------------------------------------
# Fused q/k/v projections (bf16 and fp32)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_fused_qkv_shares_the_parameters_storage(dtype):
    model = tiny_model(dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters()}
    eager, injected, _ = eager_and_injected(model, caller(tiny_inputs(dtype)))
    assert_matches_eager(eager, injected, dtype, "fused q/k/v")
    assert {name: p for name, p in model.named_parameters()} == params  # the same objects
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    for attn in attn1s(model):  # the parameters are row blocks of one storage: no second copy
        fused_rows([getattr(attn, name) for name in QKV])
        fused_rows([getattr(attn, name) for name in QKV], "bias")
    assert_no_fused_buffers(model)  # (nothing but the parameters holds it)
    ltx_kernels.remove_optimized_kernels(model)
    for attn in attn1s(model):
        pointers = {getattr(attn, name).weight.data_ptr() for name in QKV}
        assert len(pointers) == 3
        assert all(
            getattr(attn, n).weight.untyped_storage().nbytes() == getattr(attn, n).weight.nbytes
            for n in QKV
        )  # each its own storage again


def test_fused_qkv_runs_one_gemm_instead_of_three():
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    unfused = clone(model)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    ltx_kernels.inject_optimized_kernels(
        unfused, verbose=False, ops=set(FUSIONS) - {"fused_projections"}
    )
    assert gemms(lambda: call(model)) == gemms(lambda: call(unfused)) - 2 * TINY["num_layers"]
    # a hook on a member: that attention runs the three modules (the hook sees its call)
    seen = []
    hook = model.transformer_blocks[0].attn1.to_k.register_forward_hook(
        lambda module, args, out: seen.append(out.shape)
    )
    assert gemms(lambda: call(model)) == gemms(lambda: call(unfused)) - 2 * TINY["num_layers"] + 2
    assert len(seen) == 1
    hook.remove()
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), output_of(call(unfused)))


def test_fused_qkv_sees_weights_written_or_reallocated_after_injection():
    model = tiny_model(BF16)
    inputs = tiny_inputs(BF16)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    stock = tiny_model(BF16)
    stock.load_state_dict(new_state)
    with torch.no_grad():
        expected = output_of(stock(**inputs))
        model.load_state_dict(new_state)  # in place: into the fused weight's row blocks
        assert torch.equal(output_of(model(**inputs)), expected)
        attn = model.transformer_blocks[1].attn1
        attn.to_v.weight.data = attn.to_v.weight.data * 0.5  # re-allocated: eager re-links
        stock.transformer_blocks[1].attn1.to_v.weight.data *= 0.5
        assert torch.equal(output_of(model(**inputs)), output_of(stock(**inputs)))
        model.to(torch.float32).to(BF16)  # every parameter re-allocated (as offloading does)
        assert torch.equal(output_of(model(**inputs)), output_of(stock(**inputs)))


def test_fused_qkv_can_be_disabled():
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    eager, injected, report = eager_and_injected(
        model, call, ops=set(FUSIONS) - {"fused_projections"}
    )
    assert torch.equal(output_of(injected), output_of(eager))
    assert not any("fused projections" in kind for kind in report.patched)
    for attn in attn1s(model):  # each its own storage
        assert all(
            getattr(attn, n).weight.untyped_storage().nbytes() == getattr(attn, n).weight.nbytes
            for n in QKV
        )


def test_rope_tables_are_computed_once_for_the_batch():
    """No video_coords: one [1, S, D] table for the batch (same values); with per-sample
    video_coords, each sample's own."""
    model = tiny_model(torch.float32)
    inputs = tiny_inputs(torch.float32)
    tables = []
    model.rope.register_forward_hook(lambda module, args, out: tables.append(out[0].shape))
    eager, injected, _ = eager_and_injected(model, caller(inputs))
    assert tables == [(2, 32, 16), (1, 32, 16)]
    assert_matches_eager(eager, injected, torch.float32, "shared tables")
    coords = torch.rand(2, 3, 32) * 20  # per-sample positions (LTXConditionPipeline)
    with torch.no_grad():
        out = model(**inputs, video_coords=coords)
        ltx_kernels.remove_optimized_kernels(model)
        stock = model(**inputs, video_coords=coords)
    assert tables[-1] == (2, 32, 16)
    assert rel_l2(output_of(out), output_of(stock)) <= 1e-5


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------
# Per model (family and variant): a tiny bf16 model of widths FP8 takes (multiples of 16), its
# inputs, {block list: the family's FP8 presets of each block} and the family's default preset.
def _wan(**config):
    return lambda: wan_zoo.tiny_model(BF16, attention_head_dim=16, ffn_dim=64, **config)


def _ltx2(release: str, variant=None):
    widths = ltx2_zoo.FP8_WIDTHS
    return (
        lambda: ltx2_zoo.tiny_model(BF16, release, **widths),
        lambda: ltx2_zoo.inputs(BF16, release, variant, **widths),
        {"transformer_blocks": ltx2.FP8_PRESETS},
        ltx2.FP8_DEFAULT,
    )


def _redrawn(model):
    """model with its blocks' Linear weights drawn again from the global RNG (fp8_model's seed:
    model_zoo.hunyuan seeds its models itself)."""
    with torch.no_grad():
        for module in model.transformer_blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features**-0.5)
    return model


def _hunyuan(v15: bool, variant=None, **config):
    return (
        lambda: _redrawn(hunyuan_zoo.tiny_model(BF16, v15=v15, **config)),
        lambda: hunyuan_zoo.tiny_inputs(BF16, v15=v15, variant=variant),
        {"transformer_blocks": hunyuan.FP8_PRESETS},  # (HunyuanVideo's single blocks: bf16)
        hunyuan.FP8_DEFAULT,
    )


FP8_MODELS = {
    "ltx": (
        lambda: tiny_model(BF16),
        lambda: tiny_inputs(BF16),
        {"transformer_blocks": ltx.FP8_PRESETS},
        ltx.FP8_DEFAULT,
    ),
    # LTX-Video 13B's LTXConditionPipeline: a timestep per token, modulation per token
    "ltx-per-token": (
        lambda: tiny_model(BF16),
        lambda: tiny_inputs(BF16, per_token=True),
        {"transformer_blocks": ltx.FP8_PRESETS},
        ltx.FP8_DEFAULT,
    ),
    "flux": (
        lambda: flux_zoo.tiny_model(BF16),
        lambda: flux_zoo.tiny_inputs(BF16),
        {
            "transformer_blocks": flux.DOUBLE_FP8_PRESETS,
            "single_transformer_blocks": flux.SINGLE_FP8_PRESETS,
        },
        flux.FP8_DEFAULT,
    ),
    "wan": (
        _wan(),
        lambda: wan_zoo.tiny_inputs(BF16),
        {"blocks": wan.FP8_PRESETS},
        wan.FP8_DEFAULT,
    ),
    "wan-i2v": (  # the image-context K/V stay bf16
        _wan(image_dim=wan_zoo.I2V["image_dim"], added_kv_proj_dim=32),
        lambda: wan_zoo.tiny_inputs(BF16, "i2v"),
        {"blocks": wan.FP8_PRESETS},
        wan.FP8_DEFAULT,
    ),
    "wan-ti2v": (  # Wan 2.2 TI2V: modulation per token
        _wan(),
        lambda: wan_zoo.tiny_inputs(BF16, "ti2v"),
        {"blocks": wan.FP8_PRESETS},
        wan.FP8_DEFAULT,
    ),
    "ltx2-2.0": _ltx2("2.0"),
    "ltx2-2.3-stg": _ltx2("2.3", "stg"),  # gated attention, text K/V modulation, STG
    "ltx2-2.5-i2v": _ltx2("2.5", "i2v"),  # FF without bias, per-token timesteps, keyframes
    "hunyuanvideo-1.5": _hunyuan(True),
    "hunyuanvideo-1.5-i2v": _hunyuan(True, "i2v", task_type="i2v"),
    "hunyuanvideo": _hunyuan(False),
}
#: The seed each model and its inputs are drawn from (fp8_model; default 0).
FP8_SEEDS: dict[str, int] = {}


def fp8_model(family: str):
    """(model, call) of FP8_MODELS[family], drawn from a fixed seed (FP8_SEEDS): one where no
    element lands within fp32 rounding of a bf16 tie that torch's CPU kernels and ours break
    apart (as model_zoo/ltx2.py's seed), which an FP8 rounding downstream would amplify into
    a different e4m3 value and the bit-for-bit comparisons with the stock emulation would see."""
    make_model, make_inputs, _, _ = FP8_MODELS[family]
    torch.manual_seed(FP8_SEEDS.get(family, 0))
    model = make_model()
    return model, caller(make_inputs())


NEW_FAMILIES = [f for f in FP8_MODELS if f.startswith(("ltx2", "hunyuan", "wan-", "ltx-"))]


def fp8_linear_names(model, family: str, preset: str | None = None) -> list[str]:
    """The Linears of `model` that run in FP8 with `preset` (default: the family's)."""
    _, _, blocks, default = FP8_MODELS[family]
    return [
        f"{block_list}.{index}.{path}"
        for block_list, presets in blocks.items()
        for index in range(len(model.get_submodule(block_list)))
        for path in presets[preset or default]
    ]


def samples(result) -> tuple:
    """Every output tensor of a forward (LTX-2: the video and the audio)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return tuple(v for v in (result.sample, getattr(result, "audio_sample", None)) if v is not None)


def assert_same_samples(a, b) -> None:
    for x, y in zip(samples(a), samples(b), strict=True):
        assert torch.equal(x, y)


def fp8_emulated(model, family: str = "ltx", preset: str | None = None):
    """A stock copy of `model` whose FP8 Linears compute what the FP8 path must: x's bf16 value
    quantized per row and the weight per output channel (reference.quantize_rows), the
    products summed in fp32, scaled by both scales, bias added, rounded once."""
    emulated = clone(model)
    for name in fp8_linear_names(emulated, family, preset):
        linear = emulated.get_submodule(name)
        weight, weight_scale = reference.quantize_rows(linear.weight.detach())

        def forward(x, linear=linear, weight=weight, weight_scale=weight_scale):
            q, scale = reference.quantize_rows(x)
            out = (q.float() @ weight.float().T) * scale[..., None] * weight_scale
            return (out if linear.bias is None else out + linear.bias.float()).to(x.dtype)

        linear.forward = forward
    return emulated


@pytest.mark.parametrize("preset", [None, *FP8_PRESETS])
@pytest.mark.parametrize("family", FP8_MODELS)
def test_fp8_computes_the_rowwise_rule_at_every_linear(family, preset):
    """Bit for bit the emulation at every Linear of the preset (None: the family's default),
    every other Linear bf16 as it was (LTX-2: the video and the audio output)."""
    model, call = fp8_model(family)
    with torch.no_grad():
        bf16 = samples(call(model))
        emulated = samples(call(fp8_emulated(model, family, preset)))
    report = fp8_injected(model, fp8_linears=preset)
    names = fp8_linear_names(model, family, preset)
    assert report.patched["Linear (FP8 GEMM)"] == len(names)
    fp8 = {name for name, m in model.named_modules() if isinstance(m, linears.Fp8Linear)}
    assert fp8 == set(names)
    assert "Linear (FP8 GEMM)" not in report.skipped
    with torch.no_grad():
        out = samples(call(model))
    for tensor, expected, reference_bf16 in zip(out, emulated, bf16, strict=True):
        assert torch.equal(tensor, expected)
        error = rel_l2(tensor, reference_bf16)
        assert 1e-3 < error <= FP8_VS_BF16, f"FP8 vs bf16 relative L2 {error:.3g}"


def test_fp8_weights_are_quantized_once_and_parked():
    model = tiny_model(BF16)
    weights = {
        name: (m.weight, m.weight.detach().clone())
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fp8_injected(model, keep_bf16_weights=True)
    for block in model.transformer_blocks:
        for path in FP8_LINEARS:
            linear = block.get_submodule(path)
            assert isinstance(linear, linears.Fp8Linear)
            q, scale = reference.quantize_rows(linear.weight.detach())
            assert linear.weight_fp8.dtype == torch.float8_e4m3fn
            assert torch.equal(linear.weight_fp8.view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(linear.weight_scale, scale)
            assert "weight_fp8" not in model.state_dict()
        assert type(block.attn2.to_k) is torch.nn.Linear  # text K/V stay bf16
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    ltx_kernels.remove_optimized_kernels(model)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert type(m) is torch.nn.Linear and not m._buffers
            assert m.weight is weights[name][0] and torch.equal(m.weight, weights[name][1])


def test_fp8_remove_restores_bit_identical_outputs():
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    with torch.no_grad():
        before = output_of(call(model))
    fp8_injected(model, keep_bf16_weights=True)
    ltx_kernels.remove_optimized_kernels(model)
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), before)
    fp8_injected(model, keep_bf16_weights=True)  # and again after removal


def test_fp8_op_counts():
    """Per block: norm1 and norm2 emit FP8 rows (attn1's q/k/v, one GEMM; the FF), the GELU emits
    them for the down projection; attn1's and attn2's output projections and attn2's query
    quantize their input (quantize). No linear_gelu (the FP8 GEMM has no GELU epilogue)."""
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    fp8_injected(model)
    layers = TINY["num_layers"]
    assert count_ltx_ops(lambda: call(model)) == {
        "rmsnorm_modulate_quant": layers,
        "add_rmsnorm_modulate_quant": layers,
        "quantize": 4 * layers,
        "qk_rmsnorm_rope": 2 * layers,
        "gated_residual": 2 * layers,
        "layernorm_modulate": 1,
    }


@pytest.mark.parametrize(
    "family", ["ltx", "flux", "ltx2-2.0", "ltx2-2.3-stg", "hunyuanvideo-1.5", "wan-i2v"]
)
@pytest.mark.parametrize("disabled", FUSIONS)
def test_fp8_each_fusion_disabled_alone_gives_the_same_output(disabled, family):
    """An FP8-output op quantizes exactly the value its bf16 twin returns, and that value is what
    the diffusers code computes (bf16 bit-identity): disabling any one fusion moves the
    quantization into the FP8 Linear and changes no bit (preset "all": every producer)."""
    model, call = fp8_model(family)
    reference_model = clone(model)
    fp8_injected(reference_model, fp8_linears="all")
    fp8_injected(model, ops=set(FUSIONS) - {disabled}, fp8_linears="all")
    with torch.no_grad():
        assert_same_samples(call(model), call(reference_model))


def test_fp8_flux_quantizes_each_activation_once():
    """Per FLUX block in FP8: the AdaLN norms emit FP8 rows (double: norm1 for the image q/k/v,
    one GEMM; single: its norm for q/k/v and proj_mlp, one GEMM), norm2 and the FF's GELU as
    before; quantize runs on the attention output (double: to_out; single: cat(attention,
    GELU(mlp)) into proj_out, one scale over the whole row) and in the FF's GELU. Before: 3
    quantize passes in each block, 4 GEMMs in the single block."""
    double, call = flux_zoo.tiny_block("double", BF16)
    fp8_injected(double)
    assert count_ltx_ops(lambda: call(double)) == {
        "layernorm_modulate_quant": 1,  # norm1 (image)
        "layernorm_modulate": 1,  # norm1_context (the text stream stays bf16)
        "add_layernorm_modulate_quant": 1,  # norm2 (image)
        "add_layernorm_modulate": 1,  # norm2_context
        "quantize": 2,  # the attention output (to_out), GELU -> ff.net.2
        "qk_rmsnorm_rope": 2,
        "gated_residual": 2,
        "linear_gelu": 1,  # ff_context
    }
    # the AdaLN linears 2, q/k/v 2 (image: FP8), to_out and to_add_out, the FFs 2 + 2
    assert gemms(lambda: call(double)) == 10
    single, call = flux_zoo.tiny_block("single", BF16)
    fp8_injected(single)
    assert count_ltx_ops(lambda: call(single)) == {
        "layernorm_modulate_quant": 1,
        "quantize": 1,  # cat(attention, GELU(mlp)) -> proj_out
        "gelu": 1,
        "qk_rmsnorm_rope": 1,
        "gated_residual": 1,
    }
    assert gemms(lambda: call(single)) == 3  # norm.linear, q/k/v + proj_mlp (FP8), proj_out


def test_fp8_flux_is_bit_identical_to_quantizing_in_each_linear():
    """The path before the norms emitted FP8 rows: hooks on the AdaLN norms make the blocks call
    them as modules (bf16 out: the hooks see tensors), and without fused_qkv_mlp the single
    block's q/k/v and proj_mlp quantize the same rows each. The same bits, with more passes."""
    model = flux_zoo.tiny_model(BF16)
    call = caller(flux_zoo.tiny_inputs(BF16))
    previous = clone(model)
    fp8_injected(model)
    fp8_injected(previous, ops=set(FUSIONS) - {"fused_qkv_mlp"})
    seen = []
    for norm in (previous.transformer_blocks[0].norm1, previous.single_transformer_blocks[0].norm):
        norm.register_forward_hook(lambda m, args, out: seen.append(type(out[0])))
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), output_of(call(previous)))
    assert seen == [torch.Tensor] * 2
    assert count_ltx_ops(lambda: call(model))["quantize"] == 2 + 1
    assert count_ltx_ops(lambda: call(previous))["quantize"] == 3 + 3


@pytest.mark.parametrize(
    "hooked",
    [
        "transformer_blocks.0.attn",
        "transformer_blocks.0.attn.to_k",
        "single_transformer_blocks.0.attn",
        "single_transformer_blocks.0.attn.to_q",
        "single_transformer_blocks.0.proj_mlp",
    ],
)
def test_fp8_flux_hooks_see_tensors_and_the_output_is_unchanged(hooked):
    """A hook on an attention or an FP8 Linear that takes a norm's output: the norm then returns
    its bf16 output and each FP8 Linear quantizes it itself: the same bits."""
    model = flux_zoo.tiny_model(BF16)
    call = caller(flux_zoo.tiny_inputs(BF16))
    fp8_injected(model)
    with torch.no_grad():
        expected = output_of(call(model))
    seen = []
    model.get_submodule(hooked).register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(type(args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True,
    )
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), expected)
    assert seen == [torch.Tensor]


def test_fp8_bf16_blocks_keeps_the_first_and_last_blocks():
    model = tiny_model(BF16, num_layers=3)
    call = caller(tiny_inputs(BF16))
    report = fp8_injected(model, fp8_bf16_blocks=1)
    kinds = [
        type(block.get_submodule(path))
        for block in model.transformer_blocks
        for path in ("ff.net.2",)
    ]
    assert kinds == [torch.nn.Linear, linears.Fp8Linear, torch.nn.Linear]
    assert report.patched["Linear (FP8 GEMM)"] == len(FP8_LINEARS)
    kept = report.skipped["Linear (FP8 GEMM)"]
    assert len(kept) == 2 * len(FP8_LINEARS)
    assert all(reason == "kept bf16 (fp8_bf16_blocks)" for _, reason in kept)
    with torch.no_grad():
        assert torch.isfinite(output_of(call(model))).all()
    with pytest.raises(ValueError, match="fp8_bf16_blocks must be >= 0"):
        ltx_kernels.inject_optimized_kernels(tiny_model(BF16), fp8=True, fp8_bf16_blocks=-1)


def test_fp8_skips_what_it_cannot_take_and_says_why():
    report = fp8_injected(tiny_model(torch.float32))
    assert "Linear (FP8 GEMM)" not in report.patched
    reasons = {reason for _, reason in report.skipped["Linear (FP8 GEMM)"]}
    assert reasons == {"weight is torch.float32; FP8 GEMMs write bf16 (bf16 models only)"}


def test_fp8_report_says_how_many_linears_run_in_fp8():
    """fp8=True on LTX-Video names its FP8 Linears and the preset; on a model without an FP8 path
    (SD3) the report says none runs in FP8, instead of claiming FP8 GEMMs."""
    from model_zoo import MODELS

    model = tiny_model(torch.bfloat16)
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False, fp8=True)
    count = report.patched["Linear (FP8 GEMM)"]
    line = str(report).splitlines()[0]
    assert count > 0 and f"FP8 GEMMs in {count} Linears (LTX-Video all)" in line
    sd3 = MODELS["sd3"].build(torch.bfloat16)
    report = ltx_kernels.inject_optimized_kernels(sd3, verbose=False, fp8=True)
    assert "Linear (FP8 GEMM)" not in report.patched
    assert "fp8=True: none of its Linears runs in FP8" in str(report).splitlines()[0]


def test_fp8_presets_are_checked():
    model = tiny_model(BF16)
    with pytest.raises(ValueError, match=r"fp8_linears='attn' is none of \('ffn'"):
        ltx_kernels.inject_optimized_kernels(model, fp8=True, fp8_linears="attn")
    with pytest.raises(ValueError, match="fp8_linears='ffn' needs fp8=True"):
        ltx_kernels.inject_optimized_kernels(model, fp8_linears="ffn")
    assert not any(ltx_kernels.integration.injector.is_injected(m) for m in model.modules())


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_fp8_remove_restores_every_family_exactly(family):
    """Every preset: remove_optimized_kernels gives back the plain Linears, their weight objects
    and values, the state dict, and the bit-identical stock output."""
    model, call = fp8_model(family)
    weights = {
        n: (m.weight, m.weight.detach().clone())
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = call(model)
    for preset in FP8_PRESETS:
        fp8_injected(model, fp8_linears=preset, keep_bf16_weights=True)
        ltx_kernels.remove_optimized_kernels(model)
        with torch.no_grad():
            assert_same_samples(call(model), before)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            assert type(m) is torch.nn.Linear and not m._buffers, name
            assert m.weight is weights[name][0] and torch.equal(m.weight, weights[name][1])
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)


def test_fp8_wan_2_2_injects_both_experts():
    """Wan 2.2 A14B: the pipeline's two experts (transformer, transformer_2) each get the FP8
    Linears of the preset."""
    import types

    make_model = FP8_MODELS["wan"][0]
    experts = {"transformer": make_model(), "transformer_2": make_model(), "vae": None}
    pipe = types.SimpleNamespace(components=experts)
    report = fp8_injected(pipe)
    per_expert = len(fp8_linear_names(experts["transformer"], "wan"))
    assert report.patched["Linear (FP8 GEMM)"] == 2 * per_expert
    for expert in ("transformer", "transformer_2"):
        model = experts[expert]
        fp8 = {n for n, m in model.named_modules() if isinstance(m, linears.Fp8Linear)}
        assert fp8 == set(fp8_linear_names(model, "wan"))


RMS = ("rmsnorm_modulate_quant", "add_rmsnorm_modulate_quant", "quantize")
LAYER = ("layernorm_modulate_quant", "add_layernorm_modulate_quant", "quantize")


@pytest.mark.parametrize(
    "family, preset, ops, per_block",
    [
        # LTX-2, per block, video and audio: the norms emit rows for every FP8 consumer (norm1:
        # q/k/v; norm2: the text query; the audio-video norm, once per modulation: the a2v query
        # and K/V, the v2a K/V and query; norm3: the FF); quantize runs on the attention outputs
        # (self, text, cross-modal) and in the FF's GELU.
        ("ltx2-2.0", "all", RMS, (4, 6, 8)),
        ("ltx2-2.0", "ffn+self_attn", RMS, (2, 2, 4)),
        ("ltx2-2.0", "ffn", RMS, (0, 2, 2)),
        # 2.3+: bf16 gate logits read every query input, so only the K/V norms (the audio's a2v,
        # the video's v2a) and norm3 emit rows; the self-attention quantizes q/k/v's input once,
        # the text and cross-modal queries quantize theirs (quantize: 7 per stream)
        ("ltx2-2.3-stg", "all", RMS, (1, 3, 14)),
        # HunyuanVideo-1.5 (image stream): the AdaLN norm1 for q/k/v, norm2 for the FF; to_out
        # and the GELU quantize ("all": the text stream's the same)
        ("hunyuanvideo-1.5", "all", LAYER, (2, 2, 4)),  # and the text stream's
        ("hunyuanvideo-1.5", "ffn+self_attn", LAYER, (1, 1, 2)),
        ("hunyuanvideo-1.5", "ffn", LAYER, (0, 1, 1)),
        # LTX-Video 13B's per-token modulation: the same as per sample
        ("ltx-per-token", "all", RMS, (1, 1, 4)),
        ("ltx-per-token", "ffn+self_attn", RMS, (1, 1, 2)),
        # Wan: norm2 emits rows only for an FP8 attn2 query ("all")
        ("wan", "ffn+self_attn", LAYER, (1, 1, 2)),
        ("wan", "all", LAYER, (1, 2, 3)),
    ],
)
def test_fp8_quantizes_in_the_producing_op(family, preset, ops, per_block):
    """The quantized-output ops (norm, add + norm) and quantize passes of a forward, per block."""
    model, call = fp8_model(family)
    fp8_injected(model, fp8_linears=preset)
    counts = count_ltx_ops(lambda: call(model))
    blocks = sum(len(model.get_submodule(name)) for name in FP8_MODELS[family][2])
    assert [counts.get(op, 0) for op in ops] == [n * blocks for n in per_block]


@pytest.mark.parametrize(
    "family, attention",
    [
        ("ltx2-2.0", "transformer_blocks.0.attn1"),
        ("ltx2-2.0", "transformer_blocks.1.audio_to_video_attn"),
        ("ltx2-2.3-stg", "transformer_blocks.0.video_to_audio_attn"),
        ("hunyuanvideo-1.5", "transformer_blocks.0.attn"),
    ],
)
def test_fp8_hooked_attention_sees_tensors_and_the_output_is_unchanged(family, attention):
    """A hook on an attention module added after injection: the norms then hand it tensors (the
    hook sees them), which its FP8 projections quantize: the same bits."""
    model, call = fp8_model(family)
    fp8_injected(model, fp8_linears="all")
    with torch.no_grad():
        expected = call(model)
    seen = []

    def record(module, args, kwargs):
        inputs = (*args, kwargs.get("hidden_states"), kwargs.get("encoder_hidden_states"))
        seen.extend(type(x) for x in inputs if x is not None)

    hook = model.get_submodule(attention).register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        assert_same_samples(call(model), expected)
    hook.remove()
    assert seen and set(seen) == {torch.Tensor}


def test_fp8_hooks_see_tensors_and_the_output_is_unchanged():
    """A hook on attn1 or on an FP8 Linear added after injection: the norm then returns its bf16
    output (the hook sees a tensor) and each FP8 Linear quantizes it itself: the same bits."""
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    fp8_injected(model)
    with torch.no_grad():
        expected = output_of(call(model))
    seen = []
    block = model.transformer_blocks[0]
    for module in (block.attn1, block.ff.net[0].proj, block.ff.net[2]):
        hook = module.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(type(args[0] if args else kwargs["hidden_states"])),
            with_kwargs=True,
        )
        with torch.no_grad():
            assert torch.equal(output_of(call(model)), expected)
        hook.remove()
    assert seen == [torch.Tensor] * 3


def test_fp8_sees_weights_loaded_after_injection():
    model = tiny_model(BF16)
    inputs = tiny_inputs(BF16)
    fp8_injected(model, keep_bf16_weights=True)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    fresh = tiny_model(BF16)
    fresh.load_state_dict(new_state)
    fp8_injected(fresh, keep_bf16_weights=True)
    with torch.no_grad():
        model.load_state_dict(new_state)  # into the parked weights: re-quantized at the next call
        assert torch.equal(output_of(model(**inputs)), output_of(fresh(**inputs)))
    # a weight replaced by another tensor (load_state_dict(assign=True), `linear.weight = ...`),
    # even one whose version counter matches the quantized one's: re-quantized too
    linear, stock_linear = (
        model.transformer_blocks[0].ff.net[2],
        fresh.transformer_blocks[0].ff.net[2],
    )
    replacement = torch.nn.Parameter(linear.weight.detach() * 0.5)
    with torch.no_grad():
        while replacement._version < linear.weight._version:
            replacement.mul_(1)
        assert replacement._version == linear.weight._version
        linear.weight = replacement
        stock_linear.weight.mul_(0.5)
        assert torch.equal(output_of(model(**inputs)), output_of(fresh(**inputs)))


@pytest.mark.parametrize("keep_bf16_weights", [True, False], ids=["kept", "freed"])
def test_fp8_compiled_blocks_see_weights_loaded_after_injection(keep_bf16_weights):
    # Compiled blocks make no eager call in which a stale FP8 weight would be re-quantized:
    # load_state_dict quantizes what it loads at once, into the same buffer objects (what group
    # offloading tracks and the compiled graph reads).
    torch._dynamo.reset()
    model, inputs = tiny_model(BF16), tiny_inputs(BF16)
    fp8_injected(model, keep_bf16_weights=keep_bf16_weights)
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    linear = model.transformer_blocks[0].ff.net[2]
    buffers = linear.weight_fp8, linear.weight_scale
    with torch.no_grad():
        output_of(model(**inputs))
    new_state = {
        k: v + 0.05 * torch.randn_like(v) for k, v in tiny_model(BF16).state_dict().items()
    }
    fresh = tiny_model(BF16)
    fresh.load_state_dict(new_state)
    fp8_injected(fresh, keep_bf16_weights=keep_bf16_weights)
    with torch.no_grad():
        model.load_state_dict(new_state)
        assert torch.equal(output_of(model(**inputs)), output_of(fresh(**inputs)))
    assert linear.weight_fp8 is buffers[0] and linear.weight_scale is buffers[1]  # (same objects)
    torch._dynamo.reset()


def test_fp8_leaves_projections_diffusers_fused_in_bf16_and_reports_them(monkeypatch):
    # diffusers' fuse_qkv_projections before injection: its to_qkv / to_added_qkv run (bf16), so
    # the q/k/v they replaced are not FP8 Linears, and the report counts the FP8 GEMMs that run.
    model, inputs = flux_zoo.tiny_model(BF16), flux_zoo.tiny_inputs(BF16)
    model.fuse_qkv_projections()
    report = fp8_injected(model)
    gemms = []
    matmul = linears.fp8_matmul
    monkeypatch.setattr(linears, "fp8_matmul", lambda *args: gemms.append(1) or matmul(*args))
    with torch.no_grad():
        model(**inputs)
    assert report.patched[injector.FP8_LINEAR] == len(gemms) > 0
    skipped = dict(report.skipped[injector.FP8_LINEAR])
    assert "diffusers' fuse_qkv_projections fused it" in skipped["transformer_blocks.0.attn.to_q"]


def cast_inputs(inputs: dict, dtype) -> dict:
    return pytree.tree_map(
        lambda v: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v, inputs
    )


@pytest.mark.parametrize("family", ["ltx", "ltx2-2.0", "wan", "hunyuanvideo-1.5", "flux"])
def test_fp8_model_cast_to_another_dtype_raises_clearly(family):
    # The FP8 GEMMs write the dtype of the model at injection (bf16): after model.to(dtype) the
    # first FP8 GEMM says so, on every path (an FP8 Linear given rows quantized by the norm op
    # before it, a fused group), instead of a dtype mismatch deep inside attention
    # (HunyuanVideo-1.5) or a silently mixed-dtype model (Wan). Device moves keep working.
    model, call = fp8_model(family)
    inputs = FP8_MODELS[family][1]()
    fp8_injected(model)
    with torch.no_grad():
        expected = samples(call(model))
        assert_same_samples(call(model.to("cpu")), expected)  # (a device move: not a cast)
    for dtype in (torch.float32, torch.float16):
        model.to(dtype)
        with torch.no_grad(), pytest.raises(RuntimeError, match="casting a model with FP8 Linears"):
            model(**cast_inputs(inputs, dtype))
        model.to(BF16)  # back to the dtype of injection: it runs (Wan's fp32 modules now bf16)
        with torch.no_grad():
            assert all(torch.isfinite(t).all() for t in samples(call(model)))


def test_fp8_sd3_stays_bf16_and_casts():
    """SD3 has no FP8 path: with fp8=True it stays a bf16 model, which casts as any model."""
    from model_zoo import sd3 as sd3_zoo

    model, inputs = sd3_zoo.tiny_model(BF16), sd3_zoo.tiny_inputs(BF16)
    report = fp8_injected(model)
    assert not report.patched.get(injector.FP8_LINEAR)
    model.to(torch.float32)
    with torch.no_grad():
        out = output_of(model(**cast_inputs(inputs, torch.float32)))
    assert out.dtype == torch.float32


def wrap_with_lora(model, name: str):
    """Model's Linear `name` wrapped in a peft LoRA Linear with a non-zero adapter (as add_adapter
    or load_lora_adapter do); returns a function that puts the Linear back in its place."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=4, lora_alpha=4, target_modules=[name], init_lora_weights=False)
    inject_adapter_in_model(config, model)
    parent, _, attr = name.rpartition(".")
    wrapper = model.get_submodule(name)
    return lambda: setattr(model.get_submodule(parent), attr, wrapper.base_layer)


ADAPTERS_AFTER_FP8 = "adapters added after FP8 injection .* are not supported"


@pytest.mark.parametrize("family", ["ltx", "ltx2-2.3-stg", "wan", "hunyuanvideo-1.5", "flux"])
def test_fp8_adapters_added_after_injection_raise(family):
    """A peft adapter added on an FP8 Linear after injection (its bf16 weight parked: peft can
    place it) raises at the first call, on each FP8 Linear of a block, whichever path runs it
    (FLUX's single block reads the FP8 weights of q/k/v and proj_mlp as one group: the adapters
    were dropped, the output that of the model without them); the Linear back in its place, the
    model runs as before."""
    model, call = fp8_model(family)
    fp8_injected(model, keep_bf16_weights=True, fp8_linears="all")
    with torch.no_grad():
        expected = samples(call(model))
    first_blocks = {f"{blocks}.0." for blocks in FP8_MODELS[family][2]}
    names = [n for n in fp8_linear_names(model, family, "all") if n.startswith(tuple(first_blocks))]
    for name in names:
        unwrap = wrap_with_lora(model, name)
        with torch.no_grad(), pytest.raises(RuntimeError, match=ADAPTERS_AFTER_FP8):
            call(model)
        unwrap()
    with torch.no_grad():
        assert_same_samples(call(model), expected)


def test_fp8_adapters_fused_after_injection_raise():
    """fuse_lora after FP8 injection merges into the parked bf16 weight's `.data`, which no version
    counter sees: the merged adapter (its wrapper still in place) raises like an unmerged one."""
    from peft import LoraConfig

    model, call = fp8_model("flux")
    fp8_injected(model, keep_bf16_weights=True)
    model.add_adapter(LoraConfig(r=4, target_modules=["proj_out"], init_lora_weights=False))
    model.fuse_lora()
    with torch.no_grad(), pytest.raises(RuntimeError, match=ADAPTERS_AFTER_FP8):
        call(model)


def test_fp8_adapters_added_after_injection_raise_compiled():
    """Under torch.compile(fullgraph=True) too (the compiled model's guards see the new module:
    the retrace raises; Dynamo reports our error as its own, with our message)."""
    torch._dynamo.reset()
    model, call = fp8_model("flux")
    fp8_injected(model, keep_bf16_weights=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        expected = samples(call(compiled))
    unwrap = wrap_with_lora(model, "single_transformer_blocks.0.proj_mlp")
    with torch.no_grad(), pytest.raises(Exception, match=ADAPTERS_AFTER_FP8):
        call(compiled)
    unwrap()
    with torch.no_grad():
        assert_same_samples(call(compiled), expected)


def test_fp8_injected_model_deepcopies_and_pickles(tmp_path):
    """copy.deepcopy and torch.save/torch.load of an FP8 model give a model of its own: the same
    output, and each FP8 Linear checks its own slot (an adapter on the copy raises on the copy,
    the original runs)."""
    model, call = fp8_model("flux")
    fp8_injected(model, keep_bf16_weights=True)
    with torch.no_grad():
        expected = samples(call(model))
    torch.save(model, tmp_path / "model.pt")
    for copied in (clone(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        with torch.no_grad():
            assert_same_samples(call(copied), expected)
        wrap_with_lora(copied, "single_transformer_blocks.0.attn.to_q")
        with torch.no_grad(), pytest.raises(RuntimeError, match=ADAPTERS_AFTER_FP8):
            call(copied)
        with torch.no_grad():
            assert_same_samples(call(model), expected)


def test_fused_fp8_projections_keep_their_buffer_objects():
    # A fused group re-linked (its members re-allocated: offloading, .to()) points the members'
    # FP8 buffers at the new rows in place: group offloading keeps tracking the same objects.
    model, inputs = tiny_model(BF16), tiny_inputs(BF16)
    fp8_injected(model)
    attn = model.transformer_blocks[0].attn1
    members = [attn.to_q, attn.to_k, attn.to_v]
    before = [(m.weight_fp8, m.weight_scale) for m in members]
    for m in members:  # (as offloading's onload does, one member at a time)
        m.weight_fp8.data = m.weight_fp8.data.clone()
    with torch.no_grad():
        model(**inputs)
    for m, (weight_fp8, weight_scale) in zip(members, before):
        assert m.weight_fp8 is weight_fp8 and m.weight_scale is weight_scale
    fused = [m.weight_fp8.untyped_storage().data_ptr() for m in members]
    assert len(set(fused)) == 1  # (re-linked: one storage again)


@pytest.mark.parametrize("keep_bf16_weights", [True, False], ids=["kept", "freed"])
@pytest.mark.parametrize(
    "built_in_inference_mode", [False, True], ids=["built_outside", "built_inside"]
)
def test_fp8_injected_inside_inference_mode(built_in_inference_mode, keep_bf16_weights, device):
    """inject_optimized_kernels(fp8=True) inside torch.inference_mode, as a script wrapping its
    whole run does (the model built outside, or inside it too: its parameters then are inference
    tensors, which have no version counter): the model runs there and outside, gives the output of
    the model injected outside, and weights loaded afterwards (in place, inside or outside) are
    re-quantized. (On the GPU injection parks each weight on the CPU: inside inference_mode that
    copy was an inference tensor, and its version counter raised at the first call.) The bf16
    weights parked or freed (then load_state_dict quantizes what it is given)."""
    inputs = tiny_inputs(BF16, device=device)
    reference_model = tiny_model(BF16).to(device)
    fp8_injected(reference_model, keep_bf16_weights=True)
    with torch.no_grad():
        expected = output_of(reference_model(**inputs))
    state = reference_model.state_dict()
    with torch.inference_mode(built_in_inference_mode):
        model = tiny_model(BF16).to(device)
        model.load_state_dict(state)
    with torch.inference_mode():
        ltx_kernels.inject_optimized_kernels(
            model, verbose=False, fp8=True, keep_bf16_weights=keep_bf16_weights
        )
        assert torch.equal(output_of(model(**inputs)), expected)
    with torch.no_grad():
        assert torch.equal(output_of(model(**inputs)), expected)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    fresh = tiny_model(BF16).to(device)
    fresh.load_state_dict(new_state)
    fp8_injected(fresh)
    with torch.no_grad():
        expected_new = output_of(fresh(**inputs))
    # (parameters made under inference_mode can only be written there)
    with torch.inference_mode(built_in_inference_mode), torch.no_grad():
        model.load_state_dict(new_state)
    with torch.inference_mode():
        assert torch.equal(output_of(model(**inputs)), expected_new)


def test_fused_projections_relinked_inside_inference_mode_stay_writable():
    """A fused group re-linked inside torch.inference_mode (its parameters re-allocated since:
    `.to()`, offloading) points them at normal tensors: load_state_dict writes them in place
    afterwards, outside inference_mode, and the next call reads what it wrote."""
    model = tiny_model(BF16)
    inputs = tiny_inputs(BF16)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    model.to(torch.float32).to(BF16)  # every parameter re-allocated: the next call re-links
    with torch.inference_mode():
        model(**inputs)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    stock = tiny_model(BF16)
    stock.load_state_dict(new_state)
    with torch.no_grad():
        model.load_state_dict(new_state)
        assert torch.equal(output_of(model(**inputs)), output_of(stock(**inputs)))


def test_fp8_is_inference_only():
    model = tiny_model(BF16)
    inputs = tiny_inputs(BF16)
    fp8_injected(model)
    model.train()
    with pytest.raises(RuntimeError, match=r"runs in FP8 .* which is for inference"):
        model(**inputs)
    model.eval()  # gradients through an FP8 op: backward raises naming it
    out = output_of(model(**{**inputs, "hidden_states": inputs["hidden_states"].requires_grad_()}))
    with pytest.raises(RuntimeError, match="has no backward: the FP8 path"):
        out.float().sum().backward()


def test_fp8_with_lora_adapters_loaded_first():
    """Adapters on the attention projections (peft), then FP8 injection: the adapted projections
    stay bf16 (reported), the others run in FP8; the output keeps the adapters' effect."""
    from peft import LoraConfig

    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # a non-zero adapter
    with torch.no_grad():
        bf16 = output_of(call(model))
    report = fp8_injected(model)
    skipped = dict(report.skipped["Linear (FP8 GEMM)"])
    assert len(skipped) == 4 * TINY["num_layers"]  # attn1's q/k/v, attn2's q (its k/v: bf16)
    assert all(
        reason.startswith("a peft.tuners.lora.layer.Linear, not a plain nn.Linear")
        for reason in skipped.values()
    )
    with torch.no_grad():
        out = output_of(call(model))
    assert rel_l2(out, bf16) <= FP8_VS_BF16


@pytest.mark.parametrize(
    "family, backend, timestep, blocks",
    [
        ("ltx", "inductor", lambda t: torch.randint(0, 1000, (2,)), False),
        ("flux", "aot_eager", lambda t: torch.rand(2, dtype=BF16), False),  # (Inductor: 20 s)
        # compile_repeated_blocks, as docs/fp8.md recommends (HunyuanVideo-1.5's model forward
        # branches on tensor values: no whole-model fullgraph, in diffusers either); LTX-2.5:
        # gated attention, per-token timesteps
        ("ltx2-2.5-i2v", "aot_eager", lambda t: t * 0.5, True),
        ("hunyuanvideo-1.5", "aot_eager", lambda t: t * 0.5, True),
    ],
)
def test_fp8_compiles_fullgraph_without_recompiling(family, backend, timestep, blocks):
    torch._dynamo.reset()
    make_model, make_inputs, _, _ = FP8_MODELS[family]
    model = make_model()
    inputs = make_inputs()
    fp8_injected(model, fp8_linears="all")
    with torch.no_grad():
        eager = samples(model(**inputs))
    if blocks:
        model.compile_repeated_blocks(fullgraph=True, backend=backend)
        compiled = model
    else:
        compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            compiled(**{**inputs, "timestep": timestep(inputs["timestep"])})
        out = samples(compiled(**inputs))
    assert all(rel_l2(a, b) <= 1e-2 for a, b in zip(out, eager, strict=True))


def test_fp8_moves_between_devices_keeping_the_weight_parked():
    model = tiny_model(BF16)
    call = caller(tiny_inputs(BF16))
    fp8_injected(model)
    with torch.no_grad():
        expected = output_of(call(model))
    model.to(torch.float32).to(BF16)  # a cast: the FP8 buffers keep their dtypes
    linear = model.transformer_blocks[0].ff.net[2]
    assert linear.weight_fp8.dtype == torch.float8_e4m3fn
    assert linear.weight_scale.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), expected)


# ------------------------------------------------------------------------------------------------
# FP8 memory: the bf16 weights freed one Linear at a time (or kept: keep_bf16_weights), fp8_device
# ------------------------------------------------------------------------------------------------
def live_weights_at_each_quantization(model, names, monkeypatch) -> list:
    """A list that gets, at each quantization of an FP8 Linear weight from now on, how many of the
    bf16 weights of `model`'s Linears `names` (their storages as they are now) are allocated."""
    from torch.multiprocessing.reductions import StorageWeakRef

    storages = [StorageWeakRef(model.get_submodule(n).weight.untyped_storage()) for n in names]
    live = []

    def counting(*args, **kwargs):
        live.append(sum(not storage.expired() for storage in storages))
        return ltx_kernels.ops.quantize(*args, **kwargs)

    monkeypatch.setattr(linears, "quantize", counting)
    return live


@pytest.mark.parametrize("family", ["ltx", "flux", "wan", "ltx2-2.0", "hunyuanvideo-1.5"])
def test_fp8_frees_each_bf16_weight_once_quantized(family, monkeypatch):
    """By default each FP8 Linear's bf16 weight is freed once its FP8 copy exists, before the next
    one is quantized (counted: at each quantization, the one quantized and those not reached yet
    are allocated; kept, all of them stay), the module's weight None; the FP8 weights, scales and
    outputs are the kept path's, bit for bit."""
    model, call = fp8_model(family)
    kept, _ = fp8_model(family)
    names = fp8_linear_names(model, family)
    live = live_weights_at_each_quantization(model, names, monkeypatch)
    fp8_injected(model)
    assert live == list(range(len(names), 0, -1))
    live_kept = live_weights_at_each_quantization(kept, names, monkeypatch)
    fp8_injected(kept, keep_bf16_weights=True)
    assert live_kept == [len(names)] * len(names)
    for name in names:
        linear, twin = model.get_submodule(name), kept.get_submodule(name)
        assert linear.weight is None and twin.weight is not None
        assert torch.equal(linear.weight_fp8.view(torch.uint8), twin.weight_fp8.view(torch.uint8))
        assert torch.equal(linear.weight_scale, twin.weight_scale)
    with torch.no_grad():
        assert_same_samples(call(model), call(kept))


def test_fp8_freed_weights_refuse_a_state_dict_and_load_quantized(tmp_path):
    """With the bf16 weights freed: state_dict and save_pretrained raise, naming the Linear and
    keep_bf16_weights (rather than leave the weights out); load_state_dict quantizes the weights
    it is given (the output of a model loaded with them before injection, bit for bit) and
    reports a weight of another shape; peft refuses adapters on a freed Linear (it has no weight
    to place them by); group offloading moves the FP8 weights (no parameter without values), and
    sequential offloading (accelerate's cpu_offload, which reads the state dict) raises."""
    from accelerate import cpu_offload
    from diffusers.hooks import apply_group_offloading
    from peft import LoraConfig

    model = tiny_model(BF16)
    inputs = tiny_inputs(BF16)
    new_state = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    fp8_injected(model)
    refusal = r"no state dict for transformer_blocks\.0\.attn1\.to_q\.weight: .*freed at inj"
    with pytest.raises(RuntimeError, match=refusal):
        model.state_dict()
    with pytest.raises(RuntimeError, match="keep_bf16_weights=True"):
        model.save_pretrained(tmp_path)
    loaded = tiny_model(BF16)
    loaded.load_state_dict(new_state)
    fp8_injected(loaded)
    with torch.no_grad():
        result = model.load_state_dict(new_state)
        assert not result.missing_keys and not result.unexpected_keys
        assert torch.equal(output_of(model(**inputs)), output_of(loaded(**inputs)))
    wrong = {"transformer_blocks.0.ff.net.2.weight": torch.zeros(3, 3, dtype=BF16)}
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer_blocks\.0\.ff\.net"):
        model.load_state_dict(wrong, strict=False)
    with pytest.raises(AttributeError):
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["ff.net.2"]))
    with pytest.raises(RuntimeError, match="keep_bf16_weights=True"):
        cpu_offload(model, execution_device=torch.device("cpu"))
    offloaded = tiny_model(BF16)
    offloaded.load_state_dict(new_state)
    fp8_injected(offloaded)
    apply_group_offloading(
        offloaded, torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    with torch.no_grad():
        assert torch.equal(output_of(offloaded(**inputs)), output_of(loaded(**inputs)))


@pytest.mark.parametrize("family", ["ltx", "wan", "ltx2-2.0", "hunyuanvideo-1.5"])
def test_fp8_remove_restores_freed_weights_dequantized(family):
    """remove_optimized_kernels on a model whose bf16 weights were freed: a warning, and plain
    Linears whose weights are their FP8 weights dequantized (weight_fp8 * weight_scale in bf16):
    the output of the stock model with those weights, bit for bit; the state dict works again,
    and the model injects again."""
    model, call = fp8_model(family)
    stock, _ = fp8_model(family)
    names = fp8_linear_names(model, family)
    fp8_injected(model)
    dequantized = {}
    for name in names:
        linear = model.get_submodule(name)
        dequantized[name] = (linear.weight_fp8.float() * linear.weight_scale[:, None]).to(BF16)
    with pytest.warns(UserWarning, match=r"weights of \d+ FP8 Linears .* dequantized from FP8"):
        ltx_kernels.remove_optimized_kernels(model)
    with torch.no_grad():
        for name in names:
            linear = model.get_submodule(name)
            assert type(linear) is torch.nn.Linear and not linear._buffers
            assert torch.equal(linear.weight, dequantized[name])
            stock.get_submodule(name).weight.copy_(dequantized[name])
        assert_same_samples(call(model), call(stock))
    assert model.state_dict().keys() == stock.state_dict().keys()
    fp8_injected(model)


def test_fp8_memory_options():
    """fp8_device on the device the weights are on changes nothing (bit for bit); the memory
    options without fp8=True raise."""
    model, call = fp8_model("ltx")
    on_device, _ = fp8_model("ltx")
    fp8_injected(model)
    fp8_injected(on_device, fp8_device="cpu")
    for name in fp8_linear_names(model, "ltx"):
        a, b = model.get_submodule(name), on_device.get_submodule(name)
        assert torch.equal(a.weight_fp8.view(torch.uint8), b.weight_fp8.view(torch.uint8))
    with torch.no_grad():
        assert_same_samples(call(model), call(on_device))
    for option in (dict(keep_bf16_weights=True), dict(fp8_device="cpu"), dict(fp8_bf16_blocks=2)):
        ((name, value),) = option.items()
        with pytest.raises(ValueError, match=f"{name}={value!r} needs fp8=True"):
            ltx_kernels.inject_optimized_kernels(tiny_model(BF16), **option)


# ------------------------------------------------------------------------------------------------
# Full size on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_full_size_fp8_gpu():
    """LTX-Video 2B, 2x2688 tokens: the FP8 model against the bf16 injected model, and the GPU
    memory FP8 injection frees: a byte per FP8 weight (the bf16 originals move to the CPU, their
    e4m3 copies stay), less the fp32 scales."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LTXVideoTransformer3DModel().to(BF16).eval()
    call = caller(full_inputs(2, 7, 16, 24, "cuda"))
    eager, injected, _ = eager_and_injected(model, call)
    ltx_kernels.remove_optimized_kernels(model)
    names = fp8_linear_names(model, "ltx")
    freed = sum((m.weight.numel() - 4 * m.out_features) for m in map(model.get_submodule, names))
    before = torch.cuda.memory_allocated()
    report = fp8_injected(model, keep_bf16_weights=True)
    after = torch.cuda.memory_allocated()
    assert report.patched["Linear (FP8 GEMM)"] == len(names) == 28 * len(FP8_LINEARS)
    with torch.no_grad():
        out = output_of(call(model))
    error, error_eager = rel_l2(out, output_of(injected)), rel_l2(out, output_of(eager))
    print(
        f"full-size LTX-Video FP8, 2x2688 tokens: relative L2 vs bf16 kernels {error:.2e}, vs "
        f"eager {error_eager:.2e}; GPU memory freed {(before - after) / 2**30:.2f} GiB "
        f"(expected {freed / 2**30:.2f})"
    )
    assert error <= FP8_VS_BF16
    assert abs((before - after) - freed) <= 0.01 * freed
    ltx_kernels.remove_optimized_kernels(model)
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), output_of(eager))


def _real_size(family: str, device="cuda", frames: int = 16):
    """(model, inputs) at real widths: FLUX.1 (one double and one single block, 4096 image + 512
    text tokens), Wan 2.1 1.3B (2 of its 30 layers, 81 frames at 480x832), LTX-2.3 (two blocks,
    image-to-video, 2 x (16 x 16 x 24 video + 126 audio) tokens, 1024 text) or HunyuanVideo-1.5
    480p (two blocks, 8 x 30 x 53 tokens); `frames` (LTX-2, HunyuanVideo-1.5: latent frames) and
    `device` for a smaller check off the GPU."""
    if family == "wan":
        return wan_zoo.layers_of_1_3b(BF16)
    if family == "ltx2-2.3-stg":
        torch.manual_seed(0)
        with torch.device(device):
            model = LTX2VideoTransformer3DModel(**ltx2_zoo.config("2.3", full=True, num_layers=2))
        clip = dict(frames=frames, height=16, width=24, audio_frames=126, text=1024)
        inputs = ltx2_zoo.inputs(BF16, "2.3", "i2v", full=True, device=device, **clip)
        return model.to(BF16).eval(), inputs
    if family == "hunyuanvideo-1.5":
        import step_inputs

        config = hunyuan_zoo.config_480p(num_layers=2)
        torch.manual_seed(0)
        with torch.device(device):
            model = HunyuanVideo15Transformer3DModel(**config).to(BF16).eval()
            inputs = step_inputs.hunyuan_video15(
                config,
                lambda *shape: torch.randn(*shape, dtype=BF16),
                batch=1,
                frames=frames // 2,
                height=30,
                width=53,
                text=256,
                text_2=64,
                image_tokens=729,
                image=lambda *shape: torch.zeros(*shape, dtype=BF16),
                timestep=torch.tensor([500.0], dtype=BF16),
                masks=(torch.ones(1, 256), torch.ones(1, 64)),
            )
        return model, inputs
    generator = torch.Generator("cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda", dtype=BF16)

    with torch.device("cuda"):
        model = flux_zoo.tiny_model(
            BF16,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
        )
        inputs = dict(
            hidden_states=randn(1, 4096, 64),
            encoder_hidden_states=randn(1, 512, 4096),
            pooled_projections=randn(1, 768),
            timestep=torch.full((1,), 0.5, dtype=BF16),
            img_ids=flux_zoo.image_ids(64, 64, "cuda"),
            txt_ids=torch.zeros(512, 3),
            return_dict=False,
        )
    return model, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("preset", FP8_PRESETS)
@pytest.mark.parametrize("family", ["flux", "wan", "ltx2-2.3-stg", "hunyuanvideo-1.5"])
def test_real_size_fp8_gpu(family, preset):
    torch.manual_seed(0)
    model, inputs = _real_size(family)
    call = caller(inputs)
    _, injected, _ = eager_and_injected(model, call)
    ltx_kernels.remove_optimized_kernels(model)
    report = fp8_injected(model, fp8_linears=preset)
    assert report.patched["Linear (FP8 GEMM)"] == len(fp8_linear_names(model, family, preset))
    with torch.no_grad():
        out = samples(call(model))
    errors = [rel_l2(a, b) for a, b in zip(out, samples(injected), strict=True)]
    print(
        f"{family} at real widths, FP8 {preset}: relative L2 vs bf16 kernels "
        + ", ".join(f"{e:.2e}" for e in errors)
    )
    assert all(error <= FP8_VS_BF16 for error in errors)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 10, 32, 127, 128, 300])
@pytest.mark.parametrize("k, n", [(8192, 2048), (2048, 8192), (5120, 13824), (13824, 5120)])
def test_fp8_matmul_with_bias_at_any_row_count_gpu(rows, k, n):
    """The FP8 GEMM with a bias for a few rows, where cuBLASLt has no fused algorithm (LTX-2's
    audio feed-forward: K 8192 -> N 2048): equal to the fp32 product of the same e4m3 operands."""
    from ltx_kernels.integration.linears import FP8_DTYPE, fp8_matmul
    from ltx_kernels.integration.quant import QuantRows

    torch.manual_seed(0)
    a = torch.randn(rows, k, device="cuda").to(FP8_DTYPE)
    weight = torch.randn(n, k, device="cuda").to(FP8_DTYPE)
    a_scale, w_scale = torch.rand(rows, device="cuda") + 0.5, torch.rand(n, device="cuda") + 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = fp8_matmul(QuantRows(a, a_scale, "e4m3_row"), weight, w_scale, bias, torch.bfloat16)
    expected = (a.double() @ weight.double().t()) * a_scale.double()[:, None] * w_scale.double()
    expected = expected + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # two bf16 roundings at most (the bias added after the GEMM); fast accumulation's fp32 sums
    assert rel_l2(out.double(), expected) <= 2 * 2**-8


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["ltx2-2.3-stg", "hunyuanvideo-1.5"])
def test_fp8_device_quantizes_a_cpu_model_onto_the_gpu(family):
    """A bf16 model at real widths on the CPU, injected with fp8_device="cuda" (a checkpoint the
    GPU could not hold in bf16): the GPU's peak during injection stays under what injection
    leaves there (the FP8 Linears' e4m3 weights, scales and biases, in the allocator's blocks:
    up to 1 MiB more each) plus the largest bf16 Linear weight (the one being quantized) plus
    the largest FP8 storage (a fused group, concatenated while its members still hold theirs)
    and 2 MiB; the FP8 weights are those of the model injected on the GPU bit for bit, and so is
    the output once the rest of the model is moved."""
    model, inputs = _real_size(family, device="cpu")
    call = caller(pytree.tree_map(lambda t: t.cuda() if torch.is_tensor(t) else t, inputs))
    on_gpu = clone(model).cuda()
    fp8_injected(on_gpu)
    names = fp8_linear_names(model, family)
    largest_bf16 = max(model.get_submodule(name).weight.nbytes for name in names)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    fp8_injected(model, fp8_device="cuda")
    peak = torch.cuda.max_memory_allocated() - start
    held = torch.cuda.memory_allocated() - start
    storages = {}  # the FP8 Linears' GPU storages (a fused group's members share one)
    for name in names:
        linear = model.get_submodule(name)
        for tensor in (linear.weight_fp8, linear.weight_scale, linear.bias):
            if tensor is not None:
                assert tensor.is_cuda
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    resident = sum(storages.values())
    bound = held + largest_bf16 + max(storages.values()) + 2 * 2**20
    print(
        f"{family} at real widths, fp8_device='cuda' from the CPU: GPU peak "
        f"{peak / 2**20:.1f} MiB, FP8 Linears {resident / 2**20:.1f} MiB (held "
        f"{held / 2**20:.1f}), largest bf16 Linear {largest_bf16 / 2**20:.1f} MiB, bound "
        f"{bound / 2**20:.1f} MiB"
    )
    assert resident <= held <= resident + 2**20 * len(storages)
    assert peak <= bound
    for name in names:
        linear, twin = model.get_submodule(name), on_gpu.get_submodule(name)
        assert torch.equal(linear.weight_fp8.view(torch.uint8), twin.weight_fp8.view(torch.uint8))
        assert torch.equal(linear.weight_scale, twin.weight_scale)
    model.cuda()
    with torch.no_grad():
        assert_same_samples(call(model), call(on_gpu))
