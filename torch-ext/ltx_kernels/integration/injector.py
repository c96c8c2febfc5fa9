"""The injection core: what can be fused (FUSIONS and its training policy), the attention
choices (ATTENTION_CHOICES and the measured table "auto" reads), the report, the Injector the
family patchers apply their patches through, the base of our attention processors, and the
same-named patched classes. The face (`integration/__init__.py`) runs it over a pipeline.

How a module is patched, and why that way:
- A block gets a subclass of its own class *with the same name* (`__class__` swap) whose forward
  calls the fused ops; `compile_repeated_blocks` matches blocks by class name, so it still finds
  them. Parameters, buffers, state dicts and hooks on submodules are untouched.
- An attention module gets a replacement processor through `set_processor`; it keeps the
  original's attention backend and parallel config.
- Offload, cache and casting hooks (accelerate, diffusers' HookRegistry) replace `forward` on the
  instance with a wrapper of the forward they found. A module carrying such a wrapper is never
  class-swapped: the hook would keep calling the old forward. Blocks then raise (inject before
  offloading); an optional top-level patch (an output norm) is skipped and reported.
- Every fused step checks, when it runs, that the modules whose weights it reads directly carry no
  hook (leaf-level offloading or layerwise casting added after injection); otherwise it calls the
  module as diffusers does. So a step never bypasses a hook.

Linears (linears.py): a patcher names the projections of one input that run as one GEMM
(fuse_projections) and, for fp8=True, the block Linears that run in FP8 per preset (fp8_linears:
the family's default preset, or the one inject_optimized_kernels was given); both are
applied per model once every model of the pipeline is patched (take_pending, finish_model), FP8
first, so that FP8 projections fuse their FP8 weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import pickle
import sys
from collections import Counter, defaultdict

import torch

from .._op_names import FUSED_BACKWARD_OPS, OPS
from . import context_parallel, diffusers_compat, linears
from .module_checks import has_forward_hook, plain_tensor

#: What inject_optimized_kernels can use, each of which can be disabled alone: the fused ops, by op
#: name, "fused_projections" (q/k/v projections of one input as one GEMM, linears.py) and
#: "fused_qkv_mlp" (FLUX's single block with fp8=True: q/k/v and the MLP up-projection as one FP8
#: GEMM; without it, and in bf16, its q/k/v are fused_projections' group), and "recompute_norms"
#: (eager training: a norm's or a single LoRA projection's output that lora_linear or
#: qk_rmsnorm_rope saves for backward is recomputed there instead, recompute.py; without it, saved
#: as autograd saves it), and "ulysses_attention" (self-attention under diffusers' Ulysses context
#: parallelism: q/k/v in one all-to-all, attended where they land, the output in one more;
#: LTX-2's video-to-audio attention, its audio queries whole on every rank: k/v in one all-to-all,
#: each rank's heads of the queries, the output gathered over the heads; attention.py; without
#: it, diffusers' Ulysses attention), and "drop_padded_keys" (attention over
#: padded text, HunyuanVideo's: the padded keys dropped where every batch element has as many,
#: attention.py; without it, a broadcast key mask, what stock's mask computes bit for bit).
FUSIONS = (
    *OPS,
    "fused_projections",
    "fused_qkv_mlp",
    "recompute_norms",
    "ulysses_attention",
    "drop_padded_keys",
)
#: Ops whose fused forward + backward is faster than eager autograd of the diffusers code: a fused
#: step uses them while autograd records through it (training). These are the ops with a fused
#: backward (_op_names.FUSED_BACKWARD_OPS), and lora_linear (peft's LoRA Linear as one autograd
#: node: one C++ call forward and one backward, its GEMMs fused across q/k/v, where peft records
#: five nodes per projection). linear_gelu's backward (cuBLAS GEMMs and a GELU derivative from the
#: recomputed pre-activation) is not faster than eager autograd, so a training step runs the
#: diffusers code in its place: stock gradients at stock speed. Forward passes without gradients
#: (inference, validation sampling) use every enabled op.
FUSED_BACKWARD: frozenset[str] = frozenset({*FUSED_BACKWARD_OPS, "lora_linear", "recompute_norms"})
#: The same under torch.compile: the ops whose fused forward + backward is also faster than what
#: Inductor generates from the diffusers code (benchmark_ops.py --backward, H100: qk_rmsnorm_rope
#: 1.0-1.27x; not yet the norm ops, 0.5-0.9x, nor rope, 0.95-1.03x), and lora_linear, whose fused
#: q/k/v GEMMs Inductor does not form.
FUSED_BACKWARD_COMPILED: frozenset[str] = frozenset(
    {"gelu", "geglu", "qk_rmsnorm_rope", "lora_linear"}
)
DISABLE_ENV = "LTX_KERNELS_DISABLE"

#: inject_optimized_kernels' `attention=`: what the fused processors attend with (attention.py).
#: "diffusers": diffusers' attention backend of each processor, as stock attends; "ltx_kernels": our
#: attention op wherever it applies (no mask, autograd not recording, CUDA: float16/bfloat16 and
#: head_dim 64 or 128), diffusers' backend elsewhere; "auto": as "ltx_kernels" only where
#: LTX_ATTENTION_FASTER lists the GPU and head_dim and the call has as many tokens, as "diffusers"
#: elsewhere; "int8" (opt-in, a numerics change): 8-bit attention (q, k, v quantized by our ops,
#: attention_int8) wherever it applies (no mask, autograd not recording, CUDA: Hopper,
#: float16/bfloat16, head_dim 64 or 128) and LTX_INT8_ATTENTION_FASTER says it measured faster
#: (the CPU's C twins: every call), as "auto" elsewhere.
ATTENTION_CHOICES = ("auto", "ltx_kernels", "diffusers", "int8")
#: The head dims the CUDA attention kernel takes (ltx_attention_cuda_takes_head_dim).
LTX_ATTENTION_HEAD_DIMS = (64, 128)
#: Where attention="auto" attends with our op: CUDA compute capability -> ((head_dim, tokens), ...):
#: at that head_dim, calls of at least `tokens` queries and keys, where ltx_kernels.attention
#: measured faster than cuDNN's SDPA, the default backend (benchmarks/benchmark_attention.py on
#: H100 80GB HBM3s and an H200). head_dim 128: 1.03x at 1x24x4608 (FLUX.1, since the last round's
#: work tiles split along their keys, 2026-11-28; the FLUX.1-dev step 132.8 -> 130.9 ms), 0.98-1.08x
#: at 2x32x6144 (LTX-2; cuDNN's own rate moves 7-9% between machines there), 1.19-1.20x at
#: 1x40x32760 (Wan 2.1 14B) and 1x16x49290 (HunyuanVideo-1.5). head_dim 64: 1.01-1.08x at 2x32x8064
#: (LTX-Video 2B, 161 frames; 0.95x on one H100 of six runs before) and the LTX-Video 2B step there
#: 164.6 -> 160.3 ms, 1.06-1.16x at 2x32x2688 but the step there unchanged (43.1 / 43.2 ms): listed
#: from 8064. The H200 shares sm_90's entry.
LTX_ATTENTION_FASTER: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (9, 0): ((64, 8064), (128, 4608))
}
#: Where attention="int8" attends in 8 bits on CUDA: compute capability -> ((head_dim, tokens),
#: ...): at that head_dim, calls of at least `tokens` queries and keys, where int8_attention (k and
#: v quantized by our ops, q by the q/k norm pass) measured faster than our bf16 op
#: (benchmark_attention.py's "ours int8+kv quant" against "ours wgmma", one H100 80GB HBM3,
#: 2026-11-28): head_dim 64 0.80x at 2x32x2688, 1.07x at 2x32x8064; head_dim 128 0.93x at
#: 1x24x4608, 1.08x at 2x32x6144, 1.19-1.21x at 1x40x32760 and 1x16x49290. Shorter calls (cross-
#: attention over text, audio streams) attend as "auto": in 8 bits they slowed whole steps (LTX-2
#: 2x6144 + audio 733.6 -> 739.0 ms, FLUX.1-dev 131.6 -> 133.8 ms). A compute capability or
#: head_dim not listed: never in 8 bits; the CPU (the C twins): every call.
LTX_INT8_ATTENTION_FASTER: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {
    (9, 0): ((64, 8064), (128, 6144))
}
#: The report's kind for the attention modules whose calls attend with diffusers' backend although
#: attention="ltx_kernels".
LTX_ATTENTION = "attention (ltx_kernels.attention)"
#: The report's kind for the attention modules that do not attend in 8 bits although
#: attention="int8" (head_dim or GPU the kernel does not take, attention_bf16_blocks).
INT8_ATTENTION = "attention (8-bit)"

# Attribute names stored on patched modules.
_ORIGINAL_CLASS = "_ltx_kernels_original_class"
# On a patched class: the patch forward it was made for (its `forward` may be that decorated:
# diffusers_compat.with_lora_scale).
_PATCH_FORWARD = "_ltx_kernels_patch_forward"
_OPS = "_ltx_kernels_ops"
_ORIGINAL_PROCESSOR = "_ltx_kernels_original_processor"
# On a model injected after enable_parallelism / enable_cfg_parallel (beneath their hooks): the
# plan entry of diffusers' split hook (None without one).
_UNPATCHED_SPLIT_PLAN = "_ltx_kernels_unpatched_split_plan"
# What diffusers sets on every attention processor that has it (set_attention_backend,
# enable_parallelism): carried over both ways when a processor is replaced or restored.
_PROCESSOR_SETTINGS = ("_attention_backend", "_parallel_config")


#: The report's kind for the Linears that run in FP8 (fp8=True).
FP8_LINEAR = "Linear (FP8 GEMM)"


@dataclasses.dataclass
class InjectionReport:
    """What inject_optimized_kernels did: per kind of module, how many were patched; every module
    or step left on the diffusers code, with the reason; the ops in use."""

    ops: tuple[str, ...]
    fp8: bool = False
    attention: str = "auto"  # inject_optimized_kernels' attention= (ATTENTION_CHOICES)
    # family -> the FP8 preset its blocks ran (linears.FP8_PRESETS), with fp8=True
    fp8_presets: dict = dataclasses.field(default_factory=dict)
    patched: Counter = dataclasses.field(default_factory=Counter)
    skipped: dict = dataclasses.field(default_factory=lambda: defaultdict(list))

    @property
    def total_patched(self) -> int:
        return sum(self.patched.values())

    def __str__(self) -> str:
        fp8 = ""
        if self.fp8:  # fp8=True on a model without an FP8 path (LTX-2, SD3, HunyuanVideo) says so
            count = self.patched.get(FP8_LINEAR, 0)
            presets = ", ".join(f"{f} {p}" for f, p in self.fp8_presets.items())
            fp8 = (
                f"; FP8 GEMMs in {count} Linears ({presets})"
                if count
                else "; fp8=True: none of its Linears runs in FP8 (bf16)"
            )
        lines = [
            f"ltx_kernels: {self.total_patched} modules patched; ops: {', '.join(self.ops) or 'none'}"
            + fp8
        ]
        disabled = [name for name in FUSIONS if name not in self.ops]
        if disabled:
            lines.append(f"  disabled: {', '.join(disabled)}")
        lines.append(f"  attention: {self.attention} ({_attention_note(self.attention)})")
        width = max((len(kind) for kind in self.patched), default=0)
        for kind, count in sorted(self.patched.items()):
            lines.append(f"  {kind:<{width}}  {count:4d} patched")
        for kind, entries in sorted(self.skipped.items()):
            reasons = Counter(reason for _, reason in entries)
            for reason, count in reasons.items():
                first = next(name for name, r in entries if r == reason)
                more = f" (and {count - 1} more)" if count > 1 else ""
                lines.append(f"  skipped {kind}: {first or '<root>'}{more}: {reason}")
        if not self.patched and not self.skipped:
            lines.append("  no supported diffusers blocks found")
        return "\n".join(lines)


def _measured(table: dict[tuple[int, int], tuple[tuple[int, int], ...]]) -> str:
    """A table of LTX_ATTENTION_FASTER's form, for the report."""
    return "; ".join(
        f"sm_{major}{minor} head_dim {head_dim} from {tokens} tokens"
        for (major, minor), entries in sorted(table.items())
        for head_dim, tokens in entries
    )


