"""lora_linear: peft's LoRA Linear as one op (several projections of one input in one weight, each
with its adapter), on the CPU and CUDA, and the injected models' peft LoRA projections that run on
it. The op against a float64 evaluation of its formula in every dtype and layout, against peft's own
module (output and gradients), gradcheck in float64 on the op's own code, clear errors, CUDA-graph
capture of forward + backward. (test_autograd.py checks its gradients against float64 with the
other ops, opcheck, empty tensors and torch.compile; test_training.py trains every family with
adapters through it.) Injection: which peft layers it reproduces, which run themselves."""

import pytest
import torch

import ltx_kernels
from helpers import DTYPES, capture_graph, make_activation
from inject_helpers import (
    REL_L2_TOLERANCE,
    caller,
    clone,
    count_ltx_ops,
    fused_rows,
    output_of,
    rel_l2,
)
from ltx_kernels import reference
from model_zoo.ltx import TINY, tiny_inputs, tiny_model

peft = pytest.importorskip("peft", reason="peft is not installed")

# Relative L2 error of the output against the float64 value of the formula: fp32, the GEMMs'
# summation order over K = 77 terms; fp16/bf16, the roundings of the base output, x A^T and the
# update (half an ulp each, 2^-11 / 2^-8 relative, adding up in quadrature). Seen on the CPU over
# 20 seeds: at most 1.6e-7, 3.2e-4 and 2.5e-3 (against peft's module, outputs and gradients: 0,
# 3.8e-4 and 3.0e-3).
OUT_TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
K, N = 77, 45  # odd sizes: three projections of N outputs in one [3N, K] weight


def _rand(*shape, dtype, device, std=1.0):
    return (std * torch.randn(*shape, device=device)).to(dtype)


def _adapters(ranks, dtype, device):
    """(lora_a, lora_b) of one adapter per rank, each on N outputs, scaled so every term counts."""
    lora_a = [_rand(r, K, dtype=dtype, device=device, std=K**-0.5) for r in ranks]
    lora_b = [_rand(N, r, dtype=dtype, device=device, std=r**-0.5) for r in ranks]
    return lora_a, lora_b


