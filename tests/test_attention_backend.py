"""ltx_kernels' attention as diffusers attention backends (issue 34 item 4):
register_attention_backends() adds "ltx_kernels" and "ltx_kernels_int8" to diffusers' backends, and
`set_attention_backend(name)` on a stock model (no inject_optimized_kernels) attends with our
`attention` op / 8-bit attention wherever it applies, with diffusers' NATIVE backend elsewhere
(integration/attention_backend.py). On the CPU our ops' C twins attend."""

import os
import subprocess
import sys

import pytest
import torch

import ltx_kernels
from inject_helpers import OpCounter, output_of, rel_l2
from ltx_kernels.integration import ATTENTION_BACKENDS
from model_zoo import MODELS
from test_inject_int8_attention import INT8_TOLERANCE, INT8_TOLERANCE_CUDA, QUANTIZED_AT_LEAST

from diffusers.models import attention_dispatch  # (after model_zoo: its importorskip)
from diffusers.models.attention_dispatch import (
    AttentionBackendName,
    _AttentionBackendRegistry,
    dispatch_attention_fn,
)

FP32_TOLERANCE = 1e-6  # relative L2: ours sums in double (the C twin), SDPA in fp32
BF16_TOLERANCE = 1e-2
#: backend name -> the op of ours it runs
OP_OF = {"ltx_kernels": "attention", "ltx_kernels_int8": "attention_int8"}


@pytest.fixture(autouse=True)
def _registered():
    # set_attention_backend also sets diffusers' global active backend: restored after each test
    ltx_kernels.register_attention_backends()
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def _qkv(q_len=9, kv_len=11, dtype=torch.float32, device="cpu", heads=3, head_dim=16):
    torch.manual_seed(0)
    return (
        torch.randn(2, n, heads, head_dim, dtype=dtype, device=device)
        for n in (q_len, kv_len, kv_len)
    )


def _attend(backend, *args, **kwargs):
    """(dispatch_attention_fn(*args, backend=backend, ...), {our op: calls})."""
    with torch.no_grad(), OpCounter() as counter:
        out = dispatch_attention_fn(*args, backend=backend, **kwargs)
    return out, counter.counts


