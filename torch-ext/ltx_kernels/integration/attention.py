"""The attention seam: every fused processor attends through `attend` (self- and cross-attention,
masks, key lengths, context parallelism), so an attention kernel of ours enters at this one
function, not at each family's processor.

Contract of `attend(processor, query, key, value, *, parallel_config, mask, key_lengths, sdpa)`:
- query [B, Sq, H, D], key and value [B, Sk, H, D] (diffusers' dispatch layout; any strides with
  D contiguous) -> [B, Sq, H, D] in the query's dtype;
- `processor`: the fused processor calling it, which carries the enabled ops (`processor.ops`),
  the attention choice (`processor.attention`, below) and diffusers' attention backend
  (`processor._attention_backend`);
- `parallel_config`: what the call is attended with under context parallelism (the processor's
  `_parallel_config`, or None where a processor attends locally, e.g. to a gathered text);
- `mask`: an attention mask as diffusers' dispatch takes it (boolean or additive, broadcast to
  [B, H, Sq, Sk]);
- `key_lengths`: per batch element (or one for all), how many leading keys are attended (the
  keys past it are padding), a tuple of ints (`padded_key_lengths` reads them off a key mask:
  one per row). Where every element has the same length the padded keys are dropped (k/v
  sliced, no mask: exact in math, and what SDPA runs fastest); otherwise they become a
  broadcast [B, 1, 1, Sk] key mask.
  Under context parallelism they count the whole sequence (Ulysses only: below);
- `replicated`: under context parallelism, how many trailing rows of q/k/v are whole on every
  rank (HunyuanVideo-1.5's text, after this rank's chunk of the video); their output rows come
  back whole (Ulysses only: below);
- `whole_queries`: under context parallelism, the queries are whole on every rank and the keys
  split (LTX-2's video-to-audio attention): every rank gets the whole output;
- `sdpa=True`: F.scaled_dot_product_attention as stock SD3's processor calls it (diffusers'
  JointAttnProcessor2_0 ignores the attention backend), for stock numerics bit for bit.

What attends: `processor.attention`, inject_optimized_kernels' `attention=` (injector.py,
ATTENTION_CHOICES). "diffusers": diffusers' dispatch_attention_fn with the processor's backend (or
SDPA where sdpa=True), as stock attends. "ltx_kernels": our `attention` op wherever it applies
(runs_ltx_attention: no mask, q/k/v the op takes, autograd not recording, since the op has no
backward yet, and no context parallelism but ulysses_attention's), non-uniform key lengths passed
to it as they are (uniform ones still slice the keys: the same keys, no lengths tensor); every
other call as "diffusers". "auto" (the default): as "ltx_kernels" only where
LTX_ATTENTION_FASTER (injector.py) lists the GPU and head_dim and the call has at least its
tokens (queries and keys; a length torch.compile keeps symbolic counts as too few: `_long_enough`),
and the processor keeps diffusers' default backend; as "diffusers" elsewhere. "int8" (opt-in, a
numerics change): 8-bit attention (`int8_attention`: q, k and v quantized by our ops, then
attention_int8) wherever it applies and pays (runs_int8_attention: no mask, no autograd
recording; CUDA: a Hopper GPU, float16/bfloat16, head_dim 64 or 128, and at least the tokens
(queries and keys) from which LTX_INT8_ATTENTION_FASTER (injector.py) lists it faster, a length
torch.compile keeps symbolic counting as enough: `_int8_pays`; the CPU: its C twins, every call),
as "auto" elsewhere, and in the blocks
inject_optimized_kernels' attention_bf16_blocks keeps in bf16 (their processors' choice is
"auto"). Self-attention under Ulysses (below, "ulysses_attention" in FUSIONS) runs
ulysses_attention, which takes the inner attention as a callable: the same choice, made on the
tensors as they land (this rank's heads over the whole sequence: the whole sequence's tokens
count, not the rank's chunk).

Ulysses: diffusers' Ulysses sends q, k and v in three all-to-alls, each between two permuting
copies (eight copies of a [B, s, H, D] tensor per call). ulysses_attention sends q, k and v in one
all-to-all, attention reads them where they land (strided views), and the output returns in one
more: five such copies, through 8-byte elements, and two all-to-alls. Queries whole on every rank
(`whole_queries`) run ulysses_whole_queries_attention under the same rules: k and v in one
all-to-all, each rank's heads of the queries sliced locally, the output all-gathered over the
heads. Every other case (ring attention, uneven splits, a mask, autograd recording) keeps
diffusers' parallel attention.
Key lengths and replicated rows under context parallelism run ulysses_attention only: after its
all-to-all each rank holds the whole sequence of its heads in the original order (rank r's chunk
at r * s, the replicated rows last, sliced to this rank's heads locally), so the key lengths of
the whole sequence apply there as on one GPU, and no mask is ever split or gathered; ring
attention, uneven splits and autograd recording raise.
(Pipelining head chunks, one chunk's all-to-all beside the previous chunk's attention, was slower
on 2 H200s: NCCL's kernels wait for SMs and for the peer behind the attention kernel;
benchmarks/NOTES.md.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops import attention as ltx_attention
from ..ops import attention_int8, quantize, quantize_attention_k, quantize_attention_v
from .context_parallel import (
    _GatherSequence,
    all_to_all,
    capturing,
    context_parallel_config,
    version_of,
)
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .injector import LTX_ATTENTION_FASTER, LTX_ATTENTION_HEAD_DIMS, LTX_INT8_ATTENTION_FASTER
from .quant import QuantRows


def attend(
    processor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    parallel_config=None,
    mask: torch.Tensor | None = None,
    key_lengths: tuple[int, ...] | None = None,
    sdpa: bool = False,
    replicated: int = 0,
    whole_queries: bool = False,
) -> torch.Tensor:
    """The attention of q/k/v [B, S, H, D] -> [B, Sq, H, D] (the module docstring's contract)."""
    if key_lengths is not None and mask is not None:
        raise ValueError("ltx_kernels attend: pass key_lengths or mask, not both")
    if key_lengths is not None and len(key_lengths) not in (1, query.shape[0]):
        raise ValueError(
            f"ltx_kernels attend: key_lengths has {len(key_lengths)} entries for a batch of "
            f"{query.shape[0]}: one per batch element, or one for all"
        )
    cp_config = context_parallel_config(parallel_config)
    if (
        cp_config is not None
        and not cp_config.ulysses_anything
        and query.shape[2] % cp_config.ulysses_degree
    ):
        raise ValueError(
            f"ltx_kernels attend: {query.shape[2]} attention heads do not divide among "
            f"ulysses_degree={cp_config.ulysses_degree} ranks: pick a degree that divides them "
            "(or ulysses_anything=True, diffusers' uneven Ulysses)"
        )
    if cp_config is not None and (key_lengths is not None or replicated):
        _check_ulysses_whole_sequence(cp_config, query, key, value, mask, replicated)

        def local(query, key, value):  # this rank's heads, the whole sequence
            return attend(processor, query, key, value, key_lengths=key_lengths, sdpa=sdpa)

        out = ulysses_attention(query, key, value, parallel_config, local, replicated)
        return out.unflatten(2, (query.shape[2], -1)).to(query.dtype)
    uniform = key_lengths is not None and len(set(key_lengths)) == 1
    if uniform:  # (before the choice: the keys the call attends count)
        key, value = key[:, : key_lengths[0]], value[:, : key_lengths[0]]
    ours = _attending_op(processor, query, key, value, mask, cp_config)
    lengths = None  # (ours: the key lengths as the op takes them)
    if key_lengths is not None and not uniform:
        lengths = lengths_tensor(key_lengths, key.device)
        if not ours:  # a broadcast key mask
            positions = torch.arange(key.shape[1], device=key.device)
            mask = (positions < lengths[:, None])[:, None, None, :]
    if ours is not None:
        return ours(query, key, value, lengths)
    if sdpa:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
        )
        return out.transpose(1, 2).to(query.dtype)

    def dispatch(query, key, value, parallel_config=None):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        return dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=processor._attention_backend,
            parallel_config=parallel_config,
        )

    if runs_ulysses_attention(
        processor.ops, parallel_config, query, key, value, mask, whole_queries
    ):
        # (this rank's heads, over the whole sequence: strided views of one receive buffer whose
        # offsets and strides are multiples of head_dim, so aligned where q/k/v are; the choice
        # counts the whole sequence's tokens, not this rank's chunk)
        def inner(query, key, value):  # chosen on the tensors as they land: the whole sequence
            ours = our_attention(processor, query, key, value)
            return dispatch(query, key, value) if ours is None else ours(query, key, value)

        ulysses = ulysses_whole_queries_attention if whole_queries else ulysses_attention
        out = ulysses(query, key, value, parallel_config, inner)
        return out.unflatten(2, (query.shape[2], -1)).to(query.dtype)
    return dispatch(query, key, value, parallel_config).to(query.dtype)


