"""inject_optimized_kernels under diffusers' context parallelism (enable_parallelism with
ContextParallelConfig), on the CPU: two gloo processes run a tiny LTX-Video transformer with its text
split across them, and every rank's output (and, training, the gradients summed over the ranks) must
match one process running stock diffusers.

Stock diffusers 0.42 fails here as soon as the text mask is passed (every LTXPipeline call): Ulysses
raises on the mask's head axis (diffusers #14316) and ring attention applies each rank's mask chunk
to every K/V chunk (silently wrong). The fused processor gathers the text for cross-attention
(integration/context_parallel.py), which these cases check. One spawn runs every case (the imports
cost ~20 s per process); the tests then read its results.

CPU-only quirks handled here: diffusers computes `rank % torch.accelerator.device_count()`, which is
0 on a CPU-only torch (patched to 1 in the workers); no attention backend returns the log-sum-exp
ring attention needs on the CPU, so the ring case swaps diffusers' native attention op for one on
aten's CPU flash attention (which returns it) for that case only.
"""

import contextlib
import copy
import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ltx_kernels
from distributed_helpers import (
    compared_rows,
    free_port,
    generate_video_script,
    run_cases,
    run_generate_video,
)
from inject_helpers import REL_L2_TOLERANCE, output_of, rel_l2
from ltx_kernels.integration import FUSIONS
from model_zoo import ltx
from model_zoo import ltx2 as ltx2_zoo

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo"
)

WORLD = 2
TOLERANCE = 1e-5  # fp32: the split changes the summation order only


def _ulysses(degree=WORLD):
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=degree)


def _ring():
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ring_degree=WORLD)


def _ulysses_anything():
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=WORLD, ulysses_anything=True)


class _CpuLseAttention:
    """Ring attention needs the log-sum-exp of each partial attention; on the CPU only aten's flash
    attention returns it. Replaces diffusers' native attention op while active (test only)."""

    def __enter__(self):
        import diffusers.models.attention_dispatch as dispatch

        def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                    scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                    _parallel_config=None):  # fmt: skip
            q, k, v = (x.transpose(1, 2) for x in (query, key, value))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )
            out = out.transpose(1, 2)
            return (out, lse.transpose(1, 2)) if return_lse else out

        self.dispatch, self.original = dispatch, dispatch._native_attention_forward_op
        dispatch._native_attention_forward_op = forward
        return self

    def __exit__(self, *exc):
        self.dispatch._native_attention_forward_op = self.original


class _CountUlyssesCalls:
    """Counts the calls of attention.ulysses_attention (calls), of
    attention.ulysses_whole_queries_attention (whole_queries), context_parallel.gather_sequence
    (gathers) and of our attention op through the seam (ltx_attention) while active."""

    NAMES = {
        "calls": ("attention", "ulysses_attention"),
        "whole_queries": ("attention", "ulysses_whole_queries_attention"),
        "gathers": ("context_parallel", "gather_sequence"),
        "ltx_attention": ("attention", "ltx_attention"),
    }

    def __enter__(self):
        from ltx_kernels import integration

        self.originals = {}
        for count, (module, name) in self.NAMES.items():
            setattr(self, count, 0)
            module = getattr(integration, module)
            original = self.originals[module, name] = getattr(module, name)

            def counted(*args, _count=count, _original=original, **kwargs):
                setattr(self, _count, getattr(self, _count) + 1)
                return _original(*args, **kwargs)

            setattr(module, name, counted)
        return self

    def __exit__(self, *exc):
        for (module, name), original in self.originals.items():
            setattr(module, name, original)


def _run_case(device, config, order="before", mask=True, per_token=False, train=False,
              remove=False, backend=None, dtype=torch.float32, compile=False, ops=None,
              model_config=None, attention="auto"):  # fmt: skip
    """One tiny LTX model under context parallelism, injected before or after enable_parallelism;
    returns its output's (and gradients') relative L2 error against stock diffusers in one
    process, and how many attention calls ran ulysses_attention."""
    # (not under compile: Dynamo would trace the counter and recompile when it changes)
    counter = contextlib.nullcontext(SimpleNamespace(calls=0)) if compile else _CountUlyssesCalls()
    with counter as ulysses:
        return _run_counted(ulysses, device, config, order, mask, per_token, train, remove,
                            backend, dtype, compile, ops, model_config, attention)  # fmt: skip


