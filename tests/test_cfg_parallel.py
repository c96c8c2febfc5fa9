"""enable_cfg_parallel on the CPU: gloo processes run tiny pipelines (the transformer injected, no
VAE, latents out) with their two guidance branches on two groups of processes, 2 processes (one
a branch) and 4 (2 groups x Ulysses 2), and every rank's latents must equal one process running
the same pipeline with stock diffusers, bit for bit between the ranks (the guidance sum, the
scheduler and the callbacks run on every rank on the same outputs). One spawn per world size
runs every case; the tests read its results.

The CPU-only quirk of test_context_parallel.py is handled the same way: diffusers computes
`rank % torch.accelerator.device_count()`, 0 on a CPU-only torch (patched to 1 in the workers).
"""

import json
import os

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
from inject_helpers import rel_l2
from ltx_kernels.integration import enable_cfg_parallel
from model_zoo import hunyuan, ltx, wan

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo"
)

TOLERANCE = 1e-5  # fp32: the split changes the summation order only (Ulysses), or nothing
STEPS = 2


def _device(pipe) -> torch.device:
    return pipe.transformer.device


def _ulysses(degree):
    from diffusers import ContextParallelConfig

    return None if degree == 1 else ContextParallelConfig(ulysses_degree=degree)


def _ltx_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    torch.manual_seed(0)
    model = ltx.tiny_model(torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler()
    return LTXPipeline(scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=model)


def _ltx_call(pipe, guidance_scale=3.0):
    """Two steps of 9 frames 64 x 64 (2 x 2 x 2 latent tokens) on a padded 6-token prompt."""
    generator = torch.Generator().manual_seed(1)
    text = torch.randn(2, 1, ltx.TEXT, ltx.TINY["caption_channels"], generator=generator)
    mask = torch.ones(1, ltx.TEXT, dtype=torch.long)
    mask[:, ltx.TEXT - 2 :] = 0
    text, mask = text.to(_device(pipe)), mask.to(_device(pipe))
    return pipe(
        prompt_embeds=text[0],
        prompt_attention_mask=mask,
        negative_prompt_embeds=text[1],
        negative_prompt_attention_mask=mask,
        num_frames=9,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        return_dict=False,
    )[0]


def _wan_pipeline():
    from diffusers import UniPCMultistepScheduler, WanPipeline

    torch.manual_seed(0)
    model = wan.tiny_model(torch.float32)

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler, transformer=model
    )


def _wan_call(pipe, guidance_scale=3.0):
    """Two steps of 5 frames 32 x 32 (2 x 4 x 4 latents: 8 tokens) on a 5-token prompt."""
    generator = torch.Generator().manual_seed(1)
    text = torch.randn(2, 1, 5, wan.TINY["text_dim"], generator=generator).to(_device(pipe))
    return pipe(
        prompt_embeds=text[0],
        negative_prompt_embeds=text[1],
        num_frames=5,
        height=32,
        width=32,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        return_dict=False,
    )[0]


def _hunyuan15_pipeline():
    import transformer_cases  # (benchmarks/, on the path with model_zoo)
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    # in: the latents, the condition latents (zeros for text-to-video) and their mask channel
    model = hunyuan.tiny_model(torch.float32, v15=True, in_channels=2 * 4 + 1)
    return transformer_cases.denoising_pipeline(
        HunyuanVideo15Pipeline, model, scheduler=FlowMatchEulerDiscreteScheduler()
    )


