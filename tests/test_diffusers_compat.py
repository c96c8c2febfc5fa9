"""The diffusers version guard (integration/diffusers_compat.py): every family declares the diffusers
code its patches reproduce (REPRODUCED), its fingerprints are the installed diffusers' (a diffusers
upgrade that changes that code fails here first), every class a family patches comes from its
declared modules; a block whose code differs (another version, a fork) runs its own code,
reported."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ltx_kernels
from inject_helpers import REL_L2_TOLERANCE, caller, clone, eager_and_injected, output_of, rel_l2
from ltx_kernels.integration import FAMILIES, diffusers_compat
from model_zoo import MODELS
from model_zoo.flux import tiny_inputs, tiny_model

from diffusers.models.transformers import transformer_flux  # noqa: E402  (inject_helpers skips)


def _defining(reproduced, class_name):
    """The classes named `class_name` in the family's declared modules."""
    return [
        getattr(module, class_name)
        for module in map(importlib.import_module, sorted(reproduced.modules))
        if class_name in vars(module)
    ]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__.rpartition(".")[2])
def test_every_family_declares_the_installed_diffusers_code(family):
    reproduced = family.REPRODUCED
    assert isinstance(reproduced, diffusers_compat.Reproduced)
    assert reproduced.code, "a family reproduces some diffusers code"
    for key, expected in reproduced.code.items():
        class_name, method = key.split(".")
        classes = _defining(reproduced, class_name)
        assert classes, f"{key}: in none of {sorted(reproduced.modules)}"
        for cls in classes:
            assert diffusers_compat.fingerprint(getattr(cls, method)) == expected, key
            assert reproduced.unpatched(cls, method) is None
    for class_name in family.PATCHERS:  # (the models' classes too: their patchers report them)
        assert _defining(reproduced, class_name), f"{class_name}: not in the declared modules"


def test_a_block_whose_code_differs_runs_its_own_code_reported():
    class FluxTransformerBlock(transformer_flux.FluxTransformerBlock):
        def forward(self, *args, **kwargs):  # e.g. a fork's extra step
            encoder_hidden_states, hidden_states = super().forward(*args, **kwargs)
            return encoder_hidden_states, hidden_states * 1.0

    model = tiny_model(torch.float32)
    model.transformer_blocks[0].__class__ = FluxTransformerBlock
    eager, injected, report = eager_and_injected(model, caller(tiny_inputs(torch.float32)))
    assert torch.allclose(output_of(injected), output_of(eager), rtol=1e-5, atol=1e-5)
    [(name, reason)] = report.skipped["FluxTransformerBlock"]
    assert name == "transformer_blocks.0"
    assert "FluxTransformerBlock.forward (test_diffusers_compat)" in reason
    assert f"is not the diffusers {diffusers_compat.DIFFUSERS_VERSION} code" in reason
    assert type(model.transformer_blocks[0]) is FluxTransformerBlock
    ltx_kernels.remove_optimized_kernels(model)


def test_fingerprint_of_unreadable_code_is_none():
    assert diffusers_compat.fingerprint(len) is None


#: The families whose patched model forward carries diffusers' LoRA scaling (lora_scaled).
LORA_SCALED = ("ltx", "ltx2")


@pytest.mark.parametrize("name", LORA_SCALED)
def test_lora_scale_of_attention_kwargs_scales_the_adapters(name):
    """attention_kwargs={"scale": s} scales the peft LoRA adapters for the call, as diffusers'
    model forward does (apply_lora_scale)."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    model = MODELS[name].build(torch.float32)
    model.add_adapter(
        peft.LoraConfig(
            r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v"], init_lora_weights=False
        )
    )
    stock, inputs = clone(model), MODELS[name].inputs(torch.float32)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        outputs = {}
        for scale in (1.0, 0.25):
            kwargs = {**inputs, "attention_kwargs": {"scale": scale}}
            outputs[scale] = output_of(model(**kwargs))
            expected = output_of(stock(**kwargs))
            assert rel_l2(outputs[scale], expected) <= REL_L2_TOLERANCE[torch.float32], scale
    assert rel_l2(outputs[0.25], outputs[1.0]) > 1e-3


_COMPILE_TWICE = """
import sys, torch, torch._dynamo.testing, ltx_kernels
from model_zoo import MODELS
name, path = sys.argv[1:]
if path:
    model = torch.load(path, weights_only=False)
    assert hasattr(type(model), "_ltx_kernels_original_class")
else:
    model = MODELS[name].build(torch.float32)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
inputs = MODELS[name].inputs(torch.float32)
counter = torch._dynamo.testing.CompileCounter()
compiled = torch.compile(model, backend=counter, fullgraph=True)
with torch.no_grad():
    for _ in range(2):
        compiled(**inputs)
assert counter.frame_count == 1, f"{name}: {counter.frame_count} compiles"
"""


@pytest.mark.parametrize("loaded", [False, True], ids=["injected", "unpickled"])
@pytest.mark.parametrize("name", LORA_SCALED)
def test_first_compiled_model_of_a_process_compiles_once(name, loaded, tmp_path):
    """In a fresh process, the first torch.compile(fullgraph=True) of an injected LTX-Video or
    LTX-2 model, or of one unpickled there, compiles once for two calls of the same shapes.
    (lora_scaled looked diffusers' apply_lora_scale up at the first call: the guards saw that
    lookup's state change, and the second call recompiled.)"""
    path = ""
    if loaded:
        model = MODELS[name].build(torch.float32)
        ltx_kernels.inject_optimized_kernels(model, verbose=False)
        path = str(tmp_path / "model.pt")
        torch.save(model, path)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", _COMPILE_TWICE, name, path], check=True, env=env)
