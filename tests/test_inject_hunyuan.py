"""inject_optimized_kernels on HunyuanVideo and HunyuanVideo-1.5: tiny models on the CPU (diffusers'
own test configs): HunyuanVideo T2V, I2V latent_concat and token_replace, FramePack,
HunyuanVideo-1.5 t2v and i2v; exact op counts, RoPE on the image rows only, the patch embedding
(transposed in diffusers), compile_repeated_blocks without recompiles, the full-size reports on the
meta device. Each op disabled alone, bf16 bit-identity and the other per-model tests:
test_inject_models.py."""

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    assert_backend_kept,
    assert_matches_eager,
    assert_remove_restores,
    caller,
    count_ltx_ops,
    eager_and_injected,
    output_of,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS
from ltx_kernels.integration.hunyuan import DOUBLE_ATTN, PATCH_EMBED, SINGLE_ATTN, V15_ATTN
from model_zoo.hunyuan import (
    LATENT_CONCAT,
    TEXT,
    TOKEN_REPLACE,
    config_480p,
    expected_ops,
    framepack_inputs,
    tiny_framepack,
    tiny_inputs,
    tiny_model,
)

from diffusers import (  # noqa: E402  (inject_helpers skips without diffusers)
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoTransformer3DModel,
)
from diffusers.models.transformers import transformer_hunyuan_video as hv  # noqa: E402
from diffusers.models.transformers import transformer_hunyuan_video15 as hv15  # noqa: E402

FP32_TOLERANCE = 1e-6  # relative L2 vs eager: only the summation order differs


def report_for(double: int, single: int, v15: bool = False) -> dict:
    blocks = (
        {"HunyuanVideo15TransformerBlock": double, V15_ATTN: double}
        if v15
        else {
            "HunyuanVideoTransformerBlock": double,
            "HunyuanVideoSingleTransformerBlock": single,
            DOUBLE_ATTN: double,
            SINGLE_ATTN: single,
        }
    )
    adaln = {"AdaLayerNormZero": 2 * double, "AdaLayerNormContinuous": 1, PATCH_EMBED: 1}
    if single:
        adaln["AdaLayerNormZeroSingle"] = single
    return {**blocks, **adaln}


# (model config, v15, input variant, double blocks, single blocks, bf16 bit-identical)
VARIANTS = {
    "hunyuan_video": (dict(num_layers=2, num_single_layers=2), False, None, 2, 2, True),
    # Not bit-identical in bf16 with these inputs: one element of the per-head diffusers RMSNorm
    # (x * rsqrt(mean(x^2) + eps), exactly -1.77734379) lies 4e-8 beyond a bf16 rounding midpoint
    # (-1.77734375), and torch's CPU fp32 rsqrt, one ulp low there, puts diffusers' product on the
    # near side; our rmsnorm rounds correctly (the SD3.5 caveat, model_zoo/__init__.py).
    # Bit-identical without the rmsnorm op: test_inject_models.py.
    "hunyuan_video_i2v": (
        dict(LATENT_CONCAT, num_layers=2, num_single_layers=2),
        False,
        "latent_concat",
        2,
        2,
        False,
    ),
    "hunyuan_video15": ({}, True, None, 2, 0, True),
    "hunyuan_video15_i2v": ({}, True, "i2v", 2, 0, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_matches_eager_and_restores(variant, dtype):
    config, v15, inputs, double, single, bit_identical = VARIANTS[variant]
    model = tiny_model(dtype, v15, **config)
    call = caller(tiny_inputs(dtype, v15, inputs))
    eager, injected, report = eager_and_injected(model, call)
    if dtype == torch.float32:
        assert rel_l2(output_of(injected), output_of(eager)) <= FP32_TOLERANCE
    elif bit_identical:  # every fused step rounds where diffusers' bf16 code rounds
        assert torch.equal(output_of(injected), output_of(eager))
    else:
        assert_matches_eager(eager, injected, dtype, variant)
    assert dict(report.patched) == report_for(double, single, v15)
    assert not report.skipped
    counts = count_ltx_ops(lambda: call(model))
    assert counts == expected_ops(FUSIONS, double, single)
    assert all(counts[op] > 0 for op in ("rmsnorm", "rope", "add_layernorm_modulate"))
    assert_remove_restores(model, call, eager)
    processors = {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}
    stock = "HunyuanVideo15AttnProcessor2_0" if v15 else "HunyuanVideoAttnProcessor2_0"
    assert stock in processors and not any("Kernels" in p for p in processors)


def test_token_replace_blocks_stay_stock_with_patched_attention():
    # HunyuanVideo I2V (16 channels): the first frame's rows get their own modulation in blocks
    # that are not mapped; their attention (the same processor) and norm1_context are.
    model = tiny_model(torch.bfloat16, **TOKEN_REPLACE, num_layers=2, num_single_layers=2)
    call = caller(tiny_inputs(torch.bfloat16, variant="token_replace"))
    eager, injected, report = eager_and_injected(model, call)
    assert torch.equal(output_of(injected), output_of(eager))
    assert dict(report.patched) == {
        DOUBLE_ATTN: 2,
        SINGLE_ATTN: 2,
        "AdaLayerNormZero": 2,
        "AdaLayerNormContinuous": 1,
        PATCH_EMBED: 1,
    }
    for kind, prefix in (
        ("HunyuanVideoTokenReplaceTransformerBlock", "transformer_blocks"),
        ("HunyuanVideoTokenReplaceSingleTransformerBlock", "single_transformer_blocks"),
    ):
        entries = report.skipped[kind]
        assert [name for name, _ in entries] == [f"{prefix}.0", f"{prefix}.1"]
        assert all("token-replace" in reason for _, reason in entries)
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, 2, 2, token_replace=True)
    assert_remove_restores(model, call, eager)


def test_framepack_uses_the_hunyuan_video_blocks():
    model = tiny_framepack(torch.bfloat16)
    call = caller(framepack_inputs(torch.bfloat16))
    eager, injected, report = eager_and_injected(model, call)
    assert torch.equal(output_of(injected), output_of(eager))
    assert dict(report.patched) == report_for(1, 1) and not report.skipped
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, 1, 1)
    assert_remove_restores(model, call, eager)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------
