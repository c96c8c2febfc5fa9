"""The diffusers version guard (integration/diffusers_compat.py): every family declares the diffusers
code its patches reproduce (REPRODUCED), its fingerprints are the installed diffusers' (a diffusers
upgrade that changes that code fails here first), every class a family patches comes from its
declared modules; a block whose code differs (another version, a fork) runs its own code,
reported."""

import importlib

import pytest
import torch

import ltx_kernels
from inject_helpers import caller, eager_and_injected, output_of
from ltx_kernels.integration import FAMILIES, diffusers_compat
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
