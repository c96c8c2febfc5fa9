"""Training memory ("recompute_norms" in FUSIONS): while a patched block runs its forward in eager
training (`scoped`), a norm's output or a single LoRA projection's output that lora_linear or
qk_rmsnorm_rope saves for backward is saved as the call that gives it again, which their backward
runs (torch-ext/autograd_ops.cpp, "Outputs recomputed in backward"):
- a norm step's output n, saved by the next projections for their LoRA gradients (attn1's q/k/v):
  recomputed from the norm's inputs, which its own node saves anyway: one [S, D] activation less
  per block for one norm launch in backward;
- a cross-attention's query and key projections, saved by its q/k norm: recomputed by
  lora_linear from the projection's input, which lora_linear saves anyway: one [S, D] activation
  (and the text's keys) less per block for the projections' GEMMs in backward.
The values are bit for bit the forward's (the same kernels on the same inputs); an input modified
in place since the forward raises. Under torch.compile the partitioner decides what to save; under
gradient checkpointing (torch.utils.checkpoint's saved-tensor hooks in place) the block is
recomputed anyway: the scope stays off in both."""

from __future__ import annotations

import functools

import torch

from ..ops import _library


def _no_saved_tensor_hooks() -> bool:
    """Whether no saved-tensor hooks are in place (torch.utils.checkpoint saves the block's tensors
    through its own; the calls we would keep instead would hold their inputs past it). False
    where torch does not tell (a private function, there from 2.8 on at least)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(False) is None


def scoped(forward):
    """A patched block's forward, with recompute_scope on while it runs where autograd records
    eagerly and "recompute_norms" is among the block's ops."""

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if (
            "recompute_norms" not in self._ltx_kernels_ops
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or not _no_saved_tensor_hooks()
        ):
            return forward(self, *args, **kwargs)
        scope = _library().recompute_scope
        scope(True)
        try:
            return forward(self, *args, **kwargs)
        finally:
            scope(False)

    # torch.compile keeps compiled code per code object: each forward wrapped gets a copy of
    # run's, or two block classes' forwards would compile as recompilations of one function.
    run.__code__ = run.__code__.replace(co_name=forward.__name__)
    return run