def _attention_note(choice: str) -> str:
    """What attention=`choice` attends with, for the report."""
    head_dims = " or ".join(map(str, LTX_ATTENTION_HEAD_DIMS))
    if choice == "ltx_kernels":
        return (
            "ltx_kernels.attention for calls without a mask (key lengths passed to it) and "
            f"without autograd recording, on CUDA in float16/bfloat16 at head_dim {head_dims}; "
            "diffusers' attention backend for the others"
        )
    if choice == "diffusers":
        return "diffusers' attention backend of each processor"
    if choice == "int8":
        faster = _measured(LTX_INT8_ATTENTION_FASTER)
        return (
            "8-bit attention (q, k, v quantized by ltx_kernels, attention_int8: INT8 q.k, FP8 "
            "p.v; a numerics change) for calls without a mask and without autograd recording, on "
            f"a Hopper GPU in float16/bfloat16 where measured faster: {faster or 'nowhere'} "
            "(injector.LTX_INT8_ATTENTION_FASTER; the CPU's C twins: every call); as "
            f"attention='auto' for the others ({_attention_note('auto')})"
        )
    measured = _measured(LTX_ATTENTION_FASTER)
    return (
        f"ltx_kernels.attention where measured faster: {measured or 'nowhere yet'} "
        "(injector.LTX_ATTENTION_FASTER); diffusers' attention backend elsewhere"
    )


