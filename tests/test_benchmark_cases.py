"""The whole-model benchmark cases (benchmarks/transformer_cases.py) and the real configs they build
from (configs/*.json): every config builds its class at the published size; every case's shapes are
its token counts; bench_utils.random_model's weights; (GPU) every case at full width and full
shape, one block of each kind, injected vs eager."""

import json
import sys
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed")

import ltx_kernels  # noqa: E402
from inject_helpers import REL_L2_TOLERANCE, rel_l2  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_utils  # noqa: E402
import transformer_cases  # noqa: E402

CONFIGS = sorted(p.stem for p in bench_utils.CONFIGS.glob("*.json"))
# Published parameter counts of the transformers (billions), to 2 digits.
PARAMETERS = {
    "ltx-video-0.9.1": 1.9,
    "ltx-video-0.9.5": 1.9,
    "ltx-video-0.9.7-dev": 13,
    "ltx-video-0.9.8-13b-distilled": 13,
    "ltx-2": 19,
    "ltx-2.3": 19,
    "ltx-2.5": 19,
    "wan2.1-t2v-1.3b": 1.4,
    "wan2.1-t2v-14b": 14,
    "flux.1-dev": 12,
    "sd3.5-large": 8.1,
    "hunyuanvideo-1.5-480p-t2v": 8.3,
}


def meta_model(name: str):
    transformer = bench_utils.model_config(name)["transformer"]
    with accelerate.init_empty_weights():
        return getattr(diffusers, transformer["class"])(**transformer["config"])


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_the_published_size(name):
    data = json.loads((bench_utils.CONFIGS / f"{name}.json").read_text())
    assert {"model_id", "source", "transformer"} <= data.keys() and data["source"]
    billions = sum(p.numel() for p in meta_model(name).parameters()) / 1e9
    assert billions == pytest.approx(PARAMETERS[name], rel=0.05)


def test_every_config_has_its_size_and_an_unknown_one_is_named():
    assert set(CONFIGS) == set(PARAMETERS)
    with pytest.raises(ValueError, match="no config 'ltx-9'.*known: flux.1-dev"):
        bench_utils.model_config("ltx-9")


@pytest.mark.parametrize("name", list(transformer_cases.CASES))
def test_case_shapes_are_its_token_counts(name):
    case = transformer_cases.CASES[name]
    assert case.config in CONFIGS
    grids = {
        "LTX-Video": transformer_cases.LTX_GRIDS,
        "LTX-2": transformer_cases.LTX_GRIDS,
        "Wan": transformer_cases.WAN_GRIDS,
        "HunyuanVideo-1.5": transformer_cases.HUNYUAN15_GRIDS,
    }.get(case.family)
    for tokens in case.shapes:
        if grids is None:  # images: a square of patches
            assert round(tokens**0.5) ** 2 == tokens
        else:
            frames, height, width = grids[tokens]
            assert frames * height * width == tokens


def test_random_model_weights():
    """Every parameter initialized (finite, not the meta placeholder), in bf16 but for the class's
    float32-kept modules, the same for the same seed; norm scales 1, tables ~ N(0, 1/D)."""
    config = dict(
        bench_utils.model_config("wan2.1-t2v-1.3b")["transformer"]["config"],
        num_layers=1,
        num_attention_heads=2,
        ffn_dim=64,
    )
    cls = diffusers.WanTransformer3DModel
    model = bench_utils.random_model(cls, config, torch.bfloat16, "cpu", seed=3)
    again = bench_utils.random_model(cls, config, torch.bfloat16, "cpu", seed=3)
    other = bench_utils.random_model(cls, config, torch.bfloat16, "cpu", seed=4)
    assert not model.training
    for (name, p), q, r in zip(
        model.named_parameters(), again.parameters(), other.parameters(), strict=True
    ):
        kept = any(part in cls._keep_in_fp32_modules for part in name.split("."))
        assert p.dtype == (torch.float32 if kept else torch.bfloat16), name
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
        assert torch.equal(p, q), name
        if p.numel() > 16 and p.float().std() > 0:
            assert not torch.equal(p, r), name
    table = model.blocks[0].scale_shift_table  # an nn.Parameter no reset_parameters covers
    assert table.float().std().item() == pytest.approx(table.shape[-1] ** -0.5, rel=0.2)
    assert torch.equal(model.blocks[0].attn1.norm_q.weight, torch.ones_like(table[0, 0]))
    for name, buffer in model.named_buffers():  # the RoPE tables: computed, kept in float32
        assert buffer.dtype == torch.float32 and torch.isfinite(buffer).all(), name
    out = model(**transformer_cases.wan_inputs(model, 32760, torch.Generator().manual_seed(0)))[0]
    assert torch.isfinite(out).all()


# One block of each kind at full width and the full shape: the inputs reach every patched step.
ONE_BLOCK = dict(num_layers=1)
ONE_BLOCK_OVERRIDES = {
    "flux": dict(num_layers=1, num_single_layers=1),
    "hunyuanvideo-1.5": dict(num_layers=1, num_refiner_layers=1),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(transformer_cases.CASES))
def test_case_one_block_injected_gpu(name):
    model, call, tokens = transformer_cases.build(
        name, None, **ONE_BLOCK_OVERRIDES.get(name, ONE_BLOCK)
    )
    with torch.no_grad():
        eager = call(model)
        report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
        injected = call(model)
    assert torch.isfinite(eager).all() and eager.float().std() > 0
    family_blocks = {
        "LTX-Video": "LTXVideoTransformerBlock",
        "LTX-2": "LTX2VideoTransformerBlock",
        "Wan": "WanTransformerBlock",
        "FLUX": "FluxSingleTransformerBlock",
        "SD3": "JointTransformerBlock",
        "HunyuanVideo-1.5": "HunyuanVideo15TransformerBlock",
    }
    assert report.patched[family_blocks[transformer_cases.CASES[name].family]] == 1
    error = rel_l2(injected, eager)
    print(f"{name} one block, {tokens} tokens: rel L2 {error:.2e}")
    assert error <= REL_L2_TOLERANCE[torch.bfloat16]