def _run_counted(ulysses, device, config, order, mask, per_token, train, remove, backend, dtype,
                 compile, ops, model_config, attention):  # fmt: skip
    torch.manual_seed(0)
    reference = ltx.tiny_model(dtype, **(model_config or {})).to(device)
    model = copy.deepcopy(reference)
    inputs = ltx.tiny_inputs(dtype, device=device, per_token=per_token)
    if not mask:
        inputs["encoder_attention_mask"] = None
    if backend is not None:
        model.set_attention_backend(backend)
    result = {"tolerance": TOLERANCE if dtype == torch.float32 else REL_L2_TOLERANCE[dtype]}

    def inject():
        report = ltx_kernels.inject_optimized_kernels(
            model, verbose=False, ops=ops, attention=attention
        )
        result["patched"] = report.total_patched
        result["skipped"] = sorted(report.skipped)

    if order == "before":
        inject()
    model.enable_parallelism(config=config)
    if order == "after":
        inject()
    if remove:
        result["restored"] = ltx_kernels.remove_optimized_kernels(model)
    result["split_inputs"] = _split_inputs(model)
    if compile:  # fullgraph, and the second call must not recompile
        torch._dynamo.reset()
        model.compile_repeated_blocks(fullgraph=True)
        with (
            torch.no_grad(),
            torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True),
        ):
            model(**inputs)
    processor = model.transformer_blocks[0].attn2.processor
    result["processor"] = type(processor).__name__
    result["processor_parallel"] = processor._parallel_config is not None
    with (
        torch.set_grad_enabled(train),
        torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True),
    ):
        ulysses.calls = ulysses.gathers = ulysses.ltx_attention = 0
        out = output_of(model(**inputs))
        result["text_gathers"] = ulysses.gathers
        result["ltx_attention_calls"] = ulysses.ltx_attention
        expected = output_of(reference(**inputs))
    result["out"] = rel_l2(out, expected)
    result["ulysses_calls"] = ulysses.calls
    if train:
        out.square().mean().backward()
        expected.square().mean().backward()
        errors = []
        for (name, parameter), stock in zip(model.named_parameters(), reference.parameters()):
            # Each rank holds the gradient of its share of the tokens: their sum is the gradient.
            assert parameter.grad is not None, name
            dist.all_reduce(parameter.grad)
            errors.append(rel_l2(parameter.grad, stock.grad))
        result["grads"] = max(errors)
    return result


def _whole_model_compiled(device):
    """The injected tiny LTX model ([B] timesteps) under Ulysses compiled whole
    (torch.compile, the eager backend) against stock diffusers in one process, and the reasons of
    its graph breaks (Dynamo's counters)."""
    torch.manual_seed(0)
    reference = ltx.tiny_model(torch.float32).to(device)
    model = copy.deepcopy(reference)
    inputs = ltx.tiny_inputs(torch.float32, device=device)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    model.enable_parallelism(config=_ulysses())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.no_grad():
        out = output_of(torch.compile(model, backend="eager")(**inputs))
        expected = output_of(reference(**inputs))
    breaks = [" ".join(r.split())[:200] for r in torch._dynamo.utils.counters["graph_break"]]
    return {"out": rel_l2(out, expected), "tolerance": TOLERANCE, "breaks": breaks}


def _split_inputs(model) -> list[str]:
    """The inputs diffusers' split hook on the model splits (its plan's "" entry)."""
    return sorted(model._diffusers_hook.get_hook("cp_input---").metadata)


def _run_with_lse(device, config, order):
    if device == "cuda":  # cuDNN attention (bf16) returns the log-sum-exp and takes the mask
        return _run_case(device, config, order, backend="_native_cudnn", dtype=torch.bfloat16)
    with _CpuLseAttention():
        return _run_case(device, config, order)


