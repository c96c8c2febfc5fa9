"""inject_optimized_kernels' `attention=` (issue 34, stage e): "ltx_kernels" attends through our
attention op wherever it applies (on the CPU its C twin), "diffusers" as stock, "auto" (the
default) as "ltx_kernels" only where injector.LTX_ATTENTION_FASTER lists the GPU, head_dim and as
few tokens as the call has (on the CPU: "diffusers"). Every tiny model
of model_zoo with "ltx_kernels" against "diffusers"; key lengths against the key mask they stand
for; the report; torch.compile (dynamic, fullgraph) of the injected blocks; autograd recording
(the op has no backward: the fallback)."""

import pytest
import torch

import ltx_kernels
from inject_helpers import OpCounter, clone, output_of, rel_l2
from ltx_kernels.integration import ATTENTION_CHOICES, attention, injector
from model_zoo import MODELS, ltx

FP32_TOLERANCE = 1e-6  # relative L2: ours sums in double (the C twin), SDPA in fp32
BF16_TOLERANCE = 1e-2
#: SD3 (no q/k norm) keeps diffusers' processor: nothing of ours attends.
NO_PROCESSOR = {"sd3"}


def _run(model, inputs, attention_choice, grad=False):
    """(output, {op: calls}) of one forward of a copy of `model` injected with attention=."""
    model = clone(model)
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention=attention_choice)
    with torch.set_grad_enabled(grad), OpCounter() as counter:
        out = output_of(model(**inputs))
    return out, counter.counts


@pytest.mark.parametrize("name", sorted(MODELS))
def test_ltx_kernels_attention_matches_diffusers_fp32(name):
    # Every family and variant: "ltx_kernels" within fp32 summation noise of "diffusers", our op
    # running; "auto" and the default are "diffusers" bit for bit (the table lists CUDA only).
    torch.manual_seed(0)
    model, inputs = MODELS[name].build(torch.float32), MODELS[name].inputs(torch.float32)
    expected, counts = _run(model, inputs, "diffusers")
    assert "attention" not in counts
    got, counts = _run(model, inputs, "ltx_kernels")
    assert rel_l2(got, expected) <= FP32_TOLERANCE
    assert (counts.get("attention", 0) > 0) == (name not in NO_PROCESSOR), counts
    for choice in ("auto", None):
        options = {} if choice is None else {"attention": choice}
        default = clone(model)
        ltx_kernels.inject_optimized_kernels(default, verbose=False, **options)
        with torch.no_grad(), OpCounter() as counter:
            assert torch.equal(output_of(default(**inputs)), expected)
        assert "attention" not in counter.counts


@pytest.mark.parametrize("name", ["ltx", "ltx2", "flux", "wan", "sd35", "hunyuan_video15"])
def test_ltx_kernels_attention_matches_diffusers_bf16(name):
    torch.manual_seed(0)
    model, inputs = MODELS[name].build(torch.bfloat16), MODELS[name].inputs(torch.bfloat16)
    expected, _ = _run(model, inputs, "diffusers")
    got, counts = _run(model, inputs, "ltx_kernels")
    assert counts["attention"] > 0
    assert rel_l2(got, expected) <= BF16_TOLERANCE


class _Processor:
    ops = frozenset(injector.FUSIONS)
    attention = "ltx_kernels"
    _attention_backend = None


@pytest.mark.parametrize("lengths", [(11, 11), (7, 7), (7, 3), (11, 1), (0, 5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_key_lengths_reach_the_op_as_lengths(lengths, dtype, monkeypatch):
    # Mixed lengths reach our op as lengths (no mask built); the same lengths drop the padded
    # keys (a slice); either way the masked attention they stand for (a length of 0: zeros).
    calls = []

    def recorded(query, key, value, key_lengths=None):
        calls.append((key.shape[1], key_lengths))
        return ltx_kernels.attention(query, key, value, key_lengths)

    monkeypatch.setattr(attention, "ltx_attention", recorded)
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, n, 2, 8, dtype=dtype) for n in (9, 11, 11))
    out = attention.attend(_Processor(), query, key, value, key_lengths=lengths)
    valid = torch.arange(11) < torch.tensor(lengths)[:, None]
    masked = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=valid[:, None, None, :]
    ).transpose(1, 2)
    expected = torch.where(valid.any(1)[:, None, None, None], masked, 0)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
    ((keys, passed),) = calls
    if len(set(lengths)) == 1:
        assert keys == lengths[0] and passed is None
    else:
        assert keys == 11 and passed.tolist() == list(lengths)


