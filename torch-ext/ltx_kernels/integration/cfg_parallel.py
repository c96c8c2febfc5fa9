"""Classifier-free-guidance parallelism: the two guidance branches of a diffusers video pipeline
(unconditional and conditional) on two GPU groups, with context parallelism (Ulysses / ring)
inside each group, e.g. 2 groups x Ulysses 2 on 4 GPUs.

    ltx_kernels.inject_optimized_kernels(pipe)  # before or after
    enable_cfg_parallel(pipe, ContextParallelConfig(ulysses_degree=2))  # 4 processes

The processes form a (cfg, ring, ulysses) device mesh: ranks [0, N) are group 0, [N, 2N) group 1,
N the context-parallel degree. Each transformer gets diffusers' context parallelism over its own
group (the "ring" and "ulysses" dims) and a diffusers hook, outermost, that hands each group one
branch and exchanges the results between the two groups (the "cfg" dim), so that every rank
returns what one GPU would and the pipeline (guidance sum, scheduler, callbacks) runs unchanged
and identically on every rank. The branches need no communication before that exchange.

How a pipeline calls its transformer (PIPELINES; the pipeline names each call's cache context):
- batched (LTX-Video, LTX-2): one call on the branches concatenated along the batch, in the cache
  context "cond_uncond". Each group runs its half of the batch (every tensor argument whose first
  dim is the batch is halved) and one all-gather across the groups puts the whole batch back.
- separate (Wan: "cond" then "uncond"; HunyuanVideo-1.5, through its guider: "pred_cond" then
  "pred_uncond"): one call per branch, the first call's output not read before the second call. Group 0 runs the first call and group 1 returns an empty tensor of the
  output's shape for it; group 1 runs the second; after the second call one all-gather exchanges
  the two outputs and group 1 fills the first call's tensor in place.
- twins (LTX-2's STG and modality-isolation passes, one branch each, "uncond_stg" then
  "uncond_modality"): the second's arguments are the first's with two flags changed, so at the
  first call group 0 runs it and group 1 runs the second, one all-gather exchanges them, and the
  second call returns what group 1 computed (its arguments checked against those it ran with).
  With one of the two passes off, the other runs whole on every group (right, not faster).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .context_parallel import CFG_PARALLEL_HOOK, _GatherSequence, injected_plan

GROUPS = 2  # the guidance branches: unconditional and conditional


@dataclass(frozen=True)
class Twins:
    """Two single-branch passes a step (LTX-2's STG and modality-isolation passes) where the
    second's arguments are the first's with `changes`, made when the pipeline's property `when`
    is true: at the first call, group 0 runs it and group 1 the second; the second call returns
    the second pass's output (its arguments checked against the prediction)."""

    first: str  # cache contexts
    second: str
    changes: dict
    when: str


@dataclass(frozen=True)
class Branches:
    """How a pipeline class calls its transformer, by cache context: `batched`, the two guidance
    branches in one call on their concatenated batch; `separate`, one call each, in this order;
    `twins`, two further passes run side by side. A call in any other context runs whole on
    every group."""

    batched: str | None = None
    separate: tuple[str, str] | None = None
    twins: Twins | None = None
    # Whether a pipeline runs both guidance branches at this step, and what it is when not.
    guided: Callable = lambda pipe: pipe.do_classifier_free_guidance
    unguided: str = "do_classifier_free_guidance is False: guidance_scale <= 1"


_LTX = Branches(batched="cond_uncond")
_LTX2 = Branches(
    batched="cond_uncond",
    twins=Twins(
        first="uncond_stg",
        second="uncond_modality",
        changes={"isolate_modalities": True, "spatio_temporal_guidance_blocks": None},
        when="do_modality_isolation_guidance",
    ),
)
_WAN = Branches(separate=("cond", "uncond"))
_HUNYUAN_VIDEO_15 = Branches(
    separate=("pred_cond", "pred_uncond"),
    guided=lambda pipe: pipe.guider._enabled and pipe.guider.num_conditions > 1,
    unguided="its guider runs one condition: guidance_scale <= 1, or a step outside its range",
)
PIPELINES = {
    "LTXPipeline": _LTX,
    "LTXImageToVideoPipeline": _LTX,
    "LTXConditionPipeline": _LTX,
    "LTX2Pipeline": _LTX2,
    "LTX2ImageToVideoPipeline": _LTX2,
    "WanPipeline": _WAN,
    "WanImageToVideoPipeline": _WAN,
    "HunyuanVideo15Pipeline": _HUNYUAN_VIDEO_15,
    "HunyuanVideo15ImageToVideoPipeline": _HUNYUAN_VIDEO_15,
}


def enable_cfg_parallel(pipe, context_parallel=None) -> None:
    """Runs the pipeline's two guidance branches on two halves of the torch.distributed world
    (one process per GPU, e.g. torchrun), each half under `context_parallel` (a diffusers
    ContextParallelConfig: Ulysses / ring over the half's GPUs; None: one GPU a branch).

    Call instead of the transformer's enable_parallelism (it calls that on each half), before or
    after inject_optimized_kernels (injected after, remove_optimized_kernels can restore the
    model; HunyuanVideo-1.5 under context parallelism: before, its plan is ours). Every pipeline call must have guidance on (guidance_scale > 1); every rank must make
    the same calls with the same inputs, as under context parallelism."""
    import torch.distributed as dist

    name = type(pipe).__name__
    if name not in PIPELINES:
        raise TypeError(
            f"enable_cfg_parallel: {name} is not supported (no classifier-free guidance, or its "
            f"transformer calls are not known); supported: {', '.join(sorted(PIPELINES))}"
        )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "enable_cfg_parallel: torch.distributed is not initialized; launch one process per "
            "GPU (torchrun --nproc_per_node N) and call torch.distributed.init_process_group first"
        )
    degree = 1
    if context_parallel is not None:
        degree = context_parallel.ring_degree * context_parallel.ulysses_degree
        if context_parallel.mesh is not None:
            raise ValueError(
                "enable_cfg_parallel: pass a ContextParallelConfig without a mesh (the guidance "
                "groups and their context-parallel meshes are built here)"
            )
    world = dist.get_world_size()
    if world != GROUPS * degree:
        raise ValueError(
            f"enable_cfg_parallel: the world size {world} must be {GROUPS} (guidance branches) x "
            f"the context-parallel degree {degree} (ring_degree x ulysses_degree) = "
            f"{GROUPS * degree}"
        )
    transformers = _transformers(pipe)
    for key, transformer in transformers:
        if transformer._parallel_config is not None:
            raise RuntimeError(
                f"enable_cfg_parallel: pipe.{key} already runs under enable_parallelism; pass its "
                "ContextParallelConfig to enable_cfg_parallel instead (it parallelizes each "
                "guidance group)"
            )
    ring = context_parallel.ring_degree if context_parallel else 1
    ulysses = context_parallel.ulysses_degree if context_parallel else 1
    mesh = torch.distributed.device_mesh.init_device_mesh(
        torch._C._get_accelerator().type,
        (GROUPS, ring, ulysses),
        mesh_dim_names=("cfg", "ring", "ulysses"),
    )
    from diffusers.hooks import HookRegistry

    for _, transformer in transformers:
        if context_parallel is not None:
            config = _copy_config(context_parallel)
            config.mesh = mesh
            transformer.enable_parallelism(config=config, cp_plan=injected_plan(transformer))
        hook = _CfgParallelHook(pipe, PIPELINES[name], mesh["cfg"])
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(hook, CFG_PARALLEL_HOOK)