def _full_size(device, config):
    """LTX-Video 2B (random weights, bf16), 2 x 2688 tokens and a padded 128-token prompt: injected
    under context parallelism against stock diffusers on one GPU."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = LTXVideoTransformer3DModel().to(torch.bfloat16).eval()
    inputs = ltx.full_inputs(2, 7, 16, 24, device)
    with torch.no_grad():
        expected = output_of(model(**inputs))
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        model.enable_parallelism(config=config)
        out = output_of(model(**inputs))
    return {"out": rel_l2(out, expected), "tolerance": REL_L2_TOLERANCE[torch.bfloat16]}


FOUR_HEADS = dict(num_attention_heads=4, attention_head_dim=4)  # the same width, 2 heads a rank
# A head_dim the CUDA attention kernel takes (64), the text projected to the same width.
HEAD_DIM_64 = dict(attention_head_dim=64, cross_attention_dim=128)
#: Cases whose self-attention runs ulysses_attention (two blocks: one call each), and those that
#: keep diffusers' parallel attention (training, ring, uneven splits, the op disabled).
ULYSSES_ATTENTION = {
    "ulysses_inject_before": 2,
    "ulysses_inject_after": 2,
    "ulysses_per_token_timesteps": 2,
    "ulysses_inject_after_per_token_timesteps": 2,
    "ulysses_compiled": 0,  # not counted under compile
    "ulysses_4_heads": 2,
    "ulysses_train": 0,
    "ulysses_anything": 0,
    "ulysses_diffusers_attention": 0,
    "ulysses_ltx_kernels_attention": 2,
    "ring": 0,
}

CASES = {
    "ulysses_inject_before": lambda d: _run_case(d, _ulysses(), "before"),
    "ulysses_inject_after": lambda d: _run_case(d, _ulysses(), "after"),
    "ulysses_per_token_timesteps": lambda d: _run_case(d, _ulysses(), "before", per_token=True),
    # (LTXConditionPipeline as generate_video.py runs it: enable_parallelism, then the kernels)
    "ulysses_inject_after_per_token_timesteps": lambda d: _run_case(
        d, _ulysses(), "after", per_token=True
    ),
    "ulysses_train": lambda d: _run_case(d, _ulysses(), "before", train=True),
    "ulysses_compiled": lambda d: _run_case(d, _ulysses(), "before", compile=True),
    "ulysses_whole_model_compiled": _whole_model_compiled,
    "ulysses_anything": lambda d: _run_case(d, _ulysses_anything(), "before"),
    "ulysses_4_heads": lambda d: _run_case(d, _ulysses(), model_config=FOUR_HEADS),
    "ulysses_diffusers_attention": lambda d: _run_case(
        d, _ulysses(), ops=set(FUSIONS) - {"ulysses_attention"}
    ),
    # attention="ltx_kernels": our op attends each rank's heads inside ulysses_attention (on the
    # GPU in bf16 at head_dim 64, what the CUDA kernel takes; the cross-attention keeps its mask)
    "ulysses_ltx_kernels_attention": lambda d: _run_case(
        d,
        _ulysses(),
        attention="ltx_kernels",
        **(dict(dtype=torch.bfloat16, model_config=HEAD_DIM_64) if d == "cuda" else {}),
    ),
    # Removal after enable_parallelism: the restored stock processors keep the parallel config
    # (no mask: stock diffusers fails with one).
    "ulysses_remove": lambda d: _run_case(d, _ulysses(), "after", mask=False, remove=True),
}
#: Last (after the LTX-2 cases): on a GPU set_attention_backend also sets diffusers' process-wide
#: default backend.
RING_CASES = {
    "ring": lambda d: _run_with_lse(d, _ring(), "before"),
    "ring_inject_after": lambda d: _run_with_lse(d, _ring(), "after"),
}


def _ltx2_case(device, config, release="2.0", variant=None, mask=True, train=False,
               dtype=torch.float32, backend=None, order="before", ops=None, text=ltx2_zoo.TEXT,
               **model_config):  # fmt: skip
    """A tiny LTX-2 model (video and audio; `model_config`: its config's overrides) injected
    before or after enable_parallelism, against stock diffusers in one process (stock fails under
    context parallelism: its plan does not split the RoPE tables of the released "split" layout).
    Both outputs' relative L2 error (the worse), and the calls of each Ulysses path."""
    reference = ltx2_zoo.tiny_model(dtype, release, **model_config).to(device)
    model = copy.deepcopy(reference)
    inputs = ltx2_zoo.inputs(dtype, release, variant, text=text, device=device, **model_config)
    if not mask:
        inputs.update(encoder_attention_mask=None, audio_encoder_attention_mask=None)
    if backend is not None:
        model.set_attention_backend(backend)
    result = {"tolerance": TOLERANCE if dtype == torch.float32 else REL_L2_TOLERANCE[dtype]}
    if order == "after":
        model.enable_parallelism(config=config)
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False, ops=ops)
    result["skipped"] = sorted(report.skipped)
    if order == "before":
        model.enable_parallelism(config=config)
    with torch.set_grad_enabled(train), _CountUlyssesCalls() as ulysses:
        outputs = model(**inputs)
    with torch.no_grad():
        expected = reference(**inputs)
    result["out"] = max(rel_l2(out, ref) for out, ref in zip(outputs, expected))
    result["ulysses_calls"] = ulysses.calls
    result["whole_queries_calls"] = ulysses.whole_queries
    return result


def _ltx2_ring(device):
    if device == "cuda":  # cuDNN attention (bf16) returns the log-sum-exp; its heads: 64 or 128
        return _ltx2_full_width(device, _ring(), backend="_native_cudnn")
    with _CpuLseAttention():
        return _ltx2_case(device, _ring())


def _ltx2_training(device):
    try:
        _ltx2_case(device, _ulysses(), train=True)
    except NotImplementedError as error:
        return {"raised": str(error)}
    return {"raised": None}


