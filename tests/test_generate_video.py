"""scripts/generate_video.py: the parser, the random-weights pipeline (real configs, and a tiny one
run end to end), the comparison's JSON/chart/video outputs, the `auto` fallback when the hub cannot
be reached, and (GPU) the full-size pipeline's latent drift with the kernels."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY_RUN = [
    "--tiny",
    "--num-frames",
    "9",
    "--height",
    "64",
    "--width",
    "64",
    "--steps",
    "2",
    "--warmup-iterations",
    "1",
    "--runs",
    "1",
    "--no-progress",
]


def load_script(name="generate_video"):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gv():
    return load_script()


# ---- the parser --------------------------------------------------------------------------------


def test_defaults_are_the_seed_options(gv):
    args = gv.parse_args([])
    assert (
        args.kernels,
        args.compile,
        args.batch_size,
        args.num_frames,
        args.height,
        args.width,
        args.steps,
        args.warmup_iterations,
    ) == (True, False, 1, 161, 512, 768, 50, 2)
    assert (args.weights, args.model_id, args.dtype, args.guidance_scale) == (
        "auto",
        "Lightricks/LTX-Video",
        "bf16",
        3.0,
    )
    assert args.configs == ["kernels"]
    assert args.json == Path("ltx_video.json") and args.chart == Path("ltx_video_compare.png")


@pytest.mark.parametrize(
    "flags, configs",
    [
        (["--no-optimized-kernels"], ["baseline"]),
        (["--no-optimized-kernels", "--compile"], ["compile"]),
        (["--use-optimized-kernels", "--compile"], ["kernels+compile"]),
        (["--compare"], ["baseline", "kernels", "compile", "kernels+compile"]),
        (["--compare", "--configs", "kernels+compile,baseline"], ["baseline", "kernels+compile"]),
    ],
)
def test_flags_pick_configurations(gv, flags, configs):
    assert gv.parse_args(flags).configs == configs


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-optimized-kernels", "--no-optimized-kernels"], "not allowed with argument"),
        (["--num-frames", "50"], "--num-frames: must be 8k+1"),
        (["--height", "500"], "--height: must be a positive multiple of 32"),
        (["--width", "0"], "--width: must be a positive multiple of 32"),
        (["--steps", "1"], "--steps: at least 2"),
        (["--runs", "0"], "--runs: must be at least 1"),
        (["--compare", "--configs", "baseline,fast"], "--configs: unknown ['fast']"),
        (["--tiny", "--weights", "hub"], "--tiny builds a random model"),
        (["--configs", "baseline"], "--configs: only with --compare"),
        (
            ["--compile", "--warmup-iterations", "0"],
            "--warmup-iterations: must be at least 1 with torch.compile",
        ),
        (["--compile-mode", "max-autotune"], "--compile-mode: no effect without --compile"),
        (
            ["--compare", "--configs", "baseline,kernels", "--compile-scope", "blocks"],
            "--compile-scope: no effect without --compile",
        ),
        (["--dtype", "fp8"], "--dtype: invalid choice"),
    ],
)
def test_bad_arguments_name_the_argument(gv, capsys, flags, message):
    with pytest.raises(SystemExit):
        gv.parse_args(flags)
    assert message in capsys.readouterr().err


def test_benchmark_example_forwards_to_generate_video():
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "benchmark_example.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--use-optimized-kernels" in result.stdout and "--compare" in result.stdout


# ---- the random-weights pipeline ---------------------------------------------------------------


def test_random_pipeline_has_the_real_architecture(gv):
    """Built on the meta device (nothing allocated): the LTX-Video 2B transformer and the 0.9.0 VAE,
    diffusers' defaults, as this script built them before configs/ (results stay comparable)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    pipe = gv.build_random_pipeline(gv.parse_args([]).checkpoint, torch.bfloat16, "meta")
    with init_empty_weights():
        defaults = LTXVideoTransformer3DModel(), AutoencoderKLLTXVideo()
    public = lambda config: json.loads(  # lists for tuples; no private keys
        json.dumps({key: value for key, value in config.items() if not key.startswith("_")})
    )
    assert public(pipe.transformer.config) == public(defaults[0].config)
    assert public(pipe.vae.config) == public(defaults[1].config)
    transformer, vae = pipe.transformer, pipe.vae
    assert (
        transformer.config.num_layers,
        transformer.config.num_attention_heads,
        transformer.config.attention_head_dim,
        transformer.config.caption_channels,
    ) == (28, 32, 64, 4096)
    assert 1.8e9 < sum(p.numel() for p in transformer.parameters()) < 2.1e9
    assert transformer.dtype == vae.dtype == torch.bfloat16
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    assert (
        pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift_terminal == 0.1
    )