def _transformers(pipe) -> list[tuple[str, torch.nn.Module]]:
    """The pipeline's denoisers: `transformer`, and Wan 2.2's `transformer_2` where present."""
    keys = ("transformer", "transformer_2")
    return [(key, getattr(pipe, key)) for key in keys if getattr(pipe, key, None) is not None]


def _copy_config(config):
    """A fresh copy of a ContextParallelConfig (each transformer's setup writes its own state)."""
    import dataclasses

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return type(config)(**fields)


class _NoState:
    """The per-context state diffusers' StateManager asks for (none is kept)."""

    def reset(self, *args, **kwargs):
        pass


class _CfgParallelHook:
    """A diffusers ModelHook (by its protocol: diffusers is imported only when used) wrapping a
    transformer's forward, outermost: each guidance group runs its branch, the groups exchange the
    results (module docstring). Stateful for diffusers, which hands it the cache context (the
    call's name) through its StateManager."""

    _is_stateful = True

    def __init__(self, pipe, branches: Branches, cfg_mesh):
        from diffusers.hooks.hooks import StateManager

        self.fn_ref = None  # set by diffusers' HookRegistry.register_hook
        self.pipe = weakref.ref(pipe)  # (the pipeline holds the transformer, which holds this)
        self.branches = branches
        self.group = cfg_mesh.get_group()
        self.index = cfg_mesh.get_local_rank()  # this rank's guidance group: 0 or 1
        self.state = StateManager(_NoState)
        # What a later call takes: separate, the first call's output; twins, (the second twin's
        # arguments, its output).
        self.pending = None

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # (diffusers' spelling)
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def reset_state(self, module):
        self.pending = None
        return module

    def new_forward(self, module, *args, **kwargs):
        context = self.state._context
        name = None if context is None else context.name
        branches, pipe = self.branches, self.pipe()
        if name == branches.batched or name in (branches.separate or ()):
            if pipe is not None and not branches.guided(pipe):
                raise RuntimeError(
                    f"enable_cfg_parallel: {type(pipe).__name__} was called with guidance off "
                    f"({branches.unguided}): one branch, nothing to run in parallel; call it "
                    "with guidance_scale > 1, or on a pipeline without enable_cfg_parallel"
                )
            if name == branches.batched:
                return self._batched(module, args, kwargs)
            return self._separate(module, name, args, kwargs)
        twins = branches.twins
        if twins and name == twins.first and pipe is not None and getattr(pipe, twins.when):
            return self._first_twin(module, args, kwargs)
        if twins and name == twins.second and self.pending is not None:
            return self._second_twin(module, args, kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)  # (one pass, on every group)

    def _batched(self, module, args, kwargs):
        """This group's half of the batch through the model, then the whole batch's output."""
        kwargs = _keywords(module, args, kwargs)
        batch = kwargs["hidden_states"].shape[0]
        if batch % GROUPS:
            raise RuntimeError(
                f"enable_cfg_parallel: the transformer got a batch of {batch}, not the guidance "
                f"branches concatenated (a multiple of {GROUPS})"
            )
        half = batch // GROUPS
        start = self.index * half
        local = {
            key: value[start : start + half] if _is_batched(value, batch) else value
            for key, value in kwargs.items()
        }
        output = self.fn_ref.original_forward(**local)
        return _map_tensors(output, lambda x: _GatherSequence.apply(x, 0, self.group))

    def _separate(self, module, name, args, kwargs):
        """Group 0 runs the first branch's call, group 1 the second's; after the second, the
        outputs are exchanged and the first call's tensor filled where it was not computed."""
        contexts = self.branches.separate
        first = name == contexts[0]  # (a first call drops what an interrupted step left)
        if not first and self.pending is None:
            raise RuntimeError(
                f"enable_cfg_parallel: a transformer call in cache context {name!r} without one "
                f"in {contexts[0]!r} before it (each step calls {' then '.join(contexts)})"
            )
        kwargs = _keywords(module, args, kwargs)
        return_dict = kwargs.get("return_dict", True)
        if first:
            if self.index == 0:
                output = self.fn_ref.original_forward(**kwargs)
                self.pending = _sample(output)
                return output
            # filled after the second call
            self.pending = _output_like(kwargs["hidden_states"], module.config)
            return _wrap(self.pending, return_dict)
        computed = self.fn_ref.original_forward(**kwargs) if self.index == 1 else None
        local = self.pending if computed is None else _sample(computed)
        both = _GatherSequence.apply(local.unsqueeze(0), 0, self.group)  # [first, second]
        first_sample, self.pending = self.pending, None
        if computed is None:
            return _wrap(both[1], return_dict)
        if (both.shape[1:], both.dtype) != (first_sample.shape, first_sample.dtype):
            raise RuntimeError(
                f"enable_cfg_parallel: the {contexts[0]!r} call returned "
                f"{tuple(both.shape[1:])} {both.dtype}, not the {tuple(first_sample.shape)} "
                f"{first_sample.dtype} its output was laid out as"
            )
        first_sample.copy_(both[0])
        return computed

    def _first_twin(self, module, args, kwargs):
        """Group 0 runs this pass, group 1 the second twin (these arguments with its changes);
        both outputs exchanged, the second kept for its call."""
        kwargs = _keywords(module, args, kwargs)
        second = {**kwargs, **self.branches.twins.changes}
        output = self.fn_ref.original_forward(**(second if self.index else kwargs))
        both = _map_tensors(output, lambda x: _GatherSequence.apply(x.unsqueeze(0), 0, self.group))
        self.pending = (second, _map_tensors(both, lambda x: x[1]))
        return _map_tensors(both, lambda x: x[0])

    def _second_twin(self, module, args, kwargs):
        """The output the first twin's call computed for this call, its arguments checked."""
        (predicted, output), self.pending = self.pending, None
        kwargs = _keywords(module, args, kwargs)
        differing = sorted(
            key
            for key in predicted.keys() | kwargs.keys()
            if not _same(predicted.get(key), kwargs.get(key))
        )
        if differing:
            raise RuntimeError(
                f"enable_cfg_parallel: the {self.branches.twins.second!r} call's arguments "
                f"{differing} differ from the {self.branches.twins.first!r} call's with "
                f"{self.branches.twins.changes}, with which it was run ahead"
            )
        return output


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)))
        )
    return a == b