@pytest.mark.parametrize("choice", ["ltx_kernels", "diffusers"])
def test_key_lengths_become_one_device_tensor_per_tuple(choice, monkeypatch):
    # Mixed key lengths become a [B] tensor on the keys' device once per tuple (on CUDA a blocking
    # copy from pageable memory): the blocks of a step, which pass the same lengths, reuse it (for
    # our op, or diffusers' key mask built from it); other lengths get their own; the same
    # outputs as fresh tensors.
    made, tensor = [], torch.tensor

    def recorded(*args, **kwargs):
        made.append(args)
        return tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", recorded)
    monkeypatch.setattr(attention, "_last_lengths_tensor", [])
    processor = type("P", (_Processor,), {"attention": choice})()
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, n, 2, 8, dtype=torch.float64) for n in (9, 11, 11))
    outs = {}
    for lengths in [(7, 3), (7, 3), (5, 3), (5, 3), (7, 3)]:
        out = attention.attend(processor, query, key, value, key_lengths=lengths)
        assert torch.equal(outs.setdefault(lengths, out), out)
    assert made == [((7, 3),), ((5, 3),), ((7, 3),)]


@pytest.mark.parametrize("inference", [False, True], ids=["no_grad", "inference_mode"])
def test_a_key_mask_is_read_once_through_the_views_made_per_call(inference, monkeypatch):
    # diffusers' processors (Z-Image, ERNIE-Image, ...) view the model's [B, S] key mask per call
    # (mask[:, None, None, :]): padded_key_lengths reads it on the host (on CUDA: waits for the
    # GPU) once while it is unmodified, not once per call, under torch.inference_mode too (whose
    # views do not know their base); another view of it or another mask is read again, and so is
    # the mask after a write (but an inference tensor's: it has no version counter).
    reads, equal = [], torch.equal

    def recorded(*args):
        reads.append(args)
        return equal(*args)

    monkeypatch.setattr(torch, "equal", recorded)
    monkeypatch.setattr(attention, "_last_lengths", [])
    with torch.inference_mode(inference):
        mask = torch.arange(11) < torch.tensor([7, 3])[:, None]
        for _ in range(3):
            assert attention.padded_key_lengths(mask[:, None, None, :]) == (7, 3)
        assert len(reads) == 1
        assert attention.padded_key_lengths(mask[1:, None, None, :]) == (3,)
        assert attention.padded_key_lengths(mask.clone()[:, None, None, :]) == (7, 3)
        assert len(reads) == 3
    if not inference:
        mask[1, 3] = True
        assert attention.padded_key_lengths(mask[:, None, None, :]) == (7, 4)
        assert attention.padded_key_lengths(mask[:, None, None, :]) == (7, 4)
        assert len(reads) == 4


def test_a_mask_or_autograd_falls_back_to_diffusers(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "ltx_attention", lambda *args: calls.append(args))
    query, key, value = (torch.randn(2, 5, 2, 8) for _ in range(3))
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    attention.attend(_Processor(), query, key, value, mask=mask)
    with torch.enable_grad():
        attention.attend(_Processor(), query.requires_grad_(), key, value)
    assert calls == []