def test_random_prompt_embeddings_follow_the_seed(gv):
    pipe = gv.build_random_pipeline("ltx-video-0.9.1", torch.float32, "cpu", tiny=True)
    args = gv.parse_args(["--tiny", "--seed", "3"])
    first = gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32)
    again = gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32)
    other = gv.pipeline_inputs(
        pipe, gv.parse_args(["--tiny", "--seed", "4"]), torch.device("cpu"), torch.float32
    )
    embeds = first["prompt_embeds"]
    tokens = gv.FAMILIES["LTXPipeline"].text_tokens
    assert embeds.shape == (1, tokens, 32) and embeds.std() > 0.5
    assert torch.equal(embeds, again["prompt_embeds"]) and not torch.equal(
        embeds, other["prompt_embeds"]
    )
    assert not torch.equal(embeds, first["negative_prompt_embeds"])
    assert 0 < first["prompt_attention_mask"].sum() < tokens


def test_batch_of_videos(gv):
    """--batch-size 2 without a text encoder: the embeddings carry the batch (LTXPipeline does not
    repeat given embeddings), and both videos come back."""
    pipe = gv.build_random_pipeline("ltx-video-0.9.1", torch.float32, "cpu", tiny=True)
    args = gv.parse_args([*TINY_RUN, "--batch-size", "2"])
    call = gv.call_pipeline(
        pipe,
        gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32),
        args,
        torch.device("cpu"),
    )
    assert call.frames.shape == (2, 9, 3, 64, 64) and call.latents.shape == (2, 8, 8)
    assert not torch.equal(call.latents[0], call.latents[1])  # two noise draws, two videos
    assert call.total_s > call.decode_s > 0 and call.loop_s > 0


def test_config_switch_restores_the_baseline(gv):
    from diffusers import LTXVideoTransformer3DModel

    pipe = gv.build_random_pipeline("ltx-video-0.9.1", torch.float32, "cpu", tiny=True)
    args = gv.parse_args(["--tiny", "--compile", "--compile-scope", "blocks"])
    note = gv.apply_config(pipe, "kernels+compile", args)
    assert "9 modules" in note and "compile" in note
    assert hasattr(type(pipe.transformer), "_ltx_kernels_original_class")
    assert all(m._compiled_call_impl is not None for m in pipe.transformer.transformer_blocks)
    gv.restore_baseline(pipe, args)
    assert type(pipe.transformer) is LTXVideoTransformer3DModel
    for name, module in pipe.transformer.named_modules():
        assert getattr(module, "_compiled_call_impl", None) is None, name
        assert not hasattr(type(module), "_ltx_kernels_original_class"), name
        assert "_ltx_kernels_original_processor" not in vars(module), name


def test_tiny_compare_fp8_rows(gv, tmp_path, capsys):
    """The FP8 row beside the bf16 kernels: latent drift and frame PSNR against the baseline, the
    FP8 row further off than the bf16 kernels (bit-identical to diffusers on the CPU)."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--compare",
            "--configs",
            "baseline,kernels,kernels+fp8",
            "--dtype",
            "bf16",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    baseline, kernels, fp8 = rows
    assert fp8.config == "kernels+fp8" and "FP8 GEMMs" in fp8.notes
    assert baseline.psnr_db == kernels.psnr_db == float("inf") and kernels.rel_l2 == 0
    assert 0 < fp8.rel_l2 <= 0.1 and 20 < fp8.psnr_db < float("inf")
    assert "| Optimized kernels, FP8 |" in capsys.readouterr().out


def test_tiny_compare_ltx_kernels_attention(gv, tmp_path):
    """--attention ltx_kernels: the kernels' row attends with our op (on the CPU its C twin), the
    baseline with diffusers'; the latents agree within fp32 summation noise."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--compare",
            "--configs",
            "baseline,kernels",
            "--attention",
            "ltx_kernels",
            "--dtype",
            "fp32",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    baseline, kernels = rows
    assert "attention=ltx_kernels" in kernels.notes and "attention=" not in baseline.notes
    assert kernels.rel_l2 <= 1e-5


