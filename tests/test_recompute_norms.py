"""recompute_norms: in eager training, within a patched block, a norm's output or a single LoRA
projection's output that lora_linear or qk_rmsnorm_rope saves for backward is saved as the call
that gives it again (autograd_ops.cpp, integration/recompute.py). The gradients are the same bit for
bit as when the tensors are saved, backward runs each recorded call once per op that saved it, the
memory held for backward is lower, an input modified in place since the forward raises, and nothing
changes under gradient checkpointing or without gradients. The add_ ops' n is recomputed by the
plain op from their h: the two agree bit for bit (both backends, every dtype, gate forms,
upcast)."""

import pytest
import torch

import ltx_kernels
from helpers import DTYPES
from inject_helpers import OpCounter, caller, clone, output_of
from ltx_kernels import OPS
from ltx_kernels.integration import FUSIONS
from model_zoo import MODELS, ltx

peft = pytest.importorskip("peft", reason="peft is not installed")

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj"]


# The calls the backward of LTX-Video's blocks runs again, LoRA on the attention projections: norm1
# (its output is the fused q/k/v lora_linear's x) in each block but the first (where nothing before
# norm1 requires grad: it does not record), and attn2's q and k projections (the q/k norm's
# inputs). In full fine-tuning the projections are ATen's Linears, which save for themselves:
# nothing is recomputed.
def _ltx_recomputed(lora: bool, blocks: int) -> dict:
    return {"rmsnorm_modulate": blocks - 1, "lora_linear": 2 * blocks} if lora else {}


def _gradients(model, call) -> tuple[dict, dict]:
    """(every parameter's gradient, the forward ops backward ran: the recomputations)."""
    model.zero_grad(set_to_none=True)
    out = output_of(call(model))
    torch.manual_seed(1234)
    loss = (out.float() * torch.randn(out.shape, device=out.device)).sum()
    with OpCounter() as counter:
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return grads, {op: n for op, n in counter.counts.items() if op in OPS}


def _with_and_without(model_name, lora, dtype=torch.float32):
    model = MODELS[model_name].build(dtype).train()
    if lora:
        torch.manual_seed(7)
        model.requires_grad_(False)
        model.add_adapter(
            peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
        )
    without = clone(model)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    ltx_kernels.inject_optimized_kernels(
        without, verbose=False, ops=set(FUSIONS) - {"recompute_norms"}
    )
    return model, without, caller(MODELS[model_name].inputs(dtype))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("model_name", ["ltx", "ltx2", "flux", "wan", "sd35", "hunyuan_video"])
def test_recomputed_outputs_give_the_same_gradients(model_name, lora):
    model, without, call = _with_and_without(model_name, lora)
    expected, none = _gradients(without, call)
    assert not none, f"recompute_norms disabled, yet backward ran {none}"
    got, recomputed = _gradients(model, call)
    if lora:
        assert recomputed, "backward recomputed nothing"
    if model_name == "ltx":
        assert recomputed == _ltx_recomputed(lora, ltx.TINY["num_layers"])
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), f"{model_name}: {name} gradient differs"


def test_not_under_gradient_checkpointing():
    model, without, call = _with_and_without("ltx", lora=True)
    model.enable_gradient_checkpointing()
    without.enable_gradient_checkpointing()
    expected, checkpoint_forward = _gradients(without, call)
    got, recomputed = _gradients(model, call)
    assert recomputed == checkpoint_forward  # (the checkpointed blocks' forward, nothing more)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def test_input_modified_in_place_raises():
    model, _, call = _with_and_without("ltx", lora=True)
    out = output_of(call(model))
    with torch.no_grad():  # attn2's q projection's weight, which its recomputation reads
        model.transformer_blocks[-1].attn2.to_q.base_layer.weight.add_(1)
    with pytest.raises(
        RuntimeError,
        match=r"qk_rmsnorm_rope backward \(recompute_norms\): an input of lora_linear.*in place",
    ):
        out.float().sum().backward()