def test_op_takes_what_the_op_takes():
    def qkv(head_dim=64, dtype=torch.bfloat16, device="cpu", **kwargs):
        return [torch.empty(2, 16, 4, head_dim, dtype=dtype, device=device, **kwargs)] * 3

    assert attention._op_takes(*qkv(head_dim=8, dtype=torch.float32))  # CPU: the C twin
    assert not attention._op_takes(*qkv(dtype=torch.int32))
    q, k, v = qkv()
    assert not attention._op_takes(q, k.float(), v)
    assert not attention._op_takes(q, k.transpose(-1, -2), v)
    assert not attention._op_takes(q, k[:1], v[:1])  # another batch
    aligned = torch.empty(2, 16, 3 * 4 * 64)[..., 4 * 64 :].unflatten(-1, (2, 4, 64))[:, :, 0]
    assert attention._rows_aligned(aligned)  # a slice of a fused qkv projection
    assert not attention._rows_aligned(
        torch.empty(2, 16, 4 * 64 + 1)[..., 1:].unflatten(-1, (4, 64))
    )
    # traced without a graph break (dynamo cannot trace storage_offset(): the strides only)
    compiled = torch.compile(attention._rows_aligned, fullgraph=True, dynamic=True)
    assert compiled(aligned)
    assert not compiled(torch.empty(2, 16, 4, 65)[..., :64])


def test_auto_follows_the_measured_table(monkeypatch):
    # "auto" attends with ours where LTX_ATTENTION_FASTER lists the device's capability and
    # head_dim and the call has at least its tokens (queries and keys), and the processor keeps
    # diffusers' default backend. The CPU never: a stand-in capability lookup and table check the
    # rule's other half. Under torch.compile a symbolic length reads as too few: no guard, no
    # recompile from one length to the next; static lengths compare exactly.
    assert injector.LTX_ATTENTION_FASTER == {(9, 0): ((64, 8064), (128, 4608))}
    processor = type("P", (_Processor,), {"attention": "auto"})()

    def qk(tokens, keys=None, head_dim=64):
        return torch.randn(1, tokens, 2, head_dim), torch.randn(1, keys or tokens, 2, head_dim)

    query, key = qk(32)
    assert not attention.runs_ltx_attention(processor, query, key, key)  # (the CPU)
    monkeypatch.setitem(injector.LTX_ATTENTION_FASTER, (9, 0), ((64, 24),))  # (attention.py's too)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    torch._dynamo.reset()
    assert attention._measured_faster(0) == ((64, 24),)
    assert attention._long_enough(*qk(24)) and attention._long_enough(*qk(48, 30))
    assert not attention._long_enough(*qk(23)) and not attention._long_enough(*qk(48, 23))
    assert not attention._long_enough(*qk(48, head_dim=128))
    dynamic = torch.compile(attention._long_enough, fullgraph=True, dynamic=True)
    static = torch.compile(attention._long_enough, fullgraph=True, dynamic=False)
    assert not dynamic(*qk(16))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert not dynamic(*qk(32)) and not dynamic(*qk(48))
    assert [static(*qk(n)) for n in (16, 32)] == [False, True]


def test_int8_follows_the_measured_table(monkeypatch):
    # "int8" attends in 8 bits on a GPU where LTX_INT8_ATTENTION_FASTER lists the device's
    # capability and head_dim and the call has at least its tokens (queries and keys): shorter
    # calls (text cross-attention, audio) attend as "auto". The CPU's C twins take every call.
    # Under torch.compile a symbolic length counts as enough (8 bits were asked for): no guard,
    # no recompile from one length to the next; static lengths compare exactly.
    assert injector.LTX_INT8_ATTENTION_FASTER == {(9, 0): ((64, 8064), (128, 6144))}

    def qk(tokens, keys=None, head_dim=64):
        return torch.randn(1, tokens, 2, head_dim), torch.randn(1, keys or tokens, 2, head_dim)

    processor = type("P", (_Processor,), {"attention": "int8"})()
    assert attention.runs_int8_attention(processor, *qk(2), qk(2)[1])  # (the CPU: every call)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    torch._dynamo.reset()
    assert attention._int8_pays(*qk(8064)) and not attention._int8_pays(*qk(8063))
    assert not attention._int8_pays(*qk(8064, 128)) and attention._int8_pays(
        *qk(6144, head_dim=128)
    )
    assert not attention._int8_pays(*qk(6143, 9000, head_dim=128))
    monkeypatch.setitem(injector.LTX_INT8_ATTENTION_FASTER, (9, 0), ((64, 24),))
    assert attention._int8_measured_faster(0) == ((64, 24),)
    assert attention._int8_pays(*qk(24)) and attention._int8_pays(*qk(48, 30))
    assert not attention._int8_pays(*qk(23)) and not attention._int8_pays(*qk(48, 23))
    assert not attention._int8_pays(*qk(48, head_dim=128))  # (a head_dim not listed)
    dynamic = torch.compile(attention._int8_pays, fullgraph=True, dynamic=True)
    assert dynamic(*qk(16))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert dynamic(*qk(32)) and dynamic(*qk(48))
    torch._dynamo.reset()
    static = torch.compile(attention._int8_pays, fullgraph=True, dynamic=False)
    assert [static(*qk(n)) for n in (16, 32)] == [False, True]
    torch._dynamo.reset()


