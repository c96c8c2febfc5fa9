"""Helpers shared by the benchmarks and scripts: timing, environment, the checkpoints' real
configs (configs/*.json) and models built from them with random weights.

GPU time comes from CUDA-graph replay: each graph runs the op once on each of several input sets
(together several times the L2 size, so no input is served from L2), every call writing its own
output; replays are timed with CUDA events and the median per-call time is reported. Bandwidth
counts bytes read + bytes written, and is compared with a device-to-device copy measured the same
way in the same process.
"""

import contextlib
import json
import math
import socket
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size


def input_sets(make, bytes_per_set: int, min_sets: int = 2):
    """Enough freshly made input sets that together they are >= 4x the L2 size."""
    count = max(min_sets, math.ceil(4 * l2_bytes() / max(bytes_per_set, 1)))
    return [make() for _ in range(count)]


def graph_replays(fn, arg_sets, replays: int = 30, warmup_replays: int = 3,
                  capture_error_mode: str = "global"):  # fmt: skip
    """fn(*args) for every set of arg_sets captured in one CUDA graph (after a warm-up call of each
    on a side stream: compilation, autotuning, lazy init), then replayed: (ms of each timed replay,
    the captured calls' outputs, capture seconds). capture_error_mode="thread_local" where another
    thread uses CUDA while this one captures (NCCL's watchdog)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start_s = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    outputs = []  # kept alive so every call writes its own buffer
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        for args in arg_sets:
            outputs.append(fn(*args))
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - start_s
    for _ in range(warmup_replays):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times_ms = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    # (the outputs outlive the graph: their blocks of its pool are freed with them)
    return times_ms, outputs, capture_s


def graph_time_us(fn, arg_sets, replays: int = 30, warmup_replays: int = 3) -> float:
    """Median GPU time per call of fn(*args), in µs, from CUDA-graph replays over arg_sets."""
    times_ms, _, _ = graph_replays(fn, arg_sets, replays, warmup_replays)
    return statistics.median(times_ms) * 1000.0 / len(arg_sets)


def events_time_us(fn, reps: int = 30) -> float:
    """Median GPU time of fn() in µs from CUDA events around each call (no graph)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times_ms = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times_ms.append(start.elapsed_time(end))
    return statistics.median(times_ms) * 1000.0


