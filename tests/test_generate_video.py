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
    """Built on the meta device (nothing allocated): the LTX-Video 2B transformer and the 0.9.0 VAE."""
    pipe = gv.build_random_pipeline(torch.bfloat16, "meta")
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
    pipe = gv.build_random_pipeline(torch.float32, "cpu", tiny=True)
    args = gv.parse_args(["--tiny", "--seed", "3"])
    first = gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32)
    again = gv.pipeline_inputs(pipe, args, torch.device("cpu"), torch.float32)
    other = gv.pipeline_inputs(
        pipe, gv.parse_args(["--tiny", "--seed", "4"]), torch.device("cpu"), torch.float32
    )
    embeds = first["prompt_embeds"]
    assert embeds.shape == (1, gv.TEXT_TOKENS, 32) and embeds.std() > 0.5
    assert torch.equal(embeds, again["prompt_embeds"]) and not torch.equal(
        embeds, other["prompt_embeds"]
    )
    assert not torch.equal(embeds, first["negative_prompt_embeds"])
    assert 0 < first["prompt_attention_mask"].sum() < gv.TEXT_TOKENS


def test_batch_of_videos(gv):
    """--batch-size 2 without a text encoder: the embeddings carry the batch (LTXPipeline does not
    repeat given embeddings), and both videos come back."""
    pipe = gv.build_random_pipeline(torch.float32, "cpu", tiny=True)
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

    pipe = gv.build_random_pipeline(torch.float32, "cpu", tiny=True)
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


# ---- weights auto: the hub cannot be reached ---------------------------------------------------


def test_auto_falls_back_to_random_weights(gv, capsys, monkeypatch):
    from diffusers import LTXPipeline

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(LTXPipeline, "from_pretrained", unreachable)
    monkeypatch.setattr(
        gv,
        "build_random_pipeline",
        lambda dtype, device, tiny=False: ("random pipeline", dtype, str(device)),
    )
    pipe, weights = gv.load_pipeline(gv.parse_args([]), torch.device("cpu"), torch.bfloat16)
    assert (
        pipe == ("random pipeline", torch.bfloat16, "cpu") and weights == "random (hub unavailable)"
    )
    assert "could not be loaded (OSError: We couldn't connect" in capsys.readouterr().out
    with pytest.raises(OSError, match="couldn't connect"):  # --weights hub never falls back
        gv.load_pipeline(gv.parse_args(["--weights", "hub"]), torch.device("cpu"), torch.bfloat16)


def test_auto_fallback_with_an_unreachable_hub(tmp_path):
    """A real hub lookup in a fresh process: empty cache, an endpoint that refuses connections."""
    code = (
        f"import sys, torch; sys.path.insert(0, {str(SCRIPTS)!r}); import generate_video as gv\n"
        "build = gv.build_random_pipeline\n"
        "gv.build_random_pipeline = lambda dtype, device, tiny=False: build(dtype, device, tiny=True)\n"
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
