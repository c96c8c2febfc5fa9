"""The fakes of the non-attention ops (_fake.py; the ops' Meta kernels, which torch.compile runs at
trace time) refuse what the real ops refuse, with the real op's error: a fake that took an input
its op refuses would let a compiled graph be built that then fails when it runs. For each bad input
(dtypes, float64 where the op has no float64 form, eps, approximate) the real op on the CPU raises
and so does the fake, with the same message; float64 on a (fake) CUDA device is refused by the fake
(and by the real op: the gpu test). For good inputs, the fake's outputs have the real op's shapes,
dtypes and strides. (The attention ops' fakes: test_attention_op.py, test_attention_int8.py.)"""

import math
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ltx_kernels import BACKWARD_OPS, OPS, QUANT_OPS
from ltx_kernels._op_namespace import ops as library

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
I32 = torch.int32
ALL_OPS = OPS + QUANT_OPS + BACKWARD_OPS
B, S, D, HEADS, HEAD_DIM = 2, 3, 8, 2, 8


def base_args(op: str, dtype: torch.dtype) -> dict:
    """Good arguments of op, by name (its schema's), with its float tensors in dtype (the RoPE
    tables in float32, which every dtype takes)."""
    g = torch.Generator().manual_seed(0)
    t = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    x, mod, vec = t(B, S, D), t(B, 1, D), t(D)
    heads = lambda: t(B, S, HEADS, HEAD_DIM)
    table = torch.randn(S, HEAD_DIM, generator=g)
    rope_tables = {"cos": table.cos(), "sin": table.sin()}
    norm = {"x": x, "scale": mod, "shift": mod.clone(), "weight": vec, "eps": 1e-6}
    qk = {"q": heads(), "k": heads(), "q_weight": t(HEADS * HEAD_DIM)}
    qk |= {"k_weight": t(HEADS * HEAD_DIM), **rope_tables, "eps": 1e-6}
    args = {
        "rmsnorm": {"x": x, "weight": vec, "eps": 1e-6},
        "rmsnorm_modulate": norm,
        "layernorm_modulate": norm | {"bias": t(D)},
        "add_rmsnorm_modulate": norm | {"y": t(B, S, D), "gate": t(B, 1, D)},
        "add_layernorm_modulate": norm | {"y": t(B, S, D), "gate": t(B, 1, D), "bias": t(D)},
        "gated_residual": {"x": x, "y": t(B, S, D), "gate": mod},
        "rope": {"x": heads(), **rope_tables},
        "qk_rmsnorm_rope": qk,
        "gelu": {"x": x, "approximate": "tanh"},
        "geglu": {"x": x, "approximate": "none"},
        "linear_gelu": {"x": x, "weight": t(4, D), "bias": t(4)},
        "lora_linear": {"x": x, "weight": t(4, D), "bias": t(4), "lora_a": [t(2, D)]}
        | {"lora_b": [t(3, 2)], "scaling": [0.5], "offsets": [1]},
        "quantize": {"x": x, "activation": "gelu", "approximate": "tanh"},
        "gelu_backward": {"grad_out": t(B, S, D), "x": x, "approximate": "tanh"},
        "geglu_backward": {"grad_out": t(B, S, D // 2), "x": x},
        "norm_modulate_backward": {"grad_out": t(B, S, D), "grad_h": t(B, S, D), "h": x}
        | {"y": t(B, S, D), "gate": mod, "scale": t(B, 1, D), "shift": t(B, 1, D)}
        | {"weight": vec, "bias": t(D), "eps": 1e-6, "layer_norm": True, "output_mask": [True] * 7},
        "rope_backward": {"grad_out": heads(), **rope_tables},
        "qk_rmsnorm_rope_backward": {"grad_q": heads(), "grad_k": heads(), **qk}
        | {"across_heads": True, "interleaved": True, "weight_grads": [True, True]},
    }
    if op in QUANT_OPS and op != "quantize":
        return args[op.removesuffix("_quant")] | {"format": "e4m3_row"}
    return args[op]


def call(op: str, args: dict):
    """torch.ops.ltx_kernels.<op> with args by name (keyword-only ones as keywords)."""
    schema = getattr(library, op).default._schema
    positional = [args.get(a.name, a.default_value) for a in schema.arguments if not a.kwarg_only]
    keywords = {a.name: args[a.name] for a in schema.arguments if a.kwarg_only and a.name in args}
    return getattr(library, op)(*positional, **keywords)


def with_changes(op: str, dtype: torch.dtype, changes: dict) -> dict:
    """base_args(op, dtype) with changes: a dtype converts that tensor (or list of tensors) to it,
    anything else replaces the argument."""
    args = base_args(op, dtype)
    for name, change in changes.items():
        if isinstance(change, torch.dtype):
            convert = lambda t: t.to(change)
            old = args[name]
            change = [convert(t) for t in old] if isinstance(old, list) else convert(old)
        args[name] = change
    return args


def fake_call(op: str, args: dict, device: str | None = None):
    """The op on fake tensors of args' (on `device`, when given: a fake CUDA tensor needs no GPU)."""
    mode = FakeTensorMode()

    def fake(t):
        if not isinstance(t, torch.Tensor):
            return [fake(u) for u in t] if isinstance(t, list) else t
        if device is None:
            return mode.from_tensor(t)
        return FakeTensor(mode, t.to("meta"), torch.device(device))

    fakes = {name: fake(value) for name, value in args.items()}
    with mode:
        return call(op, fakes)


# c10's dtype names (the C++ ops' messages, until they spell them as torch does) -> torch's
C10_NAMES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16"}
C10_NAMES |= {"Int": "int32", "Long": "int64", "Char": "int8", "Float8_e4m3fn": "float8_e4m3fn"}


def torch_spelling(message: str) -> str:
    return re.sub(r"\b(" + "|".join(C10_NAMES) + r")\b", lambda m: C10_NAMES[m[1]], message)


# (op, dtype of the other arguments, changes): inputs the real op refuses. Each op's: a non-float
# tensor; float64 beside a model-dtype tensor where the dtypes must agree (and where the op has no
# float64 form: the quantizing ops); an operand's dtype against x's (upcast=False: x's; with
# upcast or in a backward: x's or float32; the modulation, and cos and sin, of one dtype); eps;
# approximate.
NAN, INF = math.nan, math.inf
BAD = [
    ("rmsnorm", BF16, {"x": I32}),
    ("rmsnorm", BF16, {"weight": I32}),
    ("rmsnorm", BF16, {"weight": F64}),
    ("rmsnorm", F64, {"weight": BF16}),
    ("rmsnorm", BF16, {"eps": -1e-6}),
    ("rmsnorm", BF16, {"eps": INF}),
    ("rmsnorm", BF16, {"eps": NAN}),
    ("rmsnorm", BF16, {"eps": 1e39}),  # finite, but inf as the launchers' float
    ("rmsnorm_modulate", BF16, {"x": I32}),
    ("rmsnorm_modulate", BF16, {"scale": I32}),
    ("rmsnorm_modulate", BF16, {"shift": F64}),
    ("rmsnorm_modulate", BF16, {"weight": F64}),
    ("rmsnorm_modulate", F64, {"scale": BF16}),
    ("rmsnorm_modulate", BF16, {"scale": F32}),
    ("rmsnorm_modulate", BF16, {"scale": F32, "upcast": True}),
    ("rmsnorm_modulate", BF16, {"eps": -1.0}),
    ("layernorm_modulate", BF16, {"bias": I32}),
    ("layernorm_modulate", BF16, {"bias": F64}),
    ("layernorm_modulate", BF16, {"bias": F32}),
    ("layernorm_modulate", F64, {"bias": F32}),
    ("layernorm_modulate", BF16, {"eps": NAN}),
    ("add_rmsnorm_modulate", BF16, {"y": I32}),
    ("add_rmsnorm_modulate", BF16, {"y": F32}),
    ("add_rmsnorm_modulate", BF16, {"gate": F64}),
    ("add_rmsnorm_modulate", BF16, {"gate": F32, "upcast": True}),
    ("add_rmsnorm_modulate", F64, {"y": BF16}),
    ("add_rmsnorm_modulate", BF16, {"eps": INF}),
    ("add_layernorm_modulate", BF16, {"gate": F32}),
    ("add_layernorm_modulate", BF16, {"weight": I32}),
    ("add_layernorm_modulate", F64, {"gate": F32}),
    ("add_layernorm_modulate", BF16, {"eps": -1.0}),
    ("gated_residual", BF16, {"x": I32}),
    ("gated_residual", BF16, {"y": F32}),
    ("gated_residual", BF16, {"gate": I32}),
    ("gated_residual", BF16, {"gate": F32}),
    ("gated_residual", BF16, {"gate": F64}),
    ("gated_residual", F64, {"y": F32}),
    ("gated_residual", F64, {"gate": BF16}),
    ("rope", BF16, {"x": I32}),
    ("rope", BF16, {"cos": I32}),
    ("rope", BF16, {"cos": F64}),
    ("rope", BF16, {"sin": BF16}),
    ("rope", F32, {"cos": BF16, "sin": BF16}),
    ("qk_rmsnorm_rope", BF16, {"q": I32}),
    ("qk_rmsnorm_rope", BF16, {"k": F32}),
    ("qk_rmsnorm_rope", BF16, {"q_weight": F64}),
    ("qk_rmsnorm_rope", BF16, {"k_weight": I32}),
    ("qk_rmsnorm_rope", BF16, {"cos": F64}),
    ("qk_rmsnorm_rope", F32, {"q_weight": BF16}),
    ("qk_rmsnorm_rope", F64, {"k": BF16}),
    ("qk_rmsnorm_rope", BF16, {"eps": -1.0}),
    ("gelu", BF16, {"x": I32}),
    ("gelu", BF16, {"approximate": "erf"}),
    ("geglu", BF16, {"x": I32}),
    ("geglu", BF16, {"approximate": ""}),
    ("linear_gelu", BF16, {"x": I32}),
    ("linear_gelu", BF16, {"weight": F32}),
    ("linear_gelu", BF16, {"bias": F64}),
    ("linear_gelu", F64, {"weight": BF16}),
    ("lora_linear", BF16, {"x": I32}),
    ("lora_linear", BF16, {"bias": F32}),
    ("lora_linear", BF16, {"lora_a": F32}),
    ("lora_linear", F64, {"lora_b": BF16}),
    *((op, F64, {}) for op in QUANT_OPS),  # (no float64 form)
    *((op, BF16, {"x": I32}) for op in QUANT_OPS if op != "qk_rmsnorm_rope_quant"),
    ("rmsnorm_modulate_quant", BF16, {"scale": F64}),
    ("layernorm_modulate_quant", BF16, {"bias": F32}),
    ("add_rmsnorm_modulate_quant", BF16, {"y": F32}),
    ("add_layernorm_modulate_quant", BF16, {"eps": NAN}),
    ("qk_rmsnorm_rope_quant", BF16, {"q": I32}),
    ("qk_rmsnorm_rope_quant", BF16, {"k": F64}),
    ("qk_rmsnorm_rope_quant", BF16, {"eps": -1.0}),
    ("quantize", BF16, {"approximate": "erf"}),
    ("quantize", BF16, {"activation": "relu"}),
    ("gelu_backward", BF16, {"x": I32}),
    ("gelu_backward", BF16, {"grad_out": I32}),
    ("gelu_backward", BF16, {"grad_out": F32}),
    ("gelu_backward", F32, {"grad_out": F64}),
    ("gelu_backward", BF16, {"approximate": "erf"}),
    ("geglu_backward", BF16, {"grad_out": F32}),
    ("geglu_backward", BF16, {"approximate": "sigmoid"}),
    ("norm_modulate_backward", BF16, {"h": I32}),
    ("norm_modulate_backward", BF16, {"grad_out": F32}),
    ("norm_modulate_backward", BF16, {"grad_h": F64}),
    ("norm_modulate_backward", BF16, {"y": F32}),
    ("norm_modulate_backward", F32, {"gate": BF16}),
    ("norm_modulate_backward", BF16, {"scale": F32}),  # (gate bfloat16: one dtype)
    ("norm_modulate_backward", F32, {"weight": F64}),
    ("norm_modulate_backward", BF16, {"bias": I32}),
    ("norm_modulate_backward", BF16, {"eps": -1.0}),
    ("rope_backward", BF16, {"grad_out": I32}),
    ("rope_backward", BF16, {"cos": I32}),
    ("rope_backward", F32, {"cos": F64, "sin": F64}),
    ("rope_backward", BF16, {"sin": BF16}),
    ("qk_rmsnorm_rope_backward", BF16, {"q": I32}),
    ("qk_rmsnorm_rope_backward", BF16, {"k": F32}),
    ("qk_rmsnorm_rope_backward", BF16, {"grad_q": F32}),
    ("qk_rmsnorm_rope_backward", BF16, {"grad_k": F32}),
    ("qk_rmsnorm_rope_backward", F32, {"q_weight": BF16}),
    ("qk_rmsnorm_rope_backward", F32, {"cos": F64, "sin": F64}),
    ("qk_rmsnorm_rope_backward", BF16, {"eps": NAN}),
]


def _case_id(case):
    op, dtype, changes = case
    name = lambda v: str(v).removeprefix("torch.")
    change = ",".join(f"{k}={name(v)}" for k, v in changes.items())
    return f"{op}-{name(dtype)}-{change or 'all'}"


def test_every_op_has_bad_inputs():
    assert {op for op, _, _ in BAD} == set(ALL_OPS)


@pytest.mark.parametrize("case", BAD, ids=_case_id)
def test_the_fake_refuses_what_the_op_refuses(case):
    op, dtype, changes = case
    args = with_changes(op, dtype, changes)
    with pytest.raises(RuntimeError, match=rf"^ltx_kernels\.{op}: ") as real:
        call(op, args)
    with pytest.raises(RuntimeError) as fake:
        fake_call(op, args)
    assert str(fake.value) == torch_spelling(str(real.value))


# float64 on CUDA: the ops with a float64 form take it on the CPU only.
FLOAT64_OPS = [op for op in ALL_OPS if op not in QUANT_OPS]


def _float64_on_cuda_message(op):
    name = {"qk_rmsnorm_rope": "q", "qk_rmsnorm_rope_backward": "q"}.get(op)
    name = name or {"norm_modulate_backward": "h", "rope_backward": "grad_out"}.get(op, "x")
    return (
        f"ltx_kernels.{op}: {name} is float64, which only the CPU backend takes (for gradcheck); "
        "on cuda:0 use float32, float16 or bfloat16"
    )


@pytest.mark.parametrize("op", FLOAT64_OPS)
def test_the_fake_refuses_float64_on_cuda(op):
    args = base_args(op, F64)
    call(op, args)  # (the CPU takes it)
    with pytest.raises(RuntimeError) as fake:
        fake_call(op, args, device="cuda:0")
    assert str(fake.value) == _float64_on_cuda_message(op)


@pytest.mark.gpu
@pytest.mark.parametrize("op", FLOAT64_OPS)
def test_the_op_refuses_float64_on_cuda(op):
    cuda = lambda v: v.cuda() if torch.is_tensor(v) else v
    args = {
        name: [cuda(t) for t in v] if isinstance(v, list) else cuda(v)
        for name, v in base_args(op, F64).items()
    }
    with pytest.raises(RuntimeError) as real:
        call(op, args)
    assert torch_spelling(str(real.value)) == _float64_on_cuda_message(op)


# (op, dtype, changes): inputs the real op takes, beyond every op's bfloat16 and float64 ones.
GOOD = [
    ("rmsnorm", BF16, {"weight": F32}),
    ("rmsnorm", BF16, {"weight": None}),
    ("rmsnorm", BF16, {"eps": 0.0}),
    ("rmsnorm", BF16, {"eps": -1e-50}),  # (-0 as the launchers' float)
    ("rmsnorm_modulate", BF16, {"scale": F32, "shift": F32, "weight": F32, "upcast": True}),
    ("rmsnorm_modulate", F64, {"scale": F32, "shift": F32, "upcast": True}),
    ("add_layernorm_modulate", F16, {}),
    ("add_layernorm_modulate", BF16, {"scale": F32, "shift": F32, "gate": F32, "upcast": True}),
    ("gated_residual", BF16, {"gate": F32, "upcast": True}),
    ("rope", F64, {}),  # (float32 tables)
    ("rope", BF16, {"cos": BF16, "sin": BF16}),
    ("qk_rmsnorm_rope", BF16, {"k_weight": F32, "cos": BF16, "sin": BF16}),
    ("qk_rmsnorm_rope_quant", BF16, {"format": "i8_row"}),
    ("gelu", BF16, {"approximate": "none"}),
    ("norm_modulate_backward", F32, {"shift": F64}),  # (shift's gradient: grad_out's rows)
    ("norm_modulate_backward", BF16, {"gate": F32, "scale": F32, "weight": F32}),
    # (grad_h alone: gated_residual's backward)
    (
        "norm_modulate_backward",
        BF16,
        dict.fromkeys(("grad_out", "scale", "shift", "weight", "bias"), None),
    ),
    ("qk_rmsnorm_rope_backward", BF16, {"q_weight": F32, "weight_grads": [True, False]}),
]
GOOD += [(op, BF16, {}) for op in ALL_OPS] + [(op, F64, {}) for op in FLOAT64_OPS]


@pytest.mark.parametrize("case", GOOD, ids=_case_id)
def test_the_fake_gives_the_ops_outputs(case):
    op, dtype, changes = case
    args = with_changes(op, dtype, changes)
    real, fake = call(op, args), fake_call(op, args)
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    assert len(fake) == len(real) >= 1
    for r, f in zip(real, fake):
        assert isinstance(f, FakeTensor) and not isinstance(r, FakeTensor)
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())
