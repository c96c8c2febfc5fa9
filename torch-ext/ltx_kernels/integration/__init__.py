"""diffusers integration: `inject_optimized_kernels(pipe)` rewires the transformer blocks of
LTX-Video, LTX-2, FLUX.1, Wan 2.x, SD3/SD3.5 and HunyuanVideo/HunyuanVideo-1.5 onto the fused ops,
`remove_optimized_kernels` undoes it.

The package, by floor (a module imports from the floors below it; steps.py, linears.py and
recompute.py still take the op wrappers and the library loader from the package face above):
- face: this file, the public functions and FAMILIES;
- families: one file per model family (ltx, ltx2, flux, wan, sd3, hunyuan) and adaln.py (the
  AdaLN modules they share), each a table PATCHERS of class name -> patch function;
- shared steps: steps.py (one "ours or diffusers'" decision per fused step), attention.py (the
  attention seam; attention_backend.py registers our attention as diffusers attention backends
  for stock models: register_attention_backends), context_parallel.py, recompute.py, linears.py (fused and FP8 projections);
- core: injector.py (FUSIONS, the report, the Injector the patchers apply patches through, the
  patched classes), diffusers_compat.py (the diffusers helpers the families share, and the version guard each
  family declares as REPRODUCED), module_checks.py.

Which ops are used: `ops=` (default: all of FUSIONS, which is ltx_kernels.OPS and the fusions
injector.py lists) minus the comma-separated names in the environment variable
LTX_KERNELS_DISABLE. A disabled op falls back to the diffusers code for that step only, so kernels
can be taken out one at a time when hunting a numerical difference.
"""

from __future__ import annotations

import warnings

import torch

from .._op_names import OPS
from . import adaln, flux, hunyuan, ltx, ltx2, sd3, wan
from .attention_backend import ATTENTION_BACKENDS, register_attention_backends
from .cfg_parallel import enable_cfg_parallel
from .context_parallel import injected_plan
from .linears import FP8_PRESETS, Fp8Linear, bf16_weight_freed
from .injector import (
    ATTENTION_CHOICES,
    DISABLE_ENV,
    FUSED_BACKWARD,
    FUSED_BACKWARD_COMPILED,
    FUSIONS,
    InjectionReport,
    Injector,
    check_restorable,
    is_injected,
    report_quantized_weights,
    resolve_ops,
    restore_all,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_CHOICES",
    "DISABLE_ENV",
    "FAMILIES",
    "FP8_PRESETS",
    "FUSED_BACKWARD",
    "FUSED_BACKWARD_COMPILED",
    "FUSIONS",
    "InjectionReport",
    "enable_cfg_parallel",
    "inject_optimized_kernels",
    "injected_plan",
    "register_attention_backends",
    "register_inductor_fallbacks",
    "remove_optimized_kernels",
]

#: The modules whose PATCHERS inject_optimized_kernels applies: the AdaLN modules and every family.
FAMILIES = (adaln, ltx, ltx2, flux, wan, sd3, hunyuan)
#: Class name -> patch function(name, module, injector), over FAMILIES.
_PATCHERS = {name: patch for family in FAMILIES for name, patch in family.PATCHERS.items()}