def _keywords(module, args, kwargs) -> dict:
    """The call's arguments by name (pipelines pass them by keyword; positional ones are named
    from the model class's forward)."""
    if not args:
        return kwargs
    import inspect

    bound = inspect.signature(type(module).forward).bind_partial(module, *args, **kwargs)
    named = dict(bound.arguments)
    named.pop(next(iter(named)))  # self
    return named


def _is_batched(value, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == batch


def _map_tensors(output, fn):
    """`output` (a tensor, tuple, or diffusers BaseOutput) with fn applied to each tensor."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, tuple):
        return type(output)(_map_tensors(x, fn) for x in output)
    from diffusers.utils import BaseOutput

    if isinstance(output, BaseOutput):
        return type(output)(**{key: _map_tensors(value, fn) for key, value in output.items()})
    return output


def _sample(output) -> torch.Tensor:
    """The denoiser output of a one-output transformer call (tuple or Transformer2DModelOutput)."""
    return output[0] if isinstance(output, tuple) else output.sample


def _wrap(sample: torch.Tensor, return_dict: bool):
    if not return_dict:
        return (sample,)
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    return Transformer2DModelOutput(sample=sample)


def _output_like(hidden_states: torch.Tensor, config) -> torch.Tensor:
    """An empty tensor of a video transformer's output for `hidden_states` [B, C, F, H, W]: C
    replaced by the model's out_channels (Wan: in_channels where out_channels is None)."""
    channels = config.out_channels or config.in_channels
    shape = (hidden_states.shape[0], channels, *hidden_states.shape[2:])
    return hidden_states.new_empty(shape)