#: LTX-2 under Ulysses and ring: every release, text-to-video with and without the text mask,
#: image-to-video (per-token timesteps; 2.5: the keyframe mask), STG (2.3's perturbed processor).
LTX2_CASES = {
    "ltx2_ulysses": lambda d: _ltx2_case(d, _ulysses()),
    "ltx2_ulysses_no_mask": lambda d: _ltx2_case(d, _ulysses(), mask=False),
    # inject after enable_parallelism: the split hook moves onto the patched forward
    "ltx2_ulysses_inject_after": lambda d: _ltx2_case(d, _ulysses(), order="after"),
    "ltx2.5_ulysses_i2v_inject_after": lambda d: _ltx2_case(
        d, _ulysses(), "2.5", "i2v", order="after"
    ),
    "ltx2.3_ulysses_stg": lambda d: _ltx2_case(d, _ulysses(), "2.3", "stg"),
    "ltx2_ulysses_i2v": lambda d: _ltx2_case(d, _ulysses(), "2.0", "i2v"),
    "ltx2.5_ulysses_i2v": lambda d: _ltx2_case(d, _ulysses(), "2.5", "i2v"),
}
RING_CASES["ltx2_ring"] = _ltx2_ring


def _wan_case(device, config, variant="t2v", padded=False):
    """The tiny Wan transformer injected before enable_parallelism, against stock diffusers in one
    process (Wan's plan splits the tokens at its first block; its cross-attention stays local).
    padded: the text zero-padded after 7 and 4 tokens, as WanPipeline pads its prompts (Wan takes
    no text mask: it attends to the zeros)."""
    from model_zoo import wan

    torch.manual_seed(0)
    reference = wan.tiny_model(torch.float32, **(wan.I2V if variant == "i2v" else {})).to(device)
    model = copy.deepcopy(reference)
    inputs = {
        name: value.to(device) if torch.is_tensor(value) else value
        for name, value in wan.tiny_inputs(torch.float32, variant).items()
    }
    if padded:
        for sample, length in enumerate((7, 4)):
            inputs["encoder_hidden_states"][sample, length:] = 0
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    model.enable_parallelism(config=config)
    with torch.no_grad(), _CountUlyssesCalls() as ulysses:
        out = model(**inputs)[0]
        expected = reference(**inputs)[0]
    return {"out": rel_l2(out, expected), "tolerance": TOLERANCE, "ulysses_calls": ulysses.calls}


def _hunyuan15_model(device, dtype=torch.float32, **config):
    """The tiny HunyuanVideo-1.5 transformer (a stock reference and an injected copy)."""
    from model_zoo import hunyuan

    reference = hunyuan.tiny_model(dtype, v15=True, **config).to(device)
    model = copy.deepcopy(reference)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    return reference, model


def _hunyuan15_case(device, config, variant=None):
    """The tiny HunyuanVideo-1.5 transformer injected, then under enable_parallelism with its plan
    (injected_plan: diffusers has none), against stock diffusers in one process; the text padded
    differently per batch element (the Qwen prompt of one, the ByT5 prompt of the other), so the
    key lengths differ per element."""
    from ltx_kernels.integration import injected_plan
    from model_zoo import hunyuan

    reference, model = _hunyuan15_model(device)
    model.enable_parallelism(config=config, cp_plan=injected_plan(model))
    inputs = hunyuan.tiny_inputs(torch.float32, v15=True, variant=variant)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
    with torch.no_grad(), _CountUlyssesCalls() as ulysses:
        out = model(**inputs)[0]
        expected = reference(**inputs)[0]
    return {"out": rel_l2(out, expected), "tolerance": TOLERANCE, "ulysses_calls": ulysses.calls}


def _raised(run, *args):
    """{"raised": the message of the NotImplementedError / RuntimeError run(*args) raises, or
    None}."""
    try:
        run(*args)
    except (NotImplementedError, RuntimeError) as error:
        return {"raised": str(error)}
    return {"raised": None}


def _hunyuan15_stock_plan(device):
    """injected_plan on a stock HunyuanVideo-1.5 (its processors would attend a chunk)."""
    from ltx_kernels.integration import injected_plan

    reference, _ = _hunyuan15_model(device)
    injected_plan(reference)