def report_quantized_weights(model: torch.nn.Module, prefix: str, report) -> None:
    """Reports the modules of a patched model whose weight or bias is a tensor subclass."""
    for name, module in model.named_modules():
        for attr in ("weight", "bias"):
            t = getattr(module, attr, None)
            if isinstance(t, torch.Tensor) and not plain_tensor(t):
                report.skipped["quantized weights"].append(
                    (
                        ".".join(p for p in (prefix, name) if p),
                        f"{attr} is a {type(t).__name__}: fused steps that read it (norm "
                        "weights, the GELU projection of linear_gelu) run the diffusers code",
                    )
                )
                break


class FusedAttnProcessor:
    """Base of our replacement attention processors. Injector.set_processor gives each one the
    enabled ops, the attention choice and the replaced processor's attention backend and parallel
    config."""

    _attention_backend = None
    _parallel_config = None
    ops: frozenset = frozenset()
    attention: str = "auto"  # inject_optimized_kernels' attention= (ATTENTION_CHOICES)


#: The projections diffusers' fuse_qkv_projections replaces with one to_qkv / to_added_qkv Linear.
_DIFFUSERS_FUSED = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


def _fused_by_diffusers(block: torch.nn.Module, path: str) -> bool:
    """Whether `block`'s Linear at `path` is a q/k/v projection of an attention that diffusers'
    fuse_qkv_projections fused (attn.fused_projections): its fused Linear runs instead."""
    parent, _, leaf = path.rpartition(".")
    owner = block.get_submodule(parent) if parent else block
    return leaf in _DIFFUSERS_FUSED and bool(getattr(owner, "fused_projections", False))


