"""Training through injected models: in model.train(), every parameter gets the gradient stock
diffusers gives it (full fine-tuning and peft LoRA adapters on the attention and feed-forward
projections), with and without gradient checkpointing, and under torch.compile; tiny LTX-Video,
FLUX, Wan and SD3.5 models on the CPU. While autograd records, fused steps use only the ops with a
fused backward (integration.FUSED_BACKWARD); forward passes without gradients use every op."""

import re

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    REL_L2_TOLERANCE,
    OpCounter,
    caller,
    clone,
    count_ltx_ops,
    output_of,
    rel_l2,
)
from ltx_kernels.integration import FUSED_BACKWARD, FUSIONS
from model_zoo import MODELS, ltx

TRAINED = [
    "ltx",
    "ltx_per_token",
    "ltx2",
    "ltx23",
    "ltx25_i2v",
    "flux",
    "wan",
    "skyreels_v2_df",
    "chronoedit",
    "wan_animate",
    "sd35",
    "hunyuan_video",
    "hunyuan_video15",
]  # the tiny models of model_zoo.MODELS trained here
# Attention projections (as LTX-Video-Trainer's LoRA) and the feed-forward up-projection, whose
# fused step then falls back to the adapter-carrying module.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj"]
# fp32: only the summation order of the fused forward differs from stock (up to 1.3e-5 on the
# H100 machines' Xeon CPUs: LTX-2.3's gate-logit biases, whose gradient sums over every token).
GRAD_TOLERANCE = 2e-5


def _train_step(model, call) -> set:
    """Forward + backward of a fixed random projection of the output. Returns the ltx_kernels ops
    autograd Functions recorded in the graph (the ops it differentiates through)."""
    out = output_of(call(model))
    torch.manual_seed(1234)  # the same projection whatever the output's dtype
    loss = (out.float() * torch.randn(out.shape, device=out.device)).sum()
    recorded = _recorded_ops(loss.grad_fn)
    loss.backward()
    return recorded


# The autograd Functions of torch-ext/autograd_ops.cpp whose backward is a fused backward op, and
# lora_linear's (LinearGeluFunction's recomputes its GEMM: training steps leave linear_gelu out).
FUSED_FUNCTIONS = {
    "NormFunction",
    "RopeFunction",
    "QkFunction",
    "ActivationFunction",
    "LoraLinearFunction",
}


def _recorded_ops(root) -> set:
    """The ltx_kernels autograd Functions in the graph below `root` (their nodes are named
    torch::autograd::CppNode<(anonymous namespace)::<Function>>)."""
    found, seen, stack = set(), set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        match = re.search(r"CppNode<.*::(\w+Function)>", node.name())
        if match:
            found.add(match.group(1))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _assert_same_gradients(stock, injected, what):
    trained = [(n, p) for n, p in stock.named_parameters() if p.requires_grad]
    assert trained, what
    injected_params = dict(injected.named_parameters())
    for name, p in trained:
        q = injected_params[name]
        assert (p.grad is None) == (q.grad is None), f"{what}: {name} gradient presence differs"
        if p.grad is not None:
            error = rel_l2(q.grad, p.grad)
            assert error <= GRAD_TOLERANCE, f"{what}: {name} gradient relative L2 {error:.3g}"


def _stock_and_injected(model_name, lora=False, checkpointing=False, inject_first=False):
    model = MODELS[model_name].build(torch.float32).train()
    if lora and not inject_first:
        _add_lora(model)
    stock = clone(model)
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    assert report.total_patched > 0
    if lora and inject_first:
        _add_lora(model)
        _add_lora(stock)
        stock.load_state_dict(model.state_dict())
    if checkpointing:
        stock.enable_gradient_checkpointing()
        model.enable_gradient_checkpointing()
    return stock, model, caller(MODELS[model_name].inputs(torch.float32))


def _add_lora(model):
    peft = pytest.importorskip("peft", reason="peft is not installed")
    torch.manual_seed(7)
    model.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS, init_lora_weights=False)
    )


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("model_name", TRAINED)
def test_injected_model_trains_like_stock(model_name, lora, checkpointing):
    stock, injected, call = _stock_and_injected(model_name, lora, checkpointing)
    assert not _train_step(stock, call)
    recorded = _train_step(injected, call)
    assert recorded and recorded <= FUSED_FUNCTIONS, f"autograd recorded {recorded}"
    # LoRA projections run as lora_linear (one node each, q/k/v together where fused)
    assert ("LoraLinearFunction" in recorded) == lora, recorded
    _assert_same_gradients(stock, injected, f"{model_name} lora={lora} ckpt={checkpointing}")