def _text_gather_reuse(device):
    """gather_cross_attention_inputs reuses its last gather for the same, unmodified tensors only:
    not after the text or the gathered text is written, not for another tensor of the same
    values, not under autograd recording."""
    from ltx_kernels.integration import context_parallel

    model = ltx.tiny_model(torch.float32).to(device)
    model.enable_parallelism(config=_ulysses())
    config = model.transformer_blocks[0].attn2.processor._parallel_config

    def gather(text, mask):
        return context_parallel.gather_cross_attention_inputs(config, text, mask)[:2]

    text = torch.randn(2, 3, 8, device=device)
    mask = torch.randn(2, 1, 3, device=device)
    first = gather(text, mask)
    checks = {"reused": all(a is b for a, b in zip(gather(text, mask), first))}
    checks["same values, other tensor"] = gather(text.clone(), mask)[0] is not first[0]
    first = gather(text, mask)
    text.add_(1)
    after_write = gather(text, mask)
    checks["text written"] = after_write[0] is not first[0] and torch.equal(
        after_write[0], first[0] + 1
    )
    after_write[0].mul_(2)  # a consumer writing into the gathered text
    checks["gathered text written"] = gather(text, mask)[0] is not after_write[0]
    with torch.inference_mode():  # no version counters: the same tensors are enough
        text, mask = text.clone(), mask.clone()
        checks["inference mode"] = gather(text, mask)[0] is gather(text, mask)[0]
    text = text.clone()
    with torch.enable_grad():
        text.requires_grad_(True)
        checks["autograd"] = gather(text, mask)[0] is not gather(text, mask)[0]
    return {"failed": sorted(name for name, ok in checks.items() if not ok)}


#: Wan under Ulysses: text-to-video, I2V (the image context), TI2V (a timestep per token).
WAN_CASES = {
    f"wan_ulysses_{variant}": lambda d, variant=variant: _wan_case(d, _ulysses(), variant)
    for variant in ("t2v", "i2v", "ti2v")
}
WAN_CASES["wan_ulysses_padded_text"] = lambda d: _wan_case(d, _ulysses(), padded=True)
#: HunyuanVideo-1.5 under Ulysses (injected_plan): text-to-video (the image tokens masked out) and
#: image-to-video; per-element text lengths (key lengths on the gathered sequence).
HUNYUAN15_CASES = {
    f"hunyuan15_ulysses_{variant or 't2v'}": lambda d, variant=variant: _hunyuan15_case(
        d, _ulysses(), variant
    )
    for variant in (None, "i2v")
}
#: Cases that must raise, with a word of the expected message.
RAISES = {
    "ltx2_training": (_ltx2_training, "training LTX-2 under context parallelism"),
    "hunyuan15_ring": (
        lambda d: _raised(_hunyuan15_case, d, _ring()),
        "run under Ulysses only, not with ring attention",
    ),
    "hunyuan15_stock_plan": (
        lambda d: _raised(_hunyuan15_stock_plan, d),
        "needs the injected attention processors",
    ),
}
CASES.update(LTX2_CASES)
CASES.update(WAN_CASES)
CASES.update(HUNYUAN15_CASES)
CHECKS = {"text_gather_reuse": _text_gather_reuse}
CASES.update(CHECKS)
CASES.update({name: run for name, (run, _) in RAISES.items()})
CASES.update(RING_CASES)
ULYSSES_ATTENTION.update(dict.fromkeys(LTX2_CASES, 2))  # LTX-2: each block's video self-attention
ULYSSES_ATTENTION.update(dict.fromkeys(WAN_CASES, 2))  # Wan: each block's self-attention
ULYSSES_ATTENTION.update(dict.fromkeys(HUNYUAN15_CASES, 2))  # HunyuanVideo-1.5: each block's
ULYSSES_ATTENTION["ltx2_ring"] = 0
#: Cases whose video-to-audio attention (the audio's queries whole on every rank) runs
#: ulysses_whole_queries_attention: LTX-2 under Ulysses, one call a block (two blocks).
WHOLE_QUERIES = {**dict.fromkeys(LTX2_CASES, 2), "ltx2_ring": 0}


def _ltx2_full_width(device, config, backend=None):
    """LTX-2 at full width (two of its 48 blocks, random weights, bf16), 2 x 384 video tokens, 20
    audio frames and a padded 32-token prompt: injected under context parallelism against stock
    diffusers on one GPU."""
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = LTX2VideoTransformer3DModel(**ltx2_zoo.config("2.0", full=True, num_layers=2))
    model = model.to(torch.bfloat16).eval()
    inputs = ltx2_zoo.inputs(
        torch.bfloat16, "2.0", None, 2, 4, 8, 12, 20, 32, full=True, device=device
    )
    if backend is not None:
        model.set_attention_backend(backend)
    with torch.no_grad():
        expected = model(**inputs)
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        model.enable_parallelism(config=config)
        with _CountUlyssesCalls() as ulysses:
            outputs = model(**inputs)
    error = max(rel_l2(out, ref) for out, ref in zip(outputs, expected))
    tolerance = REL_L2_TOLERANCE[torch.bfloat16]
    return {
        "out": error,
        "tolerance": tolerance,
        "ulysses_calls": ulysses.calls,
        "whole_queries_calls": ulysses.whole_queries,
    }


