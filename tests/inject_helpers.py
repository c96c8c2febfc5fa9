"""Shared helpers for the inject_optimized_kernels tests (tiny diffusers models on the CPU, full-size
blocks on the GPU)."""

import copy

import pytest
import torch
import torch.utils._pytree as pytree

import ltx_kernels
from ltx_kernels._op_names import RECOMPUTE_SCOPE_OP

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed")

# Relative L2 error of an injected model's output against the same model in eager PyTorch.
# Every fused op rounds where diffusers rounds, so only summation order differs: in fp32 that is a
# few ulps; in bf16 one ulp (2^-8) at some elements, spread through a few layers.
REL_L2_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# FP8 against the bf16 model: a sanity bound (the exact check is the bit-for-bit emulation of the
# rule). e4m3 keeps 3 mantissa bits: each quantized operand is off by up to 2^-4 (~2% relative L2
# on Gaussian rows); the tiny random models' outputs move by 1e-2 to 7e-2 (tiny FLUX, the largest),
# depending on family, seed and torch version; full-size LTX-Video 2B on the H100: 1.8e-2.
FP8_VS_BF16 = 0.1


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def output_of(result):
    """The sample tensor of a diffusers model output (dataclass, tuple or tensor)."""
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, (tuple, list)):
        return result[0]
    return result.sample


def caller(inputs):
    """call(model): one forward of a model on the keyword arguments `inputs`."""
    return lambda model: model(**inputs)


