"""diffusers context parallelism (`model.enable_parallelism(config=ContextParallelConfig(...))`) with
the fused attention processors.

diffusers splits the model's inputs along the sequence (the model class's `_cp_plan`) and runs every
attention call through Ulysses (all-to-all from sequence to heads) or ring attention (K/V chunks
passed around). LTX-Video's plan splits the text too, and cross-attention to a split, masked text
fails in diffusers 0.42: Ulysses all-gathers the mask's sequence but not its head axis, so the
[B, heads, 1, S_txt] mask meets q/k/v with heads/N heads and attention raises (diffusers #14316);
ring attention applies each rank's mask chunk to every K/V chunk that passes by, silently wrong.

The fused processors avoid both: a cross-attention under context parallelism all-gathers the text
tokens and their mask (a few hundred tokens: cheaper than the four all-to-alls of a Ulysses call
whose queries and outputs are video-sized) and attends locally, this rank's video queries against
the whole text. In inference the blocks of a step share one gather (gather_cross_attention_inputs).
Collectives are waited at once, eager through c10d's in-place ops (all_to_all, all_gather,
reduce_scatter): functional collectives return a Python tensor subclass through which every later
op would dispatch (a third of the eager step's host time on 2 H200s), and cost more host time each.

Self-attention under Ulysses goes through the attention seam (attention.py: ulysses_attention),
and so does LTX-2's video-to-audio attention (queries whole on every rank:
ulysses_whole_queries_attention).

LTX-2 keeps its audio whole on every GPU; its processors attend by role (ltx2.CP_ROLES) and take
their chunk of the RoPE tables (local_rope_tables).
"""

from __future__ import annotations

import contextlib

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


