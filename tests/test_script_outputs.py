"""What the scripts write for a user: generate_video.py's --output (no extension: .mp4; an unknown
extension or a path that cannot be written: an error before the run) and its comparison chart (the
title inside the image), benchmark_transformer.py's table (no "nanx" cells: the "vs compile"
column only with the compile column, "-" where a ratio has no reference), and cp_copy_engine.py's
error outside torchrun."""

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gv():
    return load(ROOT / "scripts" / "generate_video.py")


@pytest.fixture(scope="module")
def bt():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return load(ROOT / "benchmarks" / "benchmark_transformer.py")


# ---- generate_video.py --output -----------------------------------------------------------------


def test_output_without_extension_is_an_mp4(gv, tmp_path):
    args = gv.parse_args(["--output", str(tmp_path / "out")])
    assert args.output == tmp_path / "out.mp4"
    assert args.json == tmp_path / "out.json" and args.chart == tmp_path / "out_compare.png"


@pytest.mark.parametrize("name", ["out.mp4", "out.MOV", "out.mkv", "out.avi", "out.gif"])
def test_known_extensions_are_kept(gv, tmp_path, name):
    assert gv.parse_args(["--output", str(tmp_path / name)]).output == tmp_path / name


@pytest.mark.parametrize("name", ["out.webm", "out.json", "run.2"])
def test_unknown_extension_fails_before_the_run(gv, tmp_path, capsys, name):
    with pytest.raises(SystemExit):
        gv.parse_args(["--output", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert f"--output: {tmp_path / name}: unknown video extension" in err and ".mp4" in err
    gv.parse_args(["--output", str(tmp_path / name), "--no-video"])  # no video: only the JSON


def test_paths_that_cannot_be_written_fail_before_the_run(gv, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    (tmp_path / "folder.mp4").mkdir()
    cases = [
        (["--output", str(tmp_path / "file" / "out.mp4")], "--output: cannot write", "is a file"),
        (["--output", str(tmp_path / "folder.mp4")], "--output: cannot write", "it is a folder"),
        (["--json", str(tmp_path / "file" / "r.json")], "--json: cannot write", "is a file"),
        (
            ["--compare", "--chart", str(tmp_path / "file" / "c.png")],
            "--chart: cannot write",
            "is a file",
        ),
    ]
    for flags, option, why in cases:
        with pytest.raises(SystemExit):
            gv.parse_args(flags)
        err = capsys.readouterr().err
        assert option in err and why in err, (flags, err)
    # Missing folders are fine: the writers create them.
    gv.parse_args(["--output", str(tmp_path / "new" / "deeper" / "out")])


def test_output_without_extension_writes_the_mp4(gv, tmp_path, capsys):
    """The reported case end to end: --output out on a tiny run writes out.mp4 (or the GIF
    fallback beside it when no encoder is installed), not `could not write out`."""
    gv.main(
        [
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
            "0",
            "--runs",
            "1",
            "--no-progress",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    printed = capsys.readouterr().out
    assert "could not write" not in printed
    written = (tmp_path / "out.mp4", tmp_path / "out.gif")
    assert any(path.exists() and path.stat().st_size > 0 for path in written), printed
    assert (tmp_path / "out.json").exists()


# ---- generate_video.py's chart ------------------------------------------------------------------


def drawn_texts(fig) -> list:
    """The figure's texts, the axes' titles, texts and axis labels, and the tick labels of the
    ticks inside the view limits (the others exist but are not drawn)."""
    texts = list(fig.texts)
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            texts.append(axis.label)
            texts += [
                label
                for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
                if low <= loc <= high
            ]
    return texts


def test_chart_title_fits_the_image(gv, tmp_path, monkeypatch):
    """Every text of the chart (a two-line title with a long model id first) lies inside the
    figure when it is saved, and the title keeps every word."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    outside, texts = [], []
    savefig = Figure.savefig

    def checked_savefig(fig, *args, **kwargs):
        renderer = fig.canvas.get_renderer()
        fig.draw(renderer)
        for text in drawn_texts(fig):
            if text.get_visible() and text.get_text():
                texts.append(text.get_text())
                box = text.get_window_extent(renderer)
                if (
                    box.x0 < -1
                    or box.x1 > fig.bbox.x1 + 1
                    or box.y0 < -1
                    or box.y1 > fig.bbox.y1 + 1
                ):
                    outside.append(text.get_text())
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", checked_savefig)
    rows = [
        gv.Row(config=config, notes="", total_s=seconds, it_per_s=1.0, decode_s=0.1)
        for config, seconds in (("baseline", 53.8), ("kernels", 30.4), ("kernels+fp8", 40.5))
    ]
    title = (
        "Lightricks/LTX-Video-0.9.8-13B-distilled, 161 frames 1216x704, 50 steps, bf16, random "
        "(hub unavailable) weights\nNVIDIA H100 80GB HBM3, torch 2.11.0+cu130, 2026-08-23"
    )
    path = tmp_path / "chart.png"
    assert gv.write_chart(path, rows, title)
    assert texts and not outside, outside
    assert any(text.split() == title.split() for text in texts)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- benchmark_transformer.py's table -----------------------------------------------------------


def row(ms, vs_eager=None, vs_compile=None, rel_l2=None, peak_vs_bf16=None):
    return dict(
        ms=ms,
        first_call_s=1.5,
        speedup_vs_eager=vs_eager,
        speedup_vs_compile=vs_compile,
        rel_l2=rel_l2,
        peak_gib=12.345,
        peak_vs_bf16=peak_vs_bf16,
    )


def test_table_without_the_compile_column_has_no_vs_compile(bt):
    header = bt.table_header(vs_compile=False)
    assert "vs compile" not in header
    cells = header.splitlines()[0].count("|") - 1
    line = bt.table_row("kernels", row(10.0, vs_eager=1.5, rel_l2=1e-3), vs_compile=False)
    assert line == "| kernels | 10.00 | 1.50x | 1.5 | 1.00e-03 | 12.35 | - |"
    assert line.count("|") - 1 == cells and header.splitlines()[1].count("---") == cells


def test_table_ratios_without_a_reference_are_dashes(bt):
    header = bt.table_header(vs_compile=True)
    assert "| vs eager | vs compile |" in header
    # kernels measured before compile: no ratio to compile yet; no eager column asked for
    line = bt.table_row("kernels", row(10.0), vs_compile=True)
    assert line == "| kernels | 10.00 | - | - | 1.5 | - | 12.35 | - |" and "nan" not in line
    line = bt.table_row("compile+kernels", row(8.0, 2.0, 1.25, 2e-3), vs_compile=True)
    assert line == "| compile+kernels | 8.00 | 2.00x | 1.25x | 1.5 | 2.00e-03 | 12.35 | - |"
    line = bt.table_row("kernels+fp8", row(8.0, 2.0, None, 2e-2, 0.6), vs_compile=True)
    assert line == "| kernels+fp8 | 8.00 | 2.00x | - | 1.5 | 2.00e-02 | 12.35 | 0.60x |"


def test_8_bit_columns_say_how_many_calls_ran_in_8_bits(bt):
    # attention="int8" attends in 8 bits only where measured faster: the note under the table
    # counts a step's attention kernels by kind, and a column with none in 8 bits says so.
    import bench_utils
    import ltx_kernels
    from model_zoo import wan

    model, inputs = wan.tiny_model(torch.float32), wan.tiny_inputs(torch.float32)
    calls = {}
    for choice in ("int8", "ltx_kernels"):
        injected = copy.deepcopy(model)
        ltx_kernels.inject_optimized_kernels(injected, verbose=False, attention=choice)
        calls[choice] = bench_utils.attention_calls(lambda: injected(**inputs))
    layers = wan.TINY["num_layers"]  # (the CPU's C twins take every call: self and cross)
    assert calls["int8"] == {"8-bit": 2 * layers, "ours bf16": 0, "sdpa": 0}
    assert calls["ltx_kernels"] == {"8-bit": 0, "ours bf16": 2 * layers, "sdpa": 0}
    assert bt.attention_calls_note({"8-bit": 24, "ours bf16": 0, "sdpa": 32}) == (
        "8-bit attention in 24 of 56 calls (ours bf16 0, sdpa 32)"
    )
    assert bt.attention_calls_note({"8-bit": 0, "ours bf16": 8, "sdpa": 4}).endswith(
        "no call long enough (LTX_INT8_ATTENTION_FASTER), the column attends as 'auto'"
    )


def test_fp8_columns_peak_memory_against_their_bf16_column(bt):
    pairs = {
        "kernels+fp8": "kernels",
        "blocks+kernels+fp8": "blocks+kernels",
        "torchao-fp8+blocks": "blocks",
        "torchao-fp8": "eager",
        "blocks+kernels": None,
    }
    assert {column: bt.bf16_column(column) for column in pairs} == pairs


def test_ratio_cell(bt):
    import bench_utils

    assert bench_utils.ratio_cell(None) == "-" and bench_utils.ratio_cell(float("nan")) == "-"
    assert bench_utils.ratio_cell(1.234) == "1.23x"


def test_fp8_columns_run_once_per_preset_asked(bt):
    columns = ["kernels", "kernels+fp8", "torchao-fp8+blocks", "blocks+kernels+fp8"]
    once = [(c, c, None) for c in columns]
    assert bt.fp8_preset_runs(columns, None) == once
    assert bt.fp8_preset_runs(columns, ["ffn"]) == [
        (c, c, "ffn" if c.endswith("+fp8") else None) for c in columns
    ]
    assert bt.fp8_preset_runs(columns, ["ffn", "all"]) == [
        ("kernels", "kernels", None),
        ("kernels+fp8 [ffn]", "kernels+fp8", "ffn"),
        ("kernels+fp8 [all]", "kernels+fp8", "all"),
        ("torchao-fp8+blocks", "torchao-fp8+blocks", None),  # torchao's rowwise: every Linear
        ("blocks+kernels+fp8 [ffn]", "blocks+kernels+fp8", "ffn"),
        ("blocks+kernels+fp8 [all]", "blocks+kernels+fp8", "all"),
    ]


# ---- cp_copy_engine.py ---------------------------------------------------------------------------


def test_cp_copy_engine_outside_torchrun_says_how_to_launch(tmp_path, monkeypatch, capsys):
    """A GPU-only torchrun script: run as a plain script it stops with how to launch it."""
    script = load(ROOT / "benchmarks" / "cp_copy_engine.py")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", ["cp_copy_engine.py"])
    with pytest.raises(SystemExit) as exit_info:
        script.main()
    assert exit_info.value.code == 2
    assert "torchrun --nproc_per_node N" in capsys.readouterr().err


def test_cp_columns_name_the_optional_context_parallel_columns(bt, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark_transformer.py", "--cp-columns", "compile,bogus"])
    with pytest.raises(SystemExit):
        bt.main()
    assert "--cp-columns: unknown bogus" in capsys.readouterr().err