class Injector:
    """Handed to the per-model patch functions: applies and records patches."""

    def __init__(
        self,
        ops: frozenset[str],
        report: InjectionReport,
        fp8: bool = False,
        fp8_preset: str | None = None,
        attention: str = "auto",
        keep_bf16_weights: bool = False,
        fp8_device=None,
    ):
        self.ops = ops
        self.report = report
        self.attention = attention
        self.fp8 = fp8
        self.fp8_preset = fp8_preset  # None: each family's default
        self.keep_bf16_weights = keep_bf16_weights  # (linears.to_fp8)
        self.fp8_device = fp8_device  # where FP8 weights are quantized and kept (None: in place)
        # (block name, [(Linear name, its parent, its name there)]), in model order
        self._fp8_blocks: list = []
        self._projection_groups: list = []  # (owner name, owner, key, member names, fusion)

    def fp8_linears(
        self, name: str, block: torch.nn.Module, family: str, presets: dict, default: str
    ) -> None:
        """Names the Linears of `block` that run in FP8 with fp8=True: those of the preset chosen
        (the injection's, else the family's `default`) in `presets` (linears.fp8_presets)."""
        if self.fp8:
            preset = self.fp8_preset or default
            self.report.fp8_presets[family] = preset
            linears = []
            for path in presets[preset]:  # (in the preset's order: the report's too)
                if _fused_by_diffusers(block, path):
                    self.skip(
                        FP8_LINEAR,
                        f"{name}.{path}",
                        "diffusers' fuse_qkv_projections fused it into to_qkv (bf16): call it "
                        "after remove_optimized_kernels, or not at all (the kernels fuse q/k/v "
                        "themselves)",
                    )
                else:
                    parent, _, attr = path.rpartition(".")
                    linears.append((f"{name}.{path}", block.get_submodule(parent), attr))
            self._fp8_blocks.append((name, linears))

    def fuse_projections(
        self,
        name: str,
        owner: torch.nn.Module,
        key: str,
        names,
        fusion: str = "fused_projections",
        fp8_only: bool = False,
    ) -> None:
        """Names projections of one input (owner's modules `names`) that run as one GEMM when
        `fusion` (a name in FUSIONS) is enabled (fp8_only: and the injection is fp8=True). A
        module joins the first group named that fuses it: name a larger group before the smaller
        one it replaces."""
        if fp8_only and not self.fp8:
            return
        self._projection_groups.append((name, owner, key, tuple(names), fusion))

    def take_pending(self) -> tuple[list, list]:
        """What the patchers named since the last call (one model's FP8 Linears and projection
        groups), applied by finish_model once every model of the pipeline is patched: a model
        that fails to patch then leaves the others' weights as they were."""
        pending = (self._fp8_blocks, self._projection_groups)
        self._fp8_blocks, self._projection_groups = [], []
        return pending

    def finish_model(self, pending: tuple[list, list], fp8_bf16_blocks: int) -> None:
        """Applies what the patchers named for one model (`pending`, from take_pending): the FP8
        Linears (all but those of the first and last fp8_bf16_blocks blocks), then the fused
        projections."""
        blocks, groups = pending
        for index, (block_name, block_linears) in enumerate(blocks):
            kept = index < fp8_bf16_blocks or index >= len(blocks) - fp8_bf16_blocks
            for name, parent, attr in block_linears:
                reason = (
                    "kept bf16 (fp8_bf16_blocks)"
                    if kept
                    else linears.fp8_linear_reason(parent._modules[attr])
                )
                if reason:
                    self.skip(FP8_LINEAR, name, reason)
                else:
                    linears.to_fp8(parent, attr, self.keep_bf16_weights, self.fp8_device)
                    self.report.patched[FP8_LINEAR] += 1
        grouped = set()  # ids of the modules fused so far
        for name, owner, key, names, fusion in groups:
            members = {id(owner.get_submodule(n)) for n in names}
            if fusion not in self.ops or members & grouped:
                continue  # (members in a group named before: that group replaces this one)
            if linears.fuse(owner, key, names):
                grouped |= members
                self.report.patched[f"fused projections ({'/'.join(names)})"] += 1
            else:
                self.skip(
                    "fused projections",
                    name,
                    "the projections differ in kind (FP8 or not, adapters), size or bias",
                )

    def keep_attention_bf16(self, prefix: str, model: torch.nn.Module, count: int) -> None:
        """attention_bf16_blocks: our attention processors in the first and last `count` blocks
        of `model` attend as "auto" instead of "int8". The blocks counted are the modules of its
        block lists (ModuleLists, the outermost where they nest) that hold our processors, in
        module order: not those holding none (HunyuanVideo's token refiner blocks, stock)."""
        if not count:
            return
        blocks = []  # (block name, [(module name, our processor)])
        for list_name, block_list in model.named_modules():
            if not isinstance(block_list, torch.nn.ModuleList) or any(
                list_name.startswith(f"{block_name}.") for block_name, _ in blocks
            ):
                continue
            for index, block in enumerate(block_list):
                ours = [
                    (name, module.processor)
                    for name, module in block.named_modules()
                    if isinstance(getattr(module, "processor", None), FusedAttnProcessor)
                ]
                if ours:
                    blocks.append((".".join(p for p in (list_name, str(index)) if p), ours))
        for index, (block_name, ours) in enumerate(blocks):
            if count <= index < len(blocks) - count:
                continue
            for name, processor in ours:
                if processor.attention == "int8":
                    processor.attention = "auto"
                    path = ".".join(p for p in (prefix, block_name, name) if p)
                    self.skip(INT8_ATTENTION, path, "kept bf16 (attention_bf16_blocks)")

    def swap_forward(
        self,
        name: str,
        module: torch.nn.Module,
        forward,
        kind: str,
        required: bool = True,
        replan=None,
    ) -> bool:
        """Gives `module` a same-named subclass of its class whose forward is `forward`.
        required=False: a hooked module is skipped (reported) instead of raising. `replan`: for a
        model, how the subclass's context-parallel plan (`_cp_plan`) differs from its class's (a
        plan -> plan function); after enable_parallelism / enable_cfg_parallel, their hooks on the
        model are lifted and put back on the new forward, diffusers' split hook with that plan."""
        if replan is None:
            return self._swap_forward(name, module, forward, kind, required)
        with context_parallel.beneath_parallel_hooks(module, replan) as (lifted, unpatched_plan):
            if not self._swap_forward(name, module, forward, kind, required):
                return False
            patched_class = type(module)
            patched_class._cp_plan = replan(getattr(patched_class, "_cp_plan", None))
            if lifted:  # for remove_optimized_kernels
                module.__dict__[_UNPATCHED_SPLIT_PLAN] = unpatched_plan
            return True

    def _swap_forward(self, name, module, forward, kind, required) -> bool:
        if has_forward_hook(module):
            if context_parallel.has_parallel_split_hook(module):
                reason = (
                    "its forward is wrapped by diffusers' context-parallel hook (the model's "
                    "_cp_plan splits or gathers there, e.g. Wan's blocks.0)"
                )
                advice = (
                    "Call inject_optimized_kernels before enable_parallelism / "
                    "enable_cfg_parallel for this model."
                )
            else:
                reason = (
                    "its forward is wrapped by a hook (offloading, caching or layerwise casting "
                    "applied before inject_optimized_kernels)"
                )
                advice = (
                    "Call inject_optimized_kernels before enable_model_cpu_offload / "
                    "enable_group_offload / enable_layerwise_casting / enable_cache, or remove "
                    "those hooks first (pipe.remove_all_hooks(), model.disable_cache())."
                )
            if required:
                raise RuntimeError(
                    f"inject_optimized_kernels: cannot patch {name or '<root>'} "
                    f"({type(module).__name__}): {reason}, which would keep calling the unpatched "
                    f"forward. {advice}"
                )
            self.report.skipped[kind].append((name, reason + "; inject before adding hooks"))
            return False
        if "forward" in vars(module):  # a stale bound forward would bypass the patched class
            del module.forward
        module.__class__ = _patched_class(type(module), forward)
        setattr(module, _OPS, self.ops)
        self.report.patched[kind] += 1
        return True

    def has_stock_processor(
        self,
        name: str,
        attn: torch.nn.Module,
        stock: str,
        kind: str,
        custom_sources: str,
        is_stock=None,
    ) -> bool:
        """True when `attn` runs diffusers' processor class named `stock` (and is_stock(processor),
        when given); otherwise its custom processor is kept, and the skip is reported with what
        usually installs one (`custom_sources`)."""
        processor = attn.processor
        if type(processor).__name__ == stock and (is_stock is None or is_stock(processor)):
            return True
        self.skip(
            kind, name, f"custom processor {type(processor).__name__} kept ({custom_sources})"
        )
        return False

    def set_processor(self, name: str, attn: torch.nn.Module, processor, kind: str) -> None:
        """Installs `processor` on attention module `attn`, keeping the backend settings; with
        attention="ltx_kernels" or "int8", reports an attention whose head_dim the CUDA kernels do
        not take (its weights on a GPU or the meta device; the CPU's C twins take any), and with
        "int8" one on a GPU that is not a Hopper."""
        original = attn.processor
        for setting in _PROCESSOR_SETTINGS:
            if hasattr(original, setting):
                setattr(processor, setting, getattr(original, setting))
        processor.ops = self.ops
        processor.attention = self.attention
        if self.attention in ("ltx_kernels", "int8"):
            kind = INT8_ATTENTION if self.attention == "int8" else LTX_ATTENTION
            fallback = (
                "attends as attention='auto'"
                if kind == INT8_ATTENTION
                else ("diffusers' attention backend attends")
            )
            head_dim = attn.inner_dim // attn.heads
            on_cpu = all(p.device.type == "cpu" for p in attn.parameters())
            gpus = {p.device for p in attn.parameters() if p.is_cuda}
            if not on_cpu and head_dim not in LTX_ATTENTION_HEAD_DIMS:
                self.skip(
                    kind,
                    name,
                    f"head_dim {head_dim}: the CUDA kernel takes "
                    f"{' or '.join(map(str, LTX_ATTENTION_HEAD_DIMS))}; {fallback}",
                )
            elif kind == INT8_ATTENTION and any(
                torch.cuda.get_device_capability(gpu) != (9, 0) for gpu in gpus
            ):
                self.skip(kind, name, f"not a Hopper GPU (the 8-bit kernel's); {fallback}")
        setattr(attn, _ORIGINAL_PROCESSOR, original)
        attn.set_processor(processor)
        self.report.patched[kind] += 1

    def skip(self, kind: str, name: str, reason: str) -> None:
        self.report.skipped[kind].append((name, reason))