# The collectives along dim 0 of a contiguous tensor, waited at once (on the current stream).
# Eager through c10d's in-place ops into a new tensor: a functional collective takes ~2.5x their
# host time (its op's Python autograd wrapper, an AsyncCollectiveTensor around the result, through
# which every later op would dispatch in Python until its wait). Under Dynamo through the functional
# collectives, which it traces as the op and its wait (an in-place op traces to those and a copy).
def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Equal chunks of dim 0 to each rank, in rank order."""
    if torch.compiler.is_compiling():
        return _collective("all_to_all_single")(x, None, None, group)
    out = torch.empty_like(x)
    torch.distributed.all_to_all_single(out, x, group=group)
    return out


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x, concatenated along dim 0 in rank order."""
    if torch.compiler.is_compiling():
        return _collective("all_gather_single")(x, 0, group)
    out = x.new_empty(group.size() * x.shape[0], *x.shape[1:])
    torch.distributed.all_gather_into_tensor(out, x, group=group)
    return out


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of dim 0 of the sum of every rank's x."""
    if torch.compiler.is_compiling():
        return _collective("reduce_scatter_single")(x, "sum", 0, group)
    out = x.new_empty(x.shape[0] // group.size(), *x.shape[1:])
    torch.distributed.reduce_scatter_tensor(out, x, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim`; backward: the gradients of all ranks summed, this rank's chunk kept
    (a reduce-scatter). Both run along dim 0 of a contiguous copy: torch 2.11 gathers along another
    dim through a helper Dynamo will not trace, and its reduce-scatter needs contiguous input."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather(x.movedim(dim, 0).contiguous(), group).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.movedim(ctx.dim, 0).contiguous()
        return reduce_scatter(grad, ctx.group).movedim(0, ctx.dim), None, None


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


#: The hooks parallelism puts on the model itself, innermost first: diffusers' context-parallel
#: split hook (enable_parallelism: its plan's "" entry, which splits the model's inputs) and
#: enable_cfg_parallel's (cfg_parallel.py), each optional.
_MODEL_SPLIT_HOOK = "cp_input---"
CFG_PARALLEL_HOOK = "ltx_kernels_cfg_parallel"
_PARALLEL_HOOKS = (_MODEL_SPLIT_HOOK, CFG_PARALLEL_HOOK)


def has_parallel_split_hook(module: torch.nn.Module) -> bool:
    """True when diffusers' context parallelism hooks `module` itself (a `_cp_plan` entry: an
    input split or an output gather, e.g. Wan's blocks.0 and proj_out)."""
    registry = getattr(module, "_diffusers_hook", None)
    names = getattr(registry, "hooks", None) or {}
    return any(name.startswith(("cp_input---", "cp_output---")) for name in names)


def has_only_parallel_hooks(model: torch.nn.Module) -> bool:
    """True when model.forward is wrapped by parallelism's hooks only (_PARALLEL_HOOKS, in their
    order: no other diffusers hook, no accelerate hook, no torch forward hook)."""
    from diffusers.hooks import HookRegistry

    registry = getattr(model, "_diffusers_hook", None)
    if not isinstance(registry, HookRegistry) or not registry.hooks:
        return False
    names = list(registry.hooks)
    return (
        names == [name for name in _PARALLEL_HOOKS if name in names]
        and not hasattr(model, "_hf_hook")
        and not (model._forward_hooks or model._forward_pre_hooks)
    )


@contextlib.contextmanager
def beneath_parallel_hooks(model: torch.nn.Module, replan):
    """For a body that swaps the model's forward after enable_parallelism / enable_cfg_parallel:
    when parallelism's hooks are the only hooks on the model, lifts them for the body and puts
    them back on the new forward, diffusers' split hook with its plan entry passed through
    `replan` (a `_cp_plan` -> `_cp_plan` function, e.g. plan_without_timestep), so that the model
    is as if injected before. Yields (whether it lifted hooks, the split plan entry it lifted or
    None); (False, None), doing nothing, when the model has no such hook or others too."""
    if not has_only_parallel_hooks(model):
        yield False, None
        return
    registry = model._diffusers_hook
    lifted = {name: registry.get_hook(name) for name in registry.hooks}
    for name in reversed(list(lifted)):  # outermost first
        registry.remove_hook(name)
    split = lifted.get(_MODEL_SPLIT_HOOK)
    try:
        yield True, None if split is None else split.metadata
    except BaseException:
        for name, hook in lifted.items():  # as it was
            registry.register_hook(hook, name)
        raise
    if split is not None:
        from diffusers.hooks.context_parallel import ContextParallelSplitHook

        plan = replan({"": split.metadata})[""]
        lifted[_MODEL_SPLIT_HOOK] = ContextParallelSplitHook(plan, split.parallel_config)
    for name, hook in lifted.items():
        registry.register_hook(hook, name)


def injected_plan(model):
    """The `cp_plan` to pass to `model.enable_parallelism` where diffusers has none and the
    injected model runs one: HunyuanVideo-1.5 (hunyuan.context_parallel_plan); None (the model's
    own `_cp_plan`) for the others."""
    if type(model).__name__ == "HunyuanVideo15Transformer3DModel":
        from .hunyuan import context_parallel_plan

        return context_parallel_plan(model)
    return None


def plan_without_timestep(cp_plan):
    """A model's `_cp_plan` without a timestep entry (diffusers 0.42's LTX-Video and LTX-2 plans
    have none; a plan entry for per-token [B, S] timesteps, ours before, makes diffusers' split
    hook log a warning for every [B] timestep, a graph break under torch.compile: a whole-model
    compile under context parallelism failed with fullgraph=True). The patched forwards take
    their chunk of per-token timesteps instead (local_token_timesteps)."""
    if cp_plan is None or "timestep" not in cp_plan.get("", {}):
        return cp_plan
    inputs = {name: entry for name, entry in cp_plan[""].items() if name != "timestep"}
    return {**cp_plan, "": inputs}


def local_token_timesteps(timestep: torch.Tensor, tokens: int, parallel_config) -> torch.Tensor:
    """Per-token timesteps [B, S] of the whole sequence (LTXConditionPipeline): this rank's chunk
    where the model's tokens were split (`tokens`: how many this rank holds); a [B] timestep, or
    one of this rank's tokens, as it is (the patched LTX-Video and LTX-2 forwards, their plans
    without a timestep entry: plan_without_timestep)."""
    if timestep.ndim != 2 or timestep.shape[1] == tokens:
        return timestep
    return shard_sequence(timestep, 1, parallel_config)


def shard_sequence(x: torch.Tensor, dim: int, parallel_config) -> torch.Tensor:
    """This rank's chunk of `x` along `dim`, as diffusers' plan splits a model input (for an
    optional input, which the plan cannot name: its hook raises on an absent argument); `x` as it is
    without context parallelism."""
    cp_config = context_parallel_config(parallel_config)
    if cp_config is None:
        return x
    from diffusers.hooks.context_parallel import EquipartitionSharder, PartitionAnythingSharder

    if cp_config.ulysses_anything or cp_config.ring_anything:
        return PartitionAnythingSharder.shard_anything(x, dim, cp_config._flattened_mesh)
    return EquipartitionSharder.shard(x, dim, cp_config._flattened_mesh)


def local_rope_tables(cos_sin, tokens: int, parallel_config):
    """RoPE tables (cos, sin; tokens in dim -2) of a tensor of `tokens` tokens: this rank's chunk
    when they span the whole sequence (the plan split the tensor, not its tables), else as they
    are."""
    if cos_sin is None or context_parallel_config(parallel_config) is None:
        return cos_sin
    if cos_sin[0].shape[-2] == tokens:
        return cos_sin
    return tuple(shard_sequence(t, t.dim() - 2, parallel_config) for t in cos_sin)


def gather_cross_attention_inputs(parallel_config, encoder_hidden_states, attention_mask):
    """Under context parallelism, the whole text (tokens and mask, sequence last in the mask) for a
    cross-attention and None as the parallel config to attend with; otherwise the inputs unchanged.
    Every block of a step attends to the same text tensors: without autograd recording (and not
    under compile) the last call's gather is reused while its inputs are the same, unmodified
    tensors, so a step gathers its text once instead of once per block. (Inference tensors,
    made under torch.inference_mode, have no version counter: for them "unmodified" rests on
    nothing in diffusers writing a block's text in place.)"""
    cp_config = context_parallel_config(parallel_config)
    if cp_config is None or encoder_hidden_states is None:
        return encoder_hidden_states, attention_mask, parallel_config
    inputs = (encoder_hidden_states, attention_mask)
    reusable = not torch.compiler.is_compiling() and not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    )
    outputs = _last_text_gather_of(cp_config, inputs) if reusable else None
    if outputs is not None:
        return (*outputs, None)
    encoder_hidden_states = gather_sequence(encoder_hidden_states, 1, cp_config)
    if attention_mask is not None:
        attention_mask = gather_sequence(attention_mask, attention_mask.ndim - 1, cp_config)
    if reusable:
        tensors = (*inputs, encoder_hidden_states, attention_mask)
        versions = tuple(version_of(t) for t in tensors)
        _last_text_gather[:] = [cp_config, capturing(), tensors, versions]
    return encoder_hidden_states, attention_mask, None


#: [config, whether a CUDA graph was being captured, (text, mask, gathered text, gathered mask),
#: their versions] of the last reusable gather_cross_attention_inputs call (held: the tensors' ids
#: stay theirs).
_last_text_gather: list = []


def _last_text_gather_of(cp_config, inputs):
    """The last reusable call's (gathered text, gathered mask) when it had this config and these
    input tensors and none of the four was written since; else None."""
    if not _last_text_gather:
        return None
    config, was_capturing, tensors, versions = _last_text_gather
    if config is not cp_config or was_capturing != capturing():  # (a graph reads what it gathered)
        return None
    if any(t is not u for t, u in zip(tensors, inputs)):
        return None
    if any(version_of(t) != v for t, v in zip(tensors, versions)):
        return None
    return tensors[2:]


def version_of(t: torch.Tensor | None) -> int | None:
    """t's version counter (None for None and inference tensors, which have none)."""
    return None if t is None or t.is_inference() else t._version


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