def test_ulysses_chooses_the_inner_attention_on_the_whole_sequence(monkeypatch):
    # Under Ulysses the inner attention is chosen on q/k/v as they land (this rank's heads over
    # the whole sequence), so the length rules of "auto" and "int8" count the whole sequence's
    # tokens, not this rank's chunk of them.
    seen = []
    monkeypatch.setattr(
        attention, "our_attention", lambda processor, *qkv: seen.append(qkv[0].shape) or None
    )
    monkeypatch.setattr(attention, "context_parallel_config", lambda config: config)
    monkeypatch.setattr(attention, "runs_ulysses_attention", lambda *args: True)

    def ulysses(query, key, value, parallel_config, attend):  # 4 ranks, 2 heads each
        landed = [x.repeat(1, 4, 1, 1)[:, :, :2] for x in (query, key, value)]
        assert attend(*landed).shape == landed[0].shape
        return query.flatten(2)

    monkeypatch.setattr(attention, "ulysses_attention", ulysses)
    query, key, value = (torch.randn(1, 6, 8, 16) for _ in range(3))
    config = type("Config", (), dict(ulysses_degree=4, ring_degree=1, ulysses_anything=False))()
    attention.attend(_Processor(), query, key, value, parallel_config=config)
    assert seen == [torch.Size([1, 24, 2, 16])]


def test_the_choice_counts_the_keys_left_by_uniform_key_lengths(monkeypatch):
    # Uniform key lengths drop the padded keys before the op is chosen, so the length rules of
    # "auto" and "int8" count the keys the call attends.
    seen = []  # (the stand-in chooses diffusers' attention after recording the keys it saw)
    monkeypatch.setattr(attention, "_attending_op", lambda p, q, k, v, *a: seen.append(k.shape[1]))
    query, key, value = (torch.randn(2, 48, 2, 8) for _ in range(3))
    expected = attention.attend(_Processor(), query, key[:, :10], value[:, :10])
    out = attention.attend(_Processor(), query, key, value, key_lengths=(10, 10))
    assert seen == [10, 10] and torch.equal(out, expected)