_PATCHED_CLASSES: dict = {}


def _patched_class(cls: type, forward) -> type:
    """The same-named subclass of `cls` whose forward is `forward` (with diffusers' LoRA scaling
    where lora_scaled marked it: diffusers_compat.with_lora_scale), one per (cls, forward). Only
    injection makes its instances: calling it (`type(model).from_config(...)`,
    `from_pretrained`, `type(block)(...)`) builds a stock `cls`, which injection can then patch;
    pickle and copy.deepcopy, which find a class by its module and name (the original's), rebuild
    a patched instance through _unpickle_patched."""
    key = (cls, forward)
    if key not in _PATCHED_CLASSES:
        subclass = type(
            cls.__name__,
            (cls,),
            {
                "forward": diffusers_compat.with_lora_scale(forward),
                _PATCH_FORWARD: forward,
                _ORIGINAL_CLASS: cls,
                "__new__": _construct_original,
                "__reduce_ex__": _reduce_patched,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": f"{cls.__name__} running on ltx_kernels fused ops (`{forward.__module__}`).",
            },
        )
        _share_block_metadata(cls, subclass)
        _PATCHED_CLASSES[key] = subclass
    return _PATCHED_CLASSES[key]


def _construct_original(cls, *args, **kwargs):
    """A patched class called as a constructor: the original class's instance (not one of cls, so
    Python runs no __init__ of cls on it)."""
    return getattr(cls, _ORIGINAL_CLASS)(*args, **kwargs)


