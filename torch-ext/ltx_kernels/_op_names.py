"""The op list: the name of every op ltx_kernels registers under `torch.ops.ltx_kernels`, in the
order of the schema table (torch_binding.cpp). The ops are listed here and nowhere else in Python;
everything that goes over them derives from `OPS` and finds its own piece of each op by the op's
name:
- `ltx_kernels.OPS`, the op wrappers `ltx_kernels.<op>`, and `ltx_kernels.integration.FUSIONS`
  (the ops inject_optimized_kernels can use, each one can be disabled alone);
- the references `ltx_kernels.reference.<op>`, the fake implementations `_fake.<op>`, the autograd
  and the environment report's smoke inputs (`__main__`);
- the tests parametrized over ops.
tests/test_op_names.py checks that the compiled library registers exactly these ops and that each
piece has every op and no other. No imports, so that any module of the package can import it.
"""

OPS = (
    "rmsnorm",
    "rmsnorm_modulate",
    "layernorm_modulate",
    "add_rmsnorm_modulate",
    "add_layernorm_modulate",
    "gated_residual",
    "rope",
    "qk_rmsnorm_rope",
    "gelu",
    "geglu",
    "linear_gelu",
    "lora_linear",
)

# The quantized-output ops (inference only; `inject_optimized_kernels(..., fp8=True)`): one op per
# producer, each taking the output's `format` (one of QUANT_FORMATS) and returning the quantized
# rows and their scales (reference.quantize_rows gives each format's rule). They have every piece
# an op of OPS has (wrapper, reference, fake, report inputs) but are not fusions a user enables one
# by one, and they have no backward (their autograd raises, naming the op).
QUANT_OPS = (
    "rmsnorm_modulate_quant",
    "layernorm_modulate_quant",
    "add_rmsnorm_modulate_quant",
    "add_layernorm_modulate_quant",
    "quantize",
    "qk_rmsnorm_rope_quant",
)

# Attention, attention_int8 over 8-bit operands and their scales, and the ops quantizing k and v
# into those operands (forward only, for now): every piece an op of OPS has (wrapper, reference,
# fake, report inputs), but not a fusion of OPS (the model families attend through
# integration/attention.py), and no backward yet (their autograd raises, naming the op).
ATTENTION_OPS = ("attention", "attention_int8", "quantize_attention_k", "quantize_attention_v")

# The formats of QUANT_OPS' outputs. "e4m3_row": float8_e4m3fn with one fp32 scale per row;
# "i8_row": int8 with one fp32 scale per row (attention's q over rows of head_dim).
QUANT_FORMATS = ("e4m3_row", "i8_row")

# The functional backward ops the autograd of OPS calls (autograd_ops.cpp): registered by the library
# after the forward ops, each with a fake (_fake.py) so AOTAutograd and Inductor trace them; no
# wrapper or reference of their own (their reference is the VJP of the forward op's reference).
BACKWARD_OPS = (
    "gelu_backward",
    "geglu_backward",
    "norm_modulate_backward",
    "rope_backward",
    "qk_rmsnorm_rope_backward",
)

# The op that the C++ autograd (torch-ext/autograd_ops.cpp) calls for the inputs the fused backward
# kernels do not take: the VJP of the op's reference, defined in Python (_autograd.py).
REFERENCE_VJP_OP = "reference_vjp"

# The op that turns on and off, around a patched block's forward, the recording of outputs that
# backward recomputes instead of saving them (integration/recompute.py; no tensors).
RECOMPUTE_SCOPE_OP = "recompute_scope"

# The ops of OPS whose autograd calls a fused backward op (one of BACKWARD_OPS), and that op; the
# others (linear_gelu, lora_linear) differentiate their GEMMs with ATen (autograd_ops.cpp).
FUSED_BACKWARD_OPS = {
    "rmsnorm": "norm_modulate_backward",
    "rmsnorm_modulate": "norm_modulate_backward",
    "layernorm_modulate": "norm_modulate_backward",
    "add_rmsnorm_modulate": "norm_modulate_backward",
    "add_layernorm_modulate": "norm_modulate_backward",
    "gated_residual": "norm_modulate_backward",
    "rope": "rope_backward",
    "qk_rmsnorm_rope": "qk_rmsnorm_rope_backward",
    "gelu": "gelu_backward",
    "geglu": "geglu_backward",
}
