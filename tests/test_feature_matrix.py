"""The diffusers feature matrix (issue 32): every mapped family (LTX-Video, LTX-2, FLUX.1, Wan 2.x,
SD3.5, HunyuanVideo-1.5) injected before and after each diffusers and torch feature a pipeline is
used with: offloading (model, sequential, group: block and leaf level, streams, disk), layerwise
casting, fused q/k/v projections, attention backends, every cache diffusers exports, LoRA (load,
set_adapters, fuse, unfuse, unload, hotswap), save/from_pretrained, torch.compile (default,
dynamic=True, max-autotune, reduce-overhead), torch.export and AOT Inductor, inference_mode,
no_grad, autograd. Each cell runs the stock model and the injected one under the same feature,
with the same weights and inputs, and expects one of: the stock outputs within the dtype's
tolerance (the fused ops running, and any fallback the report names beyond the family's own), a
clear error at injection, or, where stock diffusers itself fails under the feature, the same
failure. docs/feature_matrix.md is this table (`python tests/test_feature_matrix.py` prints it;
test_docs_table_is_current checks it).

CPU: model_zoo's tiny models in fp32 (the compile and export cells compare against the stock
model in eager mode, one fp32 summation order away); compiled cells use aot_eager (the fake
kernels, functionalization and the traced forwards; whole-model Inductor on the CPU is
test_inject_ltx.py::test_compile_fullgraph_no_recompile_cpu), dynamic=True runs for three
families and AOT Inductor for one (FLUX): about 3 minutes on two cores. GPU (@pytest.mark.gpu):
each family's real widths with 1-2 blocks in bf16 (autograd in fp32), every cell, compiled with
Inductor, each against the stock model under the same feature."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import pathlib
import re
import tempfile
from typing import Callable

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    FP8_VS_BF16,
    REL_L2_TOLERANCE,
    OpCounter,
    clone,
    output_of,
    randomize_norms,
    rel_l2,
)
from model_zoo import MODELS, flux, ltx, ltx2, wan

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")
peft = pytest.importorskip("peft", reason="peft is not installed")
#: (the tiny models' calls: on a GPU the 8-bit rows take it at every length,
#: conftest.int8_at_every_length)
pytestmark = pytest.mark.usefixtures("int8_at_every_length")

#: model_zoo name -> the family's column in docs/feature_matrix.md.
FAMILIES = {
    "ltx": "LTX-Video",
    "ltx2": "LTX-2",
    "flux": "FLUX.1",
    "wan": "Wan 2.x",
    "sd35": "SD3.5",
    "hunyuan_video15": "HunyuanVideo-1.5",
}
ORDERS = ("before", "after")  # inject before / after the feature
DOC = pathlib.Path(__file__).parent.parent / "docs" / "feature_matrix.md"


# ------------------------------------------------------------------------------------------------
# Where cells run, and the models
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setup:
    """The CPU (tiny models, fp32) or the GPU (real widths, bf16)."""

    device: str
    dtype: torch.dtype

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


SETUPS = {"cpu": Setup("cpu", torch.float32), "gpu": Setup("cuda", torch.bfloat16)}


def _randn(*shape, device, dtype, generator):
    return torch.randn(*shape, generator=generator, device=device).to(dtype)


def _real_ltx(dtype, device):
    from diffusers import LTXVideoTransformer3DModel

    with torch.device(device):  # LTX-Video 2B's widths, 2 of its 28 blocks
        model = LTXVideoTransformer3DModel(num_layers=2)
    return randomize_norms(model.to(dtype), tables=True)


def _real_ltx2(dtype, device):
    from diffusers import LTX2VideoTransformer3DModel

    with torch.device(device):  # LTX-2's widths (video 4096, audio 2048), 2 of its 48 blocks
        model = LTX2VideoTransformer3DModel(**ltx2.config("2.0", full=True, num_layers=2))
    return randomize_norms(model.to(dtype), tables=True)


def _real_flux(dtype, device):
    from diffusers import FluxTransformer2DModel

    with torch.device(device):  # FLUX.1-dev's widths: a double and a single block
        model = FluxTransformer2DModel(num_layers=1, num_single_layers=1, guidance_embeds=True)
    return randomize_norms(model.to(dtype))


def _real_wan(dtype, device):
    from diffusers import WanTransformer3DModel

    with torch.device(device):  # Wan 2.1 1.3B's widths, 2 of its 30 blocks
        model = WanTransformer3DModel(
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            ffn_dim=8960,
            num_layers=2,
        )
    return wan.load_as(wan.randomize(model), dtype)


def _real_sd35(dtype, device):
    from diffusers import SD3Transformer2DModel

    with torch.device(device):  # SD3.5 Medium's widths: a dual-attention block and a plain one
        model = SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            num_layers=2,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=384,
            qk_norm="rms_norm",
            dual_attention_layers=(0,),
        )
    return randomize_norms(model.to(dtype))


def _real_hunyuan_video15(dtype, device):
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device(device):  # HunyuanVideo-1.5 480p T2V's widths, 2 of its 54 blocks
        model = HunyuanVideo15Transformer3DModel(num_layers=2, task_type="t2v")
    return randomize_norms(model.to(dtype))


def _real_inputs(family, batch, dtype, device):
    """One forward's keyword arguments for the real-width model of `family` (a few hundred tokens)."""
    generator = torch.Generator(device).manual_seed(0)
    randn = functools.partial(_randn, device=device, dtype=dtype, generator=generator)
    full = functools.partial(torch.full, device=device)
    if family == "ltx":
        return ltx.full_inputs(batch, 2, 8, 8, device, dtype, text=64)
    if family == "ltx2":
        return ltx2.inputs(dtype, "2.0", batch=batch, full=True, device=device)
    if family == "flux":
        return dict(
            hidden_states=randn(batch, 256, 64),
            encoder_hidden_states=randn(batch, 32, 4096),
            pooled_projections=randn(batch, 768),
            timestep=full((batch,), 0.5, dtype=dtype),
            guidance=full((batch,), 3.5, dtype=dtype),
            img_ids=flux.image_ids(16, 16, device),
            txt_ids=torch.zeros(32, 3, device=device),
            return_dict=False,
        )
    if family == "wan":
        return dict(
            hidden_states=randn(batch, 16, 3, 16, 16),
            timestep=full((batch,), 500.0),
            encoder_hidden_states=randn(batch, 64, 4096),
            return_dict=False,
        )
    if family == "sd35":
        return dict(
            hidden_states=randn(batch, 16, 32, 32),
            encoder_hidden_states=randn(batch, 64, 4096),
            pooled_projections=randn(batch, 2048),
            timestep=full((batch,), 500.0),
            return_dict=False,
        )
    mask = torch.ones(batch, 32, device=device)
    mask[0, 20:] = 0
    return dict(  # HunyuanVideo-1.5 T2V: all-zero image tokens
        hidden_states=randn(batch, 65, 2, 16, 16),
        timestep=full((batch,), 500.0, dtype=dtype),
        encoder_hidden_states=randn(batch, 32, 3584),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=randn(batch, 16, 1472),
        encoder_attention_mask_2=torch.ones(batch, 16, device=device),
        image_embeds=torch.zeros(batch, 16, 1152, device=device, dtype=dtype),
        return_dict=False,
    )