def _reduce_patched(self, protocol):
    """Pickling and copying a patched module: its original class, where its forward is (the
    module and the name of the module attribute holding it: a patch forward may be a wrapper,
    which pickle cannot find by its own name), and its state."""
    cls = type(self)
    forward = getattr(cls, _PATCH_FORWARD)
    module = sys.modules[forward.__module__]
    name = next((k for k, v in vars(module).items() if v is forward), None)
    if name is None:
        raise pickle.PicklingError(
            f"ltx_kernels: cannot pickle the injected {cls.__name__}: its forward is not an "
            f"attribute of {module.__name__}; remove_optimized_kernels first"
        )
    original = getattr(cls, _ORIGINAL_CLASS)
    return _unpickle_patched, (original, module.__name__, name), self.__getstate__()


def _unpickle_patched(original: type, module_name: str, name: str) -> torch.nn.Module:
    """An empty instance of original's patched class whose forward is `name` of module
    `module_name` (its state set after)."""
    forward = getattr(importlib.import_module(module_name), name)
    return object.__new__(_patched_class(original, forward))


def _share_block_metadata(cls: type, subclass: type) -> None:
    """diffusers' block caches (FirstBlockCache, MagCache) and layer skipping look a block up by its
    class in TransformerBlockRegistry: the patched subclass gets a copy of its class's entry, which
    still finds arguments by the class's forward signature (the patched forward takes the same)."""
    try:
        from diffusers.hooks._helpers import TransformerBlockRegistry
    except ImportError:  # a diffusers without the registry: nothing looks blocks up
        return
    try:
        metadata = TransformerBlockRegistry.get(cls)
    except ValueError:  # not a block diffusers' caches know
        return
    copy = dataclasses.replace(metadata)
    TransformerBlockRegistry.register(subclass, copy)
    copy._cls = cls


