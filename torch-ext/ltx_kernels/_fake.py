"""Fake (meta) implementations of every op, so they trace under torch.compile and torch.export
without touching data. Each mirrors its C++ op: same output shapes, dtypes and (contiguous)
strides, and the same shape checks, as torch._check errors."""
import torch

from ._ops import add_op_namespace_prefix


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