def _cases(dtype, device):
    """(id, args) of lora_linear: fused q/k/v with an adapter on each, two of three, one covering
    part of a weight, none; with and without bias."""
    x = _rand(2, 9, K, dtype=dtype, device=device)
    weight = _rand(3 * N, K, dtype=dtype, device=device, std=K**-0.5)
    bias = _rand(3 * N, dtype=dtype, device=device)
    a, b = _adapters((4, 8, 2), dtype, device)
    return [
        ("qkv", (x, weight, bias, a, b, [0.5, 1.0, 2.0], [0, N, 2 * N])),
        ("q_and_v", (x, weight, None, [a[0], a[2]], [b[0], b[2]], [1.0, 0.25], [0, 2 * N])),
        ("one", (x, weight[:N], bias[:N], a[1:2], b[1:2], [1.5], [0])),
        ("none", (x, weight, bias, [], [], [], [])),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64(dtype, device):
    for case, args in _cases(dtype, device):
        out = ltx_kernels.lora_linear(*args)
        exact = reference.lora_linear(*args, compute_dtype=torch.float64, round_output=False)
        assert out.dtype == dtype and out.shape == exact.shape, case
        error = rel_l2(out, exact)
        assert error <= OUT_TOLERANCE[dtype], f"{case} {dtype}: relative L2 {error:.3g}"


@pytest.mark.parametrize("layout", ["row_strided", "misaligned"])
def test_strided_and_empty_inputs(layout, device):
    dtype = torch.bfloat16
    _, (x, *rest) = _cases(dtype, device)[0]
    strided = make_activation(x.shape, dtype, device, layout)
    assert torch.equal(
        ltx_kernels.lora_linear(strided, *rest), ltx_kernels.lora_linear(strided.clone(), *rest)
    )
    empty = ltx_kernels.lora_linear(x[:, :0], *rest)
    assert empty.shape == (2, 0, 3 * N)


def _peft_linear(dtype, device, scaling_alpha=8, rank=4):
    """A peft LoRA Linear (as add_adapter makes them) over a K -> N Linear, with a non-zero B."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(K, N)

    holder = Holder().to(device, dtype)
    config = peft.LoraConfig(r=rank, lora_alpha=scaling_alpha, target_modules=["proj"])
    holder = peft.inject_adapter_in_model(config, holder)
    with torch.no_grad():
        holder.proj.lora_B["default"].weight.normal_(0, 0.5)
    return holder.proj


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_peft(dtype, device):
    """The op on a peft LoRA Linear's tensors gives the module's output and the gradients autograd
    gives x, lora_A and lora_B through the module (peft rounds more often: lora_B's output and its
    product with scaling are rounded too, so half-precision dtypes agree within their tolerance)."""
    module = _peft_linear(dtype, device)
    down, up = module.lora_A["default"].weight, module.lora_B["default"].weight
    base, scaling = module.base_layer, module.scaling["default"]
    assert scaling == 2.0
    x = _rand(3, 5, K, dtype=dtype, device=device).requires_grad_()
    grad = torch.randn(3, 5, N, device=device)
    expected_out = module(x)
    expected = torch.autograd.grad((expected_out.float() * grad).sum(), (x, down, up))
    out = ltx_kernels.lora_linear(x, base.weight, base.bias, [down], [up], [scaling])
    got = torch.autograd.grad((out.float() * grad).sum(), (x, down, up))
    tolerance = OUT_TOLERANCE[dtype]
    assert rel_l2(out, expected_out) <= tolerance
    for name, a, b in zip(("x", "lora_A", "lora_B"), got, expected):
        assert a.dtype == b.dtype and rel_l2(a, b) <= tolerance, f"{name}: {rel_l2(a, b):.3g}"


def test_gradcheck_float64_on_the_op():
    """float64 on the CPU runs the op's own code (its forward and the backward GEMMs of
    autograd_ops.cpp): every input, adapters on overlapping columns included."""
    d = dict(dtype=torch.float64, device="cpu")
    x = _rand(2, 3, K, **d).requires_grad_()
    weight = _rand(2 * N, K, **d, std=K**-0.5).requires_grad_()
    bias = _rand(2 * N, **d).requires_grad_()
    lora_a, lora_b = _adapters((3, 2), **d)
    for t in (*lora_a, *lora_b):
        t.requires_grad_()

    def fn(x, weight, bias, a0, a1, b0, b1):
        return ltx_kernels.lora_linear(x, weight, bias, [a0, a1], [b0, b1], [0.7, 1.3], [10, N])

    assert torch.autograd.gradcheck(fn, (x, weight, bias, *lora_a, *lora_b))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(scaling=[1.0]), r"one entry per adapter, got 2, 2, 1 and 2"),
        (lambda a: a.update(offsets=[0, 2 * N]), r"offsets\[1\] = 90 puts lora_b\[1\]'s 45"),
        (lambda a: a.update(offsets=[-1, N]), r"offsets\[0\] = -1"),
        (lambda a: a["lora_a"].__setitem__(1, a["lora_a"][1][:, 1:]), r"lora_a\[1\] must have"),
        (lambda a: a["lora_b"].__setitem__(0, a["lora_b"][0][:, 1:]), r"lora_b\[0\] must have"),
        (lambda a: a["lora_b"].__setitem__(0, a["lora_b"][0].double()), r"x's dtype"),
        (lambda a: a.update(bias=a["bias"][1:]), r"bias must have shape \[N\] = \[90\]"),
        (lambda a: a.update(weight=a["weight"][:, 1:]), r"weight must have shape \[N, K\]"),
    ],
)
def test_bad_arguments_raise_naming_the_op_and_argument(change, message):
    d = dict(dtype=torch.float32, device="cpu")
    lora_a, lora_b = _adapters((3, 2), **d)
    args = dict(
        x=_rand(2, K, **d),
        weight=_rand(2 * N, K, **d),
        bias=_rand(2 * N, **d),
        lora_a=lora_a,
        lora_b=lora_b,
        scaling=[1.0, 1.0],
        offsets=[0, N],
    )
    change(args)
    with pytest.raises(RuntimeError, match="ltx_kernels.lora_linear: .*" + message):
        ltx_kernels.lora_linear(**args)


@pytest.mark.gpu
def test_cuda_graph_forward_backward():
    _, args = _cases(torch.bfloat16, "cuda")[0]
    x, weight, bias, lora_a, lora_b, scaling, offsets = args
    x = x.detach().requires_grad_()
    lora_a = [a.requires_grad_() for a in lora_a]
    lora_b = [b.requires_grad_() for b in lora_b]
    leaves = [x, *lora_a, *lora_b]
    grad = torch.randn(2, 9, 3 * N, device="cuda", dtype=torch.bfloat16)

    def step():
        for t in leaves:
            t.grad = None
        out = ltx_kernels.lora_linear(x, weight, bias, lora_a, lora_b, scaling, offsets)
        out.backward(grad)
        return [out, *(t.grad for t in leaves)]

    graph, captured = capture_graph(step)
    expected = [t.clone() for t in step()]
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Injected models: peft LoRA projections on lora_linear
# ------------------------------------------------------------------------------------------------
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
# Per LTX block: attn1's q/k/v (one call over the fused weight) and output; attn2's q, k, v, output.
LORA_LINEAR_PER_BLOCK = 6


def _with_adapters(model, adapter_name="default", **config):
    """model with a (new, active) rank-4 adapter on TARGETS, lora_B away from zero."""
    torch.manual_seed(3)
    config = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **config}
    model.add_adapter(peft.LoraConfig(**config), adapter_name)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return model


def _stock_and_injected(model):
    stock = clone(model)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    return stock, model


def _assert_same_output(stock, injected, call, what=""):
    with torch.no_grad():
        error = rel_l2(output_of(call(injected)), output_of(call(stock)))
    assert error <= REL_L2_TOLERANCE[torch.float32], f"{what}: relative L2 {error:.3g}"


@pytest.mark.parametrize("inject_first", [False, True], ids=["adapters_first", "inject_first"])
def test_lora_projections_run_on_lora_linear(inject_first):
    """Adapters added before or after injection: every adapted projection runs as lora_linear
    (attn1's q/k/v as one call over the fused base weight) and the output is stock's."""
    model = tiny_model(torch.float32)
    call = caller(tiny_inputs(torch.float32))
    if inject_first:
        stock = clone(model)
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        _with_adapters(model)
        stock.load_state_dict(model.state_dict(), strict=False)
        _with_adapters(stock)
        stock.load_state_dict(model.state_dict())
    else:
        stock, model = _stock_and_injected(_with_adapters(model))
    counts = count_ltx_ops(lambda: call(model))
    assert counts["lora_linear"] == LORA_LINEAR_PER_BLOCK * TINY["num_layers"]
    for attn in (block.attn1 for block in model.transformer_blocks):  # one fused base weight
        fused_rows([getattr(attn, name).base_layer for name in ("to_q", "to_k", "to_v")])
    _assert_same_output(stock, model, call)
    with torch.no_grad():
        model.set_adapters("default", weights=0.5)  # scaling read at each call
        stock.set_adapters("default", weights=0.5)
    _assert_same_output(stock, model, call, "adapter weight 0.5")


def _second_adapter(model):
    model.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=TARGETS), "second")
    model.set_adapters(["default", "second"])


def _merge(model):
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "merge"):
            module.merge()


@pytest.mark.parametrize(
    "setup, lora_linear_calls",
    [
        (_second_adapter, 0),  # two active adapters: peft's loop runs them
        (lambda m: _with_adapters(m, lora_dropout=0.1, adapter_name="d").train(), 0),
        (lambda m: _with_adapters(m, lora_dropout=0.1, adapter_name="d").eval(), 1),  # no dropout
        (lambda m: _with_adapters(m, use_dora=True, adapter_name="dora"), 0),
        (lambda m: m.disable_adapters(), 1),  # the base layers: lora_linear without adapters
        (_merge, 1),  # merged into the base weights: the same
    ],
    ids=["two_adapters", "dropout_training", "dropout_eval", "dora", "disabled", "merged"],
)
def test_what_lora_linear_cannot_reproduce_runs_as_peft(setup, lora_linear_calls):
    """Layers lora_linear would not compute as peft does run as themselves, and every variant
    gives stock's output (lora_linear_calls: 1 where each adapted projection still runs on it).
    Dropout in training draws random masks: only the calls are checked."""
    model = _with_adapters(tiny_model(torch.float32))
    setup(model)
    stock, injected = _stock_and_injected(model)
    call = caller(tiny_inputs(torch.float32))
    counts = count_ltx_ops(lambda: call(injected))
    expected = lora_linear_calls * LORA_LINEAR_PER_BLOCK * TINY["num_layers"]
    assert counts.get("lora_linear", 0) == expected
    if not injected.training:
        _assert_same_output(stock, injected, call)


def test_remove_restores_the_adapted_model():
    model = _with_adapters(tiny_model(torch.float32))
    call = caller(tiny_inputs(torch.float32))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = output_of(call(model))
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    ltx_kernels.remove_optimized_kernels(model)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in state.items())
    assert not count_ltx_ops(lambda: call(model))
    with torch.no_grad():
        assert torch.equal(output_of(call(model)), expected)


def test_disabled_lora_linear_runs_peft():
    model = _with_adapters(tiny_model(torch.float32))
    stock = clone(model)
    ops = set(ltx_kernels.integration.FUSIONS) - {"lora_linear"}
    ltx_kernels.inject_optimized_kernels(model, verbose=False, ops=ops)
    call = caller(tiny_inputs(torch.float32))
    assert "lora_linear" not in count_ltx_ops(lambda: call(model))
    _assert_same_output(stock, model, call)
