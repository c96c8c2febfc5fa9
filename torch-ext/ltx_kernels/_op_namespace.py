"""The compiled op library of this build and its torch.ops namespace.

setuptools builds (setup.py) have the extension `_C`, which registers the ops under
torch.ops.ltx_kernels. Hub builds (kernel-builder) have no `_C`: CMake generates `_ops.py` from
kernel-builder's templates/torch/_ops.py.in, which imports the build's extension and names its
per-build namespace. `_ops.py` is therefore not committed (.gitignore), or kernel-builder would
overwrite it.
"""

import importlib.util

import torch

if importlib.util.find_spec(f"{__package__}._C") is not None:
    from . import _C  # noqa: F401  (loading it runs the TORCH_LIBRARY registrations)

    ops = torch.ops.ltx_kernels

    def add_op_namespace_prefix(op_name: str) -> str:
        """'rmsnorm' -> 'ltx_kernels::rmsnorm'."""
        return f"ltx_kernels::{op_name}"

elif importlib.util.find_spec(f"{__package__}._ops") is not None:
    from ._ops import add_op_namespace_prefix, ops  # noqa: F401
else:
    raise ImportError(
        "no compiled op library: neither the setuptools extension _C nor the _ops "
        "module of a kernel-builder build is present"
    )
