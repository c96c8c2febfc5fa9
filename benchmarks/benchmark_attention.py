"""Attention micro-benchmark: one attention call at the shapes of the supported models (issue 34's
cases), per SDPA backend (cuDNN, flash, memory-efficient) and for ltx_kernels.attention with each
of its CUDA kernel bodies (columns "ours mma": flash_mma.cuh, "ours wgmma": hopper_wgmma.cuh,
picked through LTX_KERNELS_ATTENTION_KERNEL), and for ltx_kernels.attention_int8 (column "ours
int8": hopper_int8.cuh, the kernel alone), in diffusers' [B, S, H, D] layout as the fused
processors call it; for HunyuanVideo-1.5 also its three mask forms and the attention seam's path.
"ours int8" takes q/k/v quantized to its operands in plain PyTorch outside the timing
(reference._quantize_attention_int8: per-token q scales, K smoothed by its mean with a scale per
128 keys, V per channel in e4m3, transposed); the fused quantizing ops will replace that
quantization, and their cost is timed with them, not here. "ours int8+quant" is the 8-bit
attention as attention="int8" runs it (integration/attention.int8_attention): q, k and v quantized
by our ops (quantize "i8_row", quantize_attention_k, quantize_attention_v) and attention_int8,
timed together (the issue's "quantization included"). "ours int8+kv quant" is the same with q
quantized before the timing, as where the q/k norm op emits it (qk_rmsnorm_rope_quant: LTX-Video
and Wan under attention="int8"; the norm pass's own increment is not in this column). Their
outputs are checked against the first backend's like the others, with a looser bound (8-bit
operands and e4m3 probabilities).

    python benchmarks/benchmark_attention.py [--cases a,b] [--columns c,d] [--replays 30] [--out results]
    python benchmarks/benchmark_attention.py --device cpu --scale 64   # smoke run, no timing

Each call is F.scaled_dot_product_attention on q/k/v made as [B, S, H, D] and transposed to
[B, H, S, D] views (what diffusers' native backend hands SDPA), with the backend pinned by
torch.nn.attention.sdpa_kernel. HunyuanVideo-1.5's padded text (its 480p case: 700 padded keys of
49290) in the three forms of the mask it stands for, SDPA choosing the backend as stock does:
  dense       the [B, 1, S, S] boolean mask stock diffusers builds (its construction, which
              stock repeats in every call, not timed)
  key mask    a broadcast [B, 1, 1, S] key-padding mask (and the padded query rows zeroed)
  dropped     no mask over the unpadded keys and queries (the output padded with zero rows)
  seam        HunyuanVideo15KernelsAttnProcessor's attention through integration/attention.py
              (the dropped form, its key lengths read once per mask tensor)
--columns keeps some columns (and the ones their outputs are checked against: the first backend,
the dense mask), e.g. "cudnn,ours wgmma,ours int8,ours int8+quant" leaves out the slow ones.
Times: GPU time of CUDA-graph replays (CUDA events around each call for the seam, whose host
reads of the mask are not captured), median of --replays, per call. TF/s counts 4 * B * H *
Sq * Sk * D: the backend columns over the whole (unmasked) sequence, the mask forms over the
valid queries and keys (the work the mask leaves). Before timing, every column is checked against the
dense-mask (or default-backend) output: relative L2, the mask forms over the valid query rows (a
padded text query attends to no key: backends return zeros or the mean of v there, and those rows
never reach the model's output; the processor returns zeros) (the smoke run on the CPU checks only
that).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
import bench_utils  # noqa: E402

#: name -> (batch, heads, sequence, head_dim, padded keys at the end of the sequence)
CASES = {
    "ltx-video 49f": (2, 32, 2688, 64, 0),
    "ltx-video 161f": (2, 32, 8064, 64, 0),
    "flux 1024x1024": (1, 24, 4608, 128, 0),
    "ltx-2 121f": (2, 32, 6144, 128, 0),
    "wan2.1-14b 81f 720p": (1, 40, 32760, 128, 0),
    "hunyuanvideo-1.5 480p 121f": (1, 16, 49290, 128, 700),
}
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
MASK_FORMS = ("dense", "key mask", "dropped", "seam")
#: column -> the kernel body of ltx_kernels.attention it runs (LTX_KERNELS_ATTENTION_KERNEL)
OURS = {"ours mma": "mma", "ours wgmma": "wgmma"}
INT8 = "ours int8"
INT8_QUANT = "ours int8+quant"
INT8_KV_QUANT = "ours int8+kv quant"
#: the largest relative L2 error against the reference column (the 8-bit columns': quantized
#: operands and probabilities)
TOLERANCE = {INT8: 5e-2, INT8_QUANT: 5e-2, INT8_KV_QUANT: 5e-2}
DEFAULT_TOLERANCE = 2e-2
#: every column name --columns takes ("default": the CPU smoke run's backend)
COLUMNS = ("default", *BACKENDS, *OURS, INT8, INT8_QUANT, INT8_KV_QUANT, *MASK_FORMS)


def _sdpa(query, key, value, mask=None):
    """SDPA of [B, S, H, D] tensors as diffusers' native backend calls it -> [B, S, H, D]."""
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=mask
    )
    return out.transpose(1, 2)