def resolve_ops(ops) -> frozenset[str]:
    """The enabled names: `ops` (default all of FUSIONS) minus those in LTX_KERNELS_DISABLE."""
    chosen = FUSIONS if ops is None else tuple(ops)
    disabled = tuple(s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip())
    for source, names in (("ops", chosen), (DISABLE_ENV, disabled)):
        unknown = sorted(set(names) - set(FUSIONS))
        if unknown:
            raise ValueError(
                f"inject_optimized_kernels: unknown op(s) {unknown} in {source}; "
                f"valid names: {', '.join(FUSIONS)}"
            )
    return frozenset(chosen) - frozenset(disabled)


def _restore_class(module: torch.nn.Module, original_class: type) -> None:
    """Gives a patched module its class back (a model injected after enable_parallelism /
    enable_cfg_parallel: beneath their hooks, diffusers' split hook with diffusers' plan back)."""
    beneath_hooks = _UNPATCHED_SPLIT_PLAN in vars(module)
    unpatched_plan = module.__dict__.pop(_UNPATCHED_SPLIT_PLAN, None)
    with (
        context_parallel.beneath_parallel_hooks(module, lambda _: {"": unpatched_plan})
        if beneath_hooks
        else contextlib.nullcontext()
    ):
        if "forward" in vars(module):  # stale bound patched forward left by a removed hook
            del module.forward
        module.__class__ = original_class
    del module.__dict__[_OPS]