@pytest.mark.parametrize("model_name", TRAINED)
def test_forward_without_gradients_uses_every_op(model_name):
    """A model in train() mode (LoRA adapters requiring grad) runs the fused ops where autograd
    does not record: under torch.no_grad() (validation sampling), and with the whole model frozen."""
    stock, injected, call = _stock_and_injected(model_name, lora=True)
    no_grad_counts = count_ltx_ops(lambda: call(injected))  # count_ltx_ops runs under no_grad
    assert no_grad_counts, "no fused op ran under torch.no_grad()"
    with torch.no_grad():
        error = rel_l2(output_of(call(injected)), output_of(call(stock)))
    assert error <= REL_L2_TOLERANCE[torch.float32]
    injected.requires_grad_(False)
    with OpCounter() as counter:
        call(injected)
    assert counter.counts == no_grad_counts


def _inference_tensors(model) -> list[str]:
    return [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_inference()]


@pytest.mark.parametrize("model_name", TRAINED)
def test_trains_after_inject_and_remove_inside_inference_mode(model_name):
    """inject_optimized_kernels and remove_optimized_kernels inside torch.inference_mode (a
    sampling script's), with calls there between: every parameter and buffer stays a normal
    tensor (remove_optimized_kernels gave the fused projections' parameters inference tensors:
    a training step then raised), and a training step and an optimizer step after run as stock."""
    model = MODELS[model_name].build(torch.float32).train()
    stock, call = clone(model), caller(MODELS[model_name].inputs(torch.float32))
    with torch.inference_mode():
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        call(model)
    assert not _inference_tensors(model)
    with torch.inference_mode():
        assert ltx_kernels.remove_optimized_kernels(model) > 0
    assert not _inference_tensors(model)
    for trained in (stock, model):
        _train_step(trained, call)
        torch.optim.SGD(trained.parameters(), lr=0.1).step()
    _assert_same_gradients(stock, model, f"{model_name} after inference_mode")
    for (name, p), q in zip(stock.named_parameters(), model.parameters()):
        assert torch.equal(p, q), name


def test_lora_added_after_injection():
    stock, injected, call = _stock_and_injected("ltx", lora=True, inject_first=True)
    _train_step(stock, call)
    _train_step(injected, call)
    _assert_same_gradients(stock, injected, "LoRA added after injection")


def test_compiled_training_step_matches_stock():
    """torch.compile(fullgraph=True) of the injected model: forward + backward trace with no graph
    break, two steps run without recompiling, and the gradients are stock's."""
    import torch._dynamo

    torch._dynamo.reset()
    stock, injected, call = _stock_and_injected("ltx", lora=True)
    compiled = torch.compile(injected, fullgraph=True)
    _train_step(stock, call)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            injected.zero_grad(set_to_none=True)
            _train_step(compiled, call)
    _assert_same_gradients(stock, injected, "compiled LoRA step")


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_full_size_ltx_bf16_gradients_gpu(lora):
    """LTX-Video's real block dimensions (2 of its 28 blocks, 2x1536 tokens), bf16, train mode:
    the injected model's gradients are as close to an fp32 evaluation as stock bf16 diffusers'
    are (both measured against stock diffusers in fp32 with the same weights)."""
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(0)
    with torch.device("cuda"):
        reference_model = LTXVideoTransformer3DModel(num_layers=2).train()
    if lora:
        _add_lora(reference_model)
    stock = clone(reference_model).to(torch.bfloat16)
    injected = clone(stock)
    ltx_kernels.inject_optimized_kernels(injected, verbose=False)
    inputs = ltx.full_inputs(2, 4, 16, 24, "cuda", dtype=torch.float32)
    bf16_inputs = {
        k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
        for k, v in inputs.items()
    }
    _train_step(reference_model, lambda m: m(**inputs))
    _train_step(stock, lambda m: m(**bf16_inputs))
    _train_step(injected, lambda m: m(**bf16_inputs))
    exact = dict(reference_model.named_parameters())
    ours = dict(injected.named_parameters())
    worst = 0.0
    for name, p in stock.named_parameters():
        if not p.requires_grad:
            continue
        assert ours[name].grad is not None and p.grad is not None, name
        want = exact[name].grad
        stock_error, our_error = rel_l2(p.grad, want), rel_l2(ours[name].grad, want)
        worst = max(worst, our_error / max(stock_error, 1e-3))
        assert our_error <= 1.5 * stock_error + 1e-3, (
            f"{name}: injected bf16 gradient error {our_error:.3g} vs stock bf16 {stock_error:.3g}"
        )
    print(f"full-size LTX bf16 lora={lora}: worst gradient error ratio injected/stock {worst:.2f}")


def test_compiled_steps_use_the_compiled_fused_backward_set(monkeypatch):
    """While autograd records, a step uses FUSED_BACKWARD's ops eagerly and only
    FUSED_BACKWARD_COMPILED's under torch.compile (where Inductor's code of the others is faster)."""
    from ltx_kernels.integration import FUSED_BACKWARD_COMPILED
    from ltx_kernels.integration.steps import ops_for_step

    every = frozenset(FUSIONS)
    x = torch.randn(2, 3, requires_grad=True)
    assert ops_for_step(every, x) == FUSED_BACKWARD
    assert ops_for_step(every, x.detach()) == every
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert ops_for_step(every, x) == FUSED_BACKWARD_COMPILED