def _pinned(backend):
    def call(query, key, value):
        with sdpa_kernel(backend):
            return _sdpa(query, key, value)

    return call


def _ours(body: str):
    """ltx_kernels.attention on [B, S, H, D] tensors with its kernel body pinned (the launcher
    reads the variable at each call, so a captured graph keeps the body it was captured with)."""
    import ltx_kernels

    def call(query, key, value):
        saved = os.environ.get("LTX_KERNELS_ATTENTION_KERNEL")
        os.environ["LTX_KERNELS_ATTENTION_KERNEL"] = body
        try:
            return ltx_kernels.attention(query, key, value)
        finally:
            if saved is None:
                del os.environ["LTX_KERNELS_ATTENTION_KERNEL"]
            else:
                os.environ["LTX_KERNELS_ATTENTION_KERNEL"] = saved

    return call


def _ours_int8(*operands):
    """ltx_kernels.attention_int8 on operands from _quantize_int8 (the kernel alone)."""
    import ltx_kernels

    return ltx_kernels.attention_int8(*operands)


def _int8_attention():
    """attention="int8"'s attention: our quantizing ops and attention_int8, timed together."""
    from ltx_kernels.integration.attention import int8_attention

    return int8_attention


def _quantize_query(query, key, value):
    """q as the q/k norm op hands it to int8_attention (QuantRows, QUERY_FORMAT), k and v as they
    are (not timed)."""
    from ltx_kernels.integration.attention import QUERY_FORMAT
    from ltx_kernels.integration.quant import quantize_rows

    return quantize_rows(query, QUERY_FORMAT), key, value


def _quantize_int8(query, key, value):
    """[B, S, H, D] q, k, v as attention_int8's operands (plain PyTorch, not timed)."""
    from ltx_kernels.reference import _quantize_attention_int8

    return _quantize_attention_int8(query, key, value)