def copy_bandwidth(nbytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth in TB/s (read + write counted) over 1 GiB buffers, three
    ways: cudaMemcpy (Tensor.copy_) launched eagerly, the same captured in a CUDA graph, and an
    elementwise kernel (torch.neg) in a graph. `best` is the ceiling the benchmarks compare with."""
    src = [
        torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_() for _ in range(2)
    ]
    dst = [torch.empty_like(s) for s in src]
    tbs = lambda us: 2 * nbytes / (us * 1e-6) / 1e12
    result = {
        "memcpy": tbs(events_time_us(lambda: dst[0].copy_(src[0]))),
        "memcpy_graph": tbs(graph_time_us(lambda d, s: d.copy_(s), list(zip(dst, src)))),
        "elementwise_graph": tbs(
            graph_time_us(lambda d, s: torch.neg(s, out=d), list(zip(dst, src)))
        ),
    }
    result["best"] = max(result.values())
    src.clear(), dst.clear()  # free the buffers before emptying the cache
    torch.cuda.empty_cache()
    return result


def environment() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    info = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "l2_mb": props.L2_cache_size / 2**20,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a gloo group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_thread_one_device():
    """A CPU (gloo) rank's set-up: one intra-op thread, and one accelerator device counted where
    there is none (diffusers' context parallelism takes rank % device_count())."""
    torch.set_num_threads(1)
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative L2 distance |out - ref| / |ref|, in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


class _AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels that run while active, by kind (attention_calls)."""

    def __init__(self):
        super().__init__()
        self.counts = {"8-bit": 0, "ours bf16": 0, "sdpa": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name == "ltx_kernels::attention_int8":
            self.counts["8-bit"] += 1
        elif name == "ltx_kernels::attention":
            self.counts["ours bf16"] += 1
        elif name.startswith("aten::_scaled_dot_product_") and "backward" not in name:
            self.counts["sdpa"] += 1
        return func(*args, **(kwargs or {}))


def attention_calls(fn) -> dict:
    """{kind: calls} of the attention kernels one eager call of `fn` runs: "8-bit"
    (attention_int8), "ours bf16" (ltx_kernels.attention) and "sdpa" (torch's fused SDPA
    kernels): how many of a step's attention calls a column's attention choice took (e.g.
    attention="int8" attends in 8 bits only where LTX_INT8_ATTENTION_FASTER lists the call's
    length)."""
    with torch.no_grad(), _AttentionCalls() as counter:
        fn()
    return counter.counts


def parse_columns(parser, text: str, allowed) -> list:
    """The comma-separated column names of a --columns argument, each one of `allowed` (else the
    parser's usage error)."""
    columns = [c.strip() for c in text.split(",") if c.strip()]
    unknown = set(columns) - set(allowed)
    if unknown:
        parser.error(f"unknown columns {sorted(unknown)}; choose from {', '.join(allowed)}")
    return columns


def ratio_cell(value) -> str:
    """A speedup for a table cell: "1.23x", or "-" when there is none (None or NaN: its reference
    column was not asked for, or not measured yet)."""
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def bar_chart(path: Path, title: str, shapes, columns, tbs, copy_tbs: float) -> None:
    """Grouped bars of TB/s per shape and column, with the measured copy bandwidth as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 4.5))
    width = 0.8 / len(columns)
    for i, column in enumerate(columns):
        xs = [s + (i - (len(columns) - 1) / 2) * width for s in range(len(shapes))]
        ax.bar(xs, [tbs[shape].get(column, 0.0) for shape in shapes], width, label=column)
    ax.axhline(
        copy_tbs, color="black", linestyle="--", linewidth=1, label=f"copy {copy_tbs:.2f} TB/s"
    )
    ax.set_xticks(range(len(shapes)), shapes, rotation=15, fontsize=8)
    ax.set_ylabel("TB/s (read + write)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@contextlib.contextmanager
def torchao_fp8_rowwise(model: torch.nn.Module):
    """The FP8 path a user would pick instead of ours, on `model` while the block runs: torchao's
    float8 dynamic-activation float8-weight quantization with per-row scales
    (`quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))` on
    every bf16 nn.Linear, the only ones PerRow takes). torchao replaces the weights; the bf16 ones
    wait on the CPU and come back on exit. Raises ImportError naming torchao when it is not
    installed. torchao's recommended Inductor settings (its default set_inductor_config=True:
    coordinate-descent autotuning, which took more than 4 minutes on LTX-2's and
    HunyuanVideo-1.5's blocks on an H100) hold while the block runs and are undone on exit: torchao
    leaves them on for the whole process, where they would change every compiled column after
    this one."""
    import torch._inductor.config as inductor_config

    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            quantize_,
        )
    except ImportError as error:
        raise ImportError(f"the torchao anchor needs torchao (pip install torchao): {error}")

    def bf16_linear(module, _name=None) -> bool:  # PerRow takes bf16 weights only
        return isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16

    originals = {name: (m, m.weight) for name, m in model.named_modules() if bf16_linear(m)}
    device = next(iter(originals.values()))[1].device
    inductor_settings = inductor_config.get_config_copy()
    quantize_(
        model,
        Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
        filter_fn=bf16_linear,
    )
    for _, weight in originals.values():
        weight.data = weight.data.cpu()
    try:
        yield model
    finally:
        inductor_config.load_config(inductor_settings)
        for module, weight in originals.values():
            weight.data = weight.data.to(device)
            module.weight = weight


# ------------------------------------------------------------------------------------------------
# Real configs (configs/*.json) and full-size models with random weights

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def model_config(name: str) -> dict:
    """configs/<name>.json: a checkpoint's real configs, as the hub holds them, with its model_id
    and the source of the values ("transformer": {"class", "config"}, and per pipeline the other
    components)."""
    path = CONFIGS / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise ValueError(f"no config {name!r} in {CONFIGS}; known: {known}")
    return json.loads(path.read_text())


def random_model(cls, config: dict, dtype: torch.dtype, device, seed: int = 0):
    """`cls(**config)` in eval mode with random weights made directly on `device`, in `dtype` (the
    class's `_keep_in_fp32_modules` in float32, as `from_pretrained(torch_dtype=dtype)` loads
    them), without ever holding a float32 copy of the whole model: parameters are created on the
    meta device, materialized, and initialized by their module's own `reset_parameters` (Linear,
    convolutions, norms, embeddings). Parameters of modules without one get 1 (1-D weights: norm
    scales; scalars such as the VAEs' timestep_scale_multiplier), 0 (biases) or N(0, 1/last dim)
    (tables such as scale_shift_table, diffusers' initialization of them). Buffers are computed at
    construction as usual, then cast the same way. Seeded: the same weights for the same seed,
    device and config."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls(**config)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    torch.manual_seed(seed)
    pending = {}  # parameters no reset_parameters initializes: (module, name) -> tensor

    def target(module_name: str, name: str) -> torch.dtype:  # diffusers' rule: any name part
        kept = not keep.isdisjoint(f"{module_name}.{name}".split("."))
        return torch.float32 if kept else dtype

    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=target(module_name, name), device=device),
                    requires_grad=param.requires_grad,
                )
                pending[module, name] = module._parameters[name]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                cast = target(module_name, name) if buffer.is_floating_point() else buffer.dtype
                module._buffers[name] = buffer.to(device=device, dtype=cast)
    with torch.no_grad():
        for module in model.modules():
            if module._parameters and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
                for name in module._parameters:
                    pending.pop((module, name), None)
        for (_, name), param in pending.items():
            if param.dim() == 0 or (param.dim() == 1 and name == "weight"):
                param.fill_(1.0)
            elif name == "bias":
                param.zero_()
            else:
                param.normal_(0.0, param.shape[-1] ** -0.5)
    return model.eval()