def _hunyuan15_call(pipe, guidance_scale=3.0):
    """Two steps of 5 frames 64 x 64 (2 x 4 x 4 latents: 32 tokens) on Qwen and ByT5 prompts
    padded differently in each branch (key lengths differing between the calls)."""
    pipe.guider.guidance_scale = guidance_scale
    generator = torch.Generator().manual_seed(1)
    text, text_2 = hunyuan.TEXT, 4

    def prompt(width, length, valid):
        mask = torch.ones(1, length)
        mask[:, valid:] = 0
        return torch.randn(1, length, width, generator=generator).to(_device(pipe)), mask.to(
            _device(pipe)
        )

    (embeds, mask), (negative, negative_mask) = prompt(16, text, 4), prompt(16, text, 2)
    (embeds_2, mask_2), (negative_2, negative_mask_2) = prompt(8, text_2, 3), prompt(8, text_2, 1)
    return pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=negative,
        negative_prompt_embeds_mask=negative_mask,
        prompt_embeds_2=embeds_2,
        prompt_embeds_mask_2=mask_2,
        negative_prompt_embeds_2=negative_2,
        negative_prompt_embeds_mask_2=negative_mask_2,
        num_frames=5,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        return_dict=False,
    )[0]


def _ltx2_pipeline(checkpoint="ltx-2"):
    """generate_video.py's tiny LTX-2 pipeline (2.0; "ltx-2.3": its STG perturbs the attention,
    where 2.0's tiny config leaves STG without effect): video and audio, text connectors."""
    return generate_video_script().build_random_pipeline(
        checkpoint, torch.float32, "cpu", tiny=True
    )


def _ltx2_call(pipe, guidance_scale=3.0, stg_blocks=(1,), stg_scale=1.0):
    """Two steps of 9 frames 64 x 64 (8 video tokens) on a left-padded 8-token prompt, with
    LTX2Pipeline's default guidance: CFG, STG (at the second block) and modality isolation, the
    video and audio latents concatenated."""
    generator = torch.Generator().manual_seed(1)
    width = generate_video_script().text_width(pipe)
    text = torch.randn(2, 1, 8, width, generator=generator)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, :2] = 0
    text, mask = text.to(_device(pipe)), mask.to(_device(pipe))
    video, audio = pipe(
        prompt_embeds=text[0],
        prompt_attention_mask=mask,
        negative_prompt_embeds=text[1],
        negative_prompt_attention_mask=mask,
        num_frames=9,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        guidance_scale=guidance_scale,
        spatio_temporal_guidance_blocks=list(stg_blocks),
        stg_scale=stg_scale,
        audio_stg_scale=stg_scale,
        max_sequence_length=8,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        return_dict=False,
    )
    return torch.cat([video.flatten(), audio.flatten()])


FAMILIES = {
    "ltx": (_ltx_pipeline, _ltx_call),
    "ltx2": (_ltx2_pipeline, _ltx2_call),
    "ltx2.3": (lambda: _ltx2_pipeline("ltx-2.3"), _ltx2_call),
    "wan": (_wan_pipeline, _wan_call),
    "hunyuan15": (_hunyuan15_pipeline, _hunyuan15_call),
}


def _seen_by_last_block(model) -> list:
    """The (batch, tokens) of each call of the model's last block, as they come (Wan's plan
    splits the tokens at its first block)."""
    seen = []
    blocks = getattr(model, "blocks", None) or model.transformer_blocks
    blocks[-1].register_forward_pre_hook(
        lambda _, args, kwargs: seen.append(list((args or [kwargs["hidden_states"]])[0].shape[:2])),
        with_kwargs=True,
    )
    return seen


def _case(family, ulysses, order="before", device="cpu", groups=2):
    """The pipeline with its transformer injected before or after enable_cfg_parallel against
    stock diffusers in this process, on `device`; the (batch, tokens) each call of the last block
    saw on this rank. Injected after: then removed, the hooks on the model and how many modules
    came back."""
    build_pipeline, call = FAMILIES[family]
    expected = call(build_pipeline().to(device))
    pipe = build_pipeline().to(device)
    model, stock_class = pipe.transformer, type(pipe.transformer)
    if order == "before":
        ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    enable_cfg_parallel(pipe, _ulysses(ulysses), groups=groups)
    if order == "after":
        ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    seen = _seen_by_last_block(model)
    out = call(pipe)
    result = {"out": rel_l2(out, expected), "latents": out.flatten().tolist(), "seen": seen}
    if order == "after":
        result["restored"] = ltx_kernels.remove_optimized_kernels(pipe)
        result["hooks"] = list(model._diffusers_hook.hooks)
        result["class"] = type(model) is stock_class
    return result


