"""The Linear layers of patched blocks: projections of one input fused into one GEMM, and the
opt-in FP8 GEMMs of `inject_optimized_kernels(..., fp8=True)`.

Fused projections ("fused_projections" in FUSIONS; "fused_qkv_mlp" for FLUX's single block). The
projections a block applies to one input (q, k and v of a self-attention; a single-stream block's
q, k, v and MLP up-projection) run as one GEMM over their concatenated weights. At injection the
weights (and biases) are copied into one [sum of N, K] tensor and each module's parameter is
re-pointed at its row block (`param.data = block`): no second copy, and nothing but the parameters
holds it (no module buffer), so whatever moves, casts, offloads (to memory or disk), saves or loads
parameters one by one sees the modules' own tensors only; the modules, their parameters (objects,
values, requires_grad) and the state dict stay as they were, and in-place writes (load_state_dict)
reach the GEMM. Something that re-allocates a parameter (`model.to(...)`, offloading, loading into
a model injected on the meta device, `param.data = ...`) breaks the link: eager calls check it
(data pointers and the first block's storage, well under a microsecond) and re-fuse; compiled
graphs concatenate the members' tensors (one copy of the weights per call: a graph cannot check
when it runs that the blocks still share a storage). A group whose modules are replaced (a peft
adapter the step cannot reproduce: below), hooked, or whose parameters need gradients (full
fine-tuning) runs the modules one by one. A module is in at most one group: the first one named
that fuses it (Injector.finish_model).

LoRA adapters (peft). A projection that is a peft LoRA Linear (what `add_adapter`,
`load_lora_weights` and LoRA fine-tuning put there) computes base_layer(x) + lora_B(lora_A(x)) *
scaling; the step runs it as one `lora_linear` (one autograd node, its backward GEMMs in C++): for
a fused group, the group's base GEMM over the fused weights plus every member's adapter, where
each member has at most one active vanilla adapter (no DoRA or other variant, no lora bias, no
dropout in effect: p = 0 or eval mode) with x's dtype and nothing hooks the module, its base layer
or its adapter layers (lora_terms); anything else runs the module as peft does. The group fuses the
members' base layers, so adapters added before or after injection keep the fused base GEMM.

FP8 (opt-in, inference). Which block Linears run FP8 is a named preset (FP8_PRESETS: "ffn",
"ffn+self_attn", "all"), each family's blocks' Linears listed per preset (fp8_presets) with the
family's default. A block Linear chosen for FP8 becomes an `Fp8Linear` (a subclass of
nn.Linear): its weight is quantized once per output channel to float8_e4m3fn (buffers `weight_fp8`
[N, K] and `weight_scale` [N] fp32, not in the state dict), and its GEMM is `torch._scaled_mm`
with rowwise scales (cuBLASLt/CUTLASS through libtorch; bias in the epilogue; bf16 out): y =
(q_x @ q_w^T) * s_x * s_w + bias, the fp32 accumulator scaled and rounded once. Its input is
`quant.QuantRows` in the format it declares (`quant_input` "e4m3_row": e4m3 rows plus one fp32
scale per row, produced by the norm / GELU op before it in the same pass) or a tensor, which it
quantizes per row itself (`quantize`, one pass). The rule is torchao's dynamic rowwise one
(reference.quantize_rows). Weights are quantized one Linear at a time, where the FP8 weights are
to live (inject's fp8_device, default the weight's device: a weight on the CPU goes to that device
alone, so a GPU holds the FP8 weights and one bf16 Linear at most). The bf16 original is then
freed: the module's `weight` is None (bf16_weight_freed; a meta tensor of its shape and dtype is
kept aside, _FREED_WEIGHT), so nothing computes with values that are gone (peft refuses to place
adapters on it); the state dict refuses (_refuse_state_dict) rather than leave the weights out,
load_state_dict quantizes what it is given (_quantize_loaded), and remove_optimized_kernels
restores the weight dequantized from FP8 (with a warning). With keep_bf16_weights=True it stays
the module's parameter instead, parked on the CPU, untouched: state_dict unchanged, restored
exactly by remove_optimized_kernels, and weights written after injection (load_state_dict into
the parked parameter) re-quantized at the next eager call. Either way GPU memory holds 1 byte per
FP8 weight, not 3. On the CPU the GEMM dequantizes (fp32 matmul of the e4m3 values, scaled,
rounded once), so CPU tests run the same code path up to the GEMM. What the FP8 GEMMs cannot
honour raises at the call, on every FP8 path (the Linear's forward, a fused group:
check_fp8_linear): a peft adapter layer added after injection around the Linear (each FP8 Linear
remembers its slot in its parent, _Slot; adapters loaded before injection keep their Linears
bf16), and a cast of the model to another dtype (Fp8Linear._apply records it)."""

