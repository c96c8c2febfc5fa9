"""inject_optimized_kernels tests that every model runs alike, parametrized over the tiny models of
model_zoo.MODELS: each op disabled alone (by `ops=` and by LTX_KERNELS_DISABLE), bf16 outputs
bit-identical to eager on the CPU, the attention backend kept, compile_repeated_blocks without
graph breaks or recompiles. The tests of one model alone are in test_inject_<model>.py."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    REL_L2_TOLERANCE,
    assert_backend_kept,
    assert_matches_eager,
    caller,
    clone,
    count_ltx_ops,
    eager_and_injected,
    output_of,
    quantize_linear_weights,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from model_zoo import MODELS


def models(*names):
    return [pytest.param(MODELS[name], id=name) for name in names]


@pytest.mark.parametrize("disabled", FUSIONS)
@pytest.mark.parametrize(
    "model",
    models(
        "ltx",
        "ltx_per_token",
        "ltx2",
        "ltx2_i2v",
        "ltx23",
        "ltx25_i2v",
        "flux",
        "wan_ti2v",
        "skyreels_v2_df",
        "chronoedit",
        "wan_animate",
        "sd35",
        "hunyuan_video",
        "hunyuan_video_i2v",
        "hunyuan_video15",
        "hunyuan_video15_i2v",
    ),
)
def test_each_op_can_be_disabled_alone(model, disabled, monkeypatch):
    tiny = model.build(torch.bfloat16)
    call = caller(model.inputs(torch.bfloat16))
    ops = [name for name in FUSIONS if name != disabled]
    eager, injected, report = eager_and_injected(tiny, call, ops=ops)
    assert disabled not in report.ops
    assert_matches_eager(eager, injected, torch.bfloat16, f"without {disabled}")
    counts = count_ltx_ops(lambda: call(tiny))
    assert disabled not in counts and counts == model.op_counts(disabled)
    ltx_kernels.remove_optimized_kernels(tiny)
    # The same through the environment variable.
    monkeypatch.setenv("LTX_KERNELS_DISABLE", f" {disabled} ,")
    ltx_kernels.inject_optimized_kernels(tiny, verbose=False)
    counts = count_ltx_ops(lambda: call(tiny))
    assert disabled not in counts and counts == model.op_counts(disabled)


@pytest.mark.parametrize(
    "model",
    models(
        "ltx",
        "ltx_per_token",
        "ltx2",
        "ltx2_i2v",
        "ltx23",
        "ltx25_i2v",
        "flux",
        "sd35",
        "sd3",
        "hunyuan_video",
        "hunyuan_video_i2v",
        "hunyuan_video15",
        "hunyuan_video15_i2v",
    ),
)
def test_bf16_is_bit_identical_on_cpu(model):
    # Every op rounds where diffusers' bf16 code rounds; the C backend sums in the same order as
    # far as the outputs show at this size. A regression in a rounding point shows up here first.
    ops = [name for name in FUSIONS if name not in model.bit_identical_without]
    eager, injected, _ = eager_and_injected(
        model.build(torch.bfloat16), caller(model.inputs(torch.bfloat16)), ops=ops
    )
    assert torch.equal(output_of(injected), output_of(eager))


@pytest.mark.parametrize(
    "model", models("ltx", "ltx2", "ltx23", "flux", "wan", "skyreels_v2", "chronoedit")
)
def test_attention_backend_is_kept(model):
    tiny = model.build(torch.float32)
    tiny.set_attention_backend("_native_math")
    eager, injected, _ = eager_and_injected(tiny, caller(model.inputs(torch.float32)))
    assert_matches_eager(eager, injected, torch.float32, "math backend")
    assert_backend_kept([m for m in tiny.modules() if hasattr(m, "processor")], model.processor)


@pytest.mark.parametrize(
    "model", models("ltx", "ltx2", "ltx23", "flux", "wan", "hunyuan_video", "hunyuan_video15")
)
def test_compile_repeated_blocks_fullgraph_cpu(model):
    # Dynamo and the fake kernels, without graph breaks or recompiles (Inductor on LTX only: it
    # takes 20 s a model here). (SkyReels-V2 is left out: its model hands the first block the
    # patch embedding transposed, which the stock blocks pass on while ours return rows, so the
    # first block compiles once more than the others.)
    torch._dynamo.reset()
    tiny = model.build(torch.float32)
    inputs = model.inputs(torch.float32)
    eager, _, _ = eager_and_injected(tiny, caller(inputs))
    tiny.compile_repeated_blocks(fullgraph=True, backend=model.compile_backend)
    blocks = [m for m in tiny.modules() if type(m).__name__ in tiny._repeated_blocks]
    assert blocks and all(block._compiled_call_impl is not None for block in blocks)
    with (
        torch.no_grad(),
        torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True),
    ):
        out = tiny(**inputs)
        out = tiny(**inputs)
    assert rel_l2(output_of(out), output_of(eager)) <= REL_L2_TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "model",
    models(
        "ltx", "ltx2", "ltx25_i2v", "flux", "wan_ti2v", "sd35", "hunyuan_video", "hunyuan_video15"
    ),
)
def test_quantized_linear_weights_fall_back(model):
    # Linear weights as a tensor subclass that, like torchao's Float8Tensor, runs aten ops only:
    # injection reports them and the fused steps that would hand them to our ops (linear_gelu)
    # run the diffusers code; the output is the stock model's with the same weights.
    tiny = model.build(torch.float32)
    call = caller(model.inputs(torch.float32))
    assert quantize_linear_weights(tiny) > 0
    eager, injected, report = eager_and_injected(tiny, call)
    assert_matches_eager(eager, injected, torch.float32, "quantized Linear weights")
    reasons = [reason for _, reason in report.skipped["quantized weights"]]
    assert reasons and all("weight is a QuantizedWeight" in r for r in reasons)
    assert "quantized weights" in str(report)
    assert "linear_gelu" not in count_ltx_ops(lambda: call(tiny))


# ------------------------------------------------------------------------------------------------
# Injected models under diffusers' loading and offloading paths
# ------------------------------------------------------------------------------------------------
ALL_FAMILIES = ("ltx", "ltx_per_token", "ltx2", "ltx23", "flux", "wan", "sd35", "hunyuan_video15")


@pytest.mark.parametrize("model", models(*ALL_FAMILIES))
def test_injected_while_empty_then_loaded(model):
    """Injection on a model built on the meta device (from_pretrained and accelerate's
    init_empty_weights do that, then load tensor by tensor): nothing injection builds is left on
    the meta device, and once diffusers' loader fills the parameters the model runs as the loaded
    stock model; fp8=True (quantized at injection) refuses clearly at inject time."""
    from accelerate import init_empty_weights
    from diffusers.models.model_loading_utils import load_model_dict_into_meta

    stock = model.build(torch.bfloat16)
    call = caller(model.inputs(torch.bfloat16))
    with init_empty_weights():
        empty = type(stock).from_config(stock.config)
    assert any(p.is_meta for p in empty.parameters())
    with pytest.raises(RuntimeError, match=r"fp8=True.*meta device.*inject after"):
        ltx_kernels.inject_optimized_kernels(empty, verbose=False, fp8=True)
    report = ltx_kernels.inject_optimized_kernels(empty, verbose=False)
    assert report.total_patched > 0
    load_model_dict_into_meta(empty, stock.state_dict(), dtype=torch.bfloat16)
    empty.eval()
    assert not any(t.is_meta for t in (*empty.parameters(), *empty.buffers()))
    empty.to("cpu")  # (failed with "Cannot copy out of meta tensor")
    with torch.no_grad():
        assert_matches_eager(call(stock), call(empty), torch.bfloat16, "injected while empty")


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("model", models(*ALL_FAMILIES))
def test_group_offload_to_disk_after_injection(model, offload_type, tmp_path):
    """enable_group_offload(..., offload_to_disk_path=...) saves each group's parameters and buffers
    with safetensors, which refuses tensors that overlap (it did: a fused q/k/v buffer over the
    three weights): it runs, and gives the stock model's output under the same offloading."""
    stock = model.build(torch.bfloat16)
    injected = clone(stock)
    call = caller(model.inputs(torch.bfloat16))
    ltx_kernels.inject_optimized_kernels(injected, verbose=False)
    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    for name, m in (("stock", stock), ("injected", injected)):
        m.enable_group_offload(
            torch.device("cpu"),
            offload_type=offload_type,
            offload_to_disk_path=str(tmp_path / name),
            **kwargs,
        )
    with torch.no_grad():
        expected = call(stock)
        for _ in range(2):  # (the second call loads the groups from disk again)
            assert_matches_eager(expected, call(injected), torch.bfloat16, "disk offload")