def _ltx2_four_groups_blocks_change(device):
    """LTX-2.3 on four groups called twice, the second time with STG at another block and the
    hooks' state kept from the first call (as after a call that raised: the pipeline resets it at
    the end of a call): the second call's twins, run ahead with the first call's blocks, run again
    at the STG call; both calls against stock diffusers (their STG blocks change the output)."""
    build = FAMILIES["ltx2.3"][0]
    expected = [_ltx2_call(build().to(device), stg_blocks=blocks) for blocks in ((1,), (0,))]
    pipe = build().to(device)
    pipe.maybe_free_model_hooks = lambda: None  # (keeps the hooks' state between the calls)
    ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    enable_cfg_parallel(pipe, groups=4)
    seen = _seen_by_last_block(pipe.transformer)
    outs = [_ltx2_call(pipe, stg_blocks=blocks) for blocks in ((1,), (0,))]
    return {
        "out": max(rel_l2(out, ref) for out, ref in zip(outs, expected)),
        "blocks_matter": rel_l2(expected[0], expected[1]),
        "latents": torch.cat(outs).tolist(),
        "seen": seen,
    }


def _sharing_pipeline(pipe):
    """Another LTXPipeline on the same transformer (as from_pipe makes)."""
    from diffusers import LTXPipeline

    return LTXPipeline(pipe.scheduler, None, None, None, pipe.transformer)


def _ltx_taken_over(device):
    """enable_cfg_parallel on one LTXPipeline, then a second pipeline sharing its transformer
    calls it: a clear error (the first never ran), then enable_cfg_parallel on the second takes the
    transformer over, and its call matches stock diffusers."""
    expected = _ltx_call(_ltx_pipeline().to(device))
    pipe = _ltx_pipeline().to(device)
    ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    enable_cfg_parallel(pipe)
    other, seen = _sharing_pipeline(pipe), _seen_by_last_block(pipe.transformer)
    raised = _raises(lambda: _ltx_call(other))["raised"]
    enable_cfg_parallel(other)
    out = _ltx_call(other)
    return {
        "out": rel_l2(out, expected),
        "latents": out.flatten().tolist(),
        "seen": seen,
        "raised": raised,
    }


def _ltx_taken_over_in_another_layout():
    pipe = _ltx_pipeline()
    enable_cfg_parallel(pipe, _ulysses(2))
    from diffusers import ContextParallelConfig

    return _raises(
        lambda: enable_cfg_parallel(_sharing_pipeline(pipe), ContextParallelConfig(ring_degree=2))
    )


def _ltx2_four_groups_without_stg():
    pipe = _ltx2_pipeline()
    enable_cfg_parallel(pipe, groups=4)
    return _raises(lambda: _ltx2_call(pipe, stg_scale=0.0))


def _four_groups_ltx_video():
    pipe = _ltx_pipeline()
    return _raises(lambda: enable_cfg_parallel(pipe, groups=4))


def _raises(run):
    try:
        run()
    except (TypeError, ValueError, RuntimeError) as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


def _guidance_off(family):
    build_pipeline, call = FAMILIES[family]
    pipe = build_pipeline()
    enable_cfg_parallel(pipe)
    return _raises(lambda: call(pipe, guidance_scale=1.0))


def _no_guidance_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, None)
    return _raises(lambda: enable_cfg_parallel(pipe))


def _output_not_laid_out_as_expected():
    # A transformer whose output is not laid out as its config says (here: the config's
    # out_channels changed after building it): every group raises before the exchange of the
    # branches' outputs, none is left waiting in it (Wan: one call a branch).
    pipe = _wan_pipeline()
    enable_cfg_parallel(pipe)
    pipe.transformer.register_to_config(out_channels=2 * pipe.transformer.config.in_channels)
    return _raises(lambda: _wan_call(pipe))


def _world_not_divisible():
    pipe = _ltx_pipeline()
    return _raises(lambda: enable_cfg_parallel(pipe, _ulysses(2)))  # 2 processes: 2 x 2 needed