def is_injected(module: torch.nn.Module) -> bool:
    """Whether `module` carries a patch (a patched class or a replaced processor)."""
    return hasattr(module, _ORIGINAL_CLASS) or hasattr(module, _ORIGINAL_PROCESSOR)


def check_restorable(name: str, module: torch.nn.Module) -> None:
    """Raises when a patched module got a forward hook after injection (the hook holds the
    patched forward), but parallelism's hooks on a model injected after enable_parallelism /
    enable_cfg_parallel."""
    if (
        hasattr(type(module), _ORIGINAL_CLASS)
        and has_forward_hook(module)
        and not (
            _UNPATCHED_SPLIT_PLAN in vars(module)
            and context_parallel.has_only_parallel_hooks(module)
        )
    ):
        raise RuntimeError(
            f"remove_optimized_kernels: {name or '<root>'} ({type(module).__name__}) got a "
            "forward hook after injection, which holds the patched forward; remove the hooks "
            "first (pipe.remove_all_hooks(), model.disable_cache(), ...); under context "
            "parallelism, inject after enable_parallelism to be able to restore the model"
        )


def restore_all(models) -> int:
    """Undoes the patches on every module of `models` ((name, model) pairs), each owner of fused
    projections before its members (module order); returns how many it restored."""
    return sum(restore(module) for _, model in models for module in model.modules())


def restore(module: torch.nn.Module) -> int:
    """Undoes the patches on `module` (its fused projections, FP8 weights, class, processor);
    returns how many it restored. Call it on an owner of fused projections before its members."""
    linears.unfuse_all(module)
    if isinstance(module, linears.Fp8Linear):
        linears.restore_from_fp8(module)
        return 1
    restored = 0
    original_class = getattr(type(module), _ORIGINAL_CLASS, None)
    if original_class is not None:
        _restore_class(module, original_class)
        restored += 1
    original_processor = module.__dict__.pop(_ORIGINAL_PROCESSOR, None)
    if original_processor is not None:
        for setting in _PROCESSOR_SETTINGS:  # set on ours since (set_attention_backend, ...)
            if hasattr(original_processor, setting):
                setattr(original_processor, setting, getattr(module.processor, setting))
        module.set_processor(original_processor)
        restored += 1
    return restored