def test_tiny_compare_attention_rows(gv, tmp_path, capsys):
    """The attention rows: our bf16 op (the noise floor: fp32 summation noise on the CPU) and
    8-bit attention (its quantization noise, well above the floor, within 8-bit bounds)."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--compare",
            "--configs",
            "baseline,kernels+ltx_attention,kernels+int8_attention",
            "--dtype",
            "fp32",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    baseline, bf16, int8 = rows
    assert "attention=ltx_kernels" in bf16.notes and "attention=int8" in int8.notes
    assert bf16.rel_l2 <= 1e-5
    assert 1e-4 < int8.rel_l2 <= 5e-2 and 20 < int8.psnr_db < float("inf")
    assert "| Optimized kernels, 8-bit attention |" in capsys.readouterr().out


@pytest.mark.parametrize("cache", ["first-block", "pyramid-attention-broadcast"])
def test_tiny_compare_cache_rows(gv, tmp_path, cache):
    """--cache adds stock diffusers with the cache and the kernels with it: the same caching
    decisions on the same (bf16 bit-identical) values give the same latents; the cache comes off
    after each row."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--steps",
            "4",
            "--compare",
            "--cache",
            cache,
            "--configs",
            "baseline,cache,kernels+cache",
            "--dtype",
            "bf16",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    baseline, stock_cached, kernels_cached = rows
    assert [row.config for row in rows] == ["baseline", "cache", "kernels+cache"]
    assert f"diffusers cache: {cache}" in stock_cached.notes
    assert f"diffusers cache: {cache}" in kernels_cached.notes and "modules" in kernels_cached.notes
    assert kernels_cached.rel_l2 == stock_cached.rel_l2
    assert kernels_cached.psnr_db == stock_cached.psnr_db
    if cache == "pyramid-attention-broadcast":  # it skips attention here: the latents move
        assert stock_cached.rel_l2 > 0
    # (FirstBlockCache's 5% threshold is not reached on the tiny random model: its first block's
    # output changes more between steps; tests/test_caches.py engages it with its own config.)


def test_cache_rows_need_the_cache_option(gv, capsys):
    with pytest.raises(SystemExit):
        gv.parse_args(["--compare", "--configs", "baseline,cache"])
    assert "(cache, kernels+cache: with --cache)" in capsys.readouterr().err
    args = gv.parse_args(["--cache", "first-block"])  # one run: the kernels with the cache
    assert args.configs == ["kernels+cache"]
    args = gv.parse_args(["--compare", "--cache", "first-block"])  # the default rows and both
    assert args.configs == [*gv.CONFIGS, *gv.CACHE_ROWS]