def test_create_graph_raises():
    """A recomputed output is not in the graph: a backward with create_graph=True (second
    derivatives) would lose the part through it, so it raises naming the op instead."""
    model, _, call = _with_and_without("ltx", lora=True)
    out = output_of(call(model))
    params = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(
        RuntimeError,
        match=r"backward with create_graph=True \(recompute_norms\).*second derivatives",
    ):
        torch.autograd.grad(out.float().sum(), params, create_graph=True)


@pytest.mark.parametrize(
    "layer_norm, upcast", [(False, False), (True, False), (True, True)], ids=["rms", "layer", "wan"]
)
@pytest.mark.parametrize("gate_shape", [None, (2, 1), (2, 37)], ids=["nogate", "row", "token"])
@pytest.mark.parametrize("hidden", [129, 2048, 3072])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_op_norm_equals_plain_op_of_h(dtype, hidden, gate_shape, upcast, layer_norm, device):
    """n of add_{rms,layer}norm_modulate(x, y, ...) is {rms,layer}norm_modulate(h, ...) bit for
    bit, h its first output: what recompute_norms recomputes an add_ step's n with (upcast: Wan's
    fp32 LayerNorm steps)."""

    def rows(*shape, dtype=dtype):
        return torch.randn(shape, device=device).to(dtype)

    modulation_dtype = torch.float32 if upcast else dtype
    x, y = rows(2, 37, hidden), rows(2, 37, hidden)
    scale, shift = (
        rows(2, 1, hidden, dtype=modulation_dtype),
        rows(2, 1, hidden, dtype=modulation_dtype),
    )
    gate = None if gate_shape is None else rows(*gate_shape, hidden, dtype=modulation_dtype)
    weight = rows(hidden, dtype=torch.float32 if upcast else dtype)
    if layer_norm:
        bias = rows(hidden, dtype=weight.dtype)
        h, n = ltx_kernels.add_layernorm_modulate(
            x, y, scale, shift, gate, weight, bias, 1e-6, upcast=upcast
        )
        again = ltx_kernels.layernorm_modulate(h, scale, shift, weight, bias, 1e-6, upcast=upcast)
    else:
        h, n = ltx_kernels.add_rmsnorm_modulate(x, y, scale, shift, gate, weight, 1e-6)
        again = ltx_kernels.rmsnorm_modulate(h, scale, shift, weight, 1e-6)
    assert n.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()
    assert torch.equal(n, again)


@pytest.mark.gpu
def test_saved_activations_lower_gpu():
    """LTX-Video's real block width, 3 blocks, LoRA on the attention projections, bf16: the memory
    held for backward after the forward is lower by at least norm1's output in each block but the
    first (whose norm does not record: nothing before it requires grad) and attn2's query in each
    block, [B, S, D] each."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    blocks = 3
    with torch.device("cuda"):
        model = LTXVideoTransformer3DModel(num_layers=blocks).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=32, lora_alpha=32, target_modules=LORA_TARGETS[:4]))
    inputs = ltx.full_inputs(1, 4, 16, 24, "cuda")
    held = {}  # (the second round's: the first allocates cuBLAS workspaces)
    for ops in 2 * (set(FUSIONS), set(FUSIONS) - {"recompute_norms"}):
        ltx_kernels.inject_optimized_kernels(model, verbose=False, ops=ops)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = model(**inputs)[0]
        held[len(ops)] = torch.cuda.memory_allocated() - before
        out.float().sum().backward()
        del out
        ltx_kernels.remove_optimized_kernels(model)
    activation_bytes = 1 * 4 * 16 * 24 * 2048 * 2
    saved = held[len(FUSIONS) - 1] - held[len(FUSIONS)]
    assert saved >= (2 * blocks - 1) * activation_bytes, (held, activation_bytes)
