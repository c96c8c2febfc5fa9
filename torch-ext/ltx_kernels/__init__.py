"""ltx_kernels: fused H100 (sm_90a) kernels for diffusers video and image transformers.

Every op is a torch custom op (`torch.ops.ltx_kernels.<op>`) with a CUDA kernel, a portable C CPU
implementation, a fake implementation for torch.compile/export, and a pure-PyTorch reference in
`ltx_kernels.reference`. `python -m ltx_kernels` prints an environment report for bug reports.
"""
import torch

from . import reference

__version__ = "0.1.0"
__all__ = ["rmsnorm", "reference", "OPS", "load_error"]

#: Names of the ops this build registers under torch.ops.ltx_kernels.
OPS = ("rmsnorm",)

#: Why the compiled extension failed to load, or None. When set, calling an op raises.
load_error: Exception | None = None

try:
    from ._ops import ops
    from . import _fake  # noqa: F401  (registers the fake implementations)
except ImportError as error:  # keep the package importable so `python -m ltx_kernels` can report
    load_error = error
    ops = None


def _library():
    if ops is None:
        raise RuntimeError(
            "ltx_kernels: the compiled extension failed to load "
            f"({type(load_error).__name__}: {load_error}). Build it with "
            "`pip install -e . --no-build-isolation` against the torch you run with, and run "
            "`python -m ltx_kernels` for an environment report."
        ) from load_error
    return ops


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim, matching diffusers' `RMSNorm` (rounding and output dtype).

    x: [..., hidden] float32/float16/bfloat16 with a contiguous last dim (rows may be strided).
    weight: None (no scale, nothing allocated) or [hidden] in any of those dtypes, on x's device.
    Returns a new contiguous tensor of x's shape, of weight's dtype (x's dtype without weight);
    see `ltx_kernels.reference.rmsnorm` for the exact rounding rule.
    """
    return _library().rmsnorm(x, weight, eps)
