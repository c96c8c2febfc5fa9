"""diffusers context parallelism (`model.enable_parallelism(config=ContextParallelConfig(...))`) with
the fused attention processors.

diffusers splits the model's inputs along the sequence (the model class's `_cp_plan`) and runs every
attention call through Ulysses (all-to-all from sequence to heads) or ring attention (K/V chunks
passed around). LTX-Video's plan splits the text too, and cross-attention to a split, masked text
fails in diffusers 0.42: Ulysses all-gathers the mask's sequence but not its head axis, so the
[B, heads, 1, S_txt] mask meets q/k/v with heads/N heads and attention raises (diffusers #14316);
ring attention applies each rank's mask chunk to every K/V chunk that passes by, silently wrong.

The fused processors avoid both: a cross-attention under context parallelism all-gathers the text
tokens and their mask (a few hundred tokens: one small all-gather per call, cheaper than the four
all-to-alls of a Ulysses call whose queries and outputs are video-sized) and attends locally, this
rank's video queries against the whole text. Self-attention keeps diffusers' parallel attention.
"""

from __future__ import annotations

import torch


def context_parallel_config(parallel_config):
    """The ContextParallelConfig inside an attention processor's `_parallel_config`, or None."""
    return getattr(parallel_config, "context_parallel_config", None)


def _collective(name: str):
    """A functional collective by its torch >= 2.15 name, or its older name (2.11-2.14)."""
    import torch.distributed._functional_collectives as funcol

    old_names = {
        "all_gather_single": "all_gather_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor",
    }
    return getattr(funcol, name, None) or getattr(funcol, old_names[name])


def _waited(tensor):
    import torch.distributed._functional_collectives as funcol

    return (
        funcol.wait_tensor(tensor) if isinstance(tensor, funcol.AsyncCollectiveTensor) else tensor
    )


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim`; backward: the gradients of all ranks summed, this rank's chunk kept
    (a reduce-scatter). Both run along dim 0 of a contiguous copy: torch 2.11 gathers along another
    dim through a helper Dynamo will not trace, and its reduce-scatter needs contiguous input."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        gathered = _collective("all_gather_single")(x.movedim(dim, 0).contiguous(), 0, group)
        return _waited(gathered).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.movedim(ctx.dim, 0).contiguous()
        chunk = _collective("reduce_scatter_single")(grad, "sum", 0, ctx.group)
        return _waited(chunk).movedim(0, ctx.dim), None, None


def gather_sequence(x: torch.Tensor, dim: int, cp_config) -> torch.Tensor:
    """All-gathers `x` along `dim` over the context-parallel ranks, in the rank order diffusers split
    it. Differentiable: every rank's queries attend to every chunk, so a chunk's gradient is the sum
    over the ranks."""
    if cp_config.ulysses_anything or cp_config.ring_anything:  # uneven chunks
        from diffusers.hooks.context_parallel import PartitionAnythingSharder

        if torch.is_grad_enabled() and x.requires_grad:
            raise NotImplementedError(
                "ltx_kernels: training under ulysses_anything / ring_anything is not supported "
                "(diffusers' uneven all-gather keeps only the local gradient chunk); use "
                "ulysses_degree / ring_degree with a sequence divisible by the degree"
            )
        return PartitionAnythingSharder.unshard_anything(x, dim, cp_config._flattened_mesh)
    return _GatherSequence.apply(x, dim, cp_config._flattened_mesh.get_group())


def gather_cross_attention_inputs(parallel_config, encoder_hidden_states, attention_mask):
    """Under context parallelism, the whole text (tokens and mask, sequence last in the mask) for a
    cross-attention and None as the parallel config to attend with; otherwise the inputs unchanged."""
    cp_config = context_parallel_config(parallel_config)
    if cp_config is None or encoder_hidden_states is None:
        return encoder_hidden_states, attention_mask, parallel_config
    encoder_hidden_states = gather_sequence(encoder_hidden_states, 1, cp_config)
    if attention_mask is not None:
        attention_mask = gather_sequence(attention_mask, attention_mask.ndim - 1, cp_config)
    return encoder_hidden_states, attention_mask, None