REAL_WIDTH = {
    "ltx": _real_ltx,
    "ltx2": _real_ltx2,
    "flux": _real_flux,
    "wan": _real_wan,
    "sd35": _real_sd35,
    "hunyuan_video15": _real_hunyuan_video15,
}


@functools.cache
def _base_model(family: str, setup: Setup, dtype: torch.dtype) -> torch.nn.Module:
    """The module's one build of each model (fixed seed); each Subject takes a copy."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if setup.gpu:
            return REAL_WIDTH[family](dtype, setup.device).eval()
        return MODELS[family].build(dtype).eval()


@functools.cache
def _inputs(family: str, setup: Setup, dtype: torch.dtype, batch: int) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        if setup.gpu:
            return _real_inputs(family, batch, dtype, setup.device)
        return MODELS[family].inputs(dtype, batch=batch)


# ------------------------------------------------------------------------------------------------
# A model as a user holds it
# ------------------------------------------------------------------------------------------------
#: The LoRA loader of each family's pipeline (HunyuanVideo15Pipeline has none in diffusers 0.42.1:
#: its cells use the model's own PeftAdapterMixin methods, load_lora_adapter and the like).
LORA_LOADERS = {
    "ltx": "LTXVideoLoraLoaderMixin",
    "ltx2": "LTX2LoraLoaderMixin",
    "flux": "FluxLoraLoaderMixin",
    "wan": "WanLoraLoaderMixin",
    "sd35": "SD3LoraLoaderMixin",
    "hunyuan_video15": None,
}


@functools.cache
def _pipeline_class(family: str) -> type:
    """A minimal DiffusionPipeline holding the transformer, with the family's LoRA loader: what
    the pipeline-level features (offloading, load_lora_weights, ...) need."""
    from diffusers import DiffusionPipeline, loaders

    mixin = LORA_LOADERS[family]
    bases = (DiffusionPipeline,) if mixin is None else (DiffusionPipeline, getattr(loaders, mixin))

    def __init__(self, transformer):
        DiffusionPipeline.__init__(self)
        self.register_modules(transformer=transformer)

    attributes = dict(
        __init__=__init__,
        model_cpu_offload_seq="transformer",
        text_encoder=None,  # the LoRA loaders of FLUX and SD3 look for their text encoders
        text_encoder_2=None,
    )
    return type(f"{family.title().replace('_', '')}TransformerPipeline", bases, attributes)


class Subject:
    """One model of a cell: `model` (the transformer), `pipe` (a minimal pipeline holding it),
    `call` (what a forward goes through: the model, or its compiled, exported or reloaded form),
    `target` (what inject_optimized_kernels is given), `report` (its InjectionReport)."""

    def __init__(self, family: str, setup: Setup, dtype: torch.dtype, tmp: pathlib.Path):
        self.family, self.setup, self.dtype, self.tmp = family, setup, dtype, tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.model = clone(_base_model(family, setup, dtype))
        self.pipe = _pipeline_class(family)(self.model)
        self.call = self.target = self.model
        self.report = None
        self.inject_options: dict = {}

    def inputs(self, batch: int = 2) -> dict:
        return _inputs(self.family, self.setup, self.dtype, batch)

    def forward(self, batch: int = 2):
        return output_of(self.call(**self.inputs(batch)))

    def inject(self) -> None:
        """Injects the pipeline (or the compiled model, when the feature made one)."""
        target = self.pipe if self.target is self.model else self.target
        self.report = ltx_kernels.inject_optimized_kernels(
            target, verbose=False, **self.inject_options
        )

    @property
    def injected(self) -> bool:
        return self.report is not None

    def replace_model(self, model: torch.nn.Module) -> None:
        """Continues with `model` (a reloaded copy), injected as this one was."""
        self.model = self.call = self.target = model.eval()
        self.pipe = _pipeline_class(self.family)(model)
        if self.injected:
            ltx_kernels.inject_optimized_kernels(model, verbose=False, **self.inject_options)


# ------------------------------------------------------------------------------------------------
# Outcomes
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Equal:
    """The stock outputs within tolerance, the fused ops running; `fallback`: the report kinds
    injection skips under the feature beyond those it skips on the family without it."""

    fallback: tuple = ()
    note: str = ""  # what the fallback is, for docs/feature_matrix.md


@dataclasses.dataclass(frozen=True)
class Raises:
    """inject_optimized_kernels raises this clear error (after the feature)."""

    match: str
    note: str
    error: type = RuntimeError


@dataclasses.dataclass(frozen=True)
class StockFails:
    """Stock diffusers fails under the feature (applying it or in the forward); the injected
    model fails the same way, in either order."""

    error: type
    match: str
    note: str


@dataclasses.dataclass(frozen=True)
class AsStock:
    """Not pinned yet (GPU-only cells not run so far): the stock outputs, or the error stock
    raises."""


EQUAL = Equal()
# LTX-Video's, LTX-2's and Wan's blocks hold parameters of their own (scale_shift_table), so
# leaf-level hooks (group offloading, sequential offloading) wrap the blocks themselves.
BLOCK_PARAMETERS = frozenset({"ltx", "ltx2", "wan"})
# The model-level patch of each family that a hook on the model (enable_model_cpu_offload,
# FasterCache's and TextKVCache's model hooks) makes injection skip and report.
MODEL_PATCH = {
    "ltx": "LTXVideoTransformer3DModel (output norm)",
    "ltx2": "LTX2VideoTransformer3DModel (output norms)",
}
HOOKED_BLOCKS = Raises(
    r"cannot patch .* its forward is wrapped by a hook",
    "its hooks wrap the blocks (every block: block-level group offloading, FirstBlockCache, "
    "MagCache, SeaCache; the blocks that hold parameters of their own, LTX-Video's, LTX-2's and "
    "Wan's modulation tables: leaf-level and sequential offloading), which would keep calling the "
    "stock forward: injecting after it raises, naming the block; inject first",
)


def _model_hook(family):
    if family not in MODEL_PATCH:
        return EQUAL
    note = (
        "the feature's hook on the model keeps the model-level patch (the output norms) off; "
        "the report names it"
    )
    return Equal(fallback=(MODEL_PATCH[family],), note=note)


def _leaf_hooks(family):
    return HOOKED_BLOCKS if family in BLOCK_PARAMETERS else EQUAL


# ------------------------------------------------------------------------------------------------
# Features
# ------------------------------------------------------------------------------------------------
def _no_op(subject):
    pass


def _two_calls(subject) -> list:
    """The default run: two forwards without gradients (a hook's state across calls shows)."""
    with torch.no_grad():
        return [subject.forward(), subject.forward()]


@dataclasses.dataclass(frozen=True)
class Feature:
    """A row of the matrix. apply(subject) puts the feature on a model; run(subject) returns the
    outputs compared with stock's (a list of tensors, or of (name, tensor, tolerance) for other
    tolerances than the outputs')."""

    id: str
    title: str
    group: str
    apply: Callable = _no_op
    run: Callable = _two_calls
    orders: tuple = ORDERS
    devices: tuple = ("cpu", "gpu")
    cpu_cells: Callable | None = None  # (family, order) -> whether it runs on the CPU (None: all)
    after: Callable = lambda family: EQUAL  # the outcome of injecting after it
    stock_fails: dict = dataclasses.field(default_factory=dict)  # family -> StockFails
    dtype: torch.dtype | None = None  # instead of the setup's
    eager_reference: bool = False  # on the CPU, the stock model runs without the feature
    compiles: bool = False  # runs torch.compile (dynamo is reset first)
    inject_context: Callable | None = None  # "after": injection inside this context
    inject_options: dict = dataclasses.field(default_factory=dict)
    tiny_fallback: dict = dataclasses.field(default_factory=dict)  # family -> kinds, CPU only
    tolerance: float | None = None  # instead of REL_L2_TOLERANCE[dtype]
    batches: tuple = (2, 2)  # of the eager reference's calls (eager_reference)
    requires: Callable | None = None  # (device) -> reason to skip there, or None
    unpinned: bool = False  # every cell AsStock (GPU rows whose outcome is not known yet)
    attention_op: bool | None = None  # whether ltx_kernels.attention runs (None: not checked)
    runs: tuple = ()  # ltx_kernels ops that must run (e.g. attention_int8)
    note: str = ""  # for docs/feature_matrix.md

    def expected(self, family: str, order: str):
        if family in self.stock_fails:
            return self.stock_fails[family]
        if self.unpinned:
            return AsStock()
        return self.after(family) if order == "after" else EQUAL


# Offloading ------------------------------------------------------------------------------------
def _model_cpu_offload(subject):
    subject.pipe.enable_model_cpu_offload(device=subject.setup.device)


def _sequential_cpu_offload(subject):
    if subject.setup.gpu:
        subject.pipe.enable_sequential_cpu_offload(device=subject.setup.device)
    else:  # its hooks; diffusers passes the CPU as "cpu:0", where accelerate's offload fails
        from accelerate import cpu_offload

        model = subject.model
        cpu_offload(model, torch.device("cpu"), offload_buffers=len(model._parameters) > 0)


def _group_offload(offload_type: str, stream: bool = False, disk: bool = False):
    def apply(subject):
        subject.model.enable_group_offload(
            onload_device=torch.device(subject.setup.device),
            offload_device=torch.device("cpu"),
            offload_type=offload_type,
            num_blocks_per_group=1 if offload_type == "block_level" else None,
            use_stream=stream,
            offload_to_disk_path=str(subject.tmp / "offload") if disk else None,
        )

    return apply


def _group_offload_features():
    for level, after in (("block", lambda family: HOOKED_BLOCKS), ("leaf", _leaf_hooks)):
        for variant, options, devices in (
            ("", {}, ("cpu", "gpu")),
            ("stream", dict(stream=True), ("gpu",)),
            ("disk", dict(disk=True), ("cpu", "gpu")),
        ):
            yield Feature(
                "_".join(filter(None, ("group_offload", level, variant))),
                f"`enable_group_offload` ({level} level{', ' + variant if variant else ''})",
                "offloading",
                _group_offload(f"{level}_level", **options),
                devices=devices,
                after=after,
            )


# Casting, projections, attention ---------------------------------------------------------------
def _layerwise_casting(subject):
    subject.model.enable_layerwise_casting(
        storage_dtype=torch.float8_e4m3fn, compute_dtype=subject.dtype
    )


def _fuse_qkv(subject):
    subject.model.fuse_qkv_projections()


def _attention_backend(name: str):
    def apply(subject):
        subject.model.set_attention_backend(name)

    return apply


#: 8-bit attention against stock (relative L2 of the outputs): INT8 q/k, e4m3 v (and p on CUDA),
#: against which the stock run's own rounding is negligible.
INT8_ATTENTION_VS_STOCK = 5e-2


def _hopper_on_gpu(device):
    if device == "gpu" and torch.cuda.get_device_capability() != (9, 0):
        return "the 8-bit attention kernel is Hopper's (compute capability 9.0)"
    return None


def _compiled_attention(choice: str, what: str, **options) -> Feature:
    """The `torch.compile(dynamic=True)` row of inject_optimized_kernels(attention=`choice`),
    `what` running in the graph."""
    return Feature(
        f"compile_dynamic_{choice}_attention",
        f'`torch.compile(dynamic=True)`, `attention="{choice}"`',
        "compile",
        _compile(dynamic=True),
        run=functools.partial(_compiled_calls, batches=DYNAMIC_BATCHES),
        orders=("before",),
        eager_reference=True,
        batches=DYNAMIC_BATCHES,
        compiles=True,
        inject_options=dict(attention=choice),
        cpu_cells=lambda family, order: family in ("ltx", "flux", "hunyuan_video15"),
        note=f"as `torch.compile(dynamic=True)`, {what} in the graph (HunyuanVideo-1.5: with "
        "the text's key lengths counted on the device)",
        **options,
    )


def _needs_flash_attn(device):
    import importlib.util

    return None if importlib.util.find_spec("flash_attn") else "flash-attn is not installed"


# Caches ----------------------------------------------------------------------------------------
CACHE_STEPS = 4
_TIMESTEPS = (999, 500, 400, 300)  # the current call's, for the caches that ask for it
_SIGMAS = (1.0, 0.5, 0.4, 0.3)
_STEP = [0]


def _raw_vision(module, args, kwargs):
    """SeaCache's generic adapter (the model's latents as [C, T, H, W] per sample) for the models
    without a built-in one (all but Wan T2V): packed tokens [B, S, C] unpacked by the call's
    num_frames/height/width, else as one row."""
    x = kwargs["hidden_states"]
    if x.dim() == 5:
        return list(x.unbind(0))
    if x.dim() == 4:
        return list(x.unsqueeze(2).unbind(0))
    if "height" in kwargs:
        shape = (kwargs["num_frames"], kwargs["height"], kwargs["width"], x.shape[-1])
    else:
        shape = (1, 1, x.shape[1], x.shape[-1])
    return [t.reshape(shape).permute(3, 0, 1, 2) for t in x.unbind(0)]


def _cache_config(kind: str, family: str):
    """Each cache configured to skip work from the second call on (as test_caches.py)."""
    hooks = diffusers.hooks
    timestep = lambda: _TIMESTEPS[_STEP[0]]
    if kind == "first_block":
        return hooks.FirstBlockCacheConfig(threshold=0.5)
    if kind == "mag":
        return hooks.MagCacheConfig(
            threshold=1.0,
            max_skip_steps=2,
            retention_ratio=0.0,
            num_inference_steps=CACHE_STEPS,
            mag_ratios=torch.ones(CACHE_STEPS),
        )
    if kind == "pyramid_attention_broadcast":
        return diffusers.PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 10000),
            current_timestep_callback=timestep,
        )
    if kind in ("faster", "faster_cfg"):
        cfg = dict(  # classifier-free guidance: the batch is (uncond, cond)
            low_frequency_weight_callback=lambda _: 1.1,
            high_frequency_weight_callback=lambda _: 1.1,
            unconditional_batch_skip_range=2,
            unconditional_batch_timestep_skip_range=(-1, 1000),
            tensor_format="BCFHW",
        )
        return diffusers.FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 681),
            current_timestep_callback=timestep,
            attention_weight_callback=lambda _: 0.5,
            is_guidance_distilled=kind == "faster",
            **(cfg if kind == "faster_cfg" else {}),
        )
    if kind == "taylorseer":  # fp32 factors: bf16 ones round stock's and ours apart at midpoints
        return diffusers.TaylorSeerCacheConfig(
            cache_interval=2,
            disable_cache_before_step=1,
            max_order=1,
            taylor_factors_dtype=torch.float32,
        )
    if kind == "sea":
        return diffusers.SeaCacheConfig(
            threshold=10.0,
            cache_end_steps=0,
            raw_vision_callback=None if family == "wan" else _raw_vision,
        )
    return diffusers.TextKVCacheConfig()