from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.nn.functional as F

from ..ops import lora_linear, quantize
from .module_checks import has_hooks, plain_tensor
from .quant import QuantRows, quantize_rows

FP8_DTYPE = torch.float8_e4m3fn
#: The weight dtype FP8 Linears take: torch._scaled_mm's rowwise scaling writes bf16 only.
FP8_MODEL_DTYPE = torch.bfloat16
#: Fast accumulation (torch._scaled_mm's use_fast_accum: the tensor cores' own fp32 accumulation,
#: no periodic promotion to a full fp32 sum): 10-25% faster at LTX shapes on the H100, and the
#: same output SQNR against the float64 product at K = 2048 and 8192 (28.6 dB either way: the e4m3
#: rounding of the operands dominates; benchmark_fp8.py). torchao's float8 inference default too.
FP8_FAST_ACCUMULATION = True
#: Fewer rows than this: the bias is added after torch._scaled_mm, not inside it (fp8_matmul).
SMALL_GEMM_ROWS = 128
_GROUPS = "_ltx_kernels_fused_groups"
# (the weight tensor, its version counter or None, whether load_state_dict wrote since)
_QUANTIZED_FROM = "_ltx_kernels_quantized_from"
_FP8_HOOKS = "_ltx_kernels_fp8_hooks"  # the handles of the state dict hooks to_fp8 registers
# A freed bf16 weight's shape, dtype and requires_grad, as a meta tensor (remove_optimized_kernels)
_FREED_WEIGHT = "_ltx_kernels_freed_weight"
_SLOT = "_ltx_kernels_slot"  # where the FP8 Linear sits (_Slot: check_slot)
_CAST_TO = "_ltx_kernels_cast_to"  # the dtype a cast since injection asked for (check_not_cast)


def fp8_matmul(
    rows: QuantRows, weight: torch.Tensor, weight_scale: torch.Tensor, bias, out_dtype
) -> torch.Tensor:
    """rows @ weight^T * scales (+ bias) in out_dtype: [..., K] x [N, K] -> [..., N] (rows and
    weight e4m3 with one scale per row)."""
    data, scale = rows.data, rows.scale
    a, a_scale = data.reshape(-1, data.size(-1)), scale.reshape(-1, 1)
    if a.is_cuda and a.size(0) > 0:
        # cuBLASLt finds no rowwise-scaled algorithm with a bias for a few rows (torch 2.11,
        # CUDA 13: K 8192 -> N 2048 up to 32 rows, as LTX-2's audio feed-forward): below
        # SMALL_GEMM_ROWS rows the bias is added after the GEMM (one more bf16 rounding).
        fused_bias = bias if a.size(0) >= SMALL_GEMM_ROWS else None
        out = torch._scaled_mm(
            a,
            weight.t(),
            scale_a=a_scale,
            scale_b=weight_scale[None],
            bias=fused_bias,
            out_dtype=out_dtype,
            use_fast_accum=FP8_FAST_ACCUMULATION,
        )
        if bias is not None and fused_bias is None:
            out = out + bias
    else:  # the CPU (and empty inputs): the same products in fp32, scaled, rounded once
        out = (a.float() @ weight.float().t()) * a_scale * weight_scale[None]
        out = (out if bias is None else out + bias.float()).to(out_dtype)
    return out.view(*data.shape[:-1], weight.size(0))


class Fp8Linear(torch.nn.Linear):
    """nn.Linear whose GEMM runs in FP8 (module docstring): weight_fp8 [N, K] float8_e4m3fn and
    weight_scale [N] fp32 buffers; `weight` is the original parameter parked on the CPU, or None
    where it was freed (bf16_weight_freed)."""

    _ltx_kernels_original_class = torch.nn.Linear
    quant_input = "e4m3_row"  # the QuantRows it takes as is (quant.input_format)

    def forward(self, x) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                "ltx_kernels: this Linear runs in FP8 (inject_optimized_kernels(..., fp8=True)), "
                "which is for inference; call model.eval() or torch.no_grad(), or train with "
                "fp8=False (remove_optimized_kernels, then inject again)"
            )
        check_fp8_linear(self, x)
        if not torch.compiler.is_compiling():
            refresh_fp8_weight(self)
        rows = x if isinstance(x, QuantRows) else quantize_rows(x, self.quant_input)
        return fp8_matmul(rows, self.weight_fp8, self.weight_scale, self.bias, out_dtype(self))

    def _apply(self, fn, recurse=True):
        """Device moves and casts (`.to`, `.cuda()`, offload hooks) move the FP8 buffers and the
        bias; the parked (or freed) weight stays as it is, the buffers keep their dtypes. A cast
        to another dtype than the one the GEMM writes is recorded (_CAST_TO): the next call raises
        (check_not_cast); a cast back to it clears it."""
        parked = self._parameters.pop("weight")
        fp8 = {name: self._buffers.pop(name) for name in ("weight_fp8", "weight_scale")}
        try:
            super()._apply(fn, recurse)
        finally:
            self._parameters["weight"] = parked
        probe = fn(torch.empty(0, dtype=out_dtype(self), device=fp8["weight_scale"].device))
        self._buffers.update({name: t.to(probe.device) for name, t in fp8.items()})
        if probe.dtype == out_dtype(self):
            self.__dict__.pop(_CAST_TO, None)
        else:
            self.__dict__[_CAST_TO] = probe.dtype
        return self

    def extra_repr(self) -> str:
        return super().extra_repr() + ", float8_e4m3fn weight (rowwise scales)"