@pytest.mark.parametrize(
    "model",
    models(
        "ltx",
        "ltx2",
        "flux",
        "wan",
        "skyreels_v2",
        "chronoedit",
        "wan_animate",
        "sd35",
        "hunyuan_video",
        "hunyuan_video15",
    ),
)
def test_injected_model_deepcopies(model):
    # copy.deepcopy of an injected model (an EMA or reference copy) gives an injected model of its
    # own weights with the same outputs. (Wan's processors held the module of diffusers' q/k/v
    # helpers, which deepcopy cannot copy: "cannot pickle 'module' object".)
    tiny = model.build(torch.float32)
    call = caller(model.inputs(torch.float32))
    _, injected, _ = eager_and_injected(tiny, call)
    copy = clone(tiny)
    with torch.no_grad():
        assert torch.equal(output_of(call(copy)), output_of(injected))
    assert count_ltx_ops(lambda: call(copy)) == count_ltx_ops(lambda: call(tiny))
    params = dict(tiny.named_parameters())
    for name, p in copy.named_parameters():
        assert p.data_ptr() != params[name].data_ptr(), name


@pytest.mark.parametrize("model", models(*ALL_FAMILIES))
def test_patched_class_builds_stock_models_and_pickles(model, tmp_path):
    """type(model) of an injected model is the patched subclass: building from it
    (from_config, from_pretrained, a call) gives a stock model that injection then patches (it
    gave a patched instance without injection's state: forward raised AttributeError, injection
    said 'already injected'); torch.save / torch.load round-trips the injected model (it raised
    PicklingError: the same-named subclass is not what pickle finds under that name), which
    runs as it did and can be restored."""
    tiny = model.build(torch.float32)
    call = caller(model.inputs(torch.float32))
    stock_class = type(tiny)
    _, injected, _ = eager_and_injected(tiny, call)
    patched = type(tiny)
    if patched is not stock_class:  # (Wan's and SD3's model classes are not patched, their blocks)
        assert patched._ltx_kernels_original_class is stock_class
        for fresh in (patched.from_config(tiny.config), patched(**tiny.config)):
            assert type(fresh) is stock_class
            fresh.load_state_dict(tiny.state_dict())
            ltx_kernels.inject_optimized_kernels(fresh.eval(), verbose=False)
            with torch.no_grad():
                assert torch.equal(output_of(call(fresh)), output_of(injected))
    path = tmp_path / "model.pt"
    torch.save(tiny, path)
    loaded = torch.load(path, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in tiny.modules()]
    with torch.no_grad():
        assert torch.equal(output_of(call(loaded)), output_of(injected))
    assert count_ltx_ops(lambda: call(loaded)) == count_ltx_ops(lambda: call(tiny))
    assert ltx_kernels.remove_optimized_kernels(loaded) > 0 and type(loaded) is stock_class