def randomize_norms(module, tables: bool = False, bias_mean: float = 1.0):
    """Norm weights ~ N(1, 0.3), other norm parameters ~ N(bias_mean, 0.3), and with tables=True the
    scale_shift_tables ~ N(0, 0.5): away from their init values, so a dropped weight shows."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if "norm" in name:
                parameter.normal_(1.0 if name.endswith("weight") else bias_mean, 0.3)
            elif tables and "scale_shift_table" in name:
                parameter.normal_(0.0, 0.5)
    return module


def eager_and_injected(model: torch.nn.Module, call, ops=None, **options):
    """(eager output, injected output, report) of call(model); the model is injected in place
    (with inject_optimized_kernels' `options`, e.g. fp8=True)."""
    with torch.no_grad():
        eager = call(model)
        report = ltx_kernels.inject_optimized_kernels(model, ops=ops, verbose=False, **options)
        injected = call(model)
    return eager, injected, report


def assert_matches_eager(eager, injected, dtype, what=""):
    eager, injected = output_of(eager), output_of(injected)
    assert injected.dtype == eager.dtype and injected.shape == eager.shape
    assert torch.isfinite(injected).all(), f"{what}: non-finite output"
    error = rel_l2(injected, eager)
    assert error <= REL_L2_TOLERANCE[dtype], f"{what}: relative L2 {error:.3g} vs eager"
    return error


def assert_remove_restores(model, call, eager_output):
    """remove_optimized_kernels restores bit-identical outputs and the original classes."""
    restored = ltx_kernels.remove_optimized_kernels(model)
    assert restored > 0
    with torch.no_grad():
        again = output_of(call(model))
    assert torch.equal(again, output_of(eager_output))
    for name, module in model.named_modules():
        assert not hasattr(type(module), "_ltx_kernels_original_class"), name
        assert "_ltx_kernels_original_processor" not in vars(module), name


def clone(model):
    return copy.deepcopy(model)


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of each ltx_kernels op (forward and backward) while active (not the
    recompute_scope bookkeeping of the patched blocks: test_recompute_norms.py)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, name = func.namespace, func._schema.name.split("::")[-1]
        if namespace == "ltx_kernels" and name != RECOMPUTE_SCOPE_OP:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def block_op_counts(per_block: dict, fallbacks: dict, disabled, layers: int) -> dict:
    """{op: calls} of `layers` blocks that each run the ops `per_block` counts, with op `disabled`
    left out: the counts of a block then change to fallbacks[disabled] (its unfused step's ops)."""
    counts = {op: n for op, n in per_block.items() if op != disabled}
    counts.update(fallbacks.get(disabled, {}))
    return {op: n * layers for op, n in counts.items()}


def fused_rows(modules, attr: str = "weight") -> torch.Tensor:
    """Asserts that the modules' tensors `attr` are consecutive row blocks of one storage (a fused
    group: one GEMM reads them as one tensor) and returns them as that tensor (a view)."""
    parts = [getattr(m, attr) for m in modules]
    first, address = parts[0], parts[0].data_ptr()
    for p in parts:
        assert p.is_contiguous() and p.data_ptr() == address, "not consecutive row blocks"
        address += p.nbytes
    storage = first.untyped_storage()
    assert storage.data_ptr() + storage.nbytes() >= address, "not one storage"
    rows = sum(p.shape[0] for p in parts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def assert_no_fused_buffers(model: torch.nn.Module) -> None:
    """No module of the model holds a tensor overlapping its parameters' (what disk offloading and
    safetensors refuse): fused groups keep no buffer of their own."""
    assert not any("_ltx_kernels" in name for name, _ in model.named_buffers())


def count_ltx_ops(call) -> dict:
    """{op name: number of calls} of the ltx_kernels ops run by call()."""
    with torch.no_grad(), OpCounter() as counter:
        call()
    return counter.counts


class GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products dispatched while active: aten mm/addmm/bmm (F.linear, the
    CPU's FP8 GEMM) and ltx_kernels.linear_gelu (a GEMM with a GELU epilogue)."""

    GEMMS = frozenset(
        [*(("aten", name) for name in ("mm", "addmm", "bmm", "_addmm_activation"))]
        + [("ltx_kernels", "linear_gelu")]
    )

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += (func.namespace, func._schema.name.split("::")[-1]) in self.GEMMS
        return func(*args, **(kwargs or {}))


def gemms(call) -> int:
    """The number of GEMMs call() runs (GemmCounter)."""
    with torch.no_grad(), GemmCounter() as counter:
        call()
    return counter.count


def group_offload(model, offload_type: str = "leaf_level") -> None:
    """diffusers group offloading with the CPU as onload device: the hooks of a real offload."""
    from diffusers.hooks import apply_group_offloading

    kwargs = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    apply_group_offloading(
        model, onload_device=torch.device("cpu"), offload_type=offload_type, **kwargs
    )


def inject_then_group_offload(model, call, offload_type: str, dtype=torch.bfloat16) -> None:
    """Injects, adds group offloading on top (its hooks wrap the fused code), and checks that the
    output still matches eager."""
    eager, _, _ = eager_and_injected(model, call)
    group_offload(model, offload_type)
    with torch.no_grad():
        assert_matches_eager(eager, call(model), dtype, f"inject, then {offload_type} offload")


def assert_backend_kept(attention_modules, processor_name: str) -> None:
    """Each module got our processor, carrying the `_native_math` backend set before injection."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    assert attention_modules
    for attn in attention_modules:
        assert type(attn.processor).__name__ == processor_name
        assert attn.processor._attention_backend == AttentionBackendName._NATIVE_MATH


class QuantizedWeight(torch.Tensor):
    """A stand-in for a quantized weight (torchao's Float8Tensor and the like): a wrapper tensor
    subclass holding int8 values and a per-output-channel scale that runs aten ops on its
    dequantized value and, as torchao's, raises NotImplementedError for any other op (ours)."""

    @staticmethod
    def __new__(cls, qdata, scale, dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device
        )

    def __init__(self, qdata, scale, dtype):
        self.qdata, self.scale = qdata, scale

    @classmethod
    def of(cls, weight: torch.Tensor) -> "QuantizedWeight":
        w = weight.detach().float()
        scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
        return cls((w / scale).round().to(torch.int8), scale, weight.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.qdata.float() * self.scale).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace != "aten":
            raise NotImplementedError(f"{cls.__name__} dispatch: unimplemented operator {func}")
        if func is torch.ops.aten.detach.default:
            return cls(args[0].qdata, args[0].scale, args[0].dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))


def quantize_linear_weights(model: torch.nn.Module) -> int:
    """Replaces the weight of every nn.Linear of `model` with a QuantizedWeight parameter."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = QuantizedWeight.of(module.weight)
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            count += 1
    return count