def _cache(kind: str):
    def apply(subject):
        subject.model.enable_cache(_cache_config(kind, subject.family))

    return apply


def _cache_calls(subject) -> list:
    """A denoising-like sequence of calls in one cache context (the later ones reuse)."""
    outputs = []
    with torch.no_grad():
        for step in range(CACHE_STEPS):
            _STEP[0] = step
            context = subject.model.cache_context(
                "cond", step_index=step, sigma=_SIGMAS[step], num_inference_steps=CACHE_STEPS
            )
            with context:
                outputs.append(subject.forward())
    return outputs


NO_CACHE_MIXIN = StockFails(
    AttributeError,
    "has no attribute 'enable_cache'",
    "diffusers offers no cache for SD3's model (no CacheMixin)",
)
UNREGISTERED_BLOCKS = StockFails(
    ValueError,
    "not registered",
    "diffusers' block registry, which the cache looks blocks up in, has no LTX-2 or "
    "HunyuanVideo-1.5 blocks",
)
PACKED_OUTPUT = StockFails(
    RuntimeError,
    "number of dimensions",
    "FasterCache's unconditional-batch reuse needs a [B, C, F, H, W] output; LTX's and FLUX's "
    "are packed tokens",
)


CACHE_NOTES = {
    "first_block": "four calls in a cache context (step, sigma, step count), skipping from the "
    "second (in every cache row)",
    "sea": "diffusers' generic path with a raw_vision_callback (Wan T2V: its built-in one)",
}