def test_report_names_the_choice_and_the_fallbacks():
    torch.manual_seed(0)
    model = ltx.tiny_model(torch.float32)
    for choice in ATTENTION_CHOICES:
        report = ltx_kernels.inject_optimized_kernels(clone(model), verbose=False, attention=choice)
        assert f"  attention: {choice} (" in str(report) and report.attention == choice
        assert injector.LTX_ATTENTION not in report.skipped  # (the CPU's C twin takes head_dim 8)
    assert (
        "where measured faster: sm_90 head_dim 64 from 8064 tokens; sm_90 head_dim 128 from 4608 "
        "tokens"
    ) in str(_report(clone(model), "auto"))
    assert (
        "float16/bfloat16 where measured faster: sm_90 head_dim 64 from 8064 tokens; sm_90 "
        "head_dim 128 from 6144 tokens (injector.LTX_INT8_ATTENTION_FASTER; the CPU's C twins: "
        "every call)"
    ) in str(_report(clone(model), "int8"))
    # On the meta device (as on a GPU) the tiny heads (8) are not the CUDA kernel's: each
    # attention is reported, by name, as attending with diffusers' backend.
    report = _report(clone(model).to("meta"), "ltx_kernels")
    skipped = report.skipped[injector.LTX_ATTENTION]
    assert len(skipped) == 2 * ltx.TINY["num_layers"]
    assert skipped[0] == (
        "transformer_blocks.0.attn1",
        "head_dim 8: the CUDA kernel takes 64 or 128; diffusers' attention backend attends",
    )
    assert (
        "skipped attention (ltx_kernels.attention): transformer_blocks.0.attn1 (and 3 more)"
        in str(report)
    )
    with pytest.raises(ValueError, match="attention='sage' is none of"):
        ltx_kernels.inject_optimized_kernels(clone(model), verbose=False, attention="sage")


def _report(model, choice):
    return ltx_kernels.inject_optimized_kernels(model, verbose=False, attention=choice)


def _ltx_inputs(frames):
    import step_inputs

    torch.manual_seed(1)
    return step_inputs.ltx_video(
        ltx.TINY,
        lambda *shape: torch.randn(*shape),
        batch=2,
        frames=frames,
        height=ltx.HEIGHT,
        width=ltx.WIDTH,
        text=ltx.TEXT,
        mask=step_inputs.text_mask(2, ltx.TEXT, ltx.TEXT - 2, "cpu"),
        device="cpu",
    )


@pytest.mark.parametrize("choice, op", [("ltx_kernels", "attention"), ("int8", "attention_int8")])
def test_compiled_blocks_trace_the_op_without_breaks_or_recompiles(choice, op):
    # compile_repeated_blocks(fullgraph=True, dynamic=True) on the injected LTX-Video blocks: one
    # graph, our op inside it (self-attention; for "int8" with the quantizing ops), no recompile
    # from 2 frames (32 tokens) to 3 (48). "ltx_kernels": within fp32 summation noise of stock;
    # "int8": the same values as the injected model run eager.
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ltx.tiny_model(torch.float32)
    stock = clone(model)
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention=choice)
    eager = clone(model)
    model.compile_repeated_blocks(fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        output_of(model(**_ltx_inputs(2)))
        with (
            torch._dynamo.config.patch(error_on_recompile=True),
            profile(activities=[ProfilerActivity.CPU]) as prof,
        ):
            out = output_of(model(**_ltx_inputs(3)))
        if choice == "int8":
            assert torch.equal(out, output_of(eager(**_ltx_inputs(3))))
        else:
            assert rel_l2(out, output_of(stock(**_ltx_inputs(3)))) <= 1e-5
    events = [e.name for e in prof.events() if e.name == f"ltx_kernels::{op}"]
    assert len(events) == ltx.TINY["num_layers"]


@pytest.mark.parametrize("choice, op", [("ltx_kernels", "attention"), ("int8", "attention_int8")])
def test_autograd_recording_falls_back_with_stock_gradients(choice, op):
    # Our attention ops have no backward: a training forward attends with diffusers' backend
    # (gradients bit for bit those of attention="diffusers"); the same model without gradients
    # runs ours.
    torch.manual_seed(0)
    model, inputs = MODELS["flux"].build(torch.float32), MODELS["flux"].inputs(torch.float32)
    gradients = {}
    for attention_choice in ("diffusers", choice):
        trained = clone(model).train()
        ltx_kernels.inject_optimized_kernels(trained, verbose=False, attention=attention_choice)
        with OpCounter() as counter:
            output_of(trained(**inputs)).square().mean().backward()
        assert op not in counter.counts
        gradients[attention_choice] = [p.grad for p in trained.parameters()]
        with torch.no_grad(), OpCounter() as counter:
            trained(**inputs)
        assert (op in counter.counts) == (attention_choice == choice)
    for ours, theirs in zip(gradients[choice], gradients["diffusers"]):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)