def test_torchao_row_names_what_it_needs(gv, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # as when torchao is not installed
    with pytest.raises(ImportError, match="the torchao anchor needs torchao"):
        gv.main(
            [
                *TINY_RUN,
                "--compare",
                "--configs",
                "torchao-fp8+compile",
                "--no-video",
                "--output",
                str(tmp_path / "v.mp4"),
            ]
        )


@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 2e-2)])
def test_tiny_compare_end_to_end(gv, tmp_path, capsys, monkeypatch, dtype, tolerance):
    """baseline vs kernels, 2 steps, through main(): the table, the JSON, the chart and the video
    (the GIF fallback, as when no mp4 encoder is installed)."""
    import diffusers.utils

    def no_encoder(*args, **kwargs):
        raise ImportError("export_to_video requires imageio")

    monkeypatch.setattr(diffusers.utils, "export_to_video", no_encoder)
    output = tmp_path / "video.mp4"
    rows = gv.main(
        [
            *TINY_RUN,
            "--compare",
            "--configs",
            "baseline,kernels",
            "--dtype",
            dtype,
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    assert [row.config for row in rows] == ["baseline", "kernels"]
    assert rows[0].rel_l2 == 0.0 and rows[0].speedup == 1.0
    # 9 = 2 blocks + their 4 attention processors and 2 fused q/k/v + the model's output norm
    assert rows[1].rel_l2 <= tolerance and "9 modules" in rows[1].notes
    if dtype == "fp32":  # the fused ops ran (bf16 tiny models are bit-identical to diffusers)
        assert rows[1].rel_l2 > 0
    assert (
        "| Optimized kernels |" in printed
        and "| First call (s) |" in printed
        and "frames: 9" in printed
        and "no mp4 encoder" in printed
    )
    assert (tmp_path / "video.gif").stat().st_size > 0

    results = json.loads(output.with_suffix(".json").read_text())
    assert results["weights"] == "random (tiny model)" and results["settings"]["num_frames"] == 9
    assert [r["config"] for r in results["results"]] == ["baseline", "kernels"]
    for result in results["results"]:
        assert result["total_s"] > result["decode_s"] > 0 and result["it_per_s"] > 0
        assert len(result["runs_s"]) == 1 and len(result["warmup_s"]) == 1
    assert results["video"] == str(tmp_path / "video.gif")
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "video_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib is not installed" in printed


def test_single_configuration_compiles_with_kernels(gv, tmp_path, capsys):
    """--use-optimized-kernels --compile together, as one configuration, no chart."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--use-optimized-kernels",
            "--compile",
            "--compile-scope",
            "blocks",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    printed = capsys.readouterr().out
    assert [row.config for row in rows] == ["kernels+compile"]
    assert rows[0].speedup is None and rows[0].rel_l2 is None and len(rows[0].warmup_s) == 1
    assert (
        "n/a" in printed
        and "torch.compile (blocks, fullgraph)" in rows[0].notes
        and not (tmp_path / "v_compare.png").exists()
    )
    assert (tmp_path / "v.json").exists() and not list(tmp_path.glob("v.gif"))


# ---- every checkpoint: its config, its pipeline family ------------------------------------------

# --model-id -> (configs/*.json, pipeline class, transformer parameters in billions: 2B, 13B, 19B)
CHECKPOINTS = {
    "Lightricks/LTX-Video": ("ltx-video-0.9.1", "LTXPipeline", 1.92),
    "Lightricks/LTX-Video-0.9.5": ("ltx-video-0.9.5", "LTXPipeline", 1.92),
    "Lightricks/LTX-Video-0.9.7-dev": ("ltx-video-0.9.7-dev", "LTXConditionPipeline", 13.04),
    "Lightricks/LTX-Video-0.9.8-13B-distilled": (
        "ltx-video-0.9.8-13b-distilled",
        "LTXConditionPipeline",
        13.04,
    ),
    "Lightricks/LTX-2": ("ltx-2", "LTX2Pipeline", 18.88),
    "Lightricks/LTX-2.3": ("ltx-2.3", "LTX2Pipeline", 18.99),
    "Lightricks/LTX-2.5": ("ltx-2.5", "LTX2Pipeline", 18.99),
}


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("model_id", list(CHECKPOINTS))
def test_model_id_picks_its_config_and_pipeline(gv, model_id):
    checkpoint, pipeline, _ = CHECKPOINTS[model_id]
    for given in (model_id, checkpoint):  # the hub id or the config's name
        args = gv.parse_args(["--weights", "random", "--model-id", given])
        assert (args.checkpoint, args.pipeline) == (checkpoint, pipeline)
    assert gv.checkpoints()[model_id] == checkpoint
    assert set(gv.checkpoints().values()) == {c for c, _, _ in CHECKPOINTS.values()}


def test_diffusers_repos_of_ltx_2_3_and_2_5(gv):
    """Lightricks/LTX-2.3 and -2.5 hold single files; diffusers' format is elsewhere: both ids
    name the same config, hub loading reads the diffusers repo."""
    assert gv.checkpoints()["diffusers/LTX-2.3-Diffusers"] == "ltx-2.3"
    assert gv.checkpoints()["Lightricks/LTX-2.5-Diffusers"] == "ltx-2.5"


def test_unknown_model_id(gv, capsys):
    with pytest.raises(SystemExit):
        gv.parse_args(["--weights", "random", "--model-id", "Lightricks/LTX-3"])
    err = capsys.readouterr().err
    assert "--model-id: no real config for 'Lightricks/LTX-3'" in err
    assert all(model_id in err for model_id in CHECKPOINTS)
    with pytest.raises(SystemExit):  # auto falls back to random weights: it needs the config too
        gv.parse_args(["--model-id", "Lightricks/LTX-3"])
    args = gv.parse_args(["--weights", "hub", "--model-id", "someone/ltx-finetune"])
    assert (args.checkpoint, args.pipeline, args.call) == (None, None, {})


def test_hub_only_model_id_takes_the_class_model_index_names(gv, monkeypatch, capsys):
    """--weights hub with an id no config knows: DiffusionPipeline reads the class from its
    model_index.json; the family's checks and defaults then apply, and other classes are refused."""
    import diffusers

    tiny = gv.build_random_pipeline("ltx-2", torch.float32, "cpu", tiny=True)
    loaded = [tiny]
    monkeypatch.setattr(
        diffusers.DiffusionPipeline, "from_pretrained", lambda *args, **kwargs: loaded[0]
    )
    args = gv.parse_args(["--weights", "hub", "--model-id", "someone/ltx-2-finetune"])
    pipe, weights = gv.load_pipeline(args, torch.device("cpu"), torch.float32)
    assert pipe is tiny and weights == "hub:someone/ltx-2-finetune"
    assert (args.pipeline, args.frame_rate) == ("LTX2Pipeline", 24.0)
    args = gv.parse_args(
        ["--weights", "hub", "--model-id", "someone/ltx-2-finetune", "--cache", "first-block"]
    )
    with pytest.raises(SystemExit, match="--cache: not with LTX2Pipeline"):
        gv.load_pipeline(args, torch.device("cpu"), torch.float32)
    loaded[0] = diffusers.FluxPipeline(None, None, None, None, None, None, None)
    args = gv.parse_args(["--weights", "hub", "--model-id", "someone/flux"])
    with pytest.raises(SystemExit, match="loads a FluxPipeline; generate_video runs LTXPipeline"):
        gv.load_pipeline(args, torch.device("cpu"), torch.float32)


def test_families_hold_the_pipelines_defaults(gv):
    """Random text embeddings are as long as the pipeline's max_sequence_length; --frame-rate
    defaults to its frame_rate."""
    import inspect

    import diffusers

    for name, family in gv.FAMILIES.items():
        defaults = inspect.signature(getattr(diffusers, name).__call__).parameters
        assert family.text_tokens == defaults["max_sequence_length"].default, name
        assert family.frame_rate == defaults["frame_rate"].default, name


@pytest.mark.parametrize(
    "flags, steps, guidance, call",
    [
        ([], 50, 3.0, {}),
        (["--model-id", "Lightricks/LTX-Video-0.9.5"], 50, 3.0, {}),
        (
            ["--model-id", "Lightricks/LTX-Video-0.9.7-dev"],
            30,
            5.0,
            dict(
                guidance_rescale=0.7,
                decode_timestep=0.05,
                decode_noise_scale=0.025,
                image_cond_noise_scale=0.0,
            ),
        ),
        (
            ["--model-id", "Lightricks/LTX-Video-0.9.8-13B-distilled"],
            8,
            1.0,
            dict(
                timesteps=[1000, 993, 987, 981, 975, 909, 725, 0.03],
                guidance_rescale=0.7,
                decode_timestep=0.05,
                decode_noise_scale=0.025,
                image_cond_noise_scale=0.0,
            ),
        ),
        (  # a given --steps replaces the distilled schedule, --guidance-scale the guidance
            [
                "--model-id",
                "Lightricks/LTX-Video-0.9.8-13B-distilled",
                "--steps",
                "4",
                "--guidance-scale",
                "2",
            ],
            4,
            2.0,
            dict(
                guidance_rescale=0.7,
                decode_timestep=0.05,
                decode_noise_scale=0.025,
                image_cond_noise_scale=0.0,
            ),
        ),
        (["--model-id", "Lightricks/LTX-2"], 30, 3.0, dict(spatio_temporal_guidance_blocks=[29])),
        (["--model-id", "Lightricks/LTX-2.3"], 30, 3.0, {}),
        (
            ["--model-id", "Lightricks/LTX-2.5"],
            8,
            1.0,
            dict(
                sigmas=[1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875],
                audio_guidance_scale=1.0,
            ),
        ),
    ],
)
def test_recommended_call_unless_the_flags_say(gv, flags, steps, guidance, call):
    args = gv.parse_args(flags)
    assert (args.steps, args.guidance_scale, args.call) == (steps, guidance, call)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            [
                "--model-id",
                "Lightricks/LTX-2.3",
                "--compare",
                "--cache",
                "pyramid-attention-broadcast",
            ],
            "--cache: not with LTX2Pipeline (Lightricks/LTX-2.3): diffusers 0.42's FirstBlockCache "
            "has no LTX-2 block registered",
        ),
    ],
)
def test_options_a_family_cannot_run(gv, capsys, flags, message):
    with pytest.raises(SystemExit):
        gv.parse_args(flags)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("model_id", list(CHECKPOINTS))