def _attending_op(processor, query, key, value, mask, cp_config):
    """The op of ours that attend runs on a call: none under a mask or context parallelism
    (diffusers' attention), else our_attention's choice. A query quantized by the op before
    (QuantRows: query_format said so) attends through int8_attention only, which has no backward:
    keys or values autograd records through, or a mask or context parallelism, with it raise (the
    processor asked query_format with less than the call attends)."""
    quantized = isinstance(query, QuantRows)
    if quantized and _recording(key, value):
        raise RuntimeError(
            "ltx_kernels attend: a quantized query cannot attend keys or values that autograd "
            "records through (int8_attention has no backward): query_format was asked without "
            "them"
        )
    if mask is not None or cp_config is not None:
        if quantized:
            raise RuntimeError(
                "ltx_kernels attend: a quantized query attends through int8_attention only, "
                "without a mask or context parallelism (query_format)"
            )
        return None
    return int8_attention if quantized else our_attention(processor, query, key, value)


def our_attention(processor, query, key, value, instead_of_key_mask=False):
    """The attention op of ours that attends q/k/v [B, S, H, D] (no mask, one device's heads) for
    `processor`'s attention choice: `int8_attention`, `ltx_attention`, or None (diffusers').
    instead_of_key_mask: the alternative is diffusers' backend with a key mask, the op taking key
    lengths counted on the device (runs_ltx_attention)."""
    if runs_int8_attention(processor, query, key, value):
        return int8_attention
    if runs_ltx_attention(processor, query, key, value, instead_of_key_mask):
        return ltx_attention
    return None