def _cache_features():
    caches = (
        ("first_block", "FirstBlockCache", lambda family: HOOKED_BLOCKS, UNREGISTERED_BLOCKS),
        ("mag", "MagCache", lambda family: HOOKED_BLOCKS, UNREGISTERED_BLOCKS),
        ("pyramid_attention_broadcast", "PyramidAttentionBroadcast", lambda family: EQUAL, None),
        ("faster", "FasterCache (guidance-distilled)", _model_hook, None),
        ("faster_cfg", "FasterCache (CFG batch)", _model_hook, PACKED_OUTPUT),
        ("taylorseer", "TaylorSeerCache", lambda family: EQUAL, None),
        ("sea", "SeaCache", lambda family: HOOKED_BLOCKS, UNREGISTERED_BLOCKS),
        ("text_kv", "TextKVCache", _model_hook, None),
    )
    for kind, name, after, fails in caches:
        stock_fails = {"sd35": NO_CACHE_MIXIN}
        if fails is UNREGISTERED_BLOCKS:
            stock_fails.update(ltx2=fails, hunyuan_video15=fails)
        elif fails is PACKED_OUTPUT:
            stock_fails.update(ltx=fails, ltx2=fails, flux=fails)
        yield Feature(
            f"cache_{kind}",
            f"`enable_cache({name})`",
            "caches",
            _cache(kind),
            run=_cache_calls,
            after=after,
            stock_fails=stock_fails,
            note=CACHE_NOTES.get(kind, ""),
        )


# LoRA ------------------------------------------------------------------------------------------
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


@functools.cache
def _lora_state_dicts(family: str, setup: Setup, dtype: torch.dtype) -> tuple:
    """Two LoRA checkpoints (rank 4, random, nonzero) in diffusers' format for the family."""
    from peft.utils import get_peft_model_state_dict

    checkpoints = []
    for seed in (1, 2):
        model = clone(_base_model(family, setup, dtype))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model.add_adapter(
                peft.LoraConfig(
                    r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False
                )
            )
        state = get_peft_model_state_dict(model)
        checkpoints.append({f"transformer.{k}": v.detach().clone() for k, v in state.items()})
    return tuple(checkpoints)


def _lora_owner(subject):
    """What the LoRA calls go to: the pipeline's loader, or the model (no loader)."""
    return subject.pipe if LORA_LOADERS[subject.family] else subject.model


def _load_lora(subject, index: int, name: str, **options) -> None:
    state = dict(_lora_state_dicts(subject.family, subject.setup, subject.dtype)[index])
    if LORA_LOADERS[subject.family]:
        subject.pipe.load_lora_weights(state, adapter_name=name, **options)
    else:
        subject.model.load_lora_adapter(state, adapter_name=name, **options)


def _lora_load(subject):
    _load_lora(subject, 0, "a")


def _lora_set_adapters(subject):
    _load_lora(subject, 0, "a")
    _load_lora(subject, 1, "b")
    _lora_owner(subject).set_adapters(["a", "b"], [0.6, 0.3])


def _lora_set_adapters_calls(subject) -> list:
    """Both adapters active (weighted), then one (another weight)."""
    with torch.no_grad():
        both = subject.forward()
        _lora_owner(subject).set_adapters("b", 0.5)
        return [both, subject.forward()]


