"""enable_cfg_parallel on the CPU: gloo processes run tiny pipelines (the transformer injected, no
VAE, latents out) with their two guidance branches on two groups of processes, 2 processes (one
a branch) and 4 (2 groups x Ulysses 2), and every rank's latents must equal one process running
the same pipeline with stock diffusers, bit for bit between the ranks (the guidance sum, the
scheduler and the callbacks run on every rank on the same outputs). One spawn per world size
runs every case; the tests read its results.

The CPU-only quirk of test_context_parallel.py is handled the same way: diffusers computes
`rank % torch.accelerator.device_count()`, 0 on a CPU-only torch (patched to 1 in the workers).
"""

import copy
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ltx_kernels
from inject_helpers import rel_l2
from ltx_kernels.integration import enable_cfg_parallel
from model_zoo import ltx, wan

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo"
)

TOLERANCE = 1e-5  # fp32: the split changes the summation order only (Ulysses), or nothing
STEPS = 2


def _ulysses(degree):
    from diffusers import ContextParallelConfig

    return None if degree == 1 else ContextParallelConfig(ulysses_degree=degree)


def _ltx_pipeline(model):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    scheduler = FlowMatchEulerDiscreteScheduler()
    return LTXPipeline(scheduler, vae=None, text_encoder=None, tokenizer=None, transformer=model)


def _ltx_call(pipe, guidance_scale=3.0):
    """Two steps of 9 frames 64 x 64 (2 x 2 x 2 latent tokens) on a padded 6-token prompt."""
    generator = torch.Generator().manual_seed(1)
    text = torch.randn(2, 1, ltx.TEXT, ltx.TINY["caption_channels"], generator=generator)
    mask = torch.ones(1, ltx.TEXT, dtype=torch.long)
    mask[:, ltx.TEXT - 2 :] = 0
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


def _wan_pipeline(model):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler, transformer=model
    )


def _wan_call(pipe, guidance_scale=3.0):
    """Two steps of 5 frames 32 x 32 (2 x 4 x 4 latents: 8 tokens) on a 5-token prompt."""
    generator = torch.Generator().manual_seed(1)
    text = torch.randn(2, 1, 5, wan.TINY["text_dim"], generator=generator)
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


FAMILIES = {
    "ltx": (lambda: ltx.tiny_model(torch.float32), _ltx_pipeline, _ltx_call),
    "wan": (lambda: wan.tiny_model(torch.float32), _wan_pipeline, _wan_call),
}


def _case(family, ulysses):
    """The pipeline with its transformer injected and enable_cfg_parallel against stock diffusers
    in this process; the (batch, tokens) each call of the last block saw on this rank."""
    build_model, build_pipeline, call = FAMILIES[family]
    torch.manual_seed(0)
    reference = build_model()
    model = copy.deepcopy(reference)
    expected = call(build_pipeline(reference))
    pipe = build_pipeline(model)
    ltx_kernels.inject_optimized_kernels(pipe, verbose=False)
    enable_cfg_parallel(pipe, _ulysses(ulysses))
    seen = []
    blocks = model.transformer_blocks if family == "ltx" else model.blocks
    blocks[-1].register_forward_pre_hook(  # (Wan's plan splits the tokens at its first block)
        lambda _, args, kwargs: seen.append(list((args or [kwargs["hidden_states"]])[0].shape[:2])),
        with_kwargs=True,
    )
    out = call(pipe)
    return {"out": rel_l2(out, expected), "latents": out.flatten().tolist(), "seen": seen}


def _raises(run):
    try:
        run()
    except (TypeError, ValueError, RuntimeError) as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


def _guidance_off(family):
    build_model, build_pipeline, call = FAMILIES[family]
    pipe = build_pipeline(build_model())
    enable_cfg_parallel(pipe)
    return _raises(lambda: call(pipe, guidance_scale=1.0))


def _no_guidance_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    pipe = FluxPipeline(FlowMatchEulerDiscreteScheduler(), None, None, None, None, None, None)
    return _raises(lambda: enable_cfg_parallel(pipe))


def _world_not_divisible():
    pipe = _ltx_pipeline(ltx.tiny_model(torch.float32))
    return _raises(lambda: enable_cfg_parallel(pipe, _ulysses(2)))  # 2 processes: 2 x 2 needed


#: World size -> {case: function}.
CASES = {
    2: {
        "ltx": lambda: _case("ltx", 1),
        "wan": lambda: _case("wan", 1),
        "guidance_off_ltx": lambda: _guidance_off("ltx"),
        "guidance_off_wan": lambda: _guidance_off("wan"),
        "no_guidance_pipeline": _no_guidance_pipeline,
        "world_not_divisible": _world_not_divisible,
    },
    4: {
        "ltx_ulysses": lambda: _case("ltx", 2),
        "wan_ulysses": lambda: _case("wan", 2),
    },
}
#: Cases that must raise, with a part of the expected message.
RAISES = {
    "guidance_off_ltx": "LTXPipeline was called with guidance off",
    "guidance_off_wan": "WanPipeline was called with guidance off",
    "no_guidance_pipeline": "FluxPipeline is not supported",
    "world_not_divisible": "the world size 2 must be 2 (guidance branches) x the context-parallel",
}
#: (batch, tokens) of each last-block call on every rank: LTX one batched call a step, half the
#: batch a group (Ulysses: half the tokens a rank); Wan one of the two calls a step a group.
SEEN = {"ltx": [[1, 8]] * STEPS, "ltx_ulysses": [[1, 4]] * STEPS}
SEEN.update(wan=SEEN["ltx"], wan_ulysses=SEEN["ltx_ulysses"])


def _worker(rank, world, port, results_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("cpu:gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if torch.accelerator.device_count() == 0:  # diffusers: rank % device_count()
        torch.accelerator.device_count = lambda: 1
    results = {}
    try:
        for name, case in CASES[world].items():
            try:
                results[name] = case()
            except Exception as error:  # noqa: BLE001  (reported per case by the tests)
                results[name] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """World size -> per rank {case: result}, of one spawn of that many gloo processes (run on
    first use)."""
    spawned = {}

    def of(world):
        if world not in spawned:
            directory = tmp_path_factory.mktemp(f"cfg_parallel_{world}")
            mp.spawn(_worker, args=(world, _free_port(), str(directory)), nprocs=world, join=True)
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


@pytest.mark.parametrize("world, case", _world_cases(RAISES))
def test_raises_clearly(results, world, case):
    for by_case in results(world):
        raised = by_case[case]["raised"]
        assert raised and RAISES[case] in raised, raised