#: World size -> {case: function(device)}.
CASES = {
    2: {
        "ltx": lambda d: _case("ltx", 1, device=d),
        "wan": lambda d: _case("wan", 1, device=d),
        "ltx2": lambda d: _case("ltx2", 1, device=d),
        "ltx_inject_after": lambda d: _case("ltx", 1, "after", device=d),
        "guidance_off_ltx": lambda d: _guidance_off("ltx"),
        "guidance_off_wan": lambda d: _guidance_off("wan"),
        "hunyuan15": lambda d: _case("hunyuan15", 1, device=d),
        "guidance_off_hunyuan15": lambda d: _guidance_off("hunyuan15"),
        "no_guidance_pipeline": lambda d: _no_guidance_pipeline(),
        "world_not_divisible": lambda d: _world_not_divisible(),
        "output_layout": lambda d: _output_not_laid_out_as_expected(),
        "ltx_taken_over": _ltx_taken_over,
    },
    4: {
        "ltx_ulysses": lambda d: _case("ltx", 2, device=d),
        "wan_ulysses": lambda d: _case("wan", 2, device=d),
        "ltx2_ulysses": lambda d: _case("ltx2", 2, device=d),
        "ltx_ulysses_inject_after": lambda d: _case("ltx", 2, "after", device=d),
        "hunyuan15_ulysses": lambda d: _case("hunyuan15", 2, device=d),
        "ltx2_four_groups": lambda d: _case("ltx2.3", 1, device=d, groups=4),
        "ltx2_four_groups_blocks_change": _ltx2_four_groups_blocks_change,
        "ltx2_four_groups_without_stg": lambda d: _ltx2_four_groups_without_stg(),
        "four_groups_ltx_video": lambda d: _four_groups_ltx_video(),
        "taken_over_in_another_layout": lambda d: _ltx_taken_over_in_another_layout(),
    },
    8: {"ltx2_four_groups_ulysses": lambda d: _case("ltx2.3", 2, device=d, groups=4)},
}
#: Cases that must raise, with a part of the expected message.
RAISES = {
    "guidance_off_ltx": "LTXPipeline was called with guidance off",
    "guidance_off_wan": "WanPipeline was called with guidance off",
    "guidance_off_hunyuan15": "HunyuanVideo15Pipeline was called with guidance off",
    "no_guidance_pipeline": "FluxPipeline is not supported",
    "world_not_divisible": "the world size 2 must be 2 (guidance branches) x the context-parallel",
    "output_layout": "torch.float32 the other group's output is laid out as",
    "ltx2_four_groups_without_stg": "enable_cfg_parallel(groups=4): LTX2Pipeline was called "
    "without both of its 'uncond_stg' and 'uncond_modality' passes (do_spatio_temporal_guidance"
    "=False, do_modality_isolation_guidance=True)",
    "taken_over_in_another_layout": "enable_cfg_parallel: LTXPipeline.transformer runs under it "
    "with groups=2 and ContextParallelConfig(ring_degree=1, ulysses_degree=2",
    "four_groups_ltx_video": "enable_cfg_parallel: groups=4 for LTXPipeline; 2 (the guidance "
    "branches), or 4 (the branches and the STG and modality passes) for LTX2ImageToVideoPipeline, "
    "LTX2Pipeline",
}
#: (batch, tokens) of each last-block call on every rank: LTX one batched call a step, half the
#: batch a group (Ulysses: half the tokens a rank); Wan one of the two calls a step a group.
SEEN = {"ltx": [[1, 8]] * STEPS, "ltx_ulysses": [[1, 4]] * STEPS}
SEEN.update(wan=SEEN["ltx"], wan_ulysses=SEEN["ltx_ulysses"], ltx_inject_after=SEEN["ltx"])
SEEN.update(ltx_ulysses_inject_after=SEEN["ltx_ulysses"], ltx_taken_over=SEEN["ltx"])
# HunyuanVideo-1.5: Wan's separate calls, 32 tokens (its patch size 1)
SEEN.update(hunyuan15=[[1, 32]] * STEPS, hunyuan15_ulysses=[[1, 16]] * STEPS)
# LTX-2: the batched call, then the STG pass (group 0) or the modality pass (group 1), a step
SEEN.update(ltx2=[[1, 8]] * 2 * STEPS, ltx2_ulysses=[[1, 4]] * 2 * STEPS)
# LTX-2 on four groups: two passes at the first step (the twins' call not seen yet), then one; the
# second call (other STG blocks, the state kept) runs its first step's twins again at the STG call.
SEEN.update(
    ltx2_four_groups=[[1, 8]] * (STEPS + 1), ltx2_four_groups_ulysses=[[1, 4]] * (STEPS + 1)
)
SEEN.update(ltx2_four_groups_blocks_change=[[1, 8]] * 2 * (STEPS + 1))
#: Injected after enable_cfg_parallel, then removed: how many modules came back (blocks, two
#: processors and fused q/k/v projections each, the model) and the hooks left on the model,
#: innermost first. (Wan under context parallelism is injected first: diffusers' split hook sits
#: on its first block.)
RESTORED = {
    "ltx_inject_after": (3 * ltx.TINY["num_layers"] + 1, ["ltx_kernels_cfg_parallel"]),
    "ltx_ulysses_inject_after": (
        3 * ltx.TINY["num_layers"] + 1,
        ["cp_input---", "ltx_kernels_cfg_parallel"],
    ),
}