def _hunyuan15_full_width(device, config):
    """HunyuanVideo-1.5 480p at full width (two of its 54 blocks, random weights, bf16), 2 x
    (3 x 30 x 52) video tokens and a 256 + 64-token prompt padded differently per element:
    injected under Ulysses against stock diffusers on one GPU."""
    import step_inputs
    from diffusers import HunyuanVideo15Transformer3DModel
    from ltx_kernels.integration import injected_plan
    from model_zoo import hunyuan

    torch.manual_seed(0)
    with torch.device(device):
        model = HunyuanVideo15Transformer3DModel(**hunyuan.config_480p(num_layers=2))
        model = model.to(torch.bfloat16).eval()
        masks = torch.ones(2, 256), torch.ones(2, 64)
        masks[0][0, 200:] = 0
        masks[1][1, 40:] = 0
        inputs = step_inputs.hunyuan_video15(
            model.config,
            lambda *shape: torch.randn(*shape, dtype=torch.bfloat16),
            batch=2,
            frames=3,
            height=30,
            width=52,
            text=256,
            text_2=64,
            image_tokens=729,
            image=lambda *shape: torch.zeros(*shape, dtype=torch.bfloat16),
            timestep=torch.tensor([500.0, 500.0], dtype=torch.bfloat16),
            masks=masks,
        )
    with torch.no_grad():
        expected = output_of(model(**inputs))
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        model.enable_parallelism(config=config, cp_plan=injected_plan(model))
        out = output_of(model(**inputs))
    return {"out": rel_l2(out, expected), "tolerance": REL_L2_TOLERANCE[torch.bfloat16]}


GPU_CASES = {
    "full_size_ulysses": lambda d: _full_size(d, _ulysses()),
    "ltx2_full_width_ulysses": lambda d: _ltx2_full_width(d, _ulysses()),
    "hunyuan15_full_width_ulysses": lambda d: _hunyuan15_full_width(d, _ulysses()),
}


def _worker(rank, port, results_dir, device):
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "cpu:gloo"
    cases = {**CASES, **(GPU_CASES if device == "cuda" else {})}
    run_cases(rank, WORLD, port, backend, results_dir, cases, device)


def _spawn(directory, device):
    mp.spawn(_worker, args=(free_port(), str(directory), device), nprocs=WORLD, join=True)
    ranks = []
    for rank in range(WORLD):
        with open(directory / f"rank{rank}.json") as f:
            ranks.append(json.load(f))
    return ranks


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs (NCCL)"
)


@pytest.fixture(
    scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])]
)
def results(request, tmp_path_factory):
    """Per rank, {case: result} of every case, run in one spawn of WORLD processes on gloo (CPU)
    or NCCL (one GPU each)."""
    return _spawn(tmp_path_factory.mktemp(f"context_parallel_{request.param}"), request.param)


@pytest.mark.parametrize("case", sorted(RAISES))
def test_raises_clearly(results, case):
    """LTX-2: training under context parallelism; HunyuanVideo-1.5: ring attention, and its plan
    for a stock model: each raises with the reason."""
    for by_case in results:
        assert by_case[case]["raised"] and RAISES[case][1] in by_case[case]["raised"]


@pytest.mark.parametrize("case", sorted(CHECKS))
def test_checks(results, case):
    for by_case in results:
        assert by_case[case].get("failed") == [], by_case[case]


#: Text gathers of one inference call of the tiny LTX model: its text and mask once (reused by
#: every block); training gathers per block (autograd recording).
TEXT_GATHERS = {
    "ulysses_inject_before": 2,
    "ulysses_inject_after_per_token_timesteps": 2,
    "ring": 2,
    "ulysses_train": 2 * ltx.TINY["num_layers"],
}


@pytest.mark.parametrize("case", sorted(TEXT_GATHERS))
def test_text_gathered_once_per_step(results, case):
    for by_case in results:
        assert by_case[case]["text_gathers"] == TEXT_GATHERS[case]


