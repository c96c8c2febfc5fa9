"""benchmarks/denoise_drift.py's machinery on tiny models on the CPU: one guided generation per
column through the family's diffusers pipeline, the final latents' drift against the baseline
column and the floor (the GPU runs are the benchmark's, at full size)."""

import sys
from pathlib import Path

import pytest
import torch

from model_zoo import hunyuan, wan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import denoise_drift  # noqa: E402

COLUMNS = (denoise_drift.BASELINE, denoise_drift.FLOOR, "kernels+int8_attention")


def _tiny(name):
    torch.manual_seed(0)
    if name.startswith("wan"):
        return wan.tiny_model(torch.float32), (5, 32, 32)
    # in: the latents, the condition latents (zeros for text-to-video) and their mask channel
    return hunyuan.tiny_model(torch.float32, v15=True, in_channels=2 * 4 + 1), (5, 64, 64)


@pytest.mark.parametrize("name", ["wan-1.3b", "hunyuanvideo-1.5"])
def test_drift_rows(name):
    # fp32 on the CPU: the baseline drifts 0 from itself, the floor (our bf16 attention op's twin
    # instead of SDPA: fp32 rounding) stays near fp32 noise, 8-bit attention moves the latents
    # well past it but within 8-bit noise; every column ran (no error row).
    transformer, (frames, height, width) = _tiny(name)
    kwargs = denoise_drift.generation(name, transformer, frames, height, width, steps=2)
    rows = denoise_drift.drift_rows(name, transformer, kwargs, COLUMNS)
    assert [row["column"] for row in rows] == list(COLUMNS)
    assert all("error" not in row for row in rows), rows
    baseline, floor, int8 = rows
    assert baseline["rel_l2"] == 0 and baseline["vs_floor"] is None
    assert 0 < floor["rel_l2"] < 1e-5 and floor["vs_floor"] == 1
    assert 1e-4 < int8["rel_l2"] < 5e-2 and int8["vs_floor"] > 100
    assert "| kernels+int8_attention |" in denoise_drift.table(rows)


def test_the_same_generation_twice_is_bit_identical():
    # the columns compare like with like: the same embeddings and initial noise on every run
    transformer, (frames, height, width) = _tiny("wan-1.3b")
    kwargs = denoise_drift.generation("wan-1.3b", transformer, frames, height, width, steps=2)
    rows = denoise_drift.drift_rows("wan-1.3b", transformer, kwargs, [COLUMNS[0]] * 2)
    assert rows[1]["rel_l2"] == 0