def _hopper(query: torch.Tensor) -> bool:
    """Whether query is on a Hopper GPU (sm_90), the one our attention kernel is measured on."""
    return query.is_cuda and _capability(query.device.index) == (9, 0)


def int8_attention(query, key, value, key_lengths=None, scale=None) -> torch.Tensor:
    """8-bit attention of q/k/v [B, S, H, D] -> [B, Sq, H, D] in k's dtype: q quantized per token
    and head (quantize, QUERY_FORMAT; or already, QuantRows from the op that produced it:
    query_format), k smoothed by its mean over the sequence and quantized per head
    and block of 128 keys (quantize_attention_k), v per channel in e4m3, transposed
    (quantize_attention_v), then attention_int8 (INT8 q.k, FP8 p.v) with the key lengths and
    `scale` (default D**-0.5). With key lengths, the keys past each length (never attended) are
    first set to the mean of the attended keys and the values to zero (one masked copy of each),
    so that they weigh in no scale and leave k's mean that of the attended keys: zeros there would
    pull the mean towards 0 and smooth the attended keys less (8-bit error 4.9e-2 instead of
    3.9e-2 with 70 of 150 keys attended, test_inject_int8_attention)."""
    if key_lengths is not None:
        positions = torch.arange(key.shape[1], device=key.device)
        attended = positions < key_lengths[:, None]  # [B, Sk]
        # the attended keys' sum per head and channel in one read of k: [B, 1, Sk] @ [B, Sk, H * D]
        attended_sum = torch.bmm(attended[:, None].to(key.dtype), key.flatten(2))
        mean = attended_sum / key_lengths.clamp(min=1)[:, None, None]
        attended = attended[:, :, None, None]  # [B, Sk, 1, 1]
        key = key.where(attended, mean.unflatten(2, key.shape[2:]).to(key.dtype))
        value = value.where(attended, 0)
    if isinstance(query, QuantRows):
        q8, q_scale = query.data, query.scale
    else:
        q8, q_scale = quantize(query, format=QUERY_FORMAT)
    k8, k_scale = quantize_attention_k(key)
    v8, v_scale = quantize_attention_v(value)
    return attention_int8(
        q8, q_scale, k8, k_scale, v8, v_scale, key_lengths, scale, out_dtype=key.dtype
    )