@pytest.mark.parametrize("case", sorted(set(CASES) - set(RAISES) - set(CHECKS) | set(GPU_CASES)))
def test_matches_one_process_stock(results, case):
    if case not in results[0]:
        pytest.skip("a full-size model: runs on 2 GPUs only")
    for rank, by_case in enumerate(results):
        result = by_case[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        tolerance = result["tolerance"]
        assert result["out"] <= tolerance, f"rank {rank}: output rel. L2 {result['out']:.3g}"
        if "grads" in result:
            assert result["grads"] <= tolerance, f"rank {rank}: gradient rel. L2 {result['grads']}"


@pytest.mark.parametrize("case", sorted(ULYSSES_ATTENTION))
def test_which_self_attention_runs_ulysses_attention(results, case):
    for by_case in results:
        assert by_case[case]["ulysses_calls"] == ULYSSES_ATTENTION[case]


@pytest.mark.parametrize("case", sorted(WHOLE_QUERIES))
def test_which_attention_runs_ulysses_whole_queries_attention(results, case):
    for by_case in results:
        assert by_case[case]["whole_queries_calls"] == WHOLE_QUERIES[case]


#: Calls of our attention op through the seam: attention="ltx_kernels" (each block's
#: self-attention, inside ulysses_attention), and the default ("auto": no measured entry yet).
LTX_ATTENTION_CALLS = {"ulysses_ltx_kernels_attention": 2, "ulysses_inject_before": 0}


@pytest.mark.parametrize("case", sorted(LTX_ATTENTION_CALLS))
def test_which_attention_runs_the_ltx_kernels_op(results, case):
    for by_case in results:
        assert by_case[case]["ltx_attention_calls"] == LTX_ATTENTION_CALLS[case]


@pytest.mark.parametrize(
    "case", ["ulysses_inject_before", "ulysses_inject_after", "ring", "ring_inject_after"]
)
def test_injection_patches_everything_in_either_order(results, case):
    """Injected before or after enable_parallelism, everything is patched, the model's output norm
    included (after: diffusers' split hook moves onto the patched forward), and the split hook's
    plan is diffusers' own (the patched forward takes its chunk of per-token timesteps: a plan
    entry would log a warning for every [B] timestep, a graph break under torch.compile)."""
    for by_case in results:
        result = by_case[case]
        assert result["processor"] == "LTXKernelsAttnProcessor"
        assert result["processor_parallel"]
        assert result["skipped"] == []
        # blocks, two processors and attn1's fused q/k/v projections each, the output norm
        assert result["patched"] == 4 * ltx.TINY["num_layers"] + 1
        assert "timestep" not in result["split_inputs"]


def test_whole_model_compile_has_no_graph_break_at_the_split_hook(results):
    """torch.compile of the whole model under Ulysses traces diffusers' split hook: the patched
    forward takes per-token timesteps' chunk, so the hook logs no warning for a [B] timestep
    (a logging call is a graph break; fullgraph=True failed). torch 2.11 still breaks in
    diffusers' output gather (funcol along dim 1 calls a helper Dynamo skips); torch 2.15 traces
    the whole model."""
    for by_case in results:
        breaks = by_case["ulysses_whole_model_compiled"]["breaks"]
        assert not any("logging" in reason for reason in breaks), breaks
        if tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 15):
            assert breaks == [], breaks


def test_remove_restores_stock_model_and_processors_with_parallel_config(results):
    """Removal after injecting after enable_parallelism: blocks, processors and the model back,
    the stock processors with the parallel config, the model's split hook with diffusers' plan."""
    for by_case in results:
        result = by_case["ulysses_remove"]
        assert result["restored"] == 3 * ltx.TINY["num_layers"] + 1
        assert result["processor"] == "LTXVideoAttnProcessor" and result["processor_parallel"]
        assert result["split_inputs"] == [
            "encoder_attention_mask", "encoder_hidden_states", "hidden_states"
        ]  # fmt: skip


def _generate_video_worker(
    rank, port, output, model_args, configs=("--configs", "baseline,kernels")
):
    """scripts/generate_video.py under a torchrun-like environment (gloo on the CPU)."""
    run_generate_video(
        rank,
        WORLD,
        port,
        ["--tiny", *model_args, "--num-frames", "9", "--height", "64", "--width", "64"]
        + ["--steps", "2"]
        + ["--warmup-iterations", "1", "--runs", "1", "--no-progress", "--no-video"]
        + ["--dtype", "fp32", "--compare", *configs]
        + ["--context-parallel", "ulysses", "--output", output],
    )


@pytest.mark.parametrize(
    "model_args",
    [[], ["--model-id", "Lightricks/LTX-Video-0.9.7-dev"], ["--model-id", "Lightricks/LTX-2"]],
    ids=["ltx", "ltx_condition", "ltx2"],
)
def test_generate_video_context_parallel(tmp_path, model_args):
    """torchrun --nproc_per_node 2 scripts/generate_video.py --context-parallel ulysses --compare:
    the rows (kernels on one GPU, then the baseline and the kernels on both), their latents equal
    within fp32 rounding, the results written by rank 0."""
    output = tmp_path / "video.mp4"
    mp.spawn(
        _generate_video_worker,
        args=(free_port(), str(output), model_args),
        nprocs=WORLD,
        join=True,
    )
    results, rows = compared_rows(output, TOLERANCE, audio="LTX-2" in str(model_args))
    assert "ulysses x 2 GPUs" in rows["kernels"]["notes"]
    assert "ltx_kernels processors for the text mask" in rows["baseline"]["notes"]
    assert results["settings"]["context_parallel"] == "ulysses"