def _single_block_qk(block, hidden, text, temb, rope):
    """(q, k) that `block`'s attention hands to the attention backend."""
    from diffusers.models import attention_dispatch

    seen = []
    original = attention_dispatch.dispatch_attention_fn

    def record(query, key, *args, **kwargs):
        seen.append((query, key))
        return original(query, key, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(hv, "dispatch_attention_fn", record)  # diffusers' processor
    mp.setattr(attention_dispatch, "dispatch_attention_fn", record)  # ours
    try:
        with torch.no_grad():
            block(hidden, text, temb, None, rope)
    finally:
        mp.undo()
    [qk] = seen
    return qk


class RopeRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the number of rows (dim 1) of each tensor the rope op rotates."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ltx_kernels" and func._schema.name.split("::")[-1] == "rope":
            self.rows.append(args[0].shape[1])
        return func(*args, **(kwargs or {}))


def test_single_block_rotates_the_image_rows_only():
    dtype, image_rows = torch.bfloat16, 32
    model = tiny_model(dtype)
    block = model.single_transformer_blocks[0]
    rope = model.rope(torch.zeros(1, 4, 2, 4, 4))  # fp32 [image_rows, head_dim] cos and sin
    assert rope[0].shape == (image_rows, 16)
    torch.manual_seed(0)
    hidden = torch.randn(2, image_rows, 32, dtype=dtype)
    text, temb = torch.randn(2, TEXT, 32, dtype=dtype), torch.randn(2, 32, dtype=dtype)
    eager_q, eager_k = _single_block_qk(block, hidden, text, temb, rope)
    ltx_kernels.inject_optimized_kernels(block, verbose=False)
    with RopeRows() as spy:
        q, k = _single_block_qk(block, hidden, text, temb, rope)
    assert spy.rows == [image_rows, image_rows]  # q and k: the image rows, not the text
    assert torch.equal(q, eager_q) and torch.equal(k, eager_k)
    with torch.no_grad():  # the text rows are normed, not rotated
        normed = block.norm(torch.cat([hidden, text], dim=1), emb=temb)[0]
        text_q = block.attn.to_q(normed)[:, image_rows:].unflatten(2, (2, -1))
        assert torch.equal(q[:, image_rows:], block.attn.norm_q(text_q))


@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_blocks_match_eager_on_every_row(v15):
    # Both streams of the blocks, padded text rows included (the model's output shows the image
    # rows only): HunyuanVideo's double + single block with the model's [B, 1, 1, S] key mask,
    # a HunyuanVideo-1.5 block with its [B, S_txt] text mask, which the processor turns into
    # [B, 1, S, S] (a key-only mask would change the padded text rows).
    dtype, image_rows, text_rows = torch.bfloat16, 32, 5
    model = tiny_model(dtype, v15)
    rope = model.rope(torch.zeros(1, 4, 2, 4, 4))
    torch.manual_seed(0)
    hidden = torch.randn(2, image_rows, 32, dtype=dtype)
    text, temb = torch.randn(2, text_rows, 32, dtype=dtype), torch.randn(2, 32, dtype=dtype)
    text_mask = torch.ones(2, text_rows, dtype=torch.bool)
    text_mask[0, 3:] = False
    if v15:
        blocks = model.transformer_blocks[:1]
        mask = text_mask.float()
    else:
        blocks = torch.nn.ModuleList(
            [model.transformer_blocks[0], model.single_transformer_blocks[0]]
        )
        mask = torch.cat([torch.ones(2, image_rows, dtype=torch.bool), text_mask], 1)[:, None, None]

    def call(modules):
        h, e = hidden, text
        for block in modules:
            h, e = block(h, e, temb, mask, rope)
        return torch.cat([h, e], dim=1)

    eager, injected, _ = eager_and_injected(blocks, call)
    assert torch.isfinite(eager).all() and torch.equal(injected, eager)
    expected = expected_ops(FUSIONS, 1, 0 if v15 else 1)
    expected["layernorm_modulate"] -= 1  # no output norm here
    assert count_ltx_ops(lambda: call(blocks)) == expected


@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_custom_processor_is_kept_and_reported(v15):
    stock = hv15.HunyuanVideo15AttnProcessor2_0 if v15 else hv.HunyuanVideoAttnProcessor2_0
    MyProcessor = type("MyProcessor", (stock,), {})
    model = tiny_model(torch.bfloat16, v15)
    call = caller(tiny_inputs(torch.bfloat16, v15))
    model.transformer_blocks[0].attn.set_processor(MyProcessor())
    eager, injected, report = eager_and_injected(model, call)
    assert torch.equal(output_of(injected), output_of(eager))
    kind = V15_ATTN if v15 else DOUBLE_ATTN
    double, single = (2, 0) if v15 else (1, 1)
    assert report.patched[kind] == double - 1
    [(name, reason)] = report.skipped[kind]
    assert name == "transformer_blocks.0.attn" and "MyProcessor" in reason
    assert isinstance(model.transformer_blocks[0].attn.processor, MyProcessor)
    # The block stays fused; only that attention's q/k norm + RoPE runs as in diffusers.
    expected = expected_ops(FUSIONS, double, single)
    expected["rmsnorm"] -= 4
    expected["rope"] -= 2
    assert count_ltx_ops(lambda: call(model)) == expected


def test_same_named_class_from_elsewhere_is_left_alone():
    class HunyuanVideoTransformerBlock(hv.HunyuanVideoTransformerBlock):  # a user's fork
        pass

    block = HunyuanVideoTransformerBlock(2, 16, 4.0)
    report = ltx_kernels.inject_optimized_kernels(block, verbose=False)
    assert dict(report.patched) == {"AdaLayerNormZero": 2}  # diffusers' own, inside the fork
    [(name, reason)] = report.skipped["HunyuanVideoTransformerBlock"]
    assert name == "" and "not a diffusers HunyuanVideo module" in reason
    assert type(block.attn.processor).__name__ == "HunyuanVideoAttnProcessor2_0"


@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_attention_backend_is_kept(v15, monkeypatch):
    # (test_inject_models.py's version expects every attention module patched; the token
    # refiner's stays stock here.)
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    # set_attention_backend also sets diffusers' global active backend: restored afterwards.
    monkeypatch.setattr(
        _AttentionBackendRegistry, "_active_backend", _AttentionBackendRegistry._active_backend
    )
    model = tiny_model(torch.float32, v15)
    model.set_attention_backend("_native_math")
    eager, injected, _ = eager_and_injected(model, caller(tiny_inputs(torch.float32, v15)))
    assert rel_l2(output_of(injected), output_of(eager)) <= FP32_TOLERANCE
    blocks = [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]
    processor = "HunyuanVideo15KernelsAttnProcessor" if v15 else "HunyuanVideoKernelsAttnProcessor"
    assert_backend_kept([block.attn for block in blocks], processor)
    refiner = [m for m in model.context_embedder.modules() if hasattr(m, "processor")]
    assert refiner and all(type(m.processor).__name__ == "AttnProcessor2_0" for m in refiner)


def test_hunyuan_video_key_mask_keeps_the_parallel_config(monkeypatch):
    # HunyuanVideo's processor turns its key mask into key lengths only without context
    # parallelism (attend's key lengths would attend this rank's rows alone); under a parallel
    # config (diffusers has no plan for the model: a user's) the mask and the config reach
    # diffusers' parallel attention, as in stock.
    from types import SimpleNamespace

    from ltx_kernels.integration import hunyuan

    calls = []
    monkeypatch.setattr(hunyuan, "attend", lambda *args, **kwargs: calls.append(kwargs))
    processor = hunyuan.HunyuanVideoKernelsAttnProcessor()
    processor.ops = frozenset(FUSIONS)
    query = torch.randn(2, 6, 2, 8)
    mask = (torch.arange(6) < torch.tensor([6, 4])[:, None])[:, None, None]
    processor._attend(query, query, query, mask)
    assert calls.pop() == {"key_lengths": (6, 4)}
    processor._parallel_config = SimpleNamespace(context_parallel_config=object())
    processor._attend(query, query, query, mask)
    assert calls.pop() == {"mask": mask, "parallel_config": processor._parallel_config}


# ------------------------------------------------------------------------------------------------
# Patch embedding: diffusers hands block 0 a transposed [B, S, D] view
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_hooked_patch_embedding_is_reported_and_strided_rows_fall_back(v15):
    # A hook on the patch embedding (added before injection) keeps diffusers' forward: block 0
    # then gets the transposed view, and the residual sums keep that layout, so the image stream
    # of every double block (and HunyuanVideo-1.5's output norm) runs the diffusers code; the
    # output is still eager's.
    from diffusers.hooks import HookRegistry, ModelHook

    model = tiny_model(torch.bfloat16, v15)
    call = caller(tiny_inputs(torch.bfloat16, v15))
    HookRegistry.check_if_exists_or_initialize(model.x_embedder).register_hook(ModelHook(), "noop")
    eager, injected, report = eager_and_injected(model, call)
    assert torch.equal(output_of(injected), output_of(eager))
    [(name, reason)] = report.skipped[PATCH_EMBED]
    assert name == "x_embedder" and "hook" in reason
    double, single = (2, 0) if v15 else (1, 1)
    expected = expected_ops(FUSIONS, double, single)
    for op in ("layernorm_modulate", "add_layernorm_modulate", "gated_residual"):
        expected[op] -= double  # norm1, x + gate * attn with norm2, the FF residual
    expected["layernorm_modulate"] -= single == 0  # norm_out after a double block
    assert count_ltx_ops(lambda: call(model)) == expected


@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_compile_repeated_blocks_compiles_each_block_once(v15):
    # The contiguous patch embedding gives block 0 the strides of the other blocks, fused (a
    # .contiguous() in the block instead would compile block 0 twice). One single block: the
    # second would compile again, in stock diffusers too (the first hands it slices of its
    # output, whose batch stride counts the text rows).
    torch._dynamo.reset()
    double, single = (2, 0) if v15 else (2, 1)
    model = tiny_model(
        torch.float32, v15, num_layers=double, **({} if v15 else {"num_single_layers": single})
    )
    inputs = tiny_inputs(torch.float32, v15)
    eager, _, _ = eager_and_injected(model, caller(inputs))
    assert count_ltx_ops(lambda: model(**inputs)) == expected_ops(FUSIONS, double, single)
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    with (
        torch.no_grad(),
        torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True),
    ):
        out = model(**inputs)
        out = model(**inputs)
    assert rel_l2(output_of(out), output_of(eager)) <= FP32_TOLERANCE


# ------------------------------------------------------------------------------------------------
# Full size on the meta device
# ------------------------------------------------------------------------------------------------
def test_full_size_reports_on_meta():
    with torch.device("meta"):
        model = HunyuanVideoTransformer3DModel()  # HunyuanVideo 13B: the diffusers defaults
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert dict(report.patched) == report_for(20, 40) and not report.skipped
    with torch.device("meta"):
        model = HunyuanVideo15Transformer3DModel(**config_480p())
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert dict(report.patched) == report_for(54, 0, v15=True) and not report.skipped
