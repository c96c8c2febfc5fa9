"""Autograd of every op: never silently wrong. For each op, every input that requires grad gets the
gradient of a float64 evaluation of the op's formula (`ltx_kernels.reference`, differentiated by
PyTorch in float64) on fresh random inputs, in every dtype, for every broadcast form of the
modulation tensors, odd hidden sizes, row-strided views and empty tensors; only the gradients
asked for are computed; opcheck (with its autograd and AOT tests), torch.compile(fullgraph=True) of
forward + backward, second derivatives (create_graph=True) against the float64 double backward,
and CUDA-graph capture of forward + backward. (gradcheck and gradgradcheck in float64:
test_gradcheck.py.)"""

import pytest
import torch

import ltx_kernels
from helpers import BROADCASTS, DTYPES, FRAMES, capture_graph, make_activation, make_modulation
from ltx_kernels import reference

# Relative L2 error of each gradient against the float64 evaluation. fp32: the backward computes
# in fp32 (reductions over up to a few thousand terms); fp16/bf16: the gradient is rounded to the
# input dtype where the forward rounds (as PyTorch's backward of the diffusers code is), a few
# roundings of 2^-11 / 2^-8 that add up in quadrature (seen on the CPU: at most 2.2e-7, 8e-4,
# 8.4e-3 over every case and three seeds).
GRAD_TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Relative L2 error of the second derivatives (create_graph=True, differentiated again) against
# the float64 double backward: the first derivatives' roundings carried through (seen on the CPU:
# at most 2.9e-7, 1.5e-3, 1.3e-2 over every case and three seeds; the largest, linear_gelu's gelu''
# at the pre-activation rounded to the dtype).
SECOND_TOLERANCE = {torch.float32: 1e-6, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
B, S, D = 2, 6, 37  # odd hidden size; S divisible by FRAMES
HEADS, HEAD_DIM = 3, 16


def _rand(*shape, dtype, device, std=1.0):
    return (std * torch.randn(*shape, device=device)).to(dtype)


def _x_for(kind, x):
    """x as the op sees it for a broadcast form ("frames" views x as [B, F, S/F, D])."""
    return x.unflatten(1, (FRAMES, -1)) if kind == "frames" else x


def cases(op, dtype, device, S=S, D=D, num_heads=HEADS, head_dim=HEAD_DIM):
    """(id, args, kwargs) of `op` covering its input forms, at sequence length S (a multiple of
    FRAMES), hidden size D and, for rope and qk_rmsnorm_rope, num_heads heads of head_dim (even);
    every float tensor may require grad."""
    x = make_activation((B, S, D), dtype, device, "row_strided")
    y = _rand(B, S, D, dtype=dtype, device=device)
    weight = _rand(D, dtype=dtype, device=device, std=0.3).add_(1)
    bias = _rand(D, dtype=dtype, device=device, std=0.3)
    out = []
    if op == "rmsnorm":
        out += [
            ("no_weight", (x, None, 1e-6), {}),
            ("weight", (x, weight, 1e-6), {}),
            ("fp32_weight", (x, weight.float(), 1e-6), {}),
        ]
    elif op in ("rmsnorm_modulate", "layernorm_modulate"):
        extra = (weight,) if op == "rmsnorm_modulate" else (weight, bias)
        for kind in BROADCASTS:
            scale, shift = make_modulation(kind, B, S, D, dtype, device, 2)
            out.append((kind, (_x_for(kind, x), scale, shift, *extra), {}))
        scale, shift = make_modulation("unbind6", B, S, D, torch.float32, device, 2)
        out.append(("upcast_fp32_modulation", (x, scale, shift, *extra), {"upcast": True}))
        out.append(("no_modulation_no_weight", (x, None, None), {}))
    elif op in ("add_rmsnorm_modulate", "add_layernorm_modulate"):
        extra = (weight,) if op == "add_rmsnorm_modulate" else (weight, bias)
        for kind in BROADCASTS:
            scale, shift, gate = make_modulation(kind, B, S, D, dtype, device, 3)
            out.append((kind, (_x_for(kind, x), _x_for(kind, y), scale, shift, gate, *extra), {}))
        scale, shift, gate = make_modulation("unbind6", B, S, D, torch.float32, device, 3)
        out.append(("upcast", (x, y, scale, shift, gate, *extra), {"upcast": True}))
        scale, shift = make_modulation("B1D", B, S, D, dtype, device, 2)
        out.append(("no_gate", (x, y, scale, shift, None), {}))
    elif op == "gated_residual":
        for kind in BROADCASTS:
            (gate,) = make_modulation(kind, B, S, D, dtype, device, 1)
            out.append((kind, (_x_for(kind, x), _x_for(kind, y), gate), {}))
        gate = make_modulation("unbind6", B, S, D, torch.float32, device, 1)[0]
        out += [("upcast", (x, y, gate), {"upcast": True}), ("no_gate", (x, y, None), {})]
    elif op in ("rope", "qk_rmsnorm_rope"):
        width = num_heads * head_dim
        tokens = make_activation((B, S, width), dtype, device, "row_strided")
        heads = tokens.unflatten(2, (num_heads, head_dim))  # row-strided tokens, contiguous heads
        other = _rand(*heads.shape, dtype=dtype, device=device)
        angle = torch.rand(S, head_dim, device=device) * 6.3
        cos, sin = angle.cos(), angle.sin()
        full = torch.rand(B, S, width, device=device) * 6.3
        half_angle = torch.rand(S, head_dim // 2, device=device) * 6.3
        if op == "rope":
            out += [
                ("per_head_table", (heads, cos, sin, True), {}),
                ("token_table", (tokens, full.cos(), full.sin(), True), {}),
                ("halves", (heads, cos, sin, False), {}),
                ("split_half_table", (heads, half_angle.cos(), half_angle.sin(), False), {}),
                ("x_dtype_table", (heads, cos.to(dtype), sin.to(dtype), True), {}),
            ]
        else:
            wd = _rand(width, dtype=dtype, device=device, std=0.3).add_(1)
            wh = _rand(head_dim, dtype=dtype, device=device, std=0.3).add_(1)
            tokens_k = _rand(B, S, width, dtype=dtype, device=device)
            out += [
                ("ltx", (tokens, tokens_k, wd, wd.float(), full.cos(), full.sin()), {}),
                ("no_rope", (tokens, tokens_k, wd, None, None, None), {}),
                ("wan_across_heads", (heads, other, wd, wd, cos, sin), {}),
                ("flux_per_head", (heads, other, wh, wh, cos, sin), {"across_heads": False}),
                (
                    "halves",
                    (heads, other, None, None, cos, sin),
                    {"across_heads": False, "interleaved": False},
                ),
            ]
    elif op == "gelu":
        out += [("tanh", (x, "tanh"), {}), ("none", (x, "none"), {})]
    elif op == "geglu":
        wide = make_activation((B, S, 2 * D), dtype, device, "row_strided")
        out += [("none", (wide, "none"), {}), ("tanh", (wide, "tanh"), {})]
    elif op == "linear_gelu":
        w = _rand(24, D, dtype=dtype, device=device, std=D**-0.5)
        out += [
            ("bias", (x, w, _rand(24, dtype=dtype, device=device)), {}),
            ("no_bias", (x, w, None), {}),
        ]
    elif op == "lora_linear":  # q/k/v-like: three projections in one weight, two with adapters
        w = _rand(3 * D, D, dtype=dtype, device=device, std=D**-0.5)
        lora_a = [_rand(r, D, dtype=dtype, device=device, std=D**-0.5) for r in (4, 3)]
        lora_b = [_rand(D, r, dtype=dtype, device=device, std=r**-0.5) for r in (4, 3)]
        bias = _rand(3 * D, dtype=dtype, device=device)
        out += [
            ("bias", (x, w, bias, lora_a, lora_b, [0.5, 2.0], [0, 2 * D]), {}),
            ("no_bias_one_adapter", (x, w, None, lora_a[:1], lora_b[:1], [1.0], [D]), {}),
            ("no_adapter", (x, w, bias, [], [], [], []), {}),
        ]
    else:
        raise AssertionError(f"no autograd test case for op {op}")
    return out


def _tensors(args):
    """The tensors of args, those in list arguments (lora_linear's adapters) included, in order."""
    out = []
    for a in args:
        out += [a] if isinstance(a, torch.Tensor) else _tensors(a) if isinstance(a, list) else []
    return out


def _map_tensors(args, fn):
    """args with each tensor t (also inside list arguments) of argument i replaced by fn(i, t)."""

    def one(i, a):
        if isinstance(a, torch.Tensor):
            return fn(i, a)
        return [one(i, t) for t in a] if isinstance(a, list) else a

    return [one(i, a) for i, a in enumerate(args)]


def _requiring_grad(args, which=None):
    """args with (leaf copies of) the float tensors requiring grad: all, or those of the argument
    indices `which`."""
    return _map_tensors(
        args,
        lambda i, t: t.detach().requires_grad_(True) if which is None or i in which else t,
    )


def _loss(outputs, grads):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return sum((o.float() * g).sum() for o, g in zip(outputs, grads))


def _output_grads(op, args, kwargs):
    with torch.no_grad():
        outputs = getattr(ltx_kernels, op)(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    return [torch.randn(o.shape, device=o.device) for o in outputs]


def _float64_grads(op, args, kwargs, grads):
    """Gradients of the float64 evaluation of reference.<op> (no intermediate rounding)."""
    args64 = _map_tensors(args, lambda _, t: t.detach().double().requires_grad_(t.requires_grad))
    outputs = getattr(reference, op)(
        *args64, **kwargs, compute_dtype=torch.float64, round_output=False
    )
    wanted = [a for a in _tensors(args64) if a.requires_grad]
    return torch.autograd.grad(_loss(outputs, [g.double() for g in grads]), wanted)


def _rel_l2(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_every_op_has_autograd(op):
    """Step 0 of training: each op registers its autograd (no silent pass-through)."""
    handle = getattr(torch.ops.ltx_kernels, op).default
    assert torch._C._dispatch_has_kernel_for_dispatch_key(handle.name(), "Autograd"), op


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_gradients_match_float64(op, dtype, device):
    for case, args, kwargs in cases(op, dtype, device):
        args = _requiring_grad(args)
        grads = _output_grads(op, args, kwargs)
        _loss(getattr(ltx_kernels, op)(*args, **kwargs), grads).backward()
        expected = _float64_grads(op, args, kwargs, grads)
        inputs = _tensors(args)
        for index, (a, want) in enumerate(zip(inputs, expected)):
            what = f"{op}[{case}] {dtype} grad of tensor input {index}"
            assert a.grad is not None, f"{what}: missing"
            assert a.grad.dtype == a.dtype and a.grad.shape == a.shape, what
            assert torch.isfinite(a.grad).all(), f"{what}: non-finite"
            error = _rel_l2(a.grad, want)
            assert error <= GRAD_TOLERANCE[dtype], f"{what}: relative L2 {error:.3g}"


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_only_requested_gradients(op, device):
    """With only x requiring grad (LoRA: the frozen norm weights and modulation get none), x's
    gradient is the same as with every input requiring grad, and no other input gets one."""
    _, args, kwargs = cases(op, torch.float32, device)[0 if "linear" in op else 1]
    grads = _output_grads(op, args, kwargs)
    everything = _requiring_grad(args)
    _loss(getattr(ltx_kernels, op)(*everything, **kwargs), grads).backward()
    only_x = _requiring_grad(args, which={0})
    _loss(getattr(ltx_kernels, op)(*only_x, **kwargs), grads).backward()
    torch.testing.assert_close(only_x[0].grad, everything[0].grad, rtol=1e-6, atol=1e-6)
    assert all(a.grad is None for a in _tensors(only_x[1:]))


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_empty_tensors(op, device):
    def no_tokens(a):  # the sequence dim sliced to 0 (activations, per-token operands, tables)
        if isinstance(a, torch.Tensor) and a.dim() >= 3 and a.shape[1] == S:
            return a[:, :0]
        if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] == S:
            return a[:0]
        return a

    empty = _requiring_grad([no_tokens(a) for a in cases(op, torch.float32, device)[0][1]])
    outputs = getattr(ltx_kernels, op)(*empty)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(o.sum() for o in outputs).backward()
    for a in _tensors(empty):
        assert a.grad is not None and a.grad.shape == a.shape
        # an empty input's gradient is empty; a broadcast parameter's is a sum over no rows: 0
        assert torch.count_nonzero(a.grad) == 0


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_opcheck_with_autograd(op, device):
    for _, args, kwargs in cases(op, torch.float32, device)[:2]:
        torch.library.opcheck(
            getattr(torch.ops.ltx_kernels, op).default, tuple(_requiring_grad(args)), kwargs
        )


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_compiled_forward_backward(op, device):
    """torch.compile(fullgraph=True) traces forward and backward (no graph break) and gives the
    eager gradients."""
    import torch._dynamo

    torch._dynamo.reset()
    _, args, kwargs = cases(op, torch.float32, device)[0]
    grads = _output_grads(op, args, kwargs)

    def step(*tensors):
        values = iter(tensors)
        full = _map_tensors(args, lambda *_: next(values))
        return _loss(getattr(ltx_kernels, op)(*full, **kwargs), grads)

    eager_inputs = _tensors(_requiring_grad(args))
    step(*eager_inputs).backward()
    compiled_inputs = _tensors(_requiring_grad(args))
    torch.compile(step, fullgraph=True)(*compiled_inputs).backward()
    for a, b in zip(compiled_inputs, eager_inputs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_compiled_dynamic_shapes_do_not_recompile_in_training(op):
    """torch.compile(fullgraph=True, dynamic=True) of forward + backward with every tensor input
    requiring grad, in every input form of the op: a second sequence length runs the same graphs
    (no recompile: bucketed training changes it every step) and gives the eager gradients. (A
    concrete size or stride read in the C++ autograd, rather than a symbolic one, specializes the
    traced backward to the first length.)"""
    import torch._dynamo

    for index, (case, _, kwargs) in enumerate(cases(op, torch.float32, "cpu")):

        def args_for(seq, index=index):
            return cases(op, torch.float32, "cpu", S=seq)[index][1]

        # The arguments without their tensors (captured, they would be graph constants): None
        # in each tensor's place, which `places` lists in _tensors' order.
        template = args_for(S)
        places = [
            (i, j)
            for i, a in enumerate(template)
            for j in (
                [None]
                if isinstance(a, torch.Tensor)
                else range(len(a))
                if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                else []
            )
        ]
        template = [
            None if isinstance(a, torch.Tensor) else list(a) if isinstance(a, list) else a
            for a in template
        ]

        def step(*tensors, template=template, places=places, kwargs=kwargs):
            full = [list(a) if isinstance(a, list) else a for a in template]
            for (i, j), t in zip(places, tensors):
                if j is None:
                    full[i] = t
                else:
                    full[i][j] = t
            outputs = getattr(ltx_kernels, op)(*full, **kwargs)
            return sum(
                o.float().sum() for o in (outputs if isinstance(outputs, tuple) else (outputs,))
            )

        torch._dynamo.reset()
        # aot_eager: AOTAutograd traces forward and backward through our autograd as Inductor's
        # does (what specializes does so there); Inductor's own size heuristics are not ours.
        compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
        for seq, recompile_ok in ((5 * FRAMES, True), (11 * FRAMES, False)):  # (no size shared)
            args = args_for(seq)  # (leaf copies of the same tensors for each run)
            compiled_inputs, eager_inputs = (_tensors(_requiring_grad(args)) for _ in range(2))
            with torch._dynamo.config.patch(error_on_recompile=not recompile_ok):
                compiled(*compiled_inputs).backward()
            step(*eager_inputs).backward()
            for a, b in zip(compiled_inputs, eager_inputs):
                what = f"{op}[{case}] at S={seq}"
                assert (a.grad is None) == (b.grad is None), what
                if a.grad is not None:
                    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5, msg=what)


def test_inductor_dynamic_shapes_do_not_recompile_in_training():
    """The reported case: a residual + modulated norm followed by an RMSNorm with a trained weight,
    compiled by Inductor with dynamic=True, runs a new sequence length without recompiling."""
    import torch._dynamo

    def block(x, y, scale, shift, weight):
        _, n = ltx_kernels.add_rmsnorm_modulate(x, y, scale, shift)
        return ltx_kernels.rmsnorm(n, weight)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    weight = torch.randn(64, requires_grad=True)
    for seq, recompile_ok in ((96, True), (160, False)):
        x, y = torch.randn(2, seq, 64), torch.randn(2, seq, 64)
        scale, shift = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
        with torch._dynamo.config.patch(error_on_recompile=not recompile_ok):
            compiled(x, y, scale, shift, weight).sum().backward()
        compiled_grad = weight.grad.clone()
        weight.grad = None
        block(x, y, scale, shift, weight).sum().backward()
        torch.testing.assert_close(compiled_grad, weight.grad, rtol=1e-5, atol=1e-4)
        weight.grad = None


def _first_and_second(fn, args, kwargs, grads, probes):
    """First derivatives of <fn(*args), grads> with create_graph=True, and the second: the
    gradients of <first, probes> with respect to the inputs that require grad and to grads."""
    inputs = [t for t in _tensors(args) if t.requires_grad]
    outputs = fn(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    loss = sum((o.to(g.dtype) * g).sum() for o, g in zip(outputs, grads))
    first = torch.autograd.grad(loss, inputs, create_graph=True)
    again = sum((f.to(p.dtype) * p).sum() for f, p in zip(first, probes))
    second = torch.autograd.grad(again, inputs + grads, allow_unused=True)
    return first, [torch.zeros_like(t) if g is None else g for g, t in zip(second, inputs + grads)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ltx_kernels.OPS)
def test_second_derivatives_match_float64(op, dtype, device):
    """create_graph=True gives first derivatives that are differentiable again (a differentiable
    evaluation of the VJP, not the fused backward ops, whose outputs are not), in every input form:
    they are within the gradient tolerance of the float64 ones, and their gradients with respect
    to every input and to the output gradients are those of the float64 double backward of
    reference.<op> (rope's and qk_rmsnorm_rope's tables constant, as the fused path takes them)."""
    tables = {"rope": {1, 2}, "qk_rmsnorm_rope": {4, 5}}.get(op, set())
    for case, args, kwargs in cases(op, dtype, device):
        args = _requiring_grad(args, which=set(range(len(args))) - tables)
        grads = [g.requires_grad_() for g in _output_grads(op, args, kwargs)]
        inputs = [t for t in _tensors(args) if t.requires_grad]
        probes = [torch.randn(t.shape, dtype=torch.float64, device=device) for t in inputs]
        first, second = _first_and_second(getattr(ltx_kernels, op), args, kwargs, grads, probes)
        args64 = _map_tensors(
            args, lambda _, t: t.detach().double().requires_grad_(t.requires_grad)
        )
        grads64 = [g.detach().double().requires_grad_() for g in grads]
        first64, second64 = _first_and_second(
            getattr(reference, op),
            args64,
            {**kwargs, "compute_dtype": torch.float64, "round_output": False},
            grads64,
            probes,
        )
        for index, (got, want) in enumerate(zip(first, first64, strict=True)):
            what = f"{op}[{case}] {dtype} create_graph first derivative {index}"
            assert got.requires_grad, f"{what}: not differentiable"
            assert _rel_l2(got, want) <= GRAD_TOLERANCE[dtype], f"{what}: {_rel_l2(got, want):.3g}"
        for index, (got, want) in enumerate(zip(second, second64, strict=True)):
            what = f"{op}[{case}] {dtype} second derivative {index}"
            assert torch.isfinite(got).all(), f"{what}: non-finite"
            error = _rel_l2(got, want)
            assert error <= SECOND_TOLERANCE[dtype], f"{what}: relative L2 {error:.3g}"


def test_create_graph_gradients_are_partial_derivatives():
    """A backward with create_graph=True returns the node's own gradients, the partial derivatives
    at its inputs, as without: an x computed from the weight, on the reference VJP (an rmsnorm
    weight of another dtype than x), once also got the weight's gradient through x."""
    w = (1 + 0.3 * torch.randn(8)).requires_grad_()
    weight = w.half()
    x = torch.randn(3, 8) * weight.float()
    out = ltx_kernels.rmsnorm(x, weight)
    g = torch.randn(3, 8).half()
    plain = torch.autograd.grad(out, (x, weight), g, retain_graph=True)
    again = torch.autograd.grad(out, (x, weight), g, create_graph=True)
    for a, b in zip(again, plain):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)


def test_backward_ops_differentiated_directly_raise(device):
    """The backward ops themselves compute first derivatives only: differentiating one called
    directly raises, naming it (second derivatives come from the forward op's create_graph=True)."""
    x, dout = (torch.randn(2, 8, device=device, requires_grad=True) for _ in range(2))
    cos, sin = torch.randn(2, 8, device=device), torch.randn(2, 8, device=device)
    with pytest.raises(RuntimeError, match="ltx_kernels.rope_backward is not differentiable"):
        torch.ops.ltx_kernels.rope_backward(dout, cos, sin).sum().backward()
    with pytest.raises(
        RuntimeError, match="ltx_kernels.norm_modulate_backward is not differentiable"
    ):
        outputs = torch.ops.ltx_kernels.norm_modulate_backward(
            dout, None, x, None, None, None, None, None, None, 1e-6, False, [True] + [False] * 6
        )
        outputs[0].sum().backward()


@pytest.mark.gpu
def test_cuda_graph_forward_backward():
    x, scale, shift, weight = _requiring_grad(
        cases("rmsnorm_modulate", torch.bfloat16, "cuda")[1][1]
    )
    grads = _output_grads("rmsnorm_modulate", (x, scale, shift, weight), {})

    def step():
        for t in (x, scale, shift, weight):
            t.grad = None
        _loss(ltx_kernels.rmsnorm_modulate(x, scale, shift, weight), grads).backward()
        return x.grad, scale.grad, weight.grad

    graph, captured = capture_graph(step)
    expected = [g.clone() for g in step()]
    with torch.no_grad():
        for t in (x, scale, shift, weight):
            t.add_(0)  # same inputs: the replay must reproduce the eager gradients
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