#: The format of int8_attention's q operand (QuantRows): INT8, one scale per token and head.
QUERY_FORMAT = "i8_row"


def query_format(
    processor, query, key, value, *, heads=None, mask=None, parallel_config=None, params=()
) -> str | None:
    """The format in which the op producing the query (qk_rmsnorm_rope_quant: steps.qk_norm_rope)
    may hand it to `attend(processor, query, key, value, mask=mask,
    parallel_config=parallel_config)` quantized, as QuantRows: QUERY_FORMAT where that call runs
    int8_attention (attend's own choice, _attending_op), so that q is quantized
    in the op's pass instead of one of int8_attention's own; None: hand it the tensor. q/k/v
    [B, S, H, D] as attend takes them, asked before that op (which keeps their shapes and dtype);
    with `heads`, q/k are [B, S, H * D], split here (only once the cheap refusals pass: the
    default path makes no views); `params`: its parameters (the norms' weights) and any other
    tensor the call attends (a joint attention's other stream), through which autograd may record
    too."""
    if processor.attention != "int8" or _recording(*(p for p in params if p is not None)):
        return None  # (only "int8" attends through int8_attention: runs_int8_attention)
    if heads is not None:
        query, key = (t.unflatten(2, (heads, -1)) for t in (query, key))
    cp_config = context_parallel_config(parallel_config)
    op = _attending_op(processor, query, key, value, mask, cp_config)
    return QUERY_FORMAT if op is int8_attention else None


def cat_queries(parts) -> torch.Tensor | QuantRows:
    """Queries [B, S_i, H, D] concatenated along the sequence (a joint attention's text and image
    rows): tensors as torch.cat; where some came quantized (QuantRows, query_format), the
    concatenated codes and scales, a tensor part quantized in the same format first (per token
    and head: the codes quantizing the whole concatenation gives)."""
    formats = {part.format for part in parts if isinstance(part, QuantRows)}
    if not formats:
        return torch.cat(parts, dim=1)
    (format,) = formats
    rows = [
        part if isinstance(part, QuantRows) else QuantRows(*quantize(part, format=format), format)
        for part in parts
    ]
    return QuantRows(
        torch.cat([r.data for r in rows], dim=1), torch.cat([r.scale for r in rows], dim=1), format
    )


def runs_int8_attention(processor, query, key, value) -> bool:
    """Whether `processor`'s attention choice, "int8", attends q/k/v with int8_attention: autograd
    not recording through them (no backward), the ops take them (`_int8_takes`) and 8 bits pay at
    their lengths (`_int8_pays`)."""
    return (
        processor.attention == "int8"
        and not _recording(query, key, value)
        and _int8_takes(query, key, value)
        and (not query.is_cuda or _int8_pays(query, key))  # (the CPU's C twins: every call)
    )


def _int8_pays(query, key) -> bool:
    """Whether q/k [B, S, H, D] on CUDA have at least the tokens from which int8_attention
    measured faster than attention="auto" at their head_dim (LTX_INT8_ATTENTION_FASTER of the
    device's compute capability; a head_dim it does not list: never). Decided without a guard:
    under torch.compile a length it keeps symbolic counts as enough (8 bits were asked for), so a
    new sequence length never recompiles."""
    for head_dim, tokens in _int8_measured_faster(query.device.index):
        if query.shape[-1] == head_dim:
            return not (
                statically_known_true(query.shape[1] < tokens)
                or statically_known_true(key.shape[1] < tokens)
            )
    return False


def _int8_takes(query, key, value) -> bool:
    """Whether int8_attention takes q/k/v as they are: one dtype, k/v with q's batch and heads,
    contiguous last dims; the CPU (the C twins): float16/bfloat16/float32, any head_dim; CUDA:
    compute capability 9.0 (the kernel is Hopper's), float16/bfloat16, head_dim 64 or 128. (The
    quantizing ops read any strides and write the aligned operands attention_int8 takes.)"""
    if not _operands_match(query, key, value):
        return False
    if query.device.type == "cpu":
        return query.dtype in (torch.float16, torch.bfloat16, torch.float32)
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] in LTX_ATTENTION_HEAD_DIMS
        and _capability(query.device.index) == (9, 0)
    )