#: Which block Linears run in FP8 with fp8=True, by name (inject_optimized_kernels(fp8_linears=)):
#: "ffn", the feed-forward projections; "ffn+self_attn", and the self-attention's q/k/v and output;
#: "all", and the other projections of the video/image tokens the family's patcher names
#: (cross-attention queries and outputs; LTX-2's audio-video attentions). Always bf16: embedders,
#: modulation (AdaLN linears, attention gates), proj_in/proj_out, the text-side K/V and text
#: streams. Each family declares its blocks' Linears per preset (fp8_presets) and its default.
FP8_PRESETS = ("ffn", "ffn+self_attn", "all")


def fp8_presets(ffn, self_attn=(), others=()) -> dict[str, tuple[str, ...]]:
    """A block's FP8 Linears (paths below it) per name of FP8_PRESETS: its feed-forward's `ffn`,
    with its self-attention's `self_attn`, with the `others`."""
    return {
        "ffn": tuple(ffn),
        "ffn+self_attn": (*ffn, *self_attn),
        "all": (*ffn, *self_attn, *others),
    }


def attention_projections(attn: str, names=("to_q", "to_k", "to_v", "to_out.0")) -> tuple:
    """The paths of attention module `attn`'s projections `names` (default q/k/v and output)."""
    return tuple(f"{attn}.{name}" for name in names)


def ff_projections(ff: str) -> tuple[str, str]:
    """A diffusers FeedForward's two projections (net = [GELU(proj), Dropout, Linear])."""
    return f"{ff}.net.0.proj", f"{ff}.net.2"


def self_cross_ff_fp8_presets(ff: str) -> dict[str, tuple[str, ...]]:
    """The FP8 presets of a block of self-attention attn1, cross-attention attn2 on text and a
    diffusers FeedForward named `ff` (LTX-Video, Wan): "all" adds attn2's query and output
    projections (its text-side K/V stay bf16)."""
    return fp8_presets(
        ff_projections(ff),
        attention_projections("attn1"),
        attention_projections("attn2", ("to_q", "to_out.0")),
    )


def fp8_linear_reason(linear) -> str | None:
    """None when `linear` can become an Fp8Linear, else why not (for the report)."""
    if type(linear) is not torch.nn.Linear:
        kind = f"{type(linear).__module__}.{type(linear).__qualname__}"
        return f"a {kind}, not a plain nn.Linear (adapter or custom layer)"
    if has_hooks(linear):
        return "carries a hook"
    if not (plain_tensor(linear.weight) and plain_tensor(linear.bias)):
        return f"weight is a {type(linear.weight).__name__} (already quantized)"
    if linear.weight.dtype != FP8_MODEL_DTYPE:
        return f"weight is {linear.weight.dtype}; FP8 GEMMs write bf16 (bf16 models only)"
    if linear.in_features % 16 or linear.out_features % 16:
        return "in/out features not multiples of 16 (torch._scaled_mm)"
    return None