def test_full_size_random_pipeline_is_the_real_one(gv, model_id):
    """Each checkpoint's pipeline built on the meta device (nothing allocated): its class and
    component classes, the transformer's size (2B, 13B, 19B), the text embeddings' width against
    the text encoder's, the compression the latents are sized by, LTX-2's audio chain."""
    checkpoint, pipeline, billions = CHECKPOINTS[model_id]
    spec = gv.bench_utils.model_config(checkpoint)
    pipe = gv.build_random_pipeline(checkpoint, torch.bfloat16, "meta")
    assert type(pipe).__name__ == pipeline
    for section in gv.FAMILIES[pipeline].components:
        component = getattr(pipe, section)
        assert type(component).__name__ == spec[section]["class"]
        assert component.device.type == "meta" and component.dtype == torch.bfloat16
    transformer = pipe.transformer.config
    assert abs(params(pipe.transformer) / 1e9 - billions) < 0.01
    layers, heads, head_dim = (48, 32, 128) if billions > 10 else (28, 32, 64)
    assert (transformer.num_layers, transformer.num_attention_heads) == (layers, heads)
    assert transformer.attention_head_dim == head_dim
    assert gv.text_width(pipe) == spec["text_encoder"]["width"]
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    scheduler = dict(pipe.scheduler.config)
    assert {k: scheduler[k] for k in spec["scheduler"]["config"]} == spec["scheduler"]["config"]
    if pipeline == "LTX2Pipeline":
        # the audio VAE's latents (channels x mel bins) are the transformer's audio tokens
        audio_vae = pipe.audio_vae.config
        latent_mels = audio_vae.mel_bins // pipe.audio_vae_mel_compression_ratio
        assert audio_vae.latent_channels * latent_mels == transformer.audio_in_channels == 128
        assert pipe.vocoder.config.in_channels == audio_vae.output_channels * audio_vae.mel_bins
        connectors = pipe.connectors.config
        assert connectors.caption_channels == 3840  # Gemma 3 / Gemma 4 12B's width
        if checkpoint == "ltx-2":  # one projection; the transformer projects the captions
            assert transformer.caption_channels == connectors.caption_channels
            assert pipe.vocoder.config.output_sampling_rate == 24000
        else:  # 2.3/2.5: per-stream projections to the transformer's widths; 48 kHz vocoder
            assert connectors.video_hidden_dim == transformer.cross_attention_dim == 4096
            assert connectors.audio_hidden_dim == transformer.audio_cross_attention_dim == 2048
            assert pipe.vocoder.config.output_sampling_rate == 48000
            # with the text connectors, the "22B" of Lightricks' ltx-2.3-22b checkpoints
            assert 22.0 < (params(pipe.transformer) + params(pipe.connectors)) / 1e9 < 22.3