def runs_ltx_attention(processor, query, key, value, instead_of_key_mask=False) -> bool:
    """Whether `processor`'s attention choice (processor.attention) attends q/k/v [B, S, H, D]
    (no mask, one device's heads) with ltx_kernels.attention: "ltx_kernels" where the op takes
    them (`_op_takes`) and autograd does not record through them (the op has no backward yet);
    "auto" where, besides, the processor keeps diffusers' default attention backend (a backend set
    with set_attention_backend is kept) and LTX_ATTENTION_FASTER lists the GPU and head_dim with
    no more tokens than q and k have (`_long_enough`), or,
    `instead_of_key_mask` (the alternative: that backend with a key mask, where the key lengths
    cannot be read on the host, under torch.compile), the GPU is a Hopper one: a key mask costs the
    backend more than the keys it hides (HunyuanVideo-1.5 480p, 1x16x49290 with 700 padded keys,
    H100: cuDNN with the key mask 47.8 ms, our op with the lengths 33.5 ms; benchmarks/NOTES.md)."""
    choice = "auto" if processor.attention == "int8" else processor.attention
    if choice == "diffusers" or (
        choice == "auto" and not LTX_ATTENTION_FASTER and not instead_of_key_mask
    ):
        return False
    if _recording(query, key, value):
        return False
    if not _op_takes(query, key, value):
        return False
    return choice == "ltx_kernels" or (
        processor._attention_backend is None
        and (
            (query.is_cuda and _long_enough(query, key)) or (instead_of_key_mask and _hopper(query))
        )
    )


def _long_enough(query, key) -> bool:
    """Whether q/k [B, S, H, D] on CUDA have at least the tokens from which ltx_kernels.attention
    measured faster at their head_dim (LTX_ATTENTION_FASTER of the device's compute capability).
    Decided without a guard: under torch.compile a length it keeps symbolic (dynamic=True, or
    after a recompile for a new length) counts as too few, so a new sequence length never
    recompiles; static lengths (torch.compile's first compile) and eager calls compare exactly."""
    for head_dim, tokens in _measured_faster(query.device.index):
        if query.shape[-1] == head_dim:
            return statically_known_true(query.shape[1] >= tokens) and statically_known_true(
                key.shape[1] >= tokens
            )
    return False


@torch.compiler.assume_constant_result  # (torch.compile: called once while tracing, a constant)
def _measured_faster(device_index: int | None) -> tuple[tuple[int, int], ...]:
    """((head_dim, tokens), ...): where ltx_kernels.attention measured faster on CUDA device
    `device_index` (LTX_ATTENTION_FASTER of its compute capability)."""
    return LTX_ATTENTION_FASTER.get(torch.cuda.get_device_capability(device_index), ())


@torch.compiler.assume_constant_result
def _int8_measured_faster(device_index: int | None) -> tuple[tuple[int, int], ...]:
    """((head_dim, tokens), ...): where int8_attention measured faster than attention="auto" on
    CUDA device `device_index` (LTX_INT8_ATTENTION_FASTER of its compute capability)."""
    return LTX_INT8_ATTENTION_FASTER.get(torch.cuda.get_device_capability(device_index), ())


@torch.compiler.assume_constant_result
def _capability(device_index: int | None) -> tuple[int, int]:
    """The compute capability of CUDA device `device_index`."""
    return torch.cuda.get_device_capability(device_index)


def _operands_match(query, key, value) -> bool:
    """What both attention ops take of q/k/v: one dtype, k/v with q's batch and heads, contiguous
    last dims."""
    return (
        all(t.dtype == query.dtype and t.stride(-1) == 1 for t in (query, key, value))
        and key.shape[0] == query.shape[0]
        and key.shape[2] == query.shape[2]
    )