def register_inductor_fallbacks() -> None:
    """Registers Inductor's fallback lowering of every ltx_kernels op up front.

    Inductor (torch 2.11) creates the fallback of a custom op when it first meets the op in a graph,
    and formats the op's argument IR for a log message even with logging off. The IR of an argument
    prints its producers recursively, so for an op first met deep in a large graph (the output norm
    after 28 fused blocks) the string grows exponentially and compilation never ends. Registering
    the fallbacks beforehand, with the layout constraint Inductor would pick, skips that path."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    from .._op_namespace import ops as library  # torch.ops.ltx_kernels, or a Hub build's namespace

    for name in OPS:
        packet = getattr(library, name)
        for overload_name in packet.overloads():
            op = getattr(packet, overload_name)
            if op not in lowerings:
                tag = get_layout_constraint_tag(op, with_default=True)
                make_fallback(op, layout_constraint=tag_to_layout_constraint(tag))


def _models(target) -> list[tuple[str, torch.nn.Module]]:
    """The torch modules of a pipeline (its components, each once: a model under two names, as
    Wan 2.2's transformer and transformer_2 can be, under the first) or the module itself."""
    if isinstance(target, torch.nn.Module):
        return [("", target)]
    components = getattr(target, "components", None)
    if not isinstance(components, dict):
        raise TypeError(
            "inject_optimized_kernels expects a diffusers pipeline or a torch.nn.Module "
            f"(a transformer or one of its blocks), got {type(target).__name__}"
        )
    models = {}
    for key, value in components.items():
        if isinstance(value, torch.nn.Module):
            models.setdefault(id(value), (key, value))
    return list(models.values())


def inject_optimized_kernels(
    pipe_or_model,
    ops=None,
    verbose: bool = True,
    *,
    fp8: bool = False,
    fp8_linears: str | None = None,
    fp8_bf16_blocks: int = 0,
    attention: str = "auto",
    attention_bf16_blocks: int = 0,
    keep_bf16_weights: bool = False,
    fp8_device: torch.device | str | None = None,
) -> InjectionReport:
    """Patches every supported block of a diffusers pipeline or model (LTX-Video, FLUX.1, Wan 2.x,
    SD3/SD3.5, HunyuanVideo/HunyuanVideo-1.5 transformers, or a bare block) to run on the fused
    ops, in place.

    ops: names from FUSIONS to use (default all); LTX_KERNELS_DISABLE=a,b removes names.
    fp8: opt-in FP8 inference (bf16 models, GPUs with FP8 tensor cores, or the CPU): the block
    Linears the model's patcher names (attention projections but the text-side K/V, the FF) get
    float8_e4m3fn weights with per-output-channel scales, and the ops before them emit their
    activations as e4m3 with one scale per row (linears.py, README "FP8"); embedders,
    modulation, proj_in/proj_out, norms and attention stay bf16. fp8_linears: which block Linears
    (linears.FP8_PRESETS: "ffn", "ffn+self_attn", "all"; None: each family's default, its
    FP8_DEFAULT). fp8_bf16_blocks=N keeps the first and last N blocks of each model in bf16.
    attention: what the patched attention processors attend with (ATTENTION_CHOICES):
    "ltx_kernels" our attention op wherever it applies (no mask, no autograd recording; CUDA:
    float16/bfloat16, head_dim 64 or 128), "diffusers" each processor's diffusers attention
    backend, as stock; "auto" (default) our op only where injector.LTX_ATTENTION_FASTER says it
    measured faster (Hopper: head_dim 128 from 4608 queries and keys, head_dim 64 from 8064),
    "diffusers" elsewhere; "int8" (opt-in, a numerics change)
    8-bit attention wherever it applies (no mask, no autograd recording; CUDA: Hopper,
    float16/bfloat16, head_dim 64 or 128; q, k, v quantized by our ops, attention_int8) and
    injector.LTX_INT8_ATTENTION_FASTER says it measured faster (Hopper: head_dim 64 from 8064
    queries and keys, head_dim 128 from 6144; the CPU's C twins: every call), "auto" elsewhere
    (attention.py). attention_bf16_blocks=N (with "int8") keeps the attention of the
    first and last N blocks of each model out of 8 bits (as "auto").
    The FP8 weights are quantized one Linear at a time and each bf16 original is freed after
    (the state dict then refuses; remove_optimized_kernels restores weights dequantized from FP8,
    with a warning); keep_bf16_weights=True parks the originals on the CPU instead (state dict
    unchanged, restored exactly). fp8_device: quantize on that device and keep the FP8 Linears
    there (their bf16 weight goes there alone, one Linear at a time: a bf16 model on the CPU goes
    to a GPU that could not hold it in bf16; the other modules stay where they are, move them
    after); None: where each weight is. Inject after loading and before offloading, caching or
    compiling. Returns an InjectionReport (printed when verbose). Raises on a model that is
    already injected. A pipeline is injected whole or not at all: a component that cannot be
    patched raises with every component as it was (classes, processors, weights: nothing is
    quantized or fused before every component is patched; a failure while quantizing restores the
    models quantized before it as remove_optimized_kernels does, docs/injection.md); a model under
    two component names is injected once."""
    from .. import _library

    _library()  # raises with the build error when the extension did not load
    register_inductor_fallbacks()
    ops = resolve_ops(ops)
    if fp8_linears is not None and (not fp8 or fp8_linears not in FP8_PRESETS):
        raise ValueError(
            f"inject_optimized_kernels: fp8_linears={fp8_linears!r} "
            + (f"is none of {FP8_PRESETS}" if fp8 else "needs fp8=True")
        )
    if attention not in ATTENTION_CHOICES:
        raise ValueError(
            f"inject_optimized_kernels: attention={attention!r} is none of {ATTENTION_CHOICES}"
        )
    for option, value in (
        ("keep_bf16_weights", keep_bf16_weights),
        ("fp8_device", fp8_device),
        ("fp8_bf16_blocks", fp8_bf16_blocks),
    ):
        if value not in (None, False, 0) and not fp8:
            raise ValueError(f"inject_optimized_kernels: {option}={value!r} needs fp8=True")
    if fp8_device is not None:
        fp8_device = torch.device(fp8_device)
    for option, value in (
        ("fp8_bf16_blocks", fp8_bf16_blocks),
        ("attention_bf16_blocks", attention_bf16_blocks),
    ):
        if value < 0:
            raise ValueError(f"inject_optimized_kernels: {option} must be >= 0, got {value}")
    if attention_bf16_blocks and attention != "int8":
        raise ValueError(
            "inject_optimized_kernels: attention_bf16_blocks keeps blocks out of 8-bit attention: "
            f"it needs attention='int8', got attention={attention!r}"
        )
    report = InjectionReport(
        ops=tuple(name for name in FUSIONS if name in ops), fp8=fp8, attention=attention
    )
    injector = Injector(ops, report, fp8, fp8_linears, attention, keep_bf16_weights, fp8_device)
    models = _models(pipe_or_model)
    for prefix, model in models:  # every model checked before any is patched
        for name, module in model.named_modules():
            if is_injected(module):
                raise RuntimeError(
                    f"inject_optimized_kernels: {prefix}.{name} is already injected; "
                    "call remove_optimized_kernels first"
                )
        if fp8:
            _check_fp8_device(model, prefix, fp8_device)
    # All or nothing: every model is patched before any weight is quantized or fused, and a
    # failure anywhere restores every model (the FP8 weights not yet quantized: exactly).
    try:
        patched = []  # (prefix, model, whether any module of it was patched, its pending work)
        visited = set()  # (a module inside two components: patched under the first)
        for prefix, model in models:
            patched_before = report.total_patched
            for name, module in list(model.named_modules(memo=visited)):
                patch = _PATCHERS.get(type(module).__name__)
                if patch is not None:
                    patch(".".join(p for p in (prefix, name) if p), module, injector)
            any_patched = report.total_patched > patched_before
            patched.append((prefix, model, any_patched, injector.take_pending()))
        for prefix, model, any_patched, pending in patched:
            injector.finish_model(pending, fp8_bf16_blocks)
            injector.keep_attention_bf16(prefix, model, attention_bf16_blocks)
            if any_patched:
                report_quantized_weights(model, prefix, report)
    except BaseException:
        restore_all(models)
        raise
    if verbose:
        print(report)
    return report


def _check_fp8_device(model: torch.nn.Module, prefix: str, fp8_device) -> None:
    """fp8=True needs the weights (quantized at injection: no meta-device model) and FP8 tensor
    cores (compute capability 8.9+) where the FP8 weights go (fp8_device, else where the weights
    are) on a GPU."""
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeError(
            f"inject_optimized_kernels(fp8=True): {prefix or 'the model'} has parameters on the "
            "meta device (built empty, as from_pretrained and accelerate's init_empty_weights "
            "do before loading); FP8 quantizes the weights at injection: inject after the "
            "weights are loaded (fp8=False injects on an empty model too)"
        )
    devices = {p.device for p in model.parameters()} if fp8_device is None else {fp8_device}
    devices = {d for d in devices if d.type == "cuda"}
    for device in devices:
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise RuntimeError(
                f"inject_optimized_kernels(fp8=True): {prefix or 'the model'} is on {device} "
                f"({torch.cuda.get_device_name(device)}, compute capability "
                f"{capability[0]}.{capability[1]}), which has no FP8 tensor cores (8.9+: Ada, "
                "Hopper, Blackwell); inject with fp8=False"
            )


def remove_optimized_kernels(pipe_or_model) -> int:
    """Undoes inject_optimized_kernels exactly (classes and processors restored), but the bf16
    weights of FP8 Linears injected without keep_bf16_weights, which were freed: those come back
    dequantized from FP8 (a warning says so). Returns the number of modules restored. Raises if a
    hook was added to a patched module after injection (it holds the patched forward): remove
    that hook first."""
    models = _models(pipe_or_model)
    for prefix, model in models:
        modules = list(model.named_modules())
        for name, module in modules:
            check_restorable(".".join(p for p in (prefix, name) if p), module)
        freed = [n for n, m in modules if isinstance(m, Fp8Linear) and bf16_weight_freed(m)]
        if freed:
            warnings.warn(
                f"remove_optimized_kernels: the bf16 weights of {len(freed)} FP8 Linears "
                f"({'.'.join(p for p in (prefix, freed[0]) if p)}, ...) were freed at injection "
                "(keep_bf16_weights=False): restored dequantized from FP8 (weight_fp8 * "
                "weight_scale in bf16), not the original values; inject with "
                "keep_bf16_weights=True to restore them exactly",
                stacklevel=2,
            )
    return restore_all(models)