def test_tiny_condition_pipeline_sends_per_token_timesteps(gv, tmp_path):
    """0.9.8 13B through LTXConditionPipeline: the first frame is conditioned, so the transformer
    gets timesteps [B, S] with that frame's tokens at 0 and the rest at the step's t; the kernels
    run that per-token modulation close to diffusers'."""
    args = gv.parse_args(
        [*TINY_RUN, "--model-id", "Lightricks/LTX-Video-0.9.8-13B-distilled", "--dtype", "fp32"]
    )
    pipe = gv.build_random_pipeline(args.checkpoint, torch.float32, "cpu", tiny=True)
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, a, kwargs: seen.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    inputs = gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32)
    call = gv.call_pipeline(pipe, inputs, args, torch.device("cpu"))
    tokens = 2 * 2 * 2  # (9 frames - 1) / 8 + 1 latent frames of 64/32 x 64/32
    assert call.latents.shape == (1, tokens, 8) and call.frames.shape == (1, 9, 3, 64, 64)
    assert len(seen) == 2  # two steps; guidance 1 (the distilled call): one forward each
    for timestep in seen:
        assert timestep.shape == (1, tokens)  # [B, S]
        first, rest = timestep[:, :4], timestep[:, 4:]
        assert (first == 0).all() and (rest > 0).all() and (rest == rest[0, 0]).all()
    assert seen[0][0, -1] > seen[1][0, -1]

    baseline, kernels = gv.main(
        [
            *TINY_RUN,
            "--model-id",
            "Lightricks/LTX-Video-0.9.8-13B-distilled",
            "--compare",
            "--configs",
            "baseline,kernels",
            "--dtype",
            "fp32",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    assert 0 < kernels.rel_l2 <= 1e-5 and "9 modules" in kernels.notes


def ffmpeg_streams(path: Path) -> str:
    """ffmpeg's description of a media file's streams (imageio-ffmpeg ships ffmpeg, no ffprobe)."""
    import imageio_ffmpeg

    result = subprocess.run(
        [imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-i", str(path)],
        capture_output=True,
        text=True,
    )
    return "\n".join(line for line in result.stderr.splitlines() if "Stream #" in line)


@pytest.mark.parametrize(
    "model_id, sample_rate",
    [("Lightricks/LTX-2", 24000), ("Lightricks/LTX-2.3", 48000), ("Lightricks/LTX-2.5", 48000)],
)
def test_tiny_ltx2_compare_video_and_audio(gv, tmp_path, capsys, model_id, sample_rate):
    """LTX2Pipeline end to end: baseline and kernels rows in fp32, the kernels' video latents and
    audio close to diffusers' (and moved: the fused ops ran); the mp4 carries the audio (AAC), the
    .wav beside it holds the waveform of the frames' duration."""
    pytest.importorskip("imageio_ffmpeg")
    import wave

    output = tmp_path / "v.mp4"
    rows = gv.main(
        [
            *TINY_RUN,
            "--model-id",
            model_id,
            "--compare",
            "--configs",
            "baseline,kernels",
            "--dtype",
            "fp32",
            "--warmup-iterations",
            "0",
            "--output",
            str(output),
        ]
    )
    printed = capsys.readouterr().out
    baseline, kernels = rows
    assert baseline.rel_l2 == baseline.audio_rel_l2 == 0
    assert 0 < kernels.rel_l2 <= 1e-5 and 0 < kernels.audio_rel_l2 <= 1e-4
    assert "15 modules on ltx_kernels ops" in kernels.notes  # 2 blocks, 12 attentions, the model
    assert "| Audio rel L2 |" in printed and f"audio ({sample_rate} Hz): {output}" in printed
    streams = ffmpeg_streams(output)
    assert (
        "Video: h264" in streams
        and f"Audio: aac (LC) (mp4a / 0x6134706D), {sample_rate} Hz, stereo" in streams
    )
    with wave.open(str(output.with_suffix(".wav"))) as audio:
        assert (audio.getnchannels(), audio.getframerate(), audio.getsampwidth()) == (
            2,
            sample_rate,
            2,
        )
        duration = audio.getnframes() / sample_rate
    assert abs(duration - 9 / 24) < 0.05  # 9 frames at LTX2Pipeline's 24 fps
    results = json.loads(output.with_suffix(".json").read_text())
    assert results["audio"] == results["video"] == str(output)
    assert results["settings"]["pipeline"] == "LTX2Pipeline"


def test_audio_without_ffmpeg_stays_beside_the_video(gv, tmp_path, monkeypatch):
    """No imageio-ffmpeg: the .wav is written and the reason given; a GIF cannot hold audio."""
    import wave

    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)
    t = torch.arange(2400) / 24000
    audio = torch.stack([torch.sin(2 * torch.pi * 440 * t), -torch.sin(2 * torch.pi * 440 * t)])
    (tmp_path / "v.mp4").write_bytes(b"")
    path, why_not = gv.save_audio(audio[None] * 0.5, 24000, tmp_path / "v.mp4")
    assert path == str(tmp_path / "v.wav")
    assert why_not.startswith(f"not muxed into {tmp_path / 'v.mp4'}: no ffmpeg")
    with wave.open(path) as file:
        assert (file.getnchannels(), file.getframerate(), file.getnframes()) == (2, 24000, 2400)
        pcm = torch.frombuffer(bytearray(file.readframes(2400)), dtype=torch.int16).view(-1, 2)
    assert torch.equal(pcm.T, (audio * 0.5 * 32767).round().to(torch.int16))
    path, why_not = gv.save_audio(audio[None], 24000, tmp_path / "v.gif")
    assert path == str(tmp_path / "v.wav") and why_not == "a .gif holds no audio"


# ---- weights auto: the hub cannot be reached ---------------------------------------------------


def test_auto_falls_back_to_random_weights(gv, capsys, monkeypatch):
    from diffusers import LTXPipeline

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(LTXPipeline, "from_pretrained", unreachable)
    monkeypatch.setattr(
        gv,
        "build_random_pipeline",
        lambda checkpoint, dtype, device, tiny=False, seed=0: (checkpoint, dtype, str(device)),
    )
    pipe, weights = gv.load_pipeline(gv.parse_args([]), torch.device("cpu"), torch.bfloat16)
    assert pipe == ("ltx-video-0.9.1", torch.bfloat16, "cpu")
    assert weights == "random (hub unavailable)"
    assert "could not be loaded (OSError: We couldn't connect" in capsys.readouterr().out
    with pytest.raises(OSError, match="couldn't connect"):  # --weights hub never falls back
        gv.load_pipeline(gv.parse_args(["--weights", "hub"]), torch.device("cpu"), torch.bfloat16)


def test_auto_fallback_with_an_unreachable_hub(tmp_path):
    """A real hub lookup in a fresh process: empty cache, an endpoint that refuses connections."""
    code = (
        f"import sys, torch; sys.path.insert(0, {str(SCRIPTS)!r}); import generate_video as gv\n"
        "build = gv.build_random_pipeline\n"
        "gv.build_random_pipeline = lambda *args, tiny=False, seed=0: build(*args, tiny=True)\n"
        "pipe, weights = gv.load_pipeline(gv.parse_args([]), torch.device('cpu'), torch.bfloat16)\n"
        "print('loaded:', weights, type(pipe).__name__, pipe.transformer.config.num_layers)\n"
    )
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")
    }
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Lightricks/LTX-Video could not be loaded" in result.stdout
    assert "falling back to random weights" in result.stdout
    assert "loaded: random (hub unavailable) LTXPipeline 2" in result.stdout


# ---- GPU: the full-size model ------------------------------------------------------------------


@pytest.mark.gpu
def test_full_size_kernels_drift(gv, tmp_path):
    """LTX-Video 2B with random weights, 9 frames 256x256, 3 steps: the kernels' final latents
    within 2e-2 (relative L2) of diffusers' in bf16; compile alone for scale."""
    rows = gv.main(
        [
            "--weights",
            "random",
            "--compare",
            "--configs",
            "baseline,kernels",
            "--num-frames",
            "9",
            "--height",
            "256",
            "--width",
            "256",
            "--steps",
            "3",
            "--warmup-iterations",
            "1",
            "--runs",
            "1",
            "--no-progress",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    baseline, kernels = rows
    assert 0 < kernels.rel_l2 <= 2e-2, kernels.rel_l2
    assert "113 modules" in kernels.notes and baseline.peak_gib > 3


@pytest.mark.gpu
def test_tiny_compare_with_cpu_offload(gv, tmp_path):
    """Offload hooks come off while the kernels go in: every module is patched (output norm too)."""
    rows = gv.main(
        [
            *TINY_RUN,
            "--cpu-offload",
            "--compare",
            "--configs",
            "baseline,kernels,kernels+compile",
            "--compile-scope",
            "blocks",
            "--dtype",
            "fp32",
            "--no-video",
            "--output",
            str(tmp_path / "v.mp4"),
        ]
    )
    for row in rows[1:]:
        assert "9 modules" in row.notes and "skipped" not in row.notes
        assert 0 < row.rel_l2 <= 1e-5