def _lora_fuse(subject):
    _load_lora(subject, 0, "a")
    _lora_owner(subject).fuse_lora(lora_scale=0.7)


def _lora_unfuse(subject):
    _lora_fuse(subject)
    _lora_owner(subject).unfuse_lora()


def _lora_unload(subject):
    _load_lora(subject, 0, "a")
    if LORA_LOADERS[subject.family]:
        subject.pipe.unload_lora_weights()
    else:
        subject.model.unload_lora()


def _lora_hotswap(subject):
    _load_lora(subject, 0, "a")
    _load_lora(subject, 1, "a", hotswap=True)


def _lora_hotswap_compiled(subject):
    """diffusers' recompilation-free hotswap: enable_lora_hotswap, load, torch.compile, run, swap
    in the second adapter (the calls after it must not recompile)."""
    _lora_owner(subject).enable_lora_hotswap(target_rank=8)
    _load_lora(subject, 0, "a")
    _compile()(subject)
    _load_lora(subject, 1, "a", hotswap=True)


# Serialization ---------------------------------------------------------------------------------
def _stock_class(model) -> type:
    """The diffusers class of the model's name, as pipelines load it by the name in their config
    (an injected model's own type is the same-named patched subclass)."""
    return getattr(diffusers, type(model).__name__)


def _save_and_load(subject):
    """save_pretrained, then from_pretrained (a loaded model is stock: an injected one is injected
    again)."""
    folder = subject.tmp / "saved"
    subject.model.save_pretrained(folder)
    loaded = _stock_class(subject.model).from_pretrained(folder, torch_dtype=subject.dtype)
    subject.replace_model(loaded.to(subject.setup.device))


def _load_into_empty_model(subject):
    """The model built empty (parameters on the meta device, as from_pretrained builds it), its
    weights then loaded; "before": injected while empty."""
    from accelerate import init_empty_weights

    state = subject.model.state_dict()
    with init_empty_weights():
        empty = _stock_class(subject.model).from_config(subject.model.config)
    if subject.injected:
        ltx_kernels.inject_optimized_kernels(empty, verbose=False, **subject.inject_options)
    empty.load_state_dict(state, assign=True)
    # Then to the device, as from_pretrained does: the buffers a model builds at construction and
    # does not save (Wan's RoPE tables) were built on the CPU and are moved there.
    empty.to(subject.setup.device)
    subject.model = subject.call = subject.target = empty.eval()
    subject.pipe = _pipeline_class(subject.family)(empty)


# torch.compile, torch.export -------------------------------------------------------------------
# HunyuanVideo-1.5's forward branches on a tensor (`if is_t2v:`): stock breaks the graph there.
FULLGRAPH = {family: family != "hunyuan_video15" for family in FAMILIES}
DYNAMIC_BATCHES = (7, 9)  # sizes no other dimension of the inputs has (no duck-sized guards)


def _compile(mode=None, dynamic=None):
    """torch.compile of the model (aot_eager on the CPU, Inductor on the GPU), run once: "after"
    injects into the compiled model that has run."""

    def apply(subject):
        gpu = subject.setup.gpu
        options = dict(backend="inductor", mode=mode) if gpu else dict(backend="aot_eager")
        subject.call = subject.target = torch.compile(
            subject.model, fullgraph=FULLGRAPH[subject.family], dynamic=dynamic, **options
        )
        with torch.no_grad():
            subject.forward(DYNAMIC_BATCHES[0] if dynamic else 2)

    return apply


def _compiled_calls(subject, batches=(2, 2)) -> list:
    """A call (which compiles again after an injection into a compiled model), then calls that
    must not recompile: the same inputs, or another batch size (dynamic=True; but where the
    forward breaks the graph: stock HunyuanVideo-1.5 recompiles the graph after the break, whose
    `timestep` dynamo specialized). Outputs are copied (CUDA graphs overwrite theirs at the next
    replay)."""

    def call(batch):
        torch.compiler.cudagraph_mark_step_begin()
        return subject.forward(batch).clone()

    strict = FULLGRAPH[subject.family] or len(set(batches)) == 1
    with torch.no_grad():
        outputs = [call(batches[0])]
        with torch._dynamo.config.patch(error_on_recompile=strict):
            outputs += [call(batch) for batch in batches[1:]]
    return outputs


def _export(subject) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(subject.model, (), kwargs=subject.inputs())


def _torch_export(subject):
    subject.call = _export(subject).module()


def _aoti_loads(device):
    if device == "gpu":  # (the first line of what it prints, from inside aoti_load_package)
        return (
            "stock diffusers' AOT Inductor package segfaults when loaded on the GPU (torch "
            "2.11.0+cu130, H100, 2026-11-26: `Fatal Python error: Segmentation fault` in "
            "aoti_load_package, every family it compiles), so the cell cannot compare"
        )
    return None


def _aot_inductor(subject):
    package = torch._inductor.aoti_compile_and_package(
        _export(subject), package_path=str(subject.tmp / "model.pt2")
    )
    subject.call = torch._inductor.aoti_load_package(package)


DATA_DEPENDENT_BRANCH = StockFails(
    Exception,  # torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode
    "data-dependent",
    "HunyuanVideo-1.5's forward branches on a tensor's value (`if is_t2v:`), which torch.export "
    "cannot trace",
)


# Grad modes ------------------------------------------------------------------------------------
def _calls_under(context):
    def run(subject):
        with context():
            return [subject.forward(), subject.forward()]

    return run


def _train(subject):
    subject.model.train()


def _gradients(subject) -> list:
    """One training step (a fixed random projection of the output): the output and every
    parameter's gradient, each against stock's relative to the largest gradient (the attention
    key biases' gradients are zero up to rounding)."""
    out = subject.forward()
    generator = torch.Generator(out.device).manual_seed(1234)
    weights = torch.randn(out.shape, generator=generator, device=out.device)
    (out.float() * weights).sum().backward()
    grads = [(name, p.grad) for name, p in subject.model.named_parameters() if p.requires_grad]
    tolerance = GRAD_TOLERANCE[subject.setup.device]
    return [("output", out.detach(), None), *((n, g, tolerance) for n, g in grads)]


# fp32 (every autograd cell): the fused forward's summation order only (test_training.py's bound on
# the CPU; the GPU's, at real widths, not measured yet).
GRAD_TOLERANCE = {"cpu": 2e-5, "cuda": 1e-4}