def test_importing_ltx_kernels_leaves_diffusers_alone():
    code = (
        "import ltx_kernels\n"
        "from diffusers.models.attention_dispatch import AttentionBackendName as A\n"
        "assert 'ltx_kernels' not in {m.value for m in A}, list(A)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ)


def test_registration_is_idempotent_and_the_enum_takes_the_names():
    assert ltx_kernels.register_attention_backends() == tuple(ATTENTION_BACKENDS)
    members = list(AttentionBackendName)
    backends = dict(_AttentionBackendRegistry._backends)
    assert ltx_kernels.register_attention_backends() == tuple(ATTENTION_BACKENDS)
    assert list(AttentionBackendName) == members and _AttentionBackendRegistry._backends == backends
    for value, name in ATTENTION_BACKENDS.items():
        member = AttentionBackendName(value)
        assert member is AttentionBackendName[name] is getattr(AttentionBackendName, name)
        assert member in AttentionBackendName and member == value and member.value == value
        assert members.count(member) == 1 and AttentionBackendName.__members__[name] is member
        assert member in _AttentionBackendRegistry._backends
        assert {"attn_mask", "return_lse", "_parallel_config"} <= set(
            _AttentionBackendRegistry._supported_arg_names[member]
        )
        # what set_attention_backend does with a name: no requirement, no Hub kernel, no CP
        attention_dispatch._check_attention_backend_requirements(member)
        attention_dispatch._maybe_download_kernel_for_backend(member)
        assert not _AttentionBackendRegistry._is_context_parallel_available(member)
    assert list(AttentionBackendName)[: len(members) - 2] == members[:-2]  # stock members first


def test_missing_diffusers_internals_are_named(monkeypatch):
    monkeypatch.delattr(_AttentionBackendRegistry, "_supports_context_parallel")
    monkeypatch.delattr(attention_dispatch, "_native_attention")
    with pytest.raises(
        RuntimeError,
        match=r"lacks _AttentionBackendRegistry\._supports_context_parallel, _native_attention ",
    ):
        ltx_kernels.register_attention_backends()


@pytest.mark.parametrize("name", ["flux", "wan", "ltx"])
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_stock_model_with_the_backend_matches_native(name, backend):
    # fp32: "ltx_kernels" within fp32 summation noise of stock, "ltx_kernels_int8" within 8-bit
    # noise (not exact), our op running in every attention but LTX-Video's text cross-attention
    # (an additive mask: native); back on "native", stock bit for bit and none of ours.
    torch.manual_seed(0)
    model, inputs = MODELS[name].build(torch.float32), MODELS[name].inputs(torch.float32)
    with torch.no_grad():
        expected = output_of(model(**inputs))
    model.set_attention_backend(backend)
    with torch.no_grad(), OpCounter() as counter:
        got = output_of(model(**inputs))
    assert counter.counts.get(OP_OF[backend], 0) > 0, counter.counts
    if backend == "ltx_kernels":
        assert rel_l2(got, expected) <= FP32_TOLERANCE
    else:
        assert QUANTIZED_AT_LEAST < rel_l2(got, expected) <= INT8_TOLERANCE
    model.set_attention_backend("native")
    with torch.no_grad(), OpCounter() as counter:
        assert torch.equal(output_of(model(**inputs)), expected)
    assert not counter.counts


def _masks(batch=2, q_len=9, kv_len=11):
    torch.manual_seed(1)
    leading = torch.arange(kv_len) < torch.tensor([7, 3])[:, None]  # [B, Sk]
    holes = leading.clone()
    holes[0, 2] = False  # valid keys not leading
    empty = leading.clone()
    empty[1] = False  # a row with no valid key (SDPA: NaN)
    return {
        "additive": torch.randn(batch, 1, 1, kv_len),
        "holes": holes,
        "no_valid_key": empty[:, None, None],
        "dense": torch.rand(batch, 1, q_len, kv_len) > 0.3,
        "per_head": leading[:, None, None].expand(batch, 3, 1, kv_len),
        "query_by_key": torch.rand(q_len, kv_len) > 0.3,
    }


MASKS = _masks()


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_masks_other_than_key_padding_fall_back_to_native(backend, mask):
    query, key, value = _qkv()
    expected, _ = _attend("native", query, key, value, MASKS[mask])
    out, counts = _attend(backend, query, key, value, MASKS[mask])
    assert not counts
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("mask_batch", [0, 1])
def test_an_empty_batch_with_a_key_padding_mask_falls_back_to_native(backend, mask_batch):
    # No key lengths to read: native's empty output (was a ZeroDivisionError or min() of nothing).
    query, key, value = (t[:0] for t in _qkv())
    mask = torch.ones(mask_batch, 1, 1, 11, dtype=torch.bool)
    out, counts = _attend(backend, query, key, value, mask)
    assert out.shape == (0, 9, 3, 16) and not counts


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize("case", ["causal", "dropout", "gqa", "autograd recording"])
def test_calls_our_ops_do_not_take_fall_back_to_native(backend, case):
    query, key, value = _qkv()
    kwargs = {"causal": {"is_causal": True}, "dropout": {"dropout_p": 0.5}}.get(case, {})
    if case == "gqa":  # one k/v head for q's three
        key, value, kwargs = key[:, :, :1], value[:, :, :1], {"enable_gqa": True}
    query.requires_grad_(case == "autograd recording")
    outputs = []
    for name in ("native", backend):
        torch.manual_seed(2)  # (dropout)
        with OpCounter() as counter:
            outputs.append(dispatch_attention_fn(query, key, value, backend=name, **kwargs))
        assert not counter.counts
    assert torch.equal(outputs[1], outputs[0])


def test_return_lse_falls_back_to_native_under_int8():
    # (NATIVE takes no return_lse: its own error)
    lse = {"attention_kwargs": {"return_lse": True}}
    with pytest.raises(ValueError, match="Native attention backend does not support .*return_lse"):
        dispatch_attention_fn(*_qkv(), backend="ltx_kernels_int8", **lse)


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
@pytest.mark.parametrize(
    "lengths, layout",
    [
        *(
            (lengths, layout)
            for lengths in [(7, 3), (7, 7), (11, 11)]
            for layout in ["[B, Sk]", "[B, 1, 1, Sk]"]
        ),
        ((7, 7), "[1, 1, 1, Sk]"),
    ],
)
def test_key_padding_masks_become_key_lengths(backend, lengths, layout):
    # A boolean mask whose valid keys lead: our op attends (mixed lengths as key lengths, the same
    # length as sliced keys), within noise of the masked native attention.
    query, key, value = _qkv()
    mask = torch.arange(11) < torch.tensor(lengths)[:, None]
    mask = {
        "[B, Sk]": mask,
        "[B, 1, 1, Sk]": mask[:, None, None],
        "[1, 1, 1, Sk]": mask[:1, None, None],
    }[layout]
    expected, _ = _attend("native", query, key, value, mask)
    out, counts = _attend(backend, query, key, value, mask)
    assert counts[OP_OF[backend]] == 1
    tolerance = FP32_TOLERANCE if backend == "ltx_kernels" else INT8_TOLERANCE
    assert rel_l2(out, expected) <= tolerance


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_key_lengths_become_one_device_tensor_per_mask(backend, monkeypatch):
    # The blocks of a step pass the same key-padding mask: its mixed lengths become one [B]
    # tensor on q's device (on CUDA a blocking copy from pageable memory), not one per call; other
    # lengths get their own; the same outputs.
    from ltx_kernels.integration import attention

    made, tensor = [], torch.tensor

    def recorded(*args, **kwargs):
        made.append(args)
        return tensor(*args, **kwargs)

    monkeypatch.setattr(attention, "_last_lengths_tensor", [])
    query, key, value = _qkv()
    masks = [torch.arange(11) < tensor(lengths)[:, None] for lengths in [(7, 3), (5, 3)]]
    expected = [_attend(backend, query, key, value, mask)[0] for mask in masks]
    monkeypatch.setattr(torch, "tensor", recorded)
    for i in (0, 0, 1, 1, 0):
        out, counts = _attend(backend, query, key, value, masks[i])
        assert counts[OP_OF[backend]] == 1 and torch.equal(out, expected[i])
    assert made == [((7, 3),), ((5, 3),), ((7, 3),)]


def test_return_lse_and_scale_reach_the_bf16_op():
    query, key, value = _qkv()
    out, lse = dispatch_attention_fn(
        query, key, value, scale=0.3, backend="ltx_kernels", attention_kwargs={"return_lse": True}
    )
    scores = torch.einsum("bqhd,bkhd->bhqk", query.double(), key.double()) * 0.3
    assert lse.shape == (2, 9, 3)
    torch.testing.assert_close(lse.double(), scores.logsumexp(-1).transpose(1, 2))
    expected, _ = _attend("native", query, key, value, scale=0.3)
    assert rel_l2(out, expected) <= FP32_TOLERANCE
    int8, counts = _attend("ltx_kernels_int8", query, key, value, scale=0.3)
    assert counts["attention_int8"] == 1 and rel_l2(int8, expected) <= INT8_TOLERANCE


@pytest.mark.parametrize("backend", sorted(ATTENTION_BACKENDS))
def test_compiled_model_traces_the_backend_in_one_graph(backend):
    # torch.compile(fullgraph=True) of a stock FLUX with the backend set: one graph (no break),
    # our op inside it, the values of eager with the same backend.
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = MODELS["flux"].build(torch.float32), MODELS["flux"].inputs(torch.float32)
    model.set_attention_backend(backend)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        expected = output_of(model(**inputs))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = output_of(compiled(**inputs))
    assert counter.frame_count == 1
    assert any(e.name == f"ltx_kernels::{OP_OF[backend]}" for e in prof.events())
    assert rel_l2(out, expected) <= FP32_TOLERANCE


def test_compiled_key_padding_mask_falls_back_without_a_break():
    # Under torch.compile the mask is not read on the host: native attends it, in the same graph.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    query, key, value = _qkv()
    mask = torch.arange(11) < torch.tensor([7, 3])[:, None]
    counter = CompileCounterWithBackend("aot_eager")
    attend = torch.compile(dispatch_attention_fn, backend=counter, fullgraph=True)
    expected, _ = _attend("native", query, key, value, mask)
    for backend in ATTENTION_BACKENDS:
        with torch.no_grad():
            torch.testing.assert_close(attend(query, key, value, mask, backend=backend), expected)
    assert counter.frame_count == 2
    assert not any("ltx_kernels" in str(graph.code) for graph in counter.graphs)


def test_one_module_takes_the_backend():
    # AttentionModuleMixin.set_attention_backend: that module's attention alone runs ours.
    torch.manual_seed(0)
    model, inputs = MODELS["wan"].build(torch.float32), MODELS["wan"].inputs(torch.float32)
    with torch.no_grad():
        expected = output_of(model(**inputs))
    model.blocks[0].attn1.set_attention_backend("ltx_kernels")
    with torch.no_grad(), OpCounter() as counter:
        got = output_of(model(**inputs))
    assert counter.counts == {"attention": 1}
    assert rel_l2(got, expected) <= FP32_TOLERANCE


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", [None, (300, 173)])
def test_cuda_bf16_attends_with_our_ops(head_dim, lengths):
    # bf16 on CUDA at the op's head dims: "ltx_kernels" runs our kernel within bf16 noise of
    # native; "ltx_kernels_int8" runs the 8-bit kernel on Hopper (8-bit noise), native elsewhere.
    query, key, value = _qkv(300, 300, torch.bfloat16, "cuda", heads=4, head_dim=head_dim)
    mask = (
        None
        if lengths is None
        else torch.arange(300, device="cuda") < torch.tensor(lengths, device="cuda")[:, None]
    )
    expected, _ = _attend("native", query, key, value, mask)
    out, counts = _attend("ltx_kernels", query, key, value, mask)
    assert counts["attention"] == 1
    assert rel_l2(out.float(), expected.float()) <= BF16_TOLERANCE
    out, counts = _attend("ltx_kernels_int8", query, key, value, mask)
    if torch.cuda.get_device_capability() == (9, 0):
        assert counts["attention_int8"] == 1
        assert QUANTIZED_AT_LEAST < rel_l2(out.float(), expected.float()) <= INT8_TOLERANCE_CUDA
    else:
        assert not counts and torch.equal(out, expected)


@pytest.mark.gpu
def test_cuda_head_dims_the_kernel_lacks_fall_back_to_native():
    query, key, value = _qkv(64, 64, torch.bfloat16, "cuda", heads=4, head_dim=96)
    expected, _ = _attend("native", query, key, value)
    for backend in ATTENTION_BACKENDS:
        out, counts = _attend(backend, query, key, value)
        assert not counts and torch.equal(out, expected)