def _mask_forms(tokens: int, padded: int, device):
    """The HunyuanVideo-1.5 calls of MASK_FORMS, each fn(query, key, value) -> [B, S, H, D], and the
    text mask the model hands its processors (image rows first, valid text, then the padding)."""
    from ltx_kernels.integration import FUSIONS
    from ltx_kernels.integration.hunyuan import HunyuanVideo15KernelsAttnProcessor

    valid_rows = tokens - padded
    text_rows = max(padded, min(1000, tokens // 2))  # (the text's length does not matter)
    text_mask = torch.ones(1, text_rows, dtype=torch.bool, device=device)
    text_mask[:, text_rows - padded :] = False
    valid = torch.arange(tokens, device=device) < valid_rows
    # HunyuanVideo15AttnProcessor2_0's mask: the row mask repeated to [B, 1, S, S] and ANDed with
    # its transpose (built once here; stock builds it in every call).
    pairs = valid.view(1, 1, 1, tokens).repeat(1, 1, tokens, 1)
    pairs = pairs & pairs.transpose(2, 3)

    def dense(query, key, value):
        return _sdpa(query, key, value, pairs)

    def key_mask(query, key, value):
        out = _sdpa(query, key, value, valid[None, None, None, :])
        return out.masked_fill(~valid[None, :, None, None], 0)

    def dropped(query, key, value):
        out = _sdpa(query[:, :valid_rows], key[:, :valid_rows], value[:, :valid_rows])
        return F.pad(out, (0, 0, 0, 0, 0, padded))

    processor = HunyuanVideo15KernelsAttnProcessor()
    processor.ops = frozenset(FUSIONS)

    def seam(query, key, value):  # (one mask tensor: its key lengths are read once)
        return processor._attend(query, key, value, text_mask)

    return {"dense": dense, "key mask": key_mask, "dropped": dropped, "seam": seam}


def columns(case, device, keep=None):
    """Column name -> (fn(*operands), the column its output is checked against, prepare(query, key,
    value) -> fn's operands, untimed): the backends (unmasked, against the first), ours int8
    (against the first) and, for a padded case, the mask forms (against dense); with `keep`, only
    those columns and the ones they are checked against."""
    batch, heads, tokens, head_dim, padded = case
    if device == "cpu":  # no pinned backends on the CPU
        backends = {"default": _sdpa}
    else:
        backends = {name: _pinned(backend) for name, backend in BACKENDS.items()}
        backends.update({name: _ours(body) for name, body in OURS.items()})
    first = next(iter(backends))
    cols = {name: (fn, first, _same) for name, fn in backends.items()}
    cols[INT8] = (_ours_int8, first, _quantize_int8)
    cols[INT8_QUANT] = (_int8_attention(), first, _same)
    cols[INT8_KV_QUANT] = (_int8_attention(), first, _quantize_query)
    if padded:
        cols.update(
            {name: (fn, "dense", _same) for name, fn in _mask_forms(tokens, padded, device).items()}
        )
    if keep is not None:
        kept = {name for name in cols if name in keep}
        kept |= {cols[name][1] for name in kept}  # (their references, which come first)
        cols = {name: column for name, column in cols.items() if name in kept}
    return cols


def _same(*operands):
    return operands


def _inputs(case, device, dtype, seed):
    batch, heads, tokens, head_dim, _ = case
    generator = torch.Generator(device).manual_seed(seed)
    shape = (batch, tokens, heads, head_dim)
    return tuple(torch.randn(shape, device=device, generator=generator).to(dtype) for _ in range(3))


def scaled(case, scale: int):
    """The case with its sequence (and padding) divided by `scale` (the smoke run)."""
    batch, heads, tokens, head_dim, padded = case
    return (batch, heads, max(tokens // scale, 8), head_dim, padded // scale)


def run_case(name, case, device, dtype, replays: int, keep=None) -> list[dict]:
    batch, heads, tokens, head_dim, padded = case
    valid = tokens - padded
    first = _inputs(case, device, dtype, 0)
    results, outputs = [], {}
    for column, (fn, reference, prepare) in columns(case, device, keep).items():
        try:
            out = fn(*prepare(*first)).float()
        except RuntimeError as error:  # a backend that does not take this case
            results.append({"case": name, "column": column, "error": str(error).splitlines()[0]})
            continue
        outputs.setdefault(column, out)
        expected = outputs.get(reference)
        if expected is None:  # the reference column failed: nothing to compare with (None)
            error = None
        else:
            if reference == "dense":  # the valid query rows: a padded text row attends to no
                # key, and what a backend returns there (zeros, or the mean of v) never reaches
                # the model's output
                out, expected = out[:, :valid], expected[:, :valid]
            error = ((out - expected).norm() / expected.norm()).item()
        row = {"case": name, "column": column, "rel_l2": error}
        if device == "cuda":
            if column == "seam":
                us = bench_utils.events_time_us(lambda fn=fn: fn(*first), reps=replays)
            else:
                per_set = 3 * first[0].numel() * first[0].element_size()
                sets = bench_utils.input_sets(
                    lambda: prepare(*_inputs(case, device, dtype, len(results) + 1)), per_set
                )
                us = bench_utils.graph_time_us(fn, sets, replays=replays)
                del sets
            attended = valid if reference == "dense" else tokens  # (the backends: unmasked)
            flops = 4 * batch * heads * attended * attended * head_dim
            row.update(ms=us / 1000, tflops=flops / (us * 1e-6) / 1e12)
        results.append(row)
    return results


def _table(rows) -> str:
    lines = []
    for row in rows:
        if "error" in row:
            cell = f"n/a ({row['error'][:60]})"
        else:
            error = row["rel_l2"]
            cell = "rel L2 n/a (its reference failed)" if error is None else f"rel L2 {error:.1e}"
            if "ms" in row:
                cell = f"{row['ms']:8.3f} ms {row['tflops']:6.0f} TF/s  {cell}"
        lines.append(f"{row['case']:>28} | {row['column']:<10} | {cell}")
    return "\n".join(lines)


def case_arguments(argv, program: str, doc: str, columns=None):
    """The command line of the attention benchmarks (this one, benchmark_attention_quant.py):
    (args, the case names), or None where CUDA is asked for and absent (printed). With `columns`
    (the names a --columns argument takes), args.columns: the ones asked for, or None (all)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    if columns is not None:
        parser.add_argument("--columns", default=None, help=f"from: {', '.join(columns)}")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--scale", type=int, default=1, help="divide every sequence by this")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="a folder for the JSON")
    args = parser.parse_args(argv)
    names = bench_utils.parse_columns(parser, args.cases, CASES)
    if columns is not None and args.columns is not None:
        args.columns = set(bench_utils.parse_columns(parser, args.columns, columns))
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{program}: needs a CUDA device (--device cpu: the smoke run)")
        return None
    return args, names


def main(argv=None) -> int:
    parsed = case_arguments(argv, "benchmark_attention", __doc__, COLUMNS)
    if parsed is None:
        return 2
    args, names = parsed
    dtype = torch.bfloat16
    header = f"# attention, bf16, [B, S, H, D] | {args.device}"
    if args.device == "cuda":
        env = bench_utils.environment()
        header += (
            f" {env['device']} | torch {env['torch']} | cuDNN {torch.backends.cudnn.version()}"
        )
    print(header)
    rows = []
    for name in names:
        case = scaled(CASES[name], args.scale)
        case_rows = run_case(name, case, args.device, dtype, args.replays, args.columns)
        print(_table(case_rows))
        rows += case_rows
    timed = [row["ms"] for row in rows if "ms" in row]
    if timed:
        print(f"# median of {args.replays} replays per column; {len(timed)} columns timed")
    if args.out is not None:
        payload = {"scale": args.scale, "rows": rows}
        if args.device == "cuda":
            payload["environment"] = bench_utils.environment()
        bench_utils.write_json(args.out / "attention.json", payload)
    return 0 if all(map(_passed, rows)) else 1


def _passed(row) -> bool:
    """A row within its tolerance; a backend refusing the case passes (it is reported), ours
    refusing it (the "ours" columns, the seam) or an error without its reference do not."""
    if "error" in row:
        return not (row["column"].startswith("ours") or row["column"] == "seam")
    error = row["rel_l2"]
    return error is not None and error < TOLERANCE.get(row["column"], DEFAULT_TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