def to_fp8(parent: torch.nn.Module, name: str, keep_bf16_weight: bool, device=None) -> None:
    """Quantizes the weight of parent's Linear `name` per output channel on `device` (None: the
    weight's; a weight elsewhere is copied there alone for it), moves its bias there, and makes
    the module an Fp8Linear that remembers its slot (check_slot). The bf16 weight is then parked
    on the CPU (keep_bf16_weight) or freed: the module's weight becomes None, the state dict
    refuses and load_state_dict quantizes what it is given. (Normal tensors even under
    torch.inference_mode: the parked weight stays writable by load_state_dict after it.)"""
    linear = parent._modules[name]
    weight = linear.weight
    device = weight.device if device is None else torch.device(device)
    with torch.inference_mode(False):
        weight_fp8, weight_scale = quantize(
            weight.detach().to(device), format=Fp8Linear.quant_input
        )
        linear.register_buffer("weight_fp8", weight_fp8, persistent=False)
        linear.register_buffer("weight_scale", weight_scale, persistent=False)
        if linear.bias is not None and linear.bias.device != device:
            linear.bias.data = linear.bias.data.to(device)
        if keep_bf16_weight:  # (a device copy freed: the buffers hold the GEMM's weights)
            weight.data = weight.data.to("cpu")
        else:
            freed = torch.empty_like(weight, device="meta").requires_grad_(weight.requires_grad)
            linear.__dict__[_FREED_WEIGHT] = freed
            linear.weight = None
    _mark_quantized(linear)
    linear.__dict__[_SLOT] = _Slot(parent, name)
    linear.__dict__[_FP8_HOOKS] = (
        [linear.register_load_state_dict_post_hook(_requantize_loaded)]
        if keep_bf16_weight
        else [
            linear.register_load_state_dict_pre_hook(_quantize_loaded),
            linear.register_state_dict_pre_hook(_refuse_state_dict),
        ]
    )
    linear.__class__ = Fp8Linear


def bf16_weight_freed(linear: Fp8Linear) -> bool:
    """Whether the FP8 Linear's bf16 weight was freed at injection (keep_bf16_weights=False) and
    no weight was given to it since (`linear.weight = ...`)."""
    return linear._parameters["weight"] is None


def out_dtype(linear: Fp8Linear) -> torch.dtype:
    """The dtype an FP8 Linear writes: its weight's (bf16: fp8_linear_reason), freed or not."""
    weight = linear._parameters["weight"]
    return FP8_MODEL_DTYPE if weight is None else weight.dtype


class _Slot:
    """Where an FP8 Linear sits: its parent module (a weak reference: the Linear keeps no cycle
    through its parent) and its name there. copy.deepcopy of the model points the copy's slot at
    the parent's copy (a Linear copied without its parent: at none); pickling (torch.save(model))
    saves the parent with it."""

    def __init__(self, parent: torch.nn.Module | None, name: str):
        self.ref = None if parent is None else weakref.ref(parent)
        self.name = name

    def parent(self) -> torch.nn.Module | None:
        return None if self.ref is None else self.ref()

    def __deepcopy__(self, memo):
        parent = self.parent()
        return _Slot(None if parent is None else memo.get(id(parent)), self.name)

    def __reduce__(self):
        return _Slot, (self.parent(), self.name)


def check_slot(linear: Fp8Linear) -> None:
    """Raises when the FP8 Linear's slot in its parent holds another module now: a peft adapter
    layer wrapping it, added after injection (add_adapter, load_lora_adapter). The FP8 GEMMs
    cannot apply it (a fused group reads the members' FP8 weights directly), and a merge
    (fuse_lora) writes the parked bf16 weight's `.data`, which no version counter sees. (Not
    seen: adapters added, merged and unloaded before any call; docs/fp8.md.)"""
    slot = linear.__dict__.get(_SLOT)
    parent = None if slot is None else slot.parent()
    if parent is not None and parent._modules.get(slot.name) is not linear:
        held = type(parent._modules.get(slot.name))
        raise RuntimeError(
            f"ltx_kernels: {type(parent).__name__}.{slot.name} runs in FP8 "
            "(inject_optimized_kernels(..., fp8=True)) and now sits inside a "
            f"{held.__module__}.{held.__qualname__}: adapters added after FP8 injection (peft "
            "add_adapter, load_lora_adapter / load_lora_weights, fuse_lora) are not supported, "
            "the FP8 GEMMs would ignore them. Load the adapters before injecting (the adapted "
            "Linears stay bf16), or call remove_optimized_kernels, add the adapters and inject "
            "again"
        )


def check_not_cast(linear: Fp8Linear, x=None) -> None:
    """Raises when the model was cast to another dtype since injection (Fp8Linear._apply records
    it: the GEMM still writes the dtype of injection) or x, a tensor, is of another dtype."""
    dtype, cast = out_dtype(linear), linear.__dict__.get(_CAST_TO)
    if cast is not None or (isinstance(x, torch.Tensor) and x.dtype != dtype):
        given = f"the model was cast to {cast}" if cast is not None else f"its input is {x.dtype}"
        raise RuntimeError(
            f"ltx_kernels: this Linear runs in FP8 and writes {dtype}, the model's dtype at "
            f"injection, but {given}: casting a model with FP8 Linears (model.to(dtype) after "
            "inject_optimized_kernels(..., fp8=True)) is not supported; call "
            "remove_optimized_kernels, cast, and inject again"
        )


def check_fp8_linear(linear: Fp8Linear, x=None) -> None:
    """What every FP8 path checks of each FP8 Linear it runs (its own forward, a fused group):
    nothing wraps it (check_slot), no cast since injection (check_not_cast)."""
    check_slot(linear)
    check_not_cast(linear, x)


