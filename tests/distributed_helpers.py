"""What the multi-process tests share: a free port, one rank's run of named cases (results written
as JSON for the test to read), and scripts/generate_video.py under a torchrun-like environment
with its --compare rows checked.
The processes are spawned by the tests (torch.multiprocessing), gloo on the CPU."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

# (benchmarks/bench_utils.py: the gloo set-up shared with cp_host_time.py; free_port is the tests')
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_utils import free_port, one_thread_one_device  # noqa: E402, F401


def run_cases(rank, world, port, backend, results_dir, cases: dict, *case_args):
    """Joins the process group, runs each case(*case_args), and writes {name: result, or
    {"error": ...}} to results_dir/rank<rank>.json (every case, whatever fails)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world)
    one_thread_one_device()
    results = {}
    try:
        for name, case in cases.items():
            try:
                results[name] = case(*case_args)
            except Exception as error:  # noqa: BLE001  (reported per case by the tests)
                results[name] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def generate_video_script():
    """scripts/generate_video.py as a module (its tiny random pipelines), loaded once."""
    if "generate_video" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "scripts" / "generate_video.py"
        spec = importlib.util.spec_from_file_location("generate_video", path)
        sys.modules["generate_video"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["generate_video"])
    return sys.modules["generate_video"]


def run_generate_video(rank, world, port, argv: list):
    """generate_video.py's main(argv) as rank `rank` of a torchrun launch of `world` processes."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    one_thread_one_device()
    generate_video_script().main(argv)


def compared_rows(output, tolerance: float, audio: bool) -> tuple[dict, dict]:
    """(results, rows by config) of generate_video.py --compare --configs baseline,kernels run on
    several processes, as rank 0 wrote them next to `output`: the rows kernels on one GPU, then the
    baseline and the kernels on all, their latents (and, `audio`, LTX-2's waveforms) equal to the
    parallel baseline within `tolerance` (the kernels' not bit for bit)."""
    results = json.loads(Path(output).with_suffix(".json").read_text())
    rows = {row["config"]: row for row in results["results"]}
    assert list(rows) == ["kernels-1gpu", "baseline", "kernels"]
    assert rows["kernels-1gpu"]["rel_l2"] <= tolerance  # one GPU vs the parallel baseline
    assert 0 < rows["kernels"]["rel_l2"] <= tolerance
    if audio:
        assert rows["kernels"]["audio_rel_l2"] <= tolerance
    return results, rows
