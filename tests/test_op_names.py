"""The op list (`ltx_kernels._op_names.OPS`, with BACKWARD_OPS) is the one list of ops: the compiled
library registers exactly those ops, and every piece that exists per op (wrapper, reference, fake,
environment-report inputs) has each op and no other."""

import inspect

import pytest
import torch

import ltx_kernels
from ltx_kernels import ATTENTION_OPS, BACKWARD_OPS, OPS, QUANT_OPS, _fake, ops, reference
from ltx_kernels.__main__ import smoke_inputs
from ltx_kernels._op_names import RECOMPUTE_SCOPE_OP, REFERENCE_VJP_OP
from ltx_kernels.integration import FUSIONS


def _functions_defined_in(module, but=()) -> set:
    """The public functions `module` itself defines (not the ones it imports), less `but`."""
    return {
        name
        for name, value in vars(module).items()
        if inspect.isfunction(value)
        and value.__module__ == module.__name__
        and not name.startswith("_")
    } - set(but)


def test_ops_are_the_registered_ops():
    registered = {
        name.split("::")[1].split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("ltx_kernels::")
    }
    every = (*OPS, *QUANT_OPS, *ATTENTION_OPS, *BACKWARD_OPS, REFERENCE_VJP_OP, RECOMPUTE_SCOPE_OP)
    assert len(set(every)) == len(every)
    assert set(every) == registered


PIECES = {
    "wrappers (ltx_kernels.ops.<op>)": lambda: _functions_defined_in(ops),
    "re-exported wrappers (ltx_kernels.<op>)": lambda: {
        name
        for name, value in vars(ltx_kernels).items()
        if inspect.isfunction(value) and value is vars(ops).get(name) and name != "_library"
    },
    # (and the row quantization rule the quantized ops' references share)
    "references (reference.<op>)": lambda: _functions_defined_in(
        reference, but={"quantize_rows", "dequantize_rows"}
    ),
    "reference.__all__": lambda: set(reference.__all__),
    "fakes (_fake.<op>)": lambda: _functions_defined_in(_fake, but={"register"}),
    "environment report inputs": lambda: set(smoke_inputs("cpu")),
}


# The quantized ops and attention have every piece; the backward ops have a fake and nothing else
# of these.
EXPECTED = {piece: set(OPS + QUANT_OPS + ATTENTION_OPS) for piece in PIECES} | {
    "fakes (_fake.<op>)": set(OPS + QUANT_OPS + ATTENTION_OPS + BACKWARD_OPS)
}


@pytest.mark.parametrize("piece", PIECES)
def test_every_op_has_its_piece_and_nothing_more(piece):
    names, expected = PIECES[piece](), EXPECTED[piece]
    assert not expected - names, f"{piece}: missing for {sorted(expected - names)}"
    assert not names - expected, f"{piece}: not ops: {sorted(names - expected)}"


def test_fused_backward_ops_map_ops_to_backward_ops():
    from ltx_kernels._op_names import FUSED_BACKWARD_OPS

    assert set(FUSED_BACKWARD_OPS) <= set(OPS)
    assert set(FUSED_BACKWARD_OPS.values()) == set(BACKWARD_OPS)


def test_fusions_are_the_ops_and_the_named_fusions():
    fusions = ("fused_projections", "fused_qkv_mlp", "recompute_norms", "ulysses_attention")
    assert FUSIONS == (*OPS, *fusions)
    assert set(OPS) <= set(ltx_kernels.__all__)


def test_a_meta_operand_among_real_ones_raises():
    # A call with one tensor on the meta device (a weight or RoPE table never loaded) dispatches to
    # the op's fake, its Meta kernel: that returned uninitialized memory of x's device (a wrong
    # output, silently); it raises, naming the op, as the C++ ops do for two real devices.
    checked = []
    for op, args in smoke_inputs("cpu").items():
        second = [i for i, a in enumerate(args) if isinstance(a, (torch.Tensor, list))][1:]
        if not second:  # one tensor: all on the meta device is a legitimate (shape) call
            continue
        args = list(args)
        i = second[0]
        to_meta = lambda t: t.to("meta")
        args[i] = [to_meta(t) for t in args[i]] if isinstance(args[i], list) else to_meta(args[i])
        with pytest.raises(
            RuntimeError,
            match=rf"ltx_kernels\.{op}: all tensors must be on the same device, got cpu, meta",
        ):
            getattr(ltx_kernels, op)(*args)
        checked.append(op)
    assert len(checked) >= 12, checked


def test_build_toml_lists_every_kernel_source():
    """kernel-builder compiles only what build.toml lists (setup.py globs kernel_src/ and its
    subfolders): every kernel source and header there, kernel_src/device/ and any future family
    folder included, is in the CUDA section, and the C twins in the CPU section."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    kernels = tomllib.loads((root / "build.toml").read_text())["kernel"]
    listed = {name: set(section["src"]) for name, section in kernels.items()}
    on_disk = {
        str(p.relative_to(root))
        for p in (root / "kernel_src").rglob("*")
        if p.suffix in (".cu", ".cuh", ".h", ".c", ".cpp")
    }
    assert on_disk == listed["cuda_kernels"] | listed["cpu_kernels"]
    assert {f for f in on_disk if f.endswith((".cu", ".cuh"))} <= listed["cuda_kernels"]
    assert {f for f in on_disk if f.endswith(".c")} <= listed["cpu_kernels"]