def _recording(*tensors) -> bool:
    """Whether autograd records through any of `tensors` (our attention ops have no backward)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _op_takes(query, key, value) -> bool:
    """Whether ltx_kernels.attention takes q/k/v as they are: one dtype, k/v with q's batch and
    heads, contiguous last dims; the CPU (its C twin): float16/bfloat16/float32/float64, any
    head_dim; CUDA: float16/bfloat16, head_dim 64 or 128 (LTX_ATTENTION_HEAD_DIMS), rows at
    16-byte boundaries (storage offset and strides; the storage itself is allocated aligned)."""
    operands = (query, key, value)
    if not _operands_match(*operands):
        return False
    if query.device.type == "cpu":
        return query.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] in LTX_ATTENTION_HEAD_DIMS
        and all(_rows_aligned(t) for t in operands)
    )


def _rows_aligned(t: torch.Tensor) -> bool:
    """t's rows (dims 0-2) start at 16-byte boundaries (the CUDA kernel's rule, rows.h). Under
    torch.compile the strides only: dynamo cannot trace storage_offset(); the processors' q/k/v
    are projections or their head slices, at offsets that are multiples of head_dim, and a view
    that is not aligned gets the op's error naming the operand instead of the fallback."""
    size = t.element_size()
    strides = all(
        n <= 1 or (stride * size) % 16 == 0 for n, stride in zip(t.shape[:3], t.stride()[:3])
    )
    if torch.compiler.is_compiling():
        return strides
    return strides and (t.storage_offset() * size) % 16 == 0


def padded_key_lengths(valid: torch.Tensor) -> tuple[int, ...] | None:
    """The per-batch key lengths of a boolean key mask `valid` [B, Sk] (or [B, 1, 1, Sk]) whose
    valid keys lead every row (padded text after the tokens it pads), as `attend` takes them;
    None where a row's valid keys are not its leading ones, or where the mask cannot be read on
    the host (under
    torch.compile or CUDA-graph capture: the caller then attends with the mask). Reading a CUDA
    mask waits for the GPU; the blocks of a step share one mask tensor, read once (the last
    call's lengths are reused while the mask is the same elements of the same, unmodified storage:
    the same tensor, or the same view of it, as diffusers' processors view the model's mask per
    call, e.g. mask[:, None, None, :]; an inference tensor has no version counter: "unmodified"
    then rests on nothing in diffusers writing it in place)."""
    if torch.compiler.is_compiling() or capturing():
        return None
    where = (
        valid.untyped_storage().data_ptr(),
        valid.dtype,
        valid.storage_offset(),
        valid.shape,
        valid.stride(),
        version_of(valid),
    )
    if _last_lengths and _last_lengths[1] == where:
        return _last_lengths[2]
    rows = valid.flatten(0, -2)
    lengths = rows.sum(1)
    leading = torch.arange(rows.shape[1], device=rows.device) < lengths[:, None]
    result = tuple(lengths.tolist()) if torch.equal(leading, rows) else None
    _last_lengths[:] = [valid, where, result]
    return result


#: [mask, (its storage's address, dtype, storage offset, shape, strides, version), its key
#: lengths] of the last padded_key_lengths call (the mask held: no other storage takes that
#: address; a view shares its version counter with the tensor it views).
_last_lengths: list = []


