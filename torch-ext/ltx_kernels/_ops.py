# Handle on the compiled op library. kernel-builder generates its own version of this module for
# Hub builds (with a per-build namespace); this one serves the setuptools build, whose library
# registers its ops under torch.ops.ltx_kernels.
import torch

from . import _C  # noqa: F401  (loading it runs the TORCH_LIBRARY registrations)

ops = torch.ops.ltx_kernels


def add_op_namespace_prefix(op_name: str) -> str:
    """'rmsnorm' -> 'ltx_kernels::rmsnorm'."""
    return f"ltx_kernels::{op_name}"
