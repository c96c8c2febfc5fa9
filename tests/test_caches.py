"""diffusers' caches on injected models: a model injected first and then given a cache
(FirstBlockCache, MagCache, PyramidAttentionBroadcast, FasterCache without and with CFG,
TaylorSeer) gives the outputs the stock model with the same cache gives, on every
call of a denoising-like sequence (the cache skipping blocks on the later ones), for every mapped
model family diffusers offers the caches for (SD3's model has no CacheMixin); diffusers finds the
patched blocks in its block registry."""

import pytest
import torch

import ltx_kernels
from inject_helpers import REL_L2_TOLERANCE, OpCounter, caller, clone, output_of, rel_l2
from model_zoo import MODELS

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")
hooks = pytest.importorskip("diffusers.hooks", reason="diffusers is not installed")

CACHED = ["ltx", "ltx2", "ltx23", "flux", "wan", "sd35", "hunyuan_video", "hunyuan_video15"]


# The timestep of the current call, for the caches that ask for it (FasterCache: its first call,
# at 999, is outside its skip range and fills the cache, as in a pipeline).
TIMESTEPS = (999, 500, 400, 300)
_TIMESTEP = [TIMESTEPS[0]]


def _apply(cache: str, model) -> None:
    """Gives `model` the cache named `cache`, configured to skip work from the second call on."""
    if cache == "first_block":
        hooks.apply_first_block_cache(model, hooks.FirstBlockCacheConfig(threshold=0.5))
    elif cache == "mag":
        # MagCache with fixed ratios (no calibration run): the later calls reuse the residual.
        hooks.apply_mag_cache(
            model,
            hooks.MagCacheConfig(
                threshold=1.0,
                max_skip_steps=2,
                retention_ratio=0.0,
                num_inference_steps=4,
                mag_ratios=torch.ones(4),
            ),
        )
    elif cache == "pyramid_attention_broadcast":  # through the models' enable_cache
        model.enable_cache(
            diffusers.PyramidAttentionBroadcastConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_timestep_skip_range=(-1, 10000),
                current_timestep_callback=lambda: 500,
            )
        )
    elif cache in ("faster", "faster_cfg"):
        # attention reuse; "faster" for a guidance-distilled model (no batch split), "faster_cfg"
        # with classifier-free guidance: the batch is (uncond, cond) and calls 1 and 3 run the
        # cond half only
        cfg = dict(
            low_frequency_weight_callback=lambda _: 1.1,
            high_frequency_weight_callback=lambda _: 1.1,
            unconditional_batch_skip_range=2,
            unconditional_batch_timestep_skip_range=(-1, 1000),
            tensor_format="BCFHW",
        )
        model.enable_cache(
            diffusers.FasterCacheConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_timestep_skip_range=(-1, 681),
                current_timestep_callback=lambda: _TIMESTEP[0],
                attention_weight_callback=lambda _: 0.5,
                is_guidance_distilled=cache == "faster",
                **(cfg if cache == "faster_cfg" else {}),
            )
        )
    else:
        # fp32 Taylor factors (default bf16): rounding stock's and the injected model's fp32
        # attention outputs (1e-7 apart) to bf16 flips an element at a rounding midpoint by one
        # bf16 ulp (4e-3), seen on HunyuanVideo (4e-5 relative L2 of the output).
        model.enable_cache(
            diffusers.TaylorSeerCacheConfig(
                cache_interval=2,
                disable_cache_before_step=1,
                max_order=1,
                taylor_factors_dtype=torch.float32,
            )
        )


# The caches that skip blocks or attention in these tiny models with the configs above (TaylorSeer
# skips on FLUX only: its default module patterns do not match LTX's or Wan's blocks).
ENGAGED = {"first_block", "mag", "pyramid_attention_broadcast", "faster", "faster_cfg"}
# FasterCache with CFG splits the model's output into frequencies: a video [B, C, F, H, W] output
# ("BCFHW"), which Wan's and HunyuanVideo's are (LTX's and FLUX's are packed tokens). Stock
# HunyuanVideo fails under it in diffusers 0.42.1 (its pooled text and guidance inputs are not
# halved with the batch), injected or not.
FASTER_CFG = {"wan", "hunyuan_video15"}


def _calls(model, call, steps=4):
    """Outputs of `steps` calls in one cache context, and the number of fused op calls of each."""
    outputs, op_calls = [], []
    for step in range(steps):
        _TIMESTEP[0] = TIMESTEPS[step]
        with model.cache_context("cond"), OpCounter() as counter:
            outputs.append(output_of(call(model)))
        op_calls.append(sum(counter.counts.values()))
    return outputs, op_calls


def _blocks_registered(model) -> bool:
    """Whether diffusers' TransformerBlockRegistry, which FirstBlockCache and MagCache look blocks
    up in, has the model's blocks (HunyuanVideo-1.5's are not registered in diffusers 0.42)."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = getattr(model, "transformer_blocks", None) or model.blocks
    try:
        TransformerBlockRegistry.get(type(blocks[0]))
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "cache",
    ["first_block", "mag", "pyramid_attention_broadcast", "faster", "faster_cfg", "taylorseer"],
)
@pytest.mark.parametrize("model_name", CACHED)
def test_cache_after_injection_matches_stock(model_name, cache):
    if cache == "faster_cfg" and model_name not in FASTER_CFG:
        pytest.skip("FasterCache's CFG branch needs a [B, C, F, H, W] model output")
    if (cache == "mag" and not hasattr(hooks, "apply_mag_cache")) or (
        cache == "taylorseer" and not hasattr(diffusers, "TaylorSeerCacheConfig")
    ):
        pytest.skip(f"this diffusers has no {cache} cache")
    spec = MODELS[model_name]
    model = spec.build(torch.float32)
    if not hasattr(model, "cache_context"):
        pytest.skip(f"diffusers offers no cache for {type(model).__name__} (no CacheMixin)")
    if cache in ("first_block", "mag") and not _blocks_registered(model):
        pytest.skip(f"diffusers' {cache} cache does not know {type(model).__name__}'s blocks")
    stock = clone(model)
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert report.total_patched > 0
    call = caller(spec.inputs(torch.float32))
    _apply(cache, stock)
    _apply(cache, model)
    with torch.no_grad():
        (expected, _), (got, op_calls) = _calls(stock, call), _calls(model, call)
    for step, (e, g) in enumerate(zip(expected, got)):
        error = rel_l2(g, e)
        assert error <= REL_L2_TOLERANCE[torch.float32], (
            f"{model_name} {cache} call {step}: {error}"
        )
    # The cache engaged: a later call skipped work (fewer fused op calls than the first).
    if cache in ENGAGED or model_name == "flux":
        assert min(op_calls[1:]) < op_calls[0], op_calls


def test_registry_knows_patched_blocks():
    from diffusers.hooks._helpers import TransformerBlockRegistry

    model = MODELS["ltx"].build(torch.float32)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    block = model.transformer_blocks[0]
    base = type(block).__mro__[1]
    assert type(block) is not base and type(block).__name__ == base.__name__
    assert TransformerBlockRegistry.get(type(block)).return_hidden_states_index == (
        TransformerBlockRegistry.get(base).return_hidden_states_index
    )