def lengths_tensor(key_lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`key_lengths` as a [B] tensor on `device`, as the attention ops take them. Eager, the last
    call's tensor is reused for the same lengths and device: a step's blocks pass the same lengths
    and share one host-to-device copy (on CUDA a blocking copy from pageable memory) instead of
    one per call. Under torch.compile or CUDA-graph capture, a new tensor each call. (Its readers
    never write it.)"""
    if torch.compiler.is_compiling() or capturing():
        return torch.tensor(key_lengths, device=device)
    if not _last_lengths_tensor or _last_lengths_tensor[0] != (key_lengths, device):
        _last_lengths_tensor[:] = [(key_lengths, device), torch.tensor(key_lengths, device=device)]
    return _last_lengths_tensor[1]


#: [(key lengths, device), their tensor] of the last lengths_tensor call outside compile/capture.
_last_lengths_tensor: list = []


def runs_ulysses_attention(
    ops, parallel_config, query, key, value, attention_mask, whole_queries=False
) -> bool:
    """Whether an attention call runs `ulysses_attention` (`whole_queries`:
    `ulysses_whole_queries_attention`): Ulysses only (no ring, even splits), no mask, q and k of
    one length (a self-attention; any lengths with whole queries), heads divisible by the degree,
    and no autograd recording (diffusers' Ulysses carries the backward)."""
    cp_config = context_parallel_config(parallel_config)
    return (
        "ulysses_attention" in ops
        and cp_config is not None
        and cp_config.ulysses_degree > 1
        and cp_config.ring_degree == 1
        and not cp_config.ulysses_anything
        and attention_mask is None
        and (whole_queries or query.shape[1] == key.shape[1])
        and query.shape[2] % cp_config.ulysses_degree == 0
        and not _recording(query, key, value)
    )


def _check_ulysses_whole_sequence(cp_config, query, key, value, mask, replicated: int) -> None:
    """Raises unless key lengths / replicated rows can attend under `cp_config` (ulysses_attention:
    the module docstring)."""
    reasons = []
    if mask is not None:
        reasons.append("a mask (pass key lengths only)")
    if cp_config.ring_degree > 1 or cp_config.ulysses_anything or cp_config.ring_anything:
        reasons.append("ring attention or uneven splits (run Ulysses: ulysses_degree only)")
    if query.shape[1] != key.shape[1]:
        reasons.append("queries and keys of different lengths")
    if query.shape[2] % cp_config.ulysses_degree:
        reasons.append(f"{query.shape[2]} heads, not divisible by the Ulysses degree")
    if not 0 <= replicated <= query.shape[1]:
        reasons.append(f"{replicated} replicated rows of {query.shape[1]}")
    if _recording(query, key, value):
        reasons.append("autograd recording (inference only)")
    if reasons:
        raise NotImplementedError(
            "ltx_kernels attend: key lengths / rows whole on every rank under context parallelism "
            f"run under Ulysses only, not with {'; '.join(reasons)}"
        )


def _copy(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out.copy_(x) through 8-byte elements where the layouts of both allow it (what
    Tensor.view(torch.int64) takes: a unit-stride last dim, it and the other strides and the
    storage offset in whole 8-byte elements). torch's copy of permuted views moves one element per
    access (about a third of the copy bandwidth in bf16); the same bytes as 8-byte elements move in
    a quarter of the accesses. (Compiled: Inductor writes its own copy kernel.)"""
    if x.dtype == out.dtype and x.element_size() < 8 and not torch.compiler.is_compiling():
        try:
            out.view(torch.int64).copy_(x.view(torch.int64))
            return out
        except RuntimeError:  # a layout whose elements do not pair up: element by element
            pass
    return out.copy_(x)


def _to_head_ranks(tensors, group, ranks: int) -> torch.Tensor:
    """All-to-all of this rank's chunk of the sequence, every head, to the whole sequence of this
    rank's heads: tensors [B, s, H, D] (any strides with D contiguous) travel in one send buffer
    [N (to rank), s, B, n, h * D] (h = H / N, n tensors); what arrives, [N (from rank), s, B, n,
    h * D], is returned as [B, S, n, h * D] (token = rank * s + t: the original order), a strided
    view of the receive buffer."""
    batch, tokens, heads, head_dim = tensors[0].shape
    width = heads // ranks * head_dim
    send = tensors[0].new_empty(ranks, tokens, batch, len(tensors), width)
    into = send.permute(2, 1, 0, 3, 4).unbind(3)  # each tensor's [B, s, N, h * D] in the buffer
    for x, out in zip(tensors, into):  # [B, s, H, D] -> [B, s, N, h * D]
        _copy(out, x.reshape(batch, tokens, ranks, width))
    return all_to_all(send, group).flatten(0, 1).transpose(0, 1)


def _gather_heads(out: torch.Tensor, rows: torch.Tensor, group) -> torch.Tensor:
    """Writes every rank's heads of rows whole on every rank, rows [B, R, h * D] (this rank's
    heads), into out [B, R, N, h * D] (all-gathered: one collective); returns out."""
    ranks, batch = out.shape[2], out.shape[0]
    gathered = _GatherSequence.apply(rows.contiguous(), 0, group)  # [N * B, R, h * D]
    return _copy(out, gathered.unflatten(0, (ranks, batch)).permute(1, 2, 0, 3))


def ulysses_attention(query, key, value, parallel_config, attend, replicated=0) -> torch.Tensor:
    """Ulysses self-attention: query/key/value [B, s, H, D] (this rank's s tokens of the sequence,
    every head; any strides with D contiguous) -> [B, s, H * D]. `attend(q, k, v)` attends this
    rank's heads over the whole sequence: [B, S, h, D] each -> [B, S, h, D]. With `replicated`
    rows, q/k/v are [B, s + R, H, D] whose last R rows are the same on every rank: they are not
    sent, each rank appends its heads of them to the sequence it received ([B, S + R, h, D]), and
    their output rows, all-gathered over the heads, follow this rank's: [B, s + R, H * D].

    Rank r attends heads [r h, (r + 1) h), h = H / N. q, k and v travel in one all-to-all
    (_to_head_ranks) and are attended where they land, as strided views [B, S, h, D]. The output
    returns as [N, s, B, h * D] and is copied into [B, s, N, h * D] = [B, s, H * D]. The same
    attention as on one GPU, head by head."""
    cp_config = context_parallel_config(parallel_config)
    group = cp_config._ulysses_mesh.get_group()
    ranks = cp_config.ulysses_degree
    batch, rows, heads, head_dim = query.shape
    tokens = rows - replicated  # this rank's chunk
    width = heads // ranks * head_dim  # of one rank's heads

    sent = [x[:, :tokens] if replicated else x for x in (query, key, value)]
    qkv = _to_head_ranks(sent, group, ranks)  # [B, S, 3, h * D]
    if replicated:  # this rank's heads of the whole rows, after the sequence
        head = cp_config._ulysses_mesh.get_local_rank() * width
        whole = [x[:, tokens:].flatten(2)[..., head : head + width] for x in (query, key, value)]
        whole = torch.stack(whole, 2)  # [B, R, 3, h * D]
        qkv = torch.cat([qkv, whole], 1)  # [B, S + R, 3, h * D]
    qkv = qkv.unflatten(3, (heads // ranks, head_dim))
    out = attend(*qkv.unbind(2)).flatten(2)  # [B, S (+ R), h * D]
    sequence = ranks * tokens
    if replicated:
        out, whole = out[:, :sequence], out[:, sequence:]
    out = _copy(
        out.new_empty(ranks, tokens, batch, width),
        out.unflatten(1, (ranks, tokens)).permute(1, 2, 0, 3),
    )
    out = all_to_all(out, group)  # [N, s, B, h * D], back on the tokens' rank
    result = out.new_empty(batch, rows, ranks, width)
    _copy(result[:, :tokens] if replicated else result, out.permute(2, 1, 0, 3))
    if replicated:  # every rank's heads of the whole rows
        _gather_heads(result[:, tokens:], whole, group)
    return result.flatten(2)


def ulysses_whole_queries_attention(query, key, value, parallel_config, attend) -> torch.Tensor:
    """Ulysses attention of queries whole on every rank against keys split over the ranks (LTX-2's
    video-to-audio attention: the audio's queries, the video's keys): query [B, Sq, H, D] (the
    same on every rank), key/value [B, s, H, D] (this rank's chunk) -> [B, Sq, H * D], the whole
    result on every rank. `attend(q, k, v)` attends this rank's heads: q [B, Sq, h, D] against
    k/v [B, S, h, D].

    k and v travel in one all-to-all (_to_head_ranks); the queries are not sent: each rank slices
    its heads of them; the output rows are all-gathered over the heads. (diffusers' Ulysses sends
    the queries too, so every rank attends N copies of them for its heads: the whole attention's
    work on every rank, and four collectives instead of two.)"""
    cp_config = context_parallel_config(parallel_config)
    group = cp_config._ulysses_mesh.get_group()
    ranks = cp_config.ulysses_degree
    batch, rows, heads, head_dim = query.shape
    local = heads // ranks  # heads of this rank
    kv = _to_head_ranks([key, value], group, ranks).unflatten(3, (local, head_dim))
    first = cp_config._ulysses_mesh.get_local_rank() * local
    out = attend(query[:, :, first : first + local], kv[:, :, 0], kv[:, :, 1])  # [B, Sq, h, D]
    result = out.new_empty(batch, rows, ranks, local * head_dim)
    return _gather_heads(result, out.flatten(2), group).flatten(2)
