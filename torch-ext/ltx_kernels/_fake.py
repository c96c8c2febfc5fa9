"""Fake (meta) implementations of every op, so they trace under torch.compile and torch.export
without touching data. Each mirrors its C++ op: same output shapes, dtypes and (contiguous)
strides, and the same shape checks, as torch._check errors."""
import torch

from ._op_namespace import add_op_namespace_prefix


@torch.library.register_fake(add_op_namespace_prefix("rmsnorm"))
def _rmsnorm_fake(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6):
    torch._check(x.dim() >= 1, lambda: "ltx_kernels.rmsnorm: x must have at least 1 dimension")
    if weight is not None:
        torch._check(
            weight.dim() == 1 and weight.shape[0] == x.shape[-1],
            lambda: f"ltx_kernels.rmsnorm: weight must have shape [hidden] = [{x.shape[-1]}], "
            f"got {list(weight.shape)}",
        )
    return x.new_empty(x.shape, dtype=weight.dtype if weight is not None else x.dtype)


def _check_last_dim(op: str, name: str, t, hidden: int):
    if t is not None:
        torch._check(t.dim() >= 1 and t.shape[-1] == hidden,
                     lambda: f"ltx_kernels.{op}: {name} must have last dimension {hidden}, "
                     f"got shape {list(t.shape)}")


@torch.library.register_fake(add_op_namespace_prefix("rmsnorm_modulate"))
def _rmsnorm_modulate_fake(x, scale, shift, weight=None, eps=1e-6, *, upcast=False):
    for name, t in (("scale", scale), ("shift", shift), ("weight", weight)):
        _check_last_dim("rmsnorm_modulate", name, t, x.shape[-1])
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("layernorm_modulate"))
def _layernorm_modulate_fake(x, scale, shift, weight=None, bias=None, eps=1e-6, *, upcast=False):
    for name, t in (("scale", scale), ("shift", shift), ("weight", weight), ("bias", bias)):
        _check_last_dim("layernorm_modulate", name, t, x.shape[-1])
    return x.new_empty(x.shape)


def _add_norm_modulate_fake(op, x, y, operands):
    torch._check(y.shape == x.shape, lambda: f"ltx_kernels.{op}: y must have x's shape")
    for name, t in operands:
        _check_last_dim(op, name, t, x.shape[-1])
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("add_rmsnorm_modulate"))
def _add_rmsnorm_modulate_fake(x, y, scale, shift, gate=None, weight=None, eps=1e-6, *,
                               upcast=False):
    return _add_norm_modulate_fake("add_rmsnorm_modulate", x, y, (
        ("scale", scale), ("shift", shift), ("gate", gate), ("weight", weight)))


@torch.library.register_fake(add_op_namespace_prefix("add_layernorm_modulate"))
def _add_layernorm_modulate_fake(x, y, scale, shift, gate=None, weight=None, bias=None, eps=1e-6,
                                 *, upcast=False):
    return _add_norm_modulate_fake("add_layernorm_modulate", x, y, (
        ("scale", scale), ("shift", shift), ("gate", gate), ("weight", weight), ("bias", bias)))


@torch.library.register_fake(add_op_namespace_prefix("gated_residual"))
def _gated_residual_fake(x, y, gate=None, *, upcast=False):
    torch._check(y.shape == x.shape, lambda: "ltx_kernels.gated_residual: y must have x's shape")
    _check_last_dim("gated_residual", "gate", gate, x.shape[-1])
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("rope"))
def _rope_fake(x, cos, sin, interleaved=True):
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("qk_rmsnorm_rope"))
def _qk_rmsnorm_rope_fake(q, k, q_weight, k_weight, cos, sin, eps=1e-6, across_heads=True,
                          interleaved=True):
    torch._check(k.dtype == q.dtype, lambda: "ltx_kernels.qk_rmsnorm_rope: k must have q's dtype")
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake(add_op_namespace_prefix("gelu"))
def _gelu_fake(x, approximate="tanh"):
    return x.new_empty(x.shape)


@torch.library.register_fake(add_op_namespace_prefix("geglu"))
def _geglu_fake(x, approximate="none"):
    torch._check(x.shape[-1] % 2 == 0,
                 lambda: "ltx_kernels.geglu: x must have an even last dimension")
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake(add_op_namespace_prefix("linear_gelu"))
def _linear_gelu_fake(x, weight, bias=None):
    torch._check(weight.dim() == 2 and weight.shape[1] == x.shape[-1],
                 lambda: "ltx_kernels.linear_gelu: weight must have shape [N, K] with "
                 "K = x.shape[-1]")
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
