"""Pure-PyTorch references of every ltx_kernels op, with the same signatures and the same rounding
points as the kernels.

Uses:
- Debugging (the seed's one-op-at-a-time method): swap `ltx_kernels.<op>` for
  `ltx_kernels.reference.<op>` to take a kernel out of the picture.
- Tests: `compute_dtype=torch.float64` evaluates the same math exactly, rounding only where the
  kernel (and the diffusers code it replaces) rounds; `round_output=False` also skips the final
  rounding, giving the exact value the kernel's output is a rounding of.
"""
import torch

__all__ = ["rmsnorm"]

_HALF_TYPES = (torch.float16, torch.bfloat16)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    compute_dtype: torch.dtype = torch.float32,
    round_output: bool = True,
) -> torch.Tensor:
    """diffusers' RMSNorm (`models/normalization.py`) over the last dim.

    y = x * rsqrt(mean(x^2) + eps) in compute_dtype; without weight the result is rounded to
    x.dtype; with an fp16/bf16 weight y is rounded to weight.dtype, multiplied by the weight and
    rounded again; with an fp32 weight the product is returned in fp32. So the output dtype is
    weight.dtype with a weight and x.dtype without.
    """
    y = x.to(compute_dtype)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if weight.dtype in _HALF_TYPES:
            y = y.to(weight.dtype).to(compute_dtype)
        y = y * weight.to(compute_dtype)
    return y.to(weight.dtype if weight is not None else x.dtype) if round_output else y