@pytest.mark.parametrize(
    "model_args",
    [[], ["--model-id", "Lightricks/LTX-2"]],
    ids=["ltx", "ltx2"],
)
def test_generate_video_ulysses_whole_model_compiled(tmp_path, model_args):
    """--compile-scope full under --context-parallel ulysses: the whole model compiled (Inductor,
    not fullgraph), its latents the parallel baseline's within fp32 rounding, as the uncompiled
    kernels' are."""
    output = tmp_path / "video.mp4"
    compiled = ["--configs", "baseline,kernels,kernels+compile", "--compile-scope", "full"]
    mp.spawn(
        _generate_video_worker,
        args=(free_port(), str(output), model_args, compiled),
        nprocs=WORLD,
        join=True,
    )
    results = json.loads(output.with_suffix(".json").read_text())
    rows = {row["config"]: row for row in results["results"]}
    assert list(rows) == ["kernels-1gpu", "baseline", "kernels", "kernels+compile"]
    assert "torch.compile (full)" in rows["kernels+compile"]["notes"]
    assert "ulysses x 2 GPUs" in rows["kernels+compile"]["notes"]
    # (compiled: Inductor's first call takes seconds where the tiny eager call takes milliseconds)
    assert rows["kernels+compile"]["warmup_s"][0] > 10 * rows["kernels"]["warmup_s"][0], rows
    for config in ("kernels", "kernels+compile"):
        assert 0 < rows[config]["rel_l2"] <= TOLERANCE, rows[config]


@pytest.mark.parametrize(
    "flags",
    [["--context-parallel", "ring"], ["--context-parallel", "ulysses", "--cfg-parallel"]],
    ids=["ring", "cfg_parallel"],
)
def test_generate_video_whole_model_compile_under_ulysses_alone(monkeypatch, capsys, flags):
    monkeypatch.setenv("WORLD_SIZE", "4")
    parse = generate_video_script().parse_args
    ulysses = ["--tiny", "--compile", "--context-parallel", "ulysses"]
    assert parse(ulysses).compile_scope == "blocks"  # (the default under parallelism)
    assert parse([*ulysses, "--compile-scope", "full"]).compile_scope == "full"
    with pytest.raises(SystemExit):
        generate_video_script().parse_args(
            ["--tiny", "--compile", "--compile-scope", "full", *flags]
        )
    assert (
        "--compile-scope full compiles the whole model under --context-parallel ulysses alone"
        in (capsys.readouterr().err)
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("last", [8, 12, 7])
def test_copy_through_wide_elements(dtype, last):
    """attention._copy (8-byte elements where the last dim allows): out equals x bit for bit
    for permuted, offset and odd-width views."""
    from ltx_kernels.integration.attention import _copy

    x = torch.randn(3, 5, 4, last, dtype=torch.float64).to(dtype)
    source = x.permute(2, 0, 1, 3)[1:]  # [3, 3, 5, last], offset and permuted
    out = torch.full((3, 3, 5, 2, last), float("nan"), dtype=dtype)[:, :, :, 1]
    assert _copy(out, source) is out
    assert torch.equal(out, source)


FOUR_HEADS_LTX2 = dict(
    num_attention_heads=4, attention_head_dim=4, audio_num_attention_heads=4,
    audio_attention_head_dim=2,
)  # fmt: skip
#: LTX-2 under Ulysses over 2 and 4 ranks (each rank 2 or 1 of 4 video and 4 audio heads; 8 text
#: tokens, split by the plan), image-to-video with the padded text mask as the benchmark runs it:
#: with ulysses_attention and ulysses_whole_queries_attention, and with diffusers' Ulysses
#: attention (the op disabled: the video-to-audio attention sends the audio's queries too).
LTX2_RANKS_CASES = {
    "ours": lambda degree: _ltx2_ranks_case(degree),
    "diffusers_ulysses": lambda degree: _ltx2_ranks_case(
        degree, ops=set(FUSIONS) - {"ulysses_attention"}
    ),
}


def _ltx2_ranks_case(degree, ops=None):
    return _ltx2_case("cpu", _ulysses(degree), "2.0", "i2v", ops=ops, text=8, **FOUR_HEADS_LTX2)


def _ltx2_ranks_worker(rank, world, port, results_dir):
    run_cases(rank, world, port, "cpu:gloo", results_dir, LTX2_RANKS_CASES, world)


@pytest.mark.parametrize("world", [2, 4])
def test_ltx2_ulysses_over_ranks(tmp_path, world):
    """Each rank's LTX-2 outputs equal one process's; with the op, each block's video
    self-attention runs ulysses_attention and its video-to-audio attention
    ulysses_whole_queries_attention (one call each a block); without, neither."""
    mp.spawn(_ltx2_ranks_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        by_case = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for case, result in by_case.items():
            assert "error" not in result, f"rank {rank}, {case}: {result.get('error')}"
            assert result["out"] <= result["tolerance"], (rank, case, result["out"])
            calls = 2 if case == "ours" else 0  # two blocks
            assert result["ulysses_calls"] == result["whole_queries_calls"] == calls
