"""Classifier-free-guidance parallelism: the two guidance branches of a diffusers video pipeline
(unconditional and conditional) on two GPU groups, with context parallelism (Ulysses / ring)
inside each group, e.g. 2 groups x Ulysses 2 on 4 GPUs; or, for LTX-2 with STG and modality
isolation on, its four passes a step on four groups (e.g. one GPU each on 4 GPUs).

    ltx_kernels.inject_optimized_kernels(pipe)  # before or after (Wan, HunyuanVideo-1.5: before)
    enable_cfg_parallel(pipe, ContextParallelConfig(ulysses_degree=2))  # 4 processes
    enable_cfg_parallel(ltx2_pipe, groups=4)  # 4 processes, one LTX-2 pass each

The processes form a (cfg, ring, ulysses) device mesh: ranks [0, N) are group 0, [N, 2N) group 1,
and so on, N the context-parallel degree. Each transformer gets diffusers' context parallelism over
its own group (the "ring" and "ulysses" dims) and a diffusers hook, outermost, that hands each group
one branch and exchanges the results between the groups (the "cfg" dim), so that every rank
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
- four groups (LTX-2, groups=4): the twins' arguments are the batched call's conditional half with
  their changes, and the first twin's own argument (the STG blocks, a local of the pipeline's
  call) is seen at its call. So at the first step the twins run as with two groups (groups 2 and
  3 repeat 0 and 1), and from the second step on groups 2 and 3 run the twins beside the batched
  call, in its one all-gather: one pass a step a group instead of two. Each twin's call returns
  what was run ahead for it after checking its arguments against the prediction (all of them,
  with one device sync); a first twin predicted wrongly (other STG blocks) is run then, as at
  the first step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .context_parallel import CFG_PARALLEL_HOOK, _GatherSequence, injected_plan

GROUPS = 2  # the guidance branches: unconditional and conditional
TWIN_GROUPS = 4  # LTX-2's four passes a step: the two branches and the two twins


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
    # Four groups: the arguments of the first's that only its call shows (the batched call's
    # conditional half with these is its call), and the property that turns it on.
    first_own: tuple[str, ...] = ()
    first_when: str = ""


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
        first_own=("spatio_temporal_guidance_blocks",),
        first_when="do_spatio_temporal_guidance",
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


def enable_cfg_parallel(pipe, context_parallel=None, groups: int = GROUPS) -> None:
    """Runs the pipeline's two guidance branches on two halves of the torch.distributed world
    (one process per GPU, e.g. torchrun), each half under `context_parallel` (a diffusers
    ContextParallelConfig: Ulysses / ring over the half's GPUs; None: one GPU a branch).
    groups=4 (LTX-2 pipelines, called with STG and modality isolation on): its four passes a
    step on four quarters of the world instead (module docstring).

    Call instead of the transformer's enable_parallelism (it calls that on each half), before or
    after inject_optimized_kernels (injected after, remove_optimized_kernels can restore the
    model; Wan under context parallelism: before, diffusers' split hook sits on its first block;
    HunyuanVideo-1.5 under context parallelism: before, its plan is ours). Every pipeline
    call must have guidance on (guidance_scale > 1); every rank must make the same calls with the
    same inputs, as under context parallelism. A pipeline sharing the transformers (from_pipe)
    takes them over by the same call with the same layout."""
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
    if groups != GROUPS and not (groups == TWIN_GROUPS and PIPELINES[name].twins):
        with_twins = sorted(key for key, branches in PIPELINES.items() if branches.twins)
        raise ValueError(
            f"enable_cfg_parallel: groups={groups} for {name}; {GROUPS} (the guidance branches), "
            f"or {TWIN_GROUPS} (the branches and the STG and modality passes) for "
            f"{', '.join(with_twins)}"
        )
    world = dist.get_world_size()
    if world != groups * degree:
        what = "guidance branches" if groups == GROUPS else "passes a step"
        raise ValueError(
            f"enable_cfg_parallel: the world size {world} must be {groups} ({what}) x "
            f"the context-parallel degree {degree} (ring_degree x ulysses_degree) = "
            f"{groups * degree}"
        )
    transformers = _transformers(pipe)
    hooks = [_cfg_hook(transformer) for _, transformer in transformers]
    if any(hooks):  # (a pipeline sharing the transformer, e.g. made with from_pipe)
        _rebind(pipe, transformers, hooks, (groups, context_parallel))
        return
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
        (groups, ring, ulysses),
        mesh_dim_names=("cfg", "ring", "ulysses"),
    )
    from diffusers.hooks import HookRegistry

    for _, transformer in transformers:
        if context_parallel is not None:
            config = _copy_config(context_parallel)
            config.mesh = mesh
            transformer.enable_parallelism(config=config, cp_plan=injected_plan(transformer))
        hook = _CfgParallelHook(pipe, PIPELINES[name], mesh["cfg"], (groups, context_parallel))
        registry = HookRegistry.check_if_exists_or_initialize(transformer)
        registry.register_hook(hook, CFG_PARALLEL_HOOK)


def _cfg_hook(transformer):
    """The enable_cfg_parallel hook on the transformer, or None."""
    registry = getattr(transformer, "_diffusers_hook", None)
    hook = registry.get_hook(CFG_PARALLEL_HOOK) if registry is not None else None
    return hook if isinstance(hook, _CfgParallelHook) else None


def _rebind(pipe, transformers, hooks, layout) -> None:
    """enable_cfg_parallel on a pipeline whose transformers run under it already (through another
    pipeline: from_pipe shares them): the hooks serve this pipeline from now on, in the layout
    (groups, context-parallel config) they were set up with."""
    name = type(pipe).__name__
    for (key, _), hook in zip(transformers, hooks, strict=True):
        if hook is None or hook.layout != layout:
            raise RuntimeError(
                f"enable_cfg_parallel: {name}.{key} "
                + (
                    "runs without it beside a transformer that runs under it"
                    if hook is None
                    else f"runs under it with groups={hook.layout[0]} and {hook.layout[1]}, "
                    f"not groups={layout[0]} and {layout[1]} (a layout stays as it was set up)"
                )
            )
    for hook in hooks:
        hook.pipe, hook.branches = weakref.ref(pipe), PIPELINES[name]
        hook.reset_state(None)


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

    def __init__(self, pipe, branches: Branches, cfg_mesh, layout: tuple):
        from diffusers.hooks.hooks import StateManager

        self.fn_ref = None  # set by diffusers' HookRegistry.register_hook
        self.pipe = weakref.ref(pipe)  # (the pipeline holds the transformer, which holds this)
        self.branches = branches
        self.group = cfg_mesh.get_group()
        self.layout = layout  # (groups, the ContextParallelConfig given, or None)
        self.index = cfg_mesh.get_local_rank()  # this rank's guidance group: 0 .. groups - 1
        self.state = StateManager(_NoState)
        # separate: the first call's output, for the second call
        self.pending = None
        # Calls run ahead: cache context -> (their predicted arguments, their output).
        self.ahead = {}
        # Four groups: the first twin's own arguments (Twins.first_own) at its last call.
        self.first_own = None

    @property
    def groups(self) -> int:
        return self.layout[0]

    def initialize_hook(self, module):
        return module

    def deinitalize_hook(self, module):  # (diffusers' spelling)
        return module

    def pre_forward(self, module, *args, **kwargs):
        return args, kwargs

    def post_forward(self, module, output):
        return output

    def reset_state(self, module):
        self.pending, self.ahead, self.first_own = None, {}, None
        return module

    def new_forward(self, module, *args, **kwargs):
        context = self.state._context
        name = None if context is None else context.name
        branches = self.branches
        if name in self.ahead:
            return self._ran_ahead(module, name, args, kwargs)
        if name == branches.batched or name in (branches.separate or ()):
            if self._read(branches.guided) is False:
                raise RuntimeError(
                    f"enable_cfg_parallel: {type(self.pipe()).__name__} was called with guidance off "
                    f"({branches.unguided}): one branch, nothing to run in parallel; call it "
                    "with guidance_scale > 1, or on a pipeline without enable_cfg_parallel"
                )
            if name == branches.batched:
                return self._batched(module, args, kwargs)
            return self._separate(module, name, args, kwargs)
        twins = branches.twins
        if twins and name == twins.first and self._read(lambda p: getattr(p, twins.when)):
            return self._first_twin(module, args, kwargs)
        return self.fn_ref.original_forward(*args, **kwargs)  # (one pass, on every group)

    def _read(self, read):
        """bool(read(pipeline)) of the pipeline this hook serves (None once it is gone); a clear
        error where it holds no such state: it never ran, so another pipeline sharing the
        transformer (e.g. made with from_pipe) is calling it."""
        pipe = self.pipe()
        if pipe is None:
            return None
        try:
            return bool(read(pipe))
        except AttributeError as error:
            raise RuntimeError(
                f"enable_cfg_parallel: the transformer is called, but the {type(pipe).__name__} it "
                f"serves is not running ({error}): another pipeline sharing it (from_pipe)? call "
                "enable_cfg_parallel on that pipeline too (it takes the transformers over)"
            ) from error

    def _gather(self, output):
        """Every group's output of one call, stacked along a new first dim in group order."""
        return _map_tensors(output, lambda x: _GatherSequence.apply(x.unsqueeze(0), 0, self.group))

    def _batched(self, module, args, kwargs):
        """This group's half of the batch through the model, then the whole batch's output;
        with four groups, groups 2 and 3 run the twins meanwhile (once their call was seen)."""
        kwargs = _keywords(module, args, kwargs)
        batch = kwargs["hidden_states"].shape[0]
        if batch % GROUPS:
            raise RuntimeError(
                f"enable_cfg_parallel: the transformer got a batch of {batch}, not the guidance "
                f"branches concatenated (a multiple of {GROUPS})"
            )
        half = batch // GROUPS
        runs = [
            {
                key: value[start : start + half] if _is_batched(value, batch) else value
                for key, value in kwargs.items()
            }
            for start in (0, half)
        ]
        self.ahead = {}  # (what an interrupted step left)
        if self.groups == TWIN_GROUPS:
            self._check_twins_on()
            if self.first_own is not None:  # the twins: the conditional half, changed
                runs += [{**runs[1], **self.first_own}, {**runs[1], **self.branches.twins.changes}]
        # (Four groups at the first step: groups 2 and 3 repeat the halves of 0 and 1.)
        every = self._gather(self.fn_ref.original_forward(**runs[self.index % len(runs)]))
        if len(runs) == TWIN_GROUPS:
            twins = self.branches.twins
            for group, name in enumerate((twins.first, twins.second), start=GROUPS):
                self.ahead[name] = (runs[group], _map_tensors(every, lambda x, g=group: x[g]))
        return _map_tensors(every, lambda x: x[:GROUPS].flatten(0, 1))

    def _check_twins_on(self):
        pipe, twins = self.pipe(), self.branches.twins
        on = self._read(lambda p: getattr(p, twins.first_when) and getattr(p, twins.when))
        if on is False:
            raise RuntimeError(
                f"enable_cfg_parallel(groups={TWIN_GROUPS}): {type(pipe).__name__} was called "
                f"without both of its {twins.first!r} and {twins.second!r} passes ({twins.first_when}"
                f"={getattr(pipe, twins.first_when)}, {twins.when}={getattr(pipe, twins.when)}): "
                f"{TWIN_GROUPS} groups run its four passes a step; use groups={GROUPS}"
            )

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
            shape, dtype = _output_layout(kwargs["hidden_states"], module.config)
            self.pending = kwargs["hidden_states"].new_empty(shape, dtype=dtype)
            return _wrap(self.pending, return_dict)
        computed = self.fn_ref.original_forward(**kwargs) if self.index == 1 else None
        local = self.pending if computed is None else _sample(computed)
        shape, dtype = _output_layout(kwargs["hidden_states"], module.config)
        if (local.shape, local.dtype) != (shape, dtype):  # (every group checks its own output,
            raise RuntimeError(  # before the exchange: none waits in it for a group that raised)
                f"enable_cfg_parallel: the transformer returned {tuple(local.shape)} "
                f"{local.dtype}, not the {tuple(shape)} {dtype} the other group's output is laid "
                "out as"
            )
        both = self._gather(local)  # [first, second]
        first_sample, self.pending = self.pending, None
        if computed is None:
            return _wrap(both[1], return_dict)
        first_sample.copy_(both[0])
        return computed

    def _first_twin(self, module, args, kwargs):
        """The even groups run this pass, the odd ones the second twin (these arguments with its
        changes); both outputs exchanged, the second kept for its call."""
        twins = self.branches.twins
        kwargs = _keywords(module, args, kwargs)
        if self.groups == TWIN_GROUPS:  # (seen here, run ahead from the next step)
            self.first_own = {key: kwargs.get(key) for key in twins.first_own}
        second = {**kwargs, **twins.changes}
        every = self._gather(self.fn_ref.original_forward(**(second if self.index % 2 else kwargs)))
        self.ahead[twins.second] = (second, _map_tensors(every, lambda x: x[1]))
        return _map_tensors(every, lambda x: x[0])

    def _ran_ahead(self, module, name, args, kwargs):
        """The output a call run ahead computed for this call, its arguments checked. A first
        twin run ahead with other arguments (four groups: other STG blocks) runs now instead."""
        predicted, output = self.ahead.pop(name)
        kwargs = _keywords(module, args, kwargs)
        differing = _differing(predicted, kwargs)
        if not differing:
            return output
        twins = self.branches.twins
        if name == twins.first:
            self.ahead.pop(twins.second, None)
            return self._first_twin(module, (), kwargs)
        raise RuntimeError(
            f"enable_cfg_parallel: the {name!r} call's arguments {differing} differ from those "
            "it was run ahead with (the "
            + (
                f"{twins.first!r} call's with {twins.changes})"
                if self.groups == GROUPS
                else f"{self.branches.batched!r} call's second half with {twins.changes})"
            )
        )


def _differing(predicted: dict, kwargs: dict) -> list[str]:
    """The names of the arguments that differ between two calls' (tensors: shape, dtype, device
    and values, NaN equal to NaN, compared on the devices with one sync for all)."""
    differing, compared = [], []
    for key in sorted(predicted.keys() | kwargs.keys()):
        a, b = predicted.get(key), kwargs.get(key)
        tensors = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
        if all(tensors) and (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device):
            if a is not b:
                compared.append((key, a, b))
        elif any(tensors) or a != b:
            differing.append(key)
    if compared:
        device = compared[0][1].device
        equal = torch.stack([_equal(a, b).to(device) for _, a, b in compared]).tolist()
        differing += [key for (key, _, _), same in zip(compared, equal) if not same]
    return sorted(differing)


def _equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Whether two tensors of one shape hold the same values, NaN equal to NaN (a 0-dim bool
    tensor: no sync)."""
    same = a == b
    if a.is_floating_point() or a.is_complex():
        same |= torch.isnan(a) & torch.isnan(b)
    return same.all()


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


def _output_layout(hidden_states: torch.Tensor, config) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype of a video transformer's output for `hidden_states` [B, C, F, H, W]: C
    replaced by the model's out_channels (Wan: in_channels where out_channels is None)."""
    channels = config.out_channels or config.in_channels
    return torch.Size(
        (hidden_states.shape[0], channels, *hidden_states.shape[2:])
    ), hidden_states.dtype