@pytest.mark.parametrize("choice", ["ltx_kernels", "int8"])
def test_a_frozen_model_recording_through_its_text_falls_back_with_stock_gradients(choice):
    # Prompt-embedding optimisation (a frozen model, only the text stream recording): FLUX.1's
    # joint attentions record through the text's q/k/v alone, so they attend with diffusers'
    # backend (for "int8" the image query is not quantized in its norm pass either: query_format
    # is asked with the text stream's tensors too); the gradient is stock's bit for bit.
    torch.manual_seed(0)
    model = MODELS["flux"].build(torch.float32).requires_grad_(False)
    inputs = MODELS["flux"].inputs(torch.float32)
    gradients = {}
    for attention_choice in ("diffusers", choice):
        injected = clone(model)
        ltx_kernels.inject_optimized_kernels(injected, verbose=False, attention=attention_choice)
        text = inputs["encoder_hidden_states"].clone().requires_grad_(True)
        output_of(injected(**{**inputs, "encoder_hidden_states": text})).square().mean().backward()
        gradients[attention_choice] = text.grad
    assert torch.equal(gradients[choice], gradients["diffusers"])


def test_heads_that_do_not_divide_among_the_ulysses_ranks_raise_clearly():
    # (diffusers' Ulysses would fail inside a reshape)
    from types import SimpleNamespace

    config = SimpleNamespace(ulysses_degree=2, ring_degree=1, ulysses_anything=False)
    query, key, value = (torch.randn(1, 6, 3, 8) for _ in range(3))
    with pytest.raises(ValueError, match="3 attention heads do not divide among ulysses_degree=2"):
        attention.attend(
            _Processor(),
            query,
            key,
            value,
            parallel_config=SimpleNamespace(context_parallel_config=config),
        )


def test_ulysses_attention_leaves_values_that_record_to_diffusers(monkeypatch):
    # ulysses_attention's all-to-alls carry no backward: autograd recording through any of q, k
    # or v (e.g. a LoRA on to_v alone) keeps diffusers' Ulysses; key lengths under context
    # parallelism (ulysses_attention only) raise clearly instead.
    monkeypatch.setattr(attention, "context_parallel_config", lambda config: config)
    config = type("Config", (), dict(ulysses_degree=2, ring_degree=1, ulysses_anything=False))()
    config.ring_anything = False
    qkv = [torch.randn(1, 6, 4, 8) for _ in range(3)]
    ops = frozenset(injector.FUSIONS)
    assert attention.runs_ulysses_attention(ops, config, *qkv, None)
    with torch.enable_grad():
        for i in range(3):
            recording = [t.requires_grad_(j == i) for j, t in enumerate(qkv)]
            assert not attention.runs_ulysses_attention(ops, config, *recording, None)
            with pytest.raises(NotImplementedError, match="autograd recording"):
                attention.attend(_Processor(), *recording, parallel_config=config, key_lengths=(5,))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_takes_bf16_at_64_and_128_and_matches_sdpa(head_dim):
    def qkv(head_dim=head_dim, dtype=torch.bfloat16):
        torch.manual_seed(0)
        return [torch.randn(2, 300, 4, head_dim, dtype=dtype, device="cuda") for _ in range(3)]

    assert not attention._op_takes(*qkv(head_dim=96))
    assert not attention._op_takes(*qkv(dtype=torch.float32))
    query, key, value = qkv()
    assert attention._op_takes(query, key, value)
    lengths = (300, 173)
    out = attention.attend(_Processor(), query, key, value, key_lengths=lengths)
    expected = attention.attend(
        type("P", (_Processor,), {"attention": "diffusers"})(),
        query,
        key,
        value,
        key_lengths=lengths,
    )
    assert rel_l2(out, expected) <= BF16_TOLERANCE