# ------------------------------------------------------------------------------------------------
# Pipelines: every component or none
# ------------------------------------------------------------------------------------------------
def _module_state(model) -> list:
    """Per module: its name, class, attribute names, processor, and each parameter and buffer
    (the object, its storage, a copy of its values)."""
    return [
        (
            name,
            type(m),
            sorted(vars(m)),
            getattr(m, "processor", None),
            [
                (key, t, t.data_ptr(), t.detach().clone())
                for key, t in (*m._parameters.items(), *m._buffers.items())
                if t is not None
            ],
        )
        for name, m in model.named_modules()
    ]


def _assert_same_state(model, before) -> None:
    for (name, cls, attrs, processor, tensors), now in zip(
        before, _module_state(model), strict=True
    ):
        assert now[:3] == (name, cls, attrs), name
        assert now[3] is processor, f"{name}: processor replaced"
        for (key, t, ptr, values), (_, t_now, ptr_now, _) in zip(tensors, now[4], strict=True):
            assert t_now is t and ptr_now == ptr and torch.equal(t, values), f"{name}.{key}"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_pipeline_with_a_failing_component_is_left_as_it_was(fp8):
    """A component that raises at injection (here Wan, whose last block a hook wraps) leaves the
    whole pipeline as it was: the component patched before it (LTX-Video) keeps its classes,
    processors, parameter objects, storages (no fused q/k/v) and bf16 weights (no FP8 weights,
    nothing freed), and gives the same output; so does the failing one's block patched before
    the raise. (The earlier components stayed injected, their FP8 weights quantized and their
    bf16 weights freed.)"""
    good, failing = MODELS["ltx"].build(torch.bfloat16), MODELS["wan"].build(torch.bfloat16)
    call = caller(MODELS["ltx"].inputs(torch.bfloat16))
    hooked = failing.blocks[-1]
    forward = hooked.forward
    hooked.forward = lambda *args, **kwargs: forward(*args, **kwargs)  # (as an offload hook)
    pipe = type("Pipe", (), {"components": {"transformer": good, "transformer_2": failing}})()
    before = {name: _module_state(m) for name, m in pipe.components.items()}
    with torch.no_grad():
        expected = output_of(call(good))
        last = f"transformer_2.blocks.{len(failing.blocks) - 1}"
        with pytest.raises(RuntimeError, match=f"cannot patch {last} "):
            ltx_kernels.inject_optimized_kernels(pipe, verbose=False, fp8=fp8)
        assert torch.equal(output_of(call(good)), expected)
    for name, model in pipe.components.items():
        _assert_same_state(model, before[name])
    del hooked.forward
    report = ltx_kernels.inject_optimized_kernels(pipe, verbose=False, fp8=fp8)
    assert report.patched["LTXVideoTransformerBlock"] and report.patched["WanTransformerBlock"]