def _mark_quantized(linear) -> None:
    """Records the weight the FP8 buffers were quantized from: the tensor, and its version counter
    where it has one (a tensor made under torch.inference_mode has none: writes to it are seen
    through load_state_dict only, _requantize_loaded)."""
    weight = linear.weight
    try:
        version = None if weight is None else weight._version
    except RuntimeError:  # ("Inference tensors do not track version counter")
        version = None
    linear.__dict__[_QUANTIZED_FROM] = (weight, version, False)


def _requantize_loaded(linear, incompatible_keys) -> None:
    """load_state_dict wrote into the module (in place, or replacing the weight with assign=True):
    re-quantize now, not at the next eager call, which compiled blocks never make."""
    weight, version, _ = linear.__dict__[_QUANTIZED_FROM]
    linear.__dict__[_QUANTIZED_FROM] = (weight, version, True)
    refresh_fp8_weight(linear)


def _set_fp8_weight(linear, weight_fp8: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """Points the FP8 buffers at new values, keeping the buffer objects (what group offloading
    tracks, and compiled graphs read)."""
    linear._buffers["weight_fp8"].data = weight_fp8
    linear._buffers["weight_scale"].data = weight_scale


def _quantize_loaded(
    linear, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
):
    """load_state_dict into an FP8 Linear whose bf16 weight was freed: quantizes the weight it is
    given (as load_state_dict would have copied it: in the weight's dtype) where the FP8 weights
    are, the bits the kept weight would give, and takes it out of this module's entries (its own
    copy of the dict: not an unexpected key), so the weight stays freed, assign=True too. A
    weight of another shape is reported as load_state_dict reports one."""
    key = prefix + "weight"
    given, freed = state_dict.get(key), linear.__dict__[_FREED_WEIGHT]
    if not bf16_weight_freed(linear) or not isinstance(given, torch.Tensor):
        return
    del state_dict[key]
    if given.shape != freed.shape:
        errors.append(
            f"size mismatch for {key}: copying a param with shape {given.shape} from checkpoint, "
            f"the shape in current model is {freed.shape}."
        )
        return
    with torch.inference_mode(False):
        _set_fp8_weight(
            linear,
            *quantize(
                given.detach().to(linear.weight_scale.device, freed.dtype),
                format=linear.quant_input,
            ),
        )


def _refuse_state_dict(linear, prefix, keep_vars) -> None:
    """The state dict of an FP8 Linear whose bf16 weight was freed: it has no value to give (a
    saved checkpoint would leave it out)."""
    if bf16_weight_freed(linear):
        raise RuntimeError(
            f"ltx_kernels: no state dict for {prefix}weight: its Linear runs in FP8 and its bf16 "
            "weight was freed at injection (inject_optimized_kernels(..., fp8=True) frees them "
            "unless keep_bf16_weights=True), so save_pretrained or state_dict would leave it "
            "out. Inject with keep_bf16_weights=True (the originals parked on the CPU), or call "
            "remove_optimized_kernels first (it restores the weights dequantized from FP8)"
        )


def refresh_fp8_weight(linear: Fp8Linear) -> None:
    """Re-quantizes an Fp8Linear whose weight was written since (load_state_dict, or an in-place
    write its version counter shows) or replaced (load_state_dict(..., assign=True),
    `linear.weight = ...`, also one that was freed)."""
    weight = linear.weight
    source, version, stale = linear.__dict__[_QUANTIZED_FROM]
    if stale or weight is not source or (version is not None and weight._version != version):
        device = linear.weight_scale.device
        with torch.inference_mode(False):
            _set_fp8_weight(
                linear, *quantize(weight.detach().to(device), format=linear.quant_input)
            )
        _mark_quantized(linear)


def restore_from_fp8(linear: Fp8Linear) -> None:
    """The plain nn.Linear again, on the module's device: its original weight where it was kept,
    else one dequantized from FP8 (weight_fp8 * weight_scale, rounded to the weight's dtype)."""
    device = linear.weight_scale.device
    freed = linear.__dict__.pop(_FREED_WEIGHT, None)
    with torch.inference_mode(False):
        if bf16_weight_freed(linear):
            values = linear.weight_fp8.float() * linear.weight_scale[:, None]
            linear.weight = torch.nn.Parameter(
                values.to(freed.dtype), requires_grad=freed.requires_grad
            )
        else:
            linear.weight.data = linear.weight.data.to(device)
    del linear._buffers["weight_fp8"], linear._buffers["weight_scale"]
    del linear.__dict__[_QUANTIZED_FROM]
    linear.__dict__.pop(_SLOT, None)
    linear.__dict__.pop(_CAST_TO, None)
    for hook in linear.__dict__.pop(_FP8_HOOKS):
        hook.remove()
    linear.__class__ = torch.nn.Linear


# ------------------------------------------------------------------------------------------------
# LoRA adapters (peft)
# ------------------------------------------------------------------------------------------------
def is_peft_lora(module) -> bool:
    """A peft LoRA Linear (peft.tuners.lora.layer.Linear, over an nn.Linear base_layer)."""
    cls = type(module)
    return cls.__name__ == "Linear" and cls.__module__ == "peft.tuners.lora.layer"


def base_linear(module):
    """The Linear whose weight a projection's GEMM reads: a peft LoRA Linear's base_layer, else
    the module itself."""
    return module.base_layer if is_peft_lora(module) else module


def _no_dropout(dropout) -> bool:
    return isinstance(dropout, torch.nn.Identity) or (
        isinstance(dropout, torch.nn.Dropout) and (dropout.p == 0 or not dropout.training)
    )


def lora_terms(module, x) -> list | None:
    """What `module` adds to its base layer's GEMM on x now, as lora_linear's adapters: [] for a
    plain module, or a peft LoRA Linear whose adapters are off (disabled, merged, none active);
    [(lora_A weight, lora_B weight, scaling)] for one active vanilla adapter; None where
    lora_linear would not compute what peft computes (several active adapters, DoRA or another
    variant, a lora bias, dropout in effect, hooks, weights of another dtype than x's or tensor
    subclasses) or would need the scaling on the host (a tensor: enable_lora_hotswap): the module
    then runs itself. (Submodules and parameters are read from their
    modules' tables: nn.Module.__getattr__ costs about a microsecond of host time a lookup, and
    this runs on every projection.)"""
    if not is_peft_lora(module):
        return []
    parts = module._modules
    if has_hooks(module):  # (its base layer's: lora_outputs checks the base layers)
        return None
    if module.disable_adapters:
        return None if module.merged else []  # (peft unmerges a merged one on this call)
    if module.merged:
        return []
    downs = parts["lora_A"]._modules
    active = [name for name in module.active_adapters if name in downs]
    if not active:
        return []
    if len(active) > 1:
        return None
    (name,) = active
    down, up = downs[name], parts["lora_B"]._modules[name]
    if (
        type(down) is not torch.nn.Linear
        or type(up) is not torch.nn.Linear
        or has_hooks(down)
        or has_hooks(up)
        or name in getattr(module, "lora_variant", {})
        or module.use_dora.get(name, False)
        or not _no_dropout(parts["lora_dropout"]._modules[name])
    ):
        return None
    down_weight, up_weight = down._parameters["weight"], up._parameters["weight"]
    scaling = module.scaling[name]
    if (
        isinstance(scaling, torch.Tensor)  # (hotswap: a tensor, so that swapping adapters does
        # not recompile; as a float it would cost a device sync per call, an .item() under compile)
        or down._parameters["bias"] is not None
        or up._parameters["bias"] is not None
        or not (plain_tensor(down_weight) and plain_tensor(up_weight))
        or down_weight.dtype != x.dtype
        or up_weight.dtype != x.dtype
    ):
        return None
    return [(down_weight, up_weight, float(scaling))]


def _linear_of_x(linear, x) -> bool:
    """A hook-free plain nn.Linear with plain weights of x's dtype (what lora_linear takes)."""
    if type(linear) is not torch.nn.Linear or has_hooks(linear):
        return False
    weight, bias = linear._parameters["weight"], linear._parameters["bias"]
    return plain_tensor(weight) and plain_tensor(bias) and weight.dtype == x.dtype


def lora_outputs(modules, x, owner=None, key: str = "") -> tuple | None:
    """The outputs of projections `modules` of x, some of them peft LoRA Linears, by lora_linear:
    one call over the fused base weights of owner's group `key` (given, and able to run now:
    fused_group), else one call per module. None when lora_terms refuses a module or a base layer
    is not a plain Linear of x's dtype: the caller runs the modules."""
    if not isinstance(x, torch.Tensor):  # (QuantRows: FP8 Linears carry no adapters)
        return None
    terms = [lora_terms(m, x) for m in modules]
    bases = [base_linear(m) for m in modules]
    if any(t is None for t in terms) or not all(_linear_of_x(b, x) for b in bases):
        return None
    found = fused_group(owner, key, bases) if owner is not None else None
    if found is not None:
        group, _, tensors = found
        adapters, offset = [], 0
        for size, member_terms in zip(group.sizes, terms):
            adapters += [(*term, offset) for term in member_terms]
            offset += size
        out = lora_linear(x, tensors["weight"], tensors["bias"], *_adapter_lists(adapters))
        return out.split(group.sizes, dim=-1)
    return tuple(
        lora_linear(
            x,
            b._parameters["weight"],
            b._parameters["bias"],
            *_adapter_lists([(*t, 0) for t in member_terms]),
        )
        for b, member_terms in zip(bases, terms)
    )


def _adapter_lists(adapters) -> tuple[list, list, list, list]:
    """lora_linear's lora_a, lora_b, scaling and offsets from (A, B, scaling, offset) tuples."""
    columns = tuple(zip(*adapters)) or ((), (), (), ())
    return tuple(list(c) for c in columns)


# ------------------------------------------------------------------------------------------------
# Fused projections
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Group:
    """Modules `names` of an owner fused on `attrs`: the members' tensors `attr` are consecutive
    row blocks (of `sizes` rows) of one storage, read as one tensor by _fused."""

    names: tuple[str, ...]
    attrs: tuple[str, ...]
    sizes: tuple[int, ...]
    # Whether a member's tensor was made under torch.inference_mode (a model built there): the
    # tensor keeps no version counter when re-pointed, and a view of it raises.
    no_views: bool = False


def _fused_attrs(linears) -> tuple[str, ...] | None:
    """The tensors to fuse for modules that are all plain nn.Linear or all Fp8Linear with one
    input size, dtype and device, all with or all without bias; else None."""
    kinds = {type(m) for m in linears}
    if kinds == {Fp8Linear}:
        attrs = ("weight_fp8", "weight_scale", "bias")
    elif kinds == {torch.nn.Linear}:
        attrs = ("weight", "bias")
    else:
        return None
    first = linears[0]
    same = all(
        m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        and getattr(m, attrs[0]).dtype == getattr(first, attrs[0]).dtype
        and getattr(m, attrs[0]).device == getattr(first, attrs[0]).device
        for m in linears
    )
    return attrs if same else None


def fuse(owner: torch.nn.Module, key: str, names: tuple[str, ...]) -> bool:
    """Fuses owner's modules `names` (paths below owner) as group `key`; False when they cannot
    be (kinds, sizes or bias differ: fp8_linear_reason / _fused_attrs)."""
    linears = [base_linear(owner.get_submodule(n)) for n in names]
    attrs = _fused_attrs(linears)
    if attrs is None or not all(plain_tensor(m.weight) for m in linears):
        return False
    group = _Group(names, attrs, tuple(m.out_features for m in linears))
    _link(group, linears)
    owner.__dict__.setdefault(_GROUPS, {})[key] = group
    return True


def _link(group: _Group, linears) -> None:
    """Copies the members' current tensors into one new tensor per attribute and points each
    member at its row block. Nothing else holds that tensor: the members' own tensors keep its
    storage, so whatever moves, offloads, saves or frees them one by one sees nothing else.
    (Normal tensors even under torch.inference_mode: the parameters stay writable after it.)"""
    with torch.inference_mode(False):
        for attr in group.attrs:
            parts = [_tensor_of(m, attr) for m in linears]
            if parts[0] is None:
                continue
            group.no_views = group.no_views or any(p.is_inference() for p in parts)
            fused = torch.cat([p.detach() for p in parts])
            for m, block in zip(linears, fused.split(group.sizes)):
                # (the same tensor objects: group offloading tracks them)
                (m._parameters if attr in m._parameters else m._buffers)[attr].data = block


def unfuse_all(owner: torch.nn.Module) -> None:
    """Gives each member of owner's groups its own storage again and forgets the groups. (Normal
    tensors even under torch.inference_mode: the parameters stay trainable after it.)"""
    with torch.inference_mode(False):
        for group in owner.__dict__.pop(_GROUPS, {}).values():
            for attr in group.attrs:
                for name in group.names:
                    member = base_linear(owner.get_submodule(name))
                    tensors = member._parameters if attr in member._parameters else member._buffers
                    if tensors.get(attr) is not None:  # (the same objects, as _link keeps them)
                        tensors[attr].data = tensors[attr].data.clone()


def fused_group(owner: torch.nn.Module, key: str, members=None, x=None) -> tuple | None:
    """(group, members, tensors) when owner's group `key` can run as one GEMM now: its members
    (the base layers of peft LoRA Linears; given, or looked up) are the fused modules, hook-free,
    and no gradient is recorded for their parameters (FP8 members: check_fp8_linear of each, with
    the input x, raises); `tensors` maps each of group.attrs to the members' tensors as one
    (None: a bias they do not have). Eager calls re-link a group whose members were re-allocated
    since (`.to()`, offloading, loading into a model injected on the meta device) and read the
    row blocks as one tensor; compiled graphs concatenate them (a graph cannot check, when it
    runs, that the blocks are still those of one storage: one reading them as one tensor would
    read past a parameter that offloading or `.to()` re-allocated). (Tensors are read from the
    members' tables, as in lora_terms: this runs on every call.)"""
    group = owner.__dict__.get(_GROUPS, {}).get(key)
    if group is None:
        return None
    if members is None:
        members = [base_linear(owner.get_submodule(n)) for n in group.names]
    kind = Fp8Linear if group.attrs[0] == "weight_fp8" else torch.nn.Linear
    if any(type(m) is not kind or has_hooks(m) for m in members):
        return None
    if kind is Fp8Linear:  # (x: the input, for the dtype check)
        for m in members:
            check_fp8_linear(m, x)
    if (  # (FP8 has no gradients)
        kind is torch.nn.Linear
        and torch.is_grad_enabled()
        and any(p is not None and p.requires_grad for m in members for p in m._parameters.values())
    ):
        return None
    if torch.compiler.is_compiling():  # (traced once: the full check)
        if _fused_attrs(members) != group.attrs:
            return None
        parts = {attr: [_tensor_of(m, attr) for m in members] for attr in group.attrs}
        return group, members, {a: None if p[0] is None else torch.cat(p) for a, p in parts.items()}
    if kind is Fp8Linear:
        for m in members:
            refresh_fp8_weight(m)
    tensors = {attr: _row_blocks(group, members, attr) for attr in group.attrs}
    if any(t is _UNLINKED for t in tensors.values()):  # re-allocated (or replaced) since
        if _fused_attrs(members) != group.attrs:
            return None
        _link(group, members)
        tensors = {attr: _row_blocks(group, members, attr) for attr in group.attrs}
    return group, members, tensors


def _tensor_of(module, name):
    """module's parameter or buffer `name` (None if it has none)."""
    t = module._parameters.get(name)
    return t if t is not None else module._buffers.get(name)


_UNLINKED = object()


def _row_blocks(group: _Group, members, attr: str):
    """The members' tensors `attr` as one [sum of sizes, ...] tensor without a copy when they are
    consecutive row blocks of one storage (as _link leaves them), None when none has one, else
    _UNLINKED. (The first member's storage spanning them all proves it: live storages do not
    overlap.)"""
    parts = [_tensor_of(m, attr) for m in members]
    first = parts[0]
    if first is None:
        return None if all(p is None for p in parts) else _UNLINKED
    address, row_bytes = first.data_ptr(), first.nbytes // max(first.shape[0], 1)
    for p, rows in zip(parts, group.sizes):
        if p is None or not p.is_contiguous() or p.data_ptr() != address:
            return _UNLINKED
        address += rows * row_bytes
    storage = first.untyped_storage()
    if storage.data_ptr() + storage.nbytes() < address:
        return _UNLINKED
    shape = (sum(group.sizes), *first.shape[1:])
    if group.no_views:  # (the storage read directly)
        fused = torch.empty(0, dtype=first.dtype, device=first.device)
        return fused.set_(storage, first.storage_offset(), shape, first.stride())
    return first.as_strided(shape, first.stride())


def fused_outputs(owner: torch.nn.Module, key: str, x, members=None) -> tuple | None:
    """The outputs of owner's group `key` on x (a tensor or QuantRows) as one GEMM over its fused
    weights, split per member (views of one [..., sum of N] tensor); None when the group cannot
    run now (fused_group; members: given, or looked up)."""
    found = fused_group(owner, key, members, x)
    if found is None:
        return None
    group, members, tensors = found
    if group.attrs[0] == "weight_fp8":
        rows = x if isinstance(x, QuantRows) else quantize_rows(x, Fp8Linear.quant_input)
        weight, scale = tensors["weight_fp8"], tensors["weight_scale"]
        out = fp8_matmul(rows, weight, scale, tensors["bias"], out_dtype(members[0]))
    else:
        out = F.linear(x, tensors["weight"], tensors["bias"])
    return out.split(group.sizes, dim=-1)


def projections(
    owner: torch.nn.Module, key: str, names: tuple[str, ...], x, fuse_ok: bool, lora_ok: bool
):
    """The outputs of owner's modules `names` on x (a tensor or QuantRows): with peft LoRA Linears
    among them, lora_outputs where lora_ok; otherwise one GEMM over group `key`'s fused weights
    when fuse_ok and the group is usable now (fused_outputs); else each module in turn."""
    modules = [owner.get_submodule(n) for n in names]
    if any(is_peft_lora(m) for m in modules):
        out = lora_outputs(modules, x, *((owner, key) if fuse_ok else ())) if lora_ok else None
    else:
        out = fused_outputs(owner, key, x, modules) if fuse_ok else None
    return out if out is not None else tuple(m(x) for m in modules)
