"""The setuptools build as a `kernels` build variant: scripts/kernels_variant.py lays it out with
metadata.json, and `kernels.get_local_kernel` (the `kernels` package from PyPI) loads it and runs an
op on the CPU. The loading runs in a fresh interpreter: this one already holds ltx_kernels' library,
and a second copy of it would abort the process (its TORCH_LIBRARY registers ltx_kernels again)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ltx_kernels

kernels = pytest.importorskip(
    "kernels", reason="the `kernels` package is not installed (pip install kernels)"
)
from kernels.archs import _supports_cuda_capability  # noqa: E402  (get_kernel's arch check)
from kernels.variants import get_variants_local, resolve_variant  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kernels_variant.py"

# Loads the variant found under argv[1] and applies rmsnorm to the inputs saved in argv[2].
LOAD_AND_RUN = """
import json, sys
from pathlib import Path
import kernels, torch
module = kernels.get_local_kernel(Path(sys.argv[1]))
x, weight = torch.load(sys.argv[2])
torch.save(module.rmsnorm(x, weight, 1e-6), sys.argv[2])
print(json.dumps({"name": module.__name__, "init": module.__file__, "extension": module._C.__file__,
                  "load_error": repr(module.load_error)}))
"""


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("kernels_variant", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(["--out", str(tmp_path_factory.mktemp("repo") / "build")])


def test_variant_is_the_one_kernels_picks(variant):
    picked, trace = resolve_variant(get_variants_local(variant.parent))
    assert picked is not None and picked.variant_str == variant.name, trace
    metadata = json.loads((variant / "metadata.json").read_text())
    assert (metadata["name"], metadata["id"], metadata["version"]) == (
        "ltx-kernels",
        "ltx_kernels",
        1,
    )
    assert metadata["backend"]["type"] == "cuda"
    # sm_90a machine code plus compute_90 PTX: kernels accepts Hopper and newer GPUs, not Ampere.
    archs = metadata["backend"]["archs"]
    supported = [_supports_cuda_capability(archs, cc) for cc in [(9, 0), (10, 0), (8, 0)]]
    assert supported == [True, True, False], archs


def test_get_local_kernel_runs_an_op_on_the_cpu(variant, tmp_path):
    x, weight = torch.randn(7, 111), torch.randn(111)
    io_path = tmp_path / "io.pt"
    torch.save((x, weight), io_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("LOCAL_KERNELS", None)
    command = [sys.executable, "-c", LOAD_AND_RUN, str(variant.parent.parent), str(io_path)]
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded["name"] == "ltx_kernels" and loaded["load_error"] == "None"
    assert Path(loaded["init"]).parent == variant and Path(loaded["extension"]).parent == variant
    out = torch.load(io_path)
    torch.testing.assert_close(out, ltx_kernels.reference.rmsnorm(x, weight, 1e-6))
    assert torch.equal(out, ltx_kernels.rmsnorm(x, weight, 1e-6))  # this build's library
