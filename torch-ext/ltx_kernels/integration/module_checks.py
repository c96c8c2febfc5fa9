"""What a fused step checks, on every call, on the modules and tensors it reads before it bypasses
their forward: hooks that would see the call, and tensor subclasses the ops cannot read."""

from __future__ import annotations

import torch

#: The tensor types the fused ops take. A weight of another type (a tensor subclass: torchao's
#: Float8Tensor, quanto's, GGUF's or bitsandbytes' quantized parameters) is used through its own
#: ops: a fused step that would read it runs the diffusers code (reported at injection).
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def plain_tensor(t) -> bool:
    """None or a plain tensor/parameter (not a tensor subclass)."""
    return t is None or type(t) in _PLAIN_TENSOR_TYPES


def has_forward_hook(module: torch.nn.Module) -> bool:
    """True when `forward` is replaced on the instance: an accelerate or diffusers hook (offload,
    cache, layerwise casting) or another patch wraps the forward it found there. The class's own
    forward bound to the module (what accelerate's remove_hook_from_module, and so
    pipe.remove_all_hooks(), leaves behind) is not a hook."""
    forward = vars(module).get("forward")
    return forward is not None and not _is_own_forward(module, forward)


def has_hooks(module: torch.nn.Module) -> bool:
    """has_forward_hook, or forward (pre-)hooks registered on the module: anything that would see
    a call's inputs or outputs."""
    return has_forward_hook(module) or bool(module._forward_hooks or module._forward_pre_hooks)


def _is_own_forward(module: torch.nn.Module, forward) -> bool:
    return (
        getattr(forward, "__self__", None) is module
        and getattr(forward, "__func__", None) is type(module).forward
    )