#: NVLink multicast off on the GPU machines (NCCL's NVLS, symmetric memory's and NVSHMEM's).
NO_MULTICAST = dict(
    NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1"
)


def _worker(rank, world, port, results_dir, device):
    backend = "cpu:gloo"
    if device == "cuda":
        os.environ.update(NO_MULTICAST)
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        backend = "cpu:gloo,cuda:nccl"
    run_cases(rank, world, port, backend, results_dir, CASES[world], device)


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def results(request, tmp_path_factory):
    """World size -> per rank {case: result}, of one spawn of that many processes (run on first
    use): gloo on the CPU, or NCCL with one GPU each (skipped without enough GPUs)."""
    device, spawned = request.param, {}

    def of(world):
        if device == "cuda" and torch.cuda.device_count() < world:
            pytest.skip(f"needs {world} GPUs (NCCL)")
        if world not in spawned:
            directory = tmp_path_factory.mktemp(f"cfg_parallel_{device}_{world}")
            mp.spawn(
                _worker, args=(world, free_port(), str(directory), device), nprocs=world, join=True
            )
            spawned[world] = [
                json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world)
            ]
        return spawned[world]

    return of


def _world_cases(names):
    return [(world, name) for world, cases in CASES.items() for name in cases if name in names]


@pytest.mark.parametrize("world, case", _world_cases(SEEN))
def test_matches_one_process_stock_on_every_rank(results, world, case):
    ranks = results(world)
    for rank, by_case in enumerate(ranks):
        result = by_case[case]
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert result["out"] <= TOLERANCE, f"rank {rank}: latents rel. L2 {result['out']:.3g}"
        assert result["latents"] == ranks[0][case]["latents"], f"rank {rank} differs from rank 0"
        assert result["seen"] == SEEN[case], f"rank {rank}: the last block saw {result['seen']}"
        # (a case on other STG blocks: they must change the output, or the test could not fail)
        assert result.get("blocks_matter", 1.0) > 100 * TOLERANCE, result.get("blocks_matter")
        if case == "ltx_taken_over":  # (the call before the takeover)
            assert "the LTXPipeline it serves is not running" in result["raised"], result["raised"]


@pytest.mark.parametrize("world, case", _world_cases(RAISES))
def test_raises_clearly(results, world, case):
    for by_case in results(world):
        raised = by_case[case]["raised"]
        assert raised and RAISES[case] in raised, raised


