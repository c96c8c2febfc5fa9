"""ltx_kernels: fused H100 (sm_90a) kernels for diffusers video and image transformers.

Every op is a torch custom op (`torch.ops.ltx_kernels.<op>`) with a CUDA kernel, a portable C CPU
implementation, a fake implementation for torch.compile/export, and a pure-PyTorch reference in
`ltx_kernels.reference`; `ltx_kernels.<op>` is its wrapper (ltx_kernels/ops.py).
`python -m ltx_kernels` prints an environment report for bug reports.
"""

from . import reference
from ._op_names import ATTENTION_OPS, BACKWARD_OPS, OPS, QUANT_FORMATS, QUANT_OPS
from .integration import (
    InjectionReport,
    inject_optimized_kernels,
    register_attention_backends,
    remove_optimized_kernels,
)
from .ops import *  # noqa: F403  (the op wrappers: ops.__all__, every op of the op tables)
from .ops import _library as _library  # (for integration's lazy check that the library loaded)
from .ops import load_error

__version__ = "0.1.0"
__all__ = [
    *OPS,
    *QUANT_OPS,
    *ATTENTION_OPS,
    "reference",
    "OPS",
    "QUANT_OPS",
    "QUANT_FORMATS",
    "ATTENTION_OPS",
    "BACKWARD_OPS",
    "load_error",
    "inject_optimized_kernels",
    "remove_optimized_kernels",
    "register_attention_backends",
    "InjectionReport",
]