FEATURES = (
    Feature(
        "model_cpu_offload",
        "`enable_model_cpu_offload`",
        "offloading",
        _model_cpu_offload,
        after=_model_hook,
        note="the CPU as the execution device on the CPU",
    ),
    Feature(
        "sequential_cpu_offload",
        "`enable_sequential_cpu_offload`",
        "offloading",
        _sequential_cpu_offload,
        after=_leaf_hooks,
        note="on the CPU, accelerate's cpu_offload hooks it installs (diffusers passes the CPU "
        "as 'cpu:0', where accelerate fails)",
    ),
    *_group_offload_features(),
    Feature(
        "layerwise_casting",
        "`enable_layerwise_casting` (float8_e4m3fn storage)",
        "casting",
        _layerwise_casting,
        note="computed in the model's dtype",
    ),
    Feature(
        "fuse_qkv_projections",
        "`fuse_qkv_projections`",
        "attention",
        _fuse_qkv,
        stock_fails=dict(
            ltx2=StockFails(
                RuntimeError,
                "Sizes of tensors must match",
                "LTX-2's audio-video attentions project q and k/v from different widths",
            ),
            sd35=StockFails(
                AttributeError,
                "'NoneType' object has no attribute 'ndim'",
                "FusedJointAttnProcessor2_0 fails on SD3.5's dual-attention blocks (attn2 has no "
                "context)",
            ),
        ),
    ),
    Feature(
        "attention_native",
        '`set_attention_backend("native")`',
        "attention",
        _attention_backend("native"),
    ),
    Feature(
        "attention_native_math",
        '`set_attention_backend("_native_math")`',
        "attention",
        _attention_backend("_native_math"),
    ),
    Feature(
        "attention_cudnn",
        '`set_attention_backend("_native_cudnn")`',
        "attention",
        _attention_backend("_native_cudnn"),
        devices=("gpu",),
    ),
    Feature(
        "attention_native_flash",
        '`set_attention_backend("_native_flash")`',
        "attention",
        _attention_backend("_native_flash"),
        devices=("gpu",),
        stock_fails={
            family: StockFails(
                ValueError,
                "`attn_mask` is not supported for native flash attention",
                "the text mask reaches a backend that takes none (H100, 2026-11-26)",
            )
            for family in ("ltx", "ltx2", "hunyuan_video15")
        },
    ),
    Feature(
        "attention_ltx_kernels",
        '`inject_optimized_kernels(attention="ltx_kernels")`',
        "attention",
        orders=("before",),
        inject_options=dict(attention="ltx_kernels"),
        attention_op=True,
        note="our attention op wherever it applies (no mask, no autograd recording; on the CPU "
        "its C twin), diffusers' backend elsewhere (the masked text cross-attention of LTX-Video "
        'and LTX-2); also compiled and trained in the rows marked `attention="ltx_kernels"`',
    ),
    Feature(
        "attention_int8",
        '`inject_optimized_kernels(attention="int8")`',
        "attention",
        orders=("before",),
        inject_options=dict(attention="int8"),
        tolerance=INT8_ATTENTION_VS_STOCK,
        attention_op=False,
        runs=("attention_int8", "quantize_attention_k", "quantize_attention_v"),
        requires=_hopper_on_gpu,
        note="8-bit attention wherever it applies and measured faster (no mask, no autograd "
        "recording; a Hopper GPU from 8064 tokens at head_dim 64 and 6144 at 128, here at every "
        "length; on the CPU the C twins), as `auto` elsewhere; against stock at the 8-bit bound; also "
        'compiled in the row marked `attention="int8"`',
    ),
    Feature(
        "attention_flash",
        '`set_attention_backend("flash")` (flash-attn)',
        "attention",
        _attention_backend("flash"),
        devices=("gpu",),
        unpinned=True,
        requires=_needs_flash_attn,
    ),
    *_cache_features(),
    Feature(
        "lora_load",
        "`load_lora_weights`",
        "LoRA",
        _lora_load,
        note="rank-4 adapters on to_q/to_k/to_v/to_out.0 through the pipeline's LoRA loader "
        "(HunyuanVideo15Pipeline has none in diffusers 0.42.1: the model's load_lora_adapter, "
        "set_adapters, fuse_lora, unfuse_lora, unload_lora, in every LoRA row)",
    ),
    Feature(
        "lora_set_adapters",
        "`set_adapters` (two weighted, then one)",
        "LoRA",
        _lora_set_adapters,
        run=_lora_set_adapters_calls,
    ),
    Feature("lora_fuse", "`fuse_lora`", "LoRA", _lora_fuse),
    Feature("lora_unfuse", "`fuse_lora`, `unfuse_lora`", "LoRA", _lora_unfuse),
    Feature("lora_unload", "`unload_lora_weights`", "LoRA", _lora_unload),
    Feature("lora_hotswap", "`load_lora_weights(hotswap=True)`", "LoRA", _lora_hotswap),
    Feature(
        "lora_hotswap_compiled",
        "`enable_lora_hotswap`, `torch.compile`, `load_lora_weights(hotswap=True)`",
        "LoRA",
        _lora_hotswap_compiled,
        run=_compiled_calls,
        compiles=True,
        cpu_cells=lambda family, order: family in ("ltx", "flux"),
        note="compiled as in the `torch.compile` row; after: injected into the compiled model "
        "after the swap",
    ),
    Feature(
        "save_pretrained",
        "`save_pretrained` → `from_pretrained`",
        "serialization",
        _save_and_load,
        note="a loaded model is stock: injected again",
    ),
    Feature(
        "empty_model",
        "weights loaded into an empty (meta) model",
        "serialization",
        _load_into_empty_model,
        note="before: injected while empty (`init_empty_weights`), then "
        "`load_state_dict(assign=True)`",
    ),
    Feature(
        "compile",
        "`torch.compile`",
        "compile",
        _compile(),
        run=_compiled_calls,
        eager_reference=True,
        compiles=True,
        note="aot_eager on the CPU, Inductor on the GPU; fullgraph=True but for HunyuanVideo-1.5 "
        "(stock breaks the graph); a second call must not recompile; after: injected into the "
        "compiled model that has run (it compiles again)",
    ),
    Feature(
        "compile_dynamic",
        "`torch.compile(dynamic=True)`",
        "compile",
        _compile(dynamic=True),
        run=functools.partial(_compiled_calls, batches=DYNAMIC_BATCHES),
        eager_reference=True,
        batches=DYNAMIC_BATCHES,
        note="batch 7, then 9 without recompiling (HunyuanVideo-1.5, whose forward breaks the "
        "graph: as stock, it recompiles the graph after the break once)",
        compiles=True,
        cpu_cells=lambda family, order: order == "before" and family in ("ltx", "flux", "wan"),
    ),
    _compiled_attention("ltx_kernels", "our attention op", attention_op=True),
    _compiled_attention(
        "int8",
        "the 8-bit ops",
        tolerance=INT8_ATTENTION_VS_STOCK,
        runs=("attention_int8",),
        requires=_hopper_on_gpu,
    ),
    Feature(
        "compile_max_autotune",
        '`torch.compile(mode="max-autotune")`',
        "compile",
        _compile(mode="max-autotune"),
        run=_compiled_calls,
        orders=("before",),  # (injected after: as `torch.compile`, Inductor tuned alike)
        devices=("gpu",),
        compiles=True,
    ),
    Feature(
        "compile_reduce_overhead",
        '`torch.compile(mode="reduce-overhead")` (CUDA graphs)',
        "compile",
        _compile(mode="reduce-overhead"),
        run=_compiled_calls,
        devices=("gpu",),
        compiles=True,
    ),
    Feature(
        "export",
        "`torch.export.export`",
        "export",
        _torch_export,
        orders=("before",),
        eager_reference=True,
        stock_fails=dict(hunyuan_video15=DATA_DEPENDENT_BRANCH),
    ),
    Feature(
        "aot_inductor",
        "AOT Inductor (`aoti_compile_and_package`)",
        "export",
        _aot_inductor,
        orders=("before",),
        cpu_cells=lambda family, order: family == "flux",
        eager_reference=True,
        stock_fails=dict(hunyuan_video15=DATA_DEPENDENT_BRANCH),
        requires=_aoti_loads,
        note="on the CPU; on the GPU stock diffusers' package segfaults when loaded (torch "
        "2.11.0+cu130), so those cells skip",
    ),
    Feature(
        "inference_mode",
        "`torch.inference_mode`",
        "grad modes",
        run=_calls_under(torch.inference_mode),
        inject_context=torch.inference_mode,
        note="after: injected inside it",
    ),
    Feature(
        "no_grad",
        "`torch.no_grad`",
        "grad modes",
        run=_calls_under(torch.no_grad),
        inject_context=torch.no_grad,
        note="after: injected inside it",
    ),
    Feature(
        "autograd",
        "autograd (training step, every gradient)",
        "grad modes",
        _train,
        run=_gradients,
        inject_context=torch.inference_mode,
        dtype=torch.float32,
        note="after: injected inside `torch.inference_mode`, then trained",
    ),
    Feature(
        "autograd_ltx_kernels_attention",
        'autograd, `attention="ltx_kernels"`',
        "grad modes",
        _train,
        run=_gradients,
        orders=("before",),
        dtype=torch.float32,
        inject_options=dict(attention="ltx_kernels"),
        attention_op=False,
        cpu_cells=lambda family, order: family == "ltx",
        note="the attention op has no backward yet: under autograd recording every call attends "
        "with diffusers' backend (stock gradients)",
    ),
    Feature(
        "fp8_inference_mode",
        "`inject_optimized_kernels(fp8=True)` with `torch.inference_mode`",
        "grad modes",
        run=_calls_under(torch.inference_mode),
        inject_context=torch.inference_mode,
        inject_options=dict(fp8=True),
        dtype=torch.bfloat16,
        tolerance=FP8_VS_BF16,
        # tiny Wan's 24-wide projections and tiny LTX-2's 8-wide audio stream: not multiples of
        # 16 (torch._scaled_mm), kept bf16
        tiny_fallback=dict(wan=("Linear (FP8 GEMM)",), ltx2=("Linear (FP8 GEMM)",)),
        note="bf16; against stock bf16 at the FP8 bound; after: injected inside it",
    ),
)
FEATURE_IDS = {feature.id: feature for feature in FEATURES}