@pytest.mark.parametrize("world, case", _world_cases(RESTORED))
def test_inject_after_then_remove_restores_under_the_hooks(results, world, case):
    """Injected after enable_cfg_parallel (beneath its hook and diffusers' split hook, lifted and
    put back), remove_optimized_kernels gives the stock model back with both hooks on it."""
    restored, hooks = RESTORED[case]
    for by_case in results(world):
        result = by_case[case]
        assert result["hooks"] == hooks and result["class"], result
        assert result["restored"] == restored, result["restored"]


def _generate_video_worker(rank, world, port, output, flags):
    """scripts/generate_video.py under a torchrun-like environment (gloo on the CPU)."""
    run_generate_video(
        rank,
        world,
        port,
        ["--tiny", *flags, "--num-frames", "9", "--height", "64", "--width", "64"]
        + ["--steps", "2", "--warmup-iterations", "0", "--runs", "1", "--no-progress"]
        + ["--no-video", "--dtype", "fp32", "--compare", "--configs", "baseline,kernels"]
        + ["--output", output],
    )


@pytest.mark.parametrize(
    "world, flags, layout",
    [
        (2, ["--cfg-parallel"], "cfg x 2 GPUs"),
        (2, ["--cfg-parallel", "--model-id", "Lightricks/LTX-2"], "cfg x 2 GPUs"),
        (4, ["--cfg-parallel", "--context-parallel", "ulysses"], "cfg 2 x ulysses 2 GPUs"),
        (4, ["--cfg-parallel", "4", "--model-id", "Lightricks/LTX-2"], "cfg x 4 GPUs"),
        (  # LTXConditionPipeline: per-token timesteps [2B, S], split by batch, then by tokens
            4,
            ["--cfg-parallel", "--context-parallel", "ulysses"]
            + ["--model-id", "Lightricks/LTX-Video-0.9.7-dev"],
            "cfg 2 x ulysses 2 GPUs",
        ),
    ],
    ids=["ltx", "ltx2", "ltx_ulysses", "ltx2_four_groups", "ltx_condition_ulysses"],
)
def test_generate_video_cfg_parallel(tmp_path, world, flags, layout):
    """torchrun --nproc_per_node N scripts/generate_video.py --cfg-parallel [--context-parallel
    ulysses] --compare: the rows (kernels on one GPU, then the baseline and the kernels on all),
    their latents equal within fp32 rounding, the results written by rank 0."""
    output = tmp_path / "video.mp4"
    mp.spawn(
        _generate_video_worker,
        args=(world, free_port(), str(output), flags),
        nprocs=world,
        join=True,
    )
    results, rows = compared_rows(output, TOLERANCE, audio="Lightricks/LTX-2" in flags)
    assert layout in rows["kernels"]["notes"] and layout in rows["baseline"]["notes"]
    assert results["settings"]["cfg_parallel"]


@pytest.mark.parametrize(
    "world, flags, message",
    [
        (2, ["--guidance-scale", "1"], "--cfg-parallel: needs classifier-free guidance"),
        (4, [], "--cfg-parallel: 4 GPUs; launch 2 (one guidance branch each), or an even"),
        (3, ["--context-parallel", "ulysses"], "--cfg-parallel: 3 GPUs"),
        (4, ["4"], "--cfg-parallel 4: LTX-2 only (its four passes a step)"),
        (
            4,
            ["4", "--model-id", "Lightricks/LTX-2", "--context-parallel", "ulysses"],
            "4 GPUs are one a guidance group, none left to split the sequence",
        ),
        (8, ["4"], "--cfg-parallel 4: 8 GPUs; launch 4 (one pass each), or a multiple of 4"),
    ],
    ids=[
        "guidance_off",
        "four_gpus_without_context_parallel",
        "odd_gpu_count",
        "four_groups_ltx_video",
        "four_groups_four_gpus_with_context_parallel",
        "four_groups_eight_gpus_without_context_parallel",
    ],
)
def test_generate_video_cfg_parallel_flag_errors(monkeypatch, capsys, world, flags, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit):
        generate_video_script().parse_args(["--tiny", "--cfg-parallel", *flags])
    assert message in capsys.readouterr().err