def test_pipeline_with_a_model_under_two_names_injects_it_once():
    """Two components that are one model (Wan 2.2 with one expert under transformer and
    transformer_2, or any two attributes naming one module), or a component inside another (here
    the model's block list), inject each module once, reported under the first name;
    remove_optimized_kernels restores it. (The second name raised 'already injected'.)"""
    for name, block_list in (("ltx", "transformer_blocks"), ("wan", "blocks")):
        model, call = MODELS[name].build(torch.float32), caller(MODELS[name].inputs(torch.float32))
        single = clone(model)
        alone = ltx_kernels.inject_optimized_kernels(single, verbose=False)
        components = {
            "transformer": model,
            "transformer_2": model,
            "blocks": model.get_submodule(block_list),
        }
        pipe = type("Pipe", (), {"components": components})()
        with torch.no_grad():
            eager = output_of(call(model))
            report = ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
            injected = output_of(call(model))
        assert report.patched == alone.patched and report.total_patched > 0
        names = [n for entries in report.skipped.values() for n, _ in entries]
        assert all(n.partition(".")[0] == "transformer" for n in names), names
        assert_matches_eager(eager, injected, torch.float32, name)
        restored = ltx_kernels.remove_optimized_kernels(pipe)
        assert restored == ltx_kernels.remove_optimized_kernels(single) > 0
        with torch.no_grad():
            assert torch.equal(output_of(call(model)), eager)
