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

import copy
import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ltx_kernels
from inject_helpers import REL_L2_TOLERANCE, output_of, rel_l2
from model_zoo import ltx

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo"
)

WORLD = 2
TOLERANCE = 1e-5  # fp32: the split changes the summation order only


def _ulysses():
    from diffusers import ContextParallelConfig

    return ContextParallelConfig(ulysses_degree=WORLD)


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


def _run_case(device, config, order="before", mask=True, per_token=False, train=False,
              remove=False, backend=None, dtype=torch.float32, compile=False):  # fmt: skip
    """One tiny LTX model under context parallelism, injected before or after enable_parallelism;
    returns its output's (and gradients') relative L2 error against stock diffusers in one
    process."""
    torch.manual_seed(0)
    reference = ltx.tiny_model(dtype).to(device)
    model = copy.deepcopy(reference)
    inputs = ltx.tiny_inputs(dtype, device=device, per_token=per_token)
    if not mask:
        inputs["encoder_attention_mask"] = None
    if backend is not None:
        model.set_attention_backend(backend)
    result = {"tolerance": TOLERANCE if dtype == torch.float32 else REL_L2_TOLERANCE[dtype]}

    def inject():
        report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
        result["patched"] = report.total_patched
        result["skipped"] = sorted(report.skipped)

    if order == "before":
        inject()
    model.enable_parallelism(config=config)
    if order == "after":
        inject()
    if remove:
        result["restored"] = ltx_kernels.remove_optimized_kernels(model)
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
        out = output_of(model(**inputs))
        expected = output_of(reference(**inputs))
    result["out"] = rel_l2(out, expected)
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


CASES = {
    "ulysses_inject_before": lambda d: _run_case(d, _ulysses(), "before"),
    "ulysses_inject_after": lambda d: _run_case(d, _ulysses(), "after"),
    "ulysses_per_token_timesteps": lambda d: _run_case(d, _ulysses(), "before", per_token=True),
    "ulysses_train": lambda d: _run_case(d, _ulysses(), "before", train=True),
    "ulysses_compiled": lambda d: _run_case(d, _ulysses(), "before", compile=True),
    "ulysses_anything": lambda d: _run_case(d, _ulysses_anything(), "before"),
    # Removal after enable_parallelism: the restored stock processors keep the parallel config
    # (no mask: stock diffusers fails with one).
    "ulysses_remove": lambda d: _run_case(d, _ulysses(), "after", mask=False, remove=True),
    # Last: on a GPU set_attention_backend also sets diffusers' process-wide default backend.
    "ring": lambda d: _run_with_lse(d, _ring(), "before"),
    "ring_inject_after": lambda d: _run_with_lse(d, _ring(), "after"),
}
GPU_CASES = {
    "full_size_ulysses": lambda d: _full_size(d, _ulysses()),
}


def _worker(rank, port, results_dir, device):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "cpu:gloo"
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    if torch.accelerator.device_count() == 0:  # diffusers: rank % device_count()
        torch.accelerator.device_count = lambda: 1
    results = {}
    try:
        for name, case in {**CASES, **(GPU_CASES if device == "cuda" else {})}.items():
            try:
                results[name] = case(device)
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


def _spawn(directory, device):
    mp.spawn(_worker, args=(_free_port(), str(directory), device), nprocs=WORLD, join=True)
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


@pytest.mark.parametrize("case", sorted({**CASES, **GPU_CASES}))
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


@pytest.mark.parametrize("case", ["ulysses_inject_before", "ring", "ulysses_train"])
def test_injected_before_patches_everything(results, case):
    for by_case in results:
        assert by_case[case]["processor"] == "LTXKernelsAttnProcessor"
        assert by_case[case]["processor_parallel"]
        assert by_case[case]["skipped"] == []
        # blocks, two processors and attn1's fused q/k/v projections each, the output norm
        assert by_case[case]["patched"] == 4 * ltx.TINY["num_layers"] + 1


def test_injected_after_skips_only_the_output_norm(results):
    """enable_parallelism wraps the model's forward in a hook: the output-norm patch is skipped
    (reported); blocks and processors are patched and get the parallel config."""
    for by_case in results:
        result = by_case["ulysses_inject_after"]
        assert result["processor"] == "LTXKernelsAttnProcessor" and result["processor_parallel"]
        assert result["skipped"] == ["LTXVideoTransformer3DModel (output norm)"]


def test_remove_restores_stock_processors_with_parallel_config(results):
    for by_case in results:
        result = by_case["ulysses_remove"]
        assert result["restored"] == 3 * ltx.TINY["num_layers"]
        assert result["processor"] == "LTXVideoAttnProcessor" and result["processor_parallel"]


def _generate_video_worker(rank, port, output):
    """scripts/generate_video.py under a torchrun-like environment (gloo on the CPU)."""
    import importlib.util
    import sys
    from pathlib import Path

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
    )
    torch.set_num_threads(1)
    if torch.accelerator.device_count() == 0:  # diffusers: rank % device_count()
        torch.accelerator.device_count = lambda: 1
    path = Path(__file__).resolve().parents[1] / "scripts" / "generate_video.py"
    spec = importlib.util.spec_from_file_location("generate_video", path)
    script = importlib.util.module_from_spec(spec)
    sys.modules["generate_video"] = script
    spec.loader.exec_module(script)
    script.main(
        ["--tiny", "--num-frames", "9", "--height", "64", "--width", "64", "--steps", "2"]
        + ["--warmup-iterations", "1", "--runs", "1", "--no-progress", "--no-video"]
        + ["--dtype", "fp32", "--compare", "--configs", "baseline,kernels"]
        + ["--context-parallel", "ulysses", "--output", output]
    )


def test_generate_video_context_parallel(tmp_path):
    """torchrun --nproc_per_node 2 scripts/generate_video.py --context-parallel ulysses --compare:
    the rows (kernels on one GPU, then the baseline and the kernels on both), their latents equal
    within fp32 rounding, the results written by rank 0."""
    output = tmp_path / "video.mp4"
    mp.spawn(_generate_video_worker, args=(_free_port(), str(output)), nprocs=WORLD, join=True)
    results = json.loads(output.with_suffix(".json").read_text())
    rows = {row["config"]: row for row in results["results"]}
    assert list(rows) == ["kernels-1gpu", "baseline", "kernels"]
    assert rows["kernels-1gpu"]["rel_l2"] <= TOLERANCE  # one GPU vs the split baseline
    assert 0 < rows["kernels"]["rel_l2"] <= TOLERANCE
    assert "ulysses x 2 GPUs" in rows["kernels"]["notes"]
    assert "ltx_kernels processors for the text mask" in rows["baseline"]["notes"]
    assert results["settings"]["context_parallel"] == "ulysses"