#: (feature id, family, order, "cpu"/"gpu") -> reason: cells known to fail on a cause being fixed
#: (xfail, strict: a fix makes them fail until they are taken out). None now.
XFAIL: dict = {}


# ------------------------------------------------------------------------------------------------
# A cell
# ------------------------------------------------------------------------------------------------
@functools.cache
def _baseline_skips(family: str, setup: Setup, dtype: torch.dtype) -> frozenset:
    """The report kinds injection skips on the family without any feature."""
    report = ltx_kernels.inject_optimized_kernels(
        clone(_base_model(family, setup, dtype)), verbose=False
    )
    return frozenset(report.skipped)


def _fused_ops_run(calls, compiled: bool) -> tuple[list, set]:
    """(calls(), the ltx_kernels ops that ran): counted by a dispatch mode in eager mode, seen
    through the profiler (slower to read) inside compiled graphs, exported programs and AOT
    Inductor packages."""
    if not compiled:
        with OpCounter() as counter:
            return calls(), set(counter.counts)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = calls()
    return outputs, {e.name for e in prof.events() if e.name.startswith("ltx_kernels::")}


def _steps(feature: Feature, subject: Subject, order: str) -> None:
    """Injects and applies the feature in `order`."""
    if order == "before":
        subject.inject()
        feature.apply(subject)
        return
    feature.apply(subject)
    context = feature.inject_context or contextlib.nullcontext
    with context():
        subject.inject()


def _named(outputs) -> list:
    """run()'s outputs as (name, tensor, gradient tolerance or None for an output)."""
    return [o if isinstance(o, tuple) else (f"output {i}", o, None) for i, o in enumerate(outputs)]


@functools.cache
def _stock_run(feature_id: str, family: str, device: str) -> tuple:
    """(outputs, graph breaks, None) of the stock model under the feature, or (None, None,
    (error type, message)): one run per feature, family and device, shared by the cells of both
    orders."""
    feature, setup = FEATURE_IDS[feature_id], SETUPS[device]
    with tempfile.TemporaryDirectory() as tmp:
        stock = Subject(family, setup, feature.dtype or setup.dtype, pathlib.Path(tmp))
        try:
            if _eager_reference(feature, family, setup):
                with torch.no_grad():
                    return [stock.forward(batch) for batch in feature.batches], 0, None
            _graph_breaks(reset=True)
            feature.apply(stock)
            return feature.run(stock), _graph_breaks(), None
        except Exception as error:
            return None, None, (type(error), str(error))


def _eager_reference(feature: Feature, family: str, setup: Setup) -> bool:
    """Whether the stock model runs without the feature: eager_reference rows on the CPU, where
    the stock model can neither fail under the feature nor break the graph (fullgraph)."""
    return (
        feature.eager_reference
        and not setup.gpu
        and family not in feature.stock_fails
        and FULLGRAPH[family]
    )


def _graph_breaks(reset: bool = False) -> int:
    """The graph breaks dynamo counted since the last reset."""
    from torch._dynamo.utils import counters

    if reset:
        counters["graph_break"].clear()
    return sum(counters["graph_break"].values())


