"""benchmarks/cp_host_time.py's measurement in one process (no parallelism), two blocks of
LTX-Video and of LTX-2: the injected step dispatches fewer ops and launches than stock diffusers',
and no collectives."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("diffusers", reason="diffusers is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cp_host_time  # noqa: E402


@pytest.mark.parametrize("model", sorted(cp_host_time.MODELS))
def test_counts_per_column(model):
    args = SimpleNamespace(model=model, blocks=2, steps=2, cprofile=0)
    stock, kernels = (cp_host_time.measure(c, 1, 0, args) for c in ("stock", "kernels"))
    for result in (stock, kernels):
        assert result["host_ms"] >= result["host_min_ms"] > 0
        assert result["ops"] > result["launches"] > 0
        assert result["collectives"] == 0
    assert kernels["launches"] < stock["launches"] and kernels["ops"] < stock["ops"]