@pytest.mark.gpu
def test_auto_takes_our_op_from_the_measured_tokens():
    # On a Hopper GPU "auto" attends with our op at head_dim 128 from 4608 queries and keys (FLUX.1's
    # 1024^2) and at head_dim 64 from 8064 (the table's entries), with diffusers' backend below
    # (4096, LTX-Video's 2688) and where the processor has a backend set.
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("LTX_ATTENTION_FASTER lists compute capability 9.0 only")
    processor = type("P", (_Processor,), {"attention": "auto"})()

    def qkv(tokens, keys=None, head_dim=128):
        shapes = ((1, tokens, 2, head_dim), (1, keys or tokens, 2, head_dim))
        q, k = (torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in shapes)
        return q, k, k

    assert attention.runs_ltx_attention(processor, *qkv(6144))
    assert attention.runs_ltx_attention(processor, *qkv(32760))
    assert attention.runs_ltx_attention(processor, *qkv(4608))
    assert not attention.runs_ltx_attention(processor, *qkv(4096))
    assert not attention.runs_ltx_attention(processor, *qkv(32760, 512))  # (text cross-attention)
    assert attention.runs_ltx_attention(processor, *qkv(8064, head_dim=64))
    assert not attention.runs_ltx_attention(processor, *qkv(2688, head_dim=64))
    assert not attention.runs_ltx_attention(processor, *qkv(8064, 128, head_dim=64))
    processor._attention_backend = "flash"
    assert not attention.runs_ltx_attention(processor, *qkv(6144))


@pytest.mark.parametrize("choice, op", [("ltx_kernels", "attention"), ("int8", "attention_int8")])
def test_hunyuan_video15_compiled_attends_with_device_key_lengths(choice, op):
    # Under torch.compile HunyuanVideo-1.5's text mask cannot become key lengths on the host: our
    # op takes them as a tensor counted on the device (the same output as eager, which reads them
    # on the host); a mask whose valid keys do not lead (the model never makes one) raises.
    from ltx_kernels.integration.hunyuan import HunyuanVideo15KernelsAttnProcessor
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    processor = HunyuanVideo15KernelsAttnProcessor()
    processor.ops, processor.attention = frozenset(injector.FUSIONS), choice
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 24 + 7, 2, 8) for _ in range(3))
    text_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)  # 7 text rows
    compiled = torch.compile(processor._attend, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        expected = processor._attend(query, key, value, text_mask)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = compiled(query, key, value, text_mask)
        assert torch.equal(out, expected)
        assert any(e.name == f"ltx_kernels::{op}" for e in prof.events())
        with pytest.raises(RuntimeError, match="valid keys first"):
            compiled(query, key, value, text_mask.flip(-1))


@pytest.mark.parametrize(
    "choice, hopper, op",
    [("auto", True, "attention"), ("auto", False, None), ("diffusers", True, None)],
)
def test_hunyuan_video15_compiled_auto_takes_the_key_lengths_on_hopper(
    choice, hopper, op, monkeypatch
):
    # Under torch.compile the alternative to our op with the key lengths is a key mask to
    # diffusers' backend (cuDNN: 1.4x the op at HunyuanVideo-1.5 480p on an H100): "auto" takes
    # our op on a Hopper GPU (the check patched here, the C twin attending), diffusers' backend
    # with the mask elsewhere; "diffusers" always keeps the mask. The same output as eager.
    from ltx_kernels.integration.hunyuan import HunyuanVideo15KernelsAttnProcessor
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(attention, "_hopper", lambda query: hopper)
    torch._dynamo.reset()
    processor = HunyuanVideo15KernelsAttnProcessor()
    processor.ops, processor.attention = frozenset(injector.FUSIONS), choice
    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 24 + 7, 2, 8) for _ in range(3))
    text_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    compiled = torch.compile(processor._attend, fullgraph=True, dynamic=True, backend="aot_eager")
    with torch.no_grad():
        expected = processor._attend(query, key, value, text_mask)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = compiled(query, key, value, text_mask)
    ops = {e.name for e in prof.events() if e.name.startswith("ltx_kernels::attention")}
    assert ops == ({f"ltx_kernels::{op}"} if op else set())
    assert rel_l2(out, expected) <= 1e-6