def run_cell(feature: Feature, family: str, order: str, device: str, tmp: pathlib.Path):
    """One cell: the injected model (injected in `order`) under the feature against the stock
    model under it, as feature.expected says."""
    if feature.requires is not None and (reason := feature.requires(device)):
        pytest.skip(reason)
    if feature.compiles:
        torch._dynamo.reset()
    setup = SETUPS[device]
    dtype = feature.dtype or setup.dtype
    injected = Subject(family, setup, dtype, tmp)
    injected.inject_options = dict(feature.inject_options)
    expected = feature.expected(family, order)

    if isinstance(expected, Raises):
        feature.apply(injected)
        with pytest.raises(expected.error, match=expected.match):
            injected.inject()
        return
    want, stock_breaks, stock_error = _stock_run(feature.id, family, device)
    if isinstance(expected, StockFails) or (isinstance(expected, AsStock) and stock_error):
        error, match = (
            (expected.error, expected.match)
            if isinstance(expected, StockFails)
            else (stock_error[0], re.escape(stock_error[1][:80]))
        )
        assert stock_error and issubclass(stock_error[0], error), f"stock: {stock_error}"
        assert re.search(match, stock_error[1]), stock_error[1]
        with pytest.raises(error, match=match):
            _steps(feature, injected, order)
            feature.run(injected)
        return
    assert stock_error is None, f"stock diffusers failed: {stock_error}"
    _graph_breaks(reset=True)
    _steps(feature, injected, order)
    compiled = feature.compiles or feature.group == "export"
    got, ops = _fused_ops_run(lambda: feature.run(injected), compiled)
    if feature.compiles:  # (fullgraph=True where stock has none: a break raises)
        breaks = _graph_breaks()
        assert breaks <= stock_breaks, f"{breaks} graph breaks, stock {stock_breaks}"

    tolerance = feature.tolerance or REL_L2_TOLERANCE[dtype]
    want, got = _named(want), _named(got)
    assert [name for name, *_ in got] == [name for name, *_ in want]
    largest = max(
        (w.double().norm().item() for _, w, t in want if t is not None and w is not None),
        default=0.0,
    )
    for (name, w, t), (_, g, _) in zip(want, got):
        assert (g is None) == (w is None), f"{name}: present in one model only"
        if w is None:
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.isfinite(g).all(), f"{name}: non-finite"
        if t is None:  # an output
            error, bound = rel_l2(g, w), tolerance
        else:  # a gradient, relative to the largest gradient's scale at least
            error = (g.double() - w.double()).norm().item() / max(
                w.double().norm().item(), 1e-4 * largest
            )
            bound = t
        assert error <= bound, f"{name}: relative L2 {error:.3g} vs stock (bound {bound:g})"
    assert ops, "no ltx_kernels op ran: the injection is not in effect"
    ran = {name.split("::")[-1] for name in ops}  # (compiled: "ltx_kernels::attention")
    if feature.attention_op is not None:
        assert ("attention" in ran) == feature.attention_op, f"ops that ran: {sorted(ran)}"
    missing = set(feature.runs) - ran
    assert not missing, f"{sorted(missing)} did not run; ops that ran: {sorted(ran)}"
    fallback = set(injected.report.skipped) - _baseline_skips(family, setup, dtype)
    tiny = () if setup.gpu else feature.tiny_fallback.get(family, ())
    wanted = getattr(expected, "fallback", ())  # (AsStock: none)
    assert fallback == {*wanted, *tiny}, f"report skips {fallback}"


def _cells():
    for feature in FEATURES:
        for family in FAMILIES:
            for order in feature.orders:
                for device in feature.devices:
                    marks = [pytest.mark.gpu] if device == "gpu" else []
                    if (
                        device == "cpu"
                        and feature.cpu_cells
                        and not feature.cpu_cells(family, order)
                    ):
                        continue
                    reason = XFAIL.get((feature.id, family, order, device))
                    if reason:
                        marks.append(pytest.mark.xfail(strict=True, reason=reason))
                    yield pytest.param(
                        feature.id,
                        family,
                        order,
                        device,
                        id=f"{feature.id}-{family}-{order}-{device}",
                        marks=marks,
                    )


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread: the tiny models gain nothing from more, and the module's time stays
    stable on a shared machine (OpenMP threads spin while they wait for a core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("feature, family, order, device", list(_cells()))
def test_cell(feature, family, order, device, tmp_path):
    run_cell(FEATURE_IDS[feature], family, order, device, tmp_path)


# ------------------------------------------------------------------------------------------------
# docs/feature_matrix.md
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KnownFailure:
    """A cell marked in XFAIL: its cause is being fixed."""

    reason: str


def _outcome(feature: Feature, family: str, order: str):
    reasons = {XFAIL.get((feature.id, family, order, device)) for device in feature.devices}
    reasons.discard(None)
    return KnownFailure(reasons.pop()) if reasons else feature.expected(family, order)


def _symbol(outcome, notes: dict) -> str:
    if isinstance(outcome, Equal) and not outcome.fallback:
        return "✓"
    if isinstance(outcome, KnownFailure):
        number = notes.setdefault("fails, being fixed: " + outcome.reason, len(notes) + 1)
        return f"✗ [{number}]"
    if isinstance(outcome, AsStock):
        note = (
            "GPU only, not run yet: expected the stock outputs, or the error stock diffusers "
            "raises (flash and cuDNN attention take no mask in some configurations)"
        )
        label = "?"
    elif isinstance(outcome, Equal):
        note, label = outcome.note, "✓ fallback"
    elif isinstance(outcome, Raises):
        note, label = outcome.note, "error"
    else:
        note, label = "stock diffusers fails too: " + outcome.note, "n/a"
    number = notes.setdefault(note, len(notes) + 1)
    return f"{label} [{number}]"


def markdown_table() -> str:
    """The families × features table of docs/feature_matrix.md, from FEATURES."""
    notes: dict = {}
    header = "| feature | " + " | ".join(FAMILIES.values()) + " |"
    lines = [header, "|---" * (len(FAMILIES) + 1) + "|"]
    for feature in FEATURES:
        cells = []
        for family in FAMILIES:
            before, *after = (_outcome(feature, family, order) for order in feature.orders)
            text = _symbol(before, notes)
            if after and after[0] != before:
                text += " / " + _symbol(after[0], notes)
            cells.append(text)
        title = feature.title
        if feature.devices == ("gpu",):
            title += " (GPU)"
        if feature.orders == ("before",):
            title += " (inject before)"
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"[{number}] {note}." for note, number in notes.items()]
    lines += ["", "How rows apply the feature, where it is not plain:", ""]
    lines += [f"- {feature.title}: {feature.note}." for feature in FEATURES if feature.note]
    return "\n".join(lines)


def test_docs_table_is_current():
    assert markdown_table() in DOC.read_text(), (
        f"{DOC.name} is out of date: paste `python tests/test_feature_matrix.py`'s output"
    )


if __name__ == "__main__":
    print(markdown_table())
