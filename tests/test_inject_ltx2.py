"""inject_optimized_kernels on LTX-2, LTX-2.3 and LTX-2.5: tiny models on the CPU (diffusers' own test
sizes with each release's flags): text-to-video, image-to-video with per-token timesteps, STG, the
audio stream, the audio-video cross-attention with a RoPE table per tensor, gates, split and
interleaved RoPE; exact reports and op counts; code that is not diffusers 0.42.1's left stock; the
full-size reports on the meta device; a full-size two-block subset on the GPU. Each op disabled
alone, bf16 bit-identity, compile, training and caches: the shared tests (model_zoo.MODELS)."""

import math

import pytest
import torch

import ltx_kernels
from inject_helpers import (
    REL_L2_TOLERANCE,
    assert_remove_restores,
    caller,
    clone,
    count_ltx_ops,
    eager_and_injected,
    inject_then_group_offload,
    rel_l2,
)
from ltx_kernels.integration import FUSIONS, diffusers_compat
from ltx_kernels.integration.ltx2 import AV_ATTN, BLOCK, GATES, MODEL, SELF_ATTN, TEXT_ATTN, TEXT_KV
from model_zoo.ltx2 import RELEASES, config, expected_ops, inputs, tiny_model

from diffusers import LTX2VideoTransformer3DModel  # noqa: E402  (inject_helpers skips without it)
from diffusers.models.transformers import transformer_ltx2  # noqa: E402

FP32_TOLERANCE = 1e-6  # relative L2 vs eager: only the summation order differs


def report_for(release: str, layers: int) -> tuple[dict, dict]:
    """(patched, number of skipped entries per kind) of a stock model with `layers` blocks."""
    patched = {BLOCK: layers, SELF_ATTN: 2 * layers, TEXT_ATTN: 2 * layers, AV_ATTN: 2 * layers}
    patched[MODEL] = 1
    skipped = {}
    if RELEASES[release]["gated_attn"]:
        skipped = {GATES: 6 * layers, TEXT_KV: layers}
    return patched, skipped


def skipped_counts(report) -> dict:
    return {kind: len(entries) for kind, entries in report.skipped.items()}


def assert_same_outputs(injected, eager, dtype):
    """Both outputs (video, audio): bit-identical in bf16, within FP32_TOLERANCE in fp32."""
    for ours, theirs in zip(injected, eager, strict=True):
        assert torch.isfinite(ours).all()
        if dtype == torch.float32:
            assert rel_l2(ours, theirs) <= FP32_TOLERANCE
        else:
            assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------------------------
# Whole models
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [None, "i2v", "stg"], ids=["t2v", "i2v", "stg"])
@pytest.mark.parametrize("release", list(RELEASES))
def test_tiny_matches_eager_and_restores(release, variant, dtype):
    model = tiny_model(dtype, release)
    call = caller(inputs(dtype, release, variant))
    eager, injected, report = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, dtype)
    patched, skipped = report_for(release, 2)
    assert dict(report.patched) == patched and skipped_counts(report) == skipped
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, release, variant=variant)
    assert_remove_restores(model, call, eager)
    processors = {type(m.processor).__name__ for m in model.modules() if hasattr(m, "processor")}
    stock = "LTX2PerturbedAttnProcessor" if RELEASES[release]["perturbed_attn"] else None
    assert processors == {stock or "LTX2AudioVideoAttnProcessor"}


@pytest.mark.parametrize(
    "release, overrides",
    [
        ("2.0", dict(rope_type="interleaved")),  # diffusers' default: pairs over the whole token
        ("2.5", dict(rope_type="interleaved")),
        ("2.0", dict(norm_elementwise_affine=True)),  # RMSNorm weights in every norm
        ("2.5", dict(norm_elementwise_affine=True)),
        # the audio-video cross-attention with 4 heads, its RoPE tables with the video's 2
        # (diffusers builds them with num_attention_heads): the rotation follows the tables
        ("2.0", dict(audio_num_attention_heads=4, audio_attention_head_dim=2)),
        ("2.5", dict(use_prompt_adaln_single=False)),  # KV-cacheable: the static text K/V table
    ],
    ids=[
        "2.0-interleaved_rope",
        "2.5-interleaved_rope",
        "2.0-norm_weights",
        "2.5-norm_weights",
        "2.0-audio_heads_4x2",
        "2.5-static_text_kv_table",
    ],
)
def test_config_variants_are_bit_identical(release, overrides):
    model = tiny_model(torch.bfloat16, release, **overrides)
    if overrides.get("norm_elementwise_affine"):
        assert model.transformer_blocks[0].norm2.weight is not None
    call = caller(inputs(torch.bfloat16, release))
    eager, injected, report = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    assert dict(report.patched) == report_for(release, 2)[0]
    assert count_ltx_ops(lambda: call(model)) == expected_ops(FUSIONS, release)


def test_video_self_attention_mask():
    # IC-LoRA's multiplicative [B, S, S] mask on the video self-attention (reference tokens at
    # half strength), turned into a bias by the model and into [B, H, S, S] by the processor.
    model = tiny_model(torch.bfloat16, "2.3")
    kwargs = inputs(torch.bfloat16, "2.3")
    mask = torch.ones(2, 32, 32)
    mask[:, :, 16:] = 0.5
    mask[1, :, 24:] = 0.0
    call = caller({**kwargs, "video_self_attention_mask": mask})
    eager, injected, _ = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    with torch.no_grad():
        assert rel_l2(caller(kwargs)(model)[0], injected[0]) > 1e-3  # the mask is applied


@pytest.mark.parametrize("disabled", [{"rope"}, {"qk_rmsnorm_rope"}, {"rope", "qk_rmsnorm_rope"}])
@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_rope_fallbacks_are_bit_identical(rope_type, disabled):
    # Without the rope op the rotations run diffusers' own code on the views our steps hand it
    # (split: head views and transposed tables, turned back); without qk_rmsnorm_rope the norms
    # run as torch.nn.RMSNorm over the token before the head views.
    model = tiny_model(torch.bfloat16, "2.3", rope_type=rope_type)
    call = caller(inputs(torch.bfloat16, "2.3"))
    eager, injected, _ = eager_and_injected(model, call, ops=set(FUSIONS) - disabled)
    assert_same_outputs(injected, eager, torch.bfloat16)
    counts = count_ltx_ops(lambda: call(model))
    assert not disabled & set(counts) and counts["add_rmsnorm_modulate"] == 12


@pytest.mark.parametrize("release", ["2.0", "2.3"])
def test_isolate_modalities_skips_the_audio_video_attention(release):
    model = tiny_model(torch.bfloat16, release)
    call = caller({**inputs(torch.bfloat16, release), "isolate_modalities": True})
    eager, injected, _ = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    expected = expected_ops(FUSIONS, release, audio_video=False)
    assert count_ltx_ops(lambda: call(model)) == expected and "rope" not in expected


# ------------------------------------------------------------------------------------------------
# Spatio-temporal guidance (LTX2PerturbedAttnProcessor)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["mixed", "all_perturbed"])
def test_stg_gives_stock_outputs(mask, dtype):
    # mixed: block 1's self-attention perturbs the second sample only (lerp of values and
    # attention); all_perturbed: the default mask, every sample takes the values (no attention).
    model = tiny_model(dtype, "2.3")
    kwargs = inputs(dtype, "2.3", "stg")
    if mask == "all_perturbed":
        kwargs["perturbation_mask"] = None
    call = caller(kwargs)
    eager, injected, _ = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, dtype)
    with torch.no_grad():  # STG changes the output: the perturbation is not dropped
        unperturbed = caller(inputs(dtype, "2.3"))(model)
    assert rel_l2(unperturbed[0], injected[0]) > 1e-3
    stg_layers = 1 if mask == "all_perturbed" else 0
    counts = count_ltx_ops(lambda: call(model))
    assert counts == expected_ops(FUSIONS, "2.3", stg_layers=stg_layers)
    attn = model.transformer_blocks[1].attn1
    assert type(attn.processor).__name__ == "LTX2KernelsPerturbedAttnProcessor"


def test_perturbed_processor_set_by_the_user_is_fused():
    # LTX-2.0 blocks pass no perturbation mask: the STG processor a user sets on them (as diffusers'
    # available processors allow) runs its plain path.
    model = tiny_model(torch.bfloat16, "2.0")
    model.transformer_blocks[0].attn1.set_processor(transformer_ltx2.LTX2PerturbedAttnProcessor())
    call = caller(inputs(torch.bfloat16, "2.0"))
    eager, injected, report = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    assert report.patched[SELF_ATTN] == 4
    processor = model.transformer_blocks[0].attn1.processor
    assert type(processor).__name__ == "LTX2KernelsPerturbedAttnProcessor"


# ------------------------------------------------------------------------------------------------
# Blocks: the audio stream, the audio-video cross-attention, gates
# ------------------------------------------------------------------------------------------------
def block_call(model, kwargs, **flags):
    """call(block): block 0 of `model` on the hidden states, embeddings and RoPE tables its model
    hands it for `kwargs` (recorded from one stock forward); flags override block arguments."""
    seen = {}
    block = model.transformer_blocks[0]

    def record(module, args, block_kwargs):
        seen.update(block_kwargs)

    handle = block.register_forward_pre_hook(record, with_kwargs=True)
    with torch.no_grad():
        model(**kwargs)
    handle.remove()
    return lambda b: b(**{**seen, **flags})


class OpRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op name, width of its first operand) of every ltx_kernels op call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "ltx_kernels":
            self.calls.append((func._schema.name.split("::")[-1], args[0].shape[-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "a2v, v2a", [(True, True), (True, False), (False, True), (False, False)], ids=str
)
@pytest.mark.parametrize("release", ["2.0", "2.3"])
def test_block_with_each_audio_video_attention(release, a2v, v2a):
    # Each stream's pending residual goes into the norm of the next step that runs: the audio-video
    # norms with one or two modulations, or norm3.
    dtype = torch.bfloat16
    model = tiny_model(dtype, release)
    call = block_call(
        model,
        inputs(dtype, release, "i2v"),
        use_a2v_cross_attention=a2v,
        use_v2a_cross_attention=v2a,
    )
    block = model.transformer_blocks[0]
    eager, injected, _ = eager_and_injected(block, call)
    assert_same_outputs(injected, eager, dtype)
    with torch.no_grad(), OpRows() as spy:
        call(block)
    # one rope op per rotated tensor (q and k) of each audio-video attention in use
    assert sum(op == "rope" for op, _ in spy.calls) == 2 * (a2v + v2a)
    norms = [width for op, width in spy.calls if op in ("rmsnorm_modulate", "add_rmsnorm_modulate")]
    used = a2v + v2a
    # norm1, norm2, the audio-video norm (one or two modulations), norm3; per stream
    assert sorted(norms) == sorted([8, 16] * (3 + used))


def test_audio_stream_runs_on_the_fused_ops():
    # Every fused step has its audio twin: the same ops on the audio rows (width 8) as on the
    # video rows (width 16), and the audio output is eager's too.
    model = tiny_model(torch.bfloat16, "2.3")
    call = caller(inputs(torch.bfloat16, "2.3", "i2v"))
    eager, injected, _ = eager_and_injected(model, call)
    assert torch.equal(injected[1], eager[1])
    with torch.no_grad(), OpRows() as spy:
        call(model)
    for op in ("rmsnorm_modulate", "add_rmsnorm_modulate", "linear_gelu", "gated_residual"):
        video = sum(1 for name, width in spy.calls if name == op and width == 16)
        audio = sum(1 for name, width in spy.calls if name == op and width == 8)
        assert video == audio > 0, op
    assert ("layernorm_modulate", 8) in spy.calls and ("layernorm_modulate", 16) in spy.calls


def test_per_head_gates_are_applied():
    # 2.3's gated attention: gate logits moved away from their values change the output, in the
    # injected model as in eager, bit for bit (the gates are diffusers' code in our processor).
    model = tiny_model(torch.bfloat16, "2.3")
    call = caller(inputs(torch.bfloat16, "2.3"))
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        before = call(model)[0]
        for m in model.modules():
            if getattr(m, "to_gate_logits", None) is not None:
                m.to_gate_logits.bias.add_(1.0)
        after = call(model)[0]
        ltx_kernels.remove_optimized_kernels(model)
        eager = call(model)[0]
    assert not torch.equal(before, after) and torch.equal(after, eager)


def test_audio_video_rope_rotates_queries_and_keys_by_their_own_tables():
    # The a2v attention: video queries with the video cross table, audio keys with the audio one
    # (different lengths), each through the rope op, as diffusers rotates them.
    model = tiny_model(torch.float32, "2.0")
    attn = model.transformer_blocks[0].audio_to_video_attn
    torch.manual_seed(0)
    video, audio = torch.randn(2, 32, 16), torch.randn(2, 5, 8)
    coords = model.rope.prepare_video_coords(2, 2, 4, 4, "cpu", fps=24.0)
    audio_coords = model.audio_rope.prepare_audio_coords(2, 5, "cpu")
    q_rope = model.cross_attn_rope(coords[:, 0:1])
    k_rope = model.cross_attn_audio_rope(audio_coords[:, 0:1])
    assert q_rope[0].shape == (2, 2, 32, 2) and k_rope[0].shape == (2, 2, 5, 2)  # [B, H, S, r]

    def call(k_table):
        with torch.no_grad():
            return attn(video, audio, query_rotary_emb=q_rope, key_rotary_emb=k_table)

    eager = call(k_rope)
    ltx_kernels.inject_optimized_kernels(model, verbose=False)
    with torch.no_grad(), OpRows() as spy:
        injected = call(k_rope)
    assert rel_l2(injected, eager) <= FP32_TOLERANCE
    assert [op for op, _ in spy.calls] == ["qk_rmsnorm_rope", "rope", "rope"]
    # The key's table is used: the query's in its place changes the result (a length mismatch
    # aside, here both tables are cut to the 5 audio rows).
    swapped = call((q_rope[0][:, :, :5], q_rope[1][:, :, :5]))
    assert rel_l2(swapped, injected) > 1e-3


# ------------------------------------------------------------------------------------------------
# What stays stock
# ------------------------------------------------------------------------------------------------
def test_code_other_than_diffusers_0_42_1_is_left_stock():
    # A block, processor or model whose code is not the code the patches reproduce (a fork,
    # another diffusers version) keeps it, reported; the rest is patched.
    class LTX2VideoTransformerBlock(transformer_ltx2.LTX2VideoTransformerBlock):
        def forward(self, *args, **kwargs):  # e.g. a fork's extra step
            hidden_states, audio_hidden_states = super().forward(*args, **kwargs)
            return hidden_states * 1.0, audio_hidden_states

    class LTX2AudioVideoAttnProcessor(transformer_ltx2.LTX2AudioVideoAttnProcessor):
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return super().__call__(attn, hidden_states, *args, **kwargs)

    class LTX2VideoTransformer3DModel(transformer_ltx2.LTX2VideoTransformer3DModel):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    model = tiny_model(torch.bfloat16, "2.0")
    model.__class__ = LTX2VideoTransformer3DModel
    model.transformer_blocks[1].__class__ = LTX2VideoTransformerBlock
    model.transformer_blocks[0].attn2.set_processor(LTX2AudioVideoAttnProcessor())
    call = caller(inputs(torch.bfloat16, "2.0"))
    eager, injected, report = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    for kind, name, method in (
        (BLOCK, "transformer_blocks.1", "LTX2VideoTransformerBlock.forward"),
        (TEXT_ATTN, "transformer_blocks.0.attn2", "LTX2AudioVideoAttnProcessor.__call__"),
        (MODEL, "", "LTX2VideoTransformer3DModel.forward"),
    ):
        [(skipped, reason)] = report.skipped[kind]
        assert skipped == name and f"{method} (test_inject_ltx2)" in reason
        assert "is not the diffusers 0.42.1 code" in reason
    assert (
        report.patched[BLOCK] == 1
        and report.patched[TEXT_ATTN] == 3
        and MODEL not in report.patched
    )
    assert report.patched[SELF_ATTN] == 4  # the forked block's attention is patched
    expected = expected_ops(FUSIONS, "2.0", layers=1)
    expected["qk_rmsnorm_rope"] += 5  # block 1's patched attention, but block 0's attn2
    expected["rope"] += 4
    del expected["layernorm_modulate"]  # the output norms
    assert count_ltx_ops(lambda: call(model)) == expected


def test_fingerprint_ignores_docstrings_comments_and_blank_lines_only():
    def version(which):
        if which == "a":

            def forward(x):
                """One docstring."""
                return x + 1  # a comment

        elif which == "b":

            def forward(x):
                """Another, longer docstring."""

                return x + 1

        else:

            def forward(x):
                return x + 2

        return forward

    a, b, c = (diffusers_compat.fingerprint(version(which)) for which in "abc")
    assert a == b != c and a is not None


def test_custom_processor_is_kept_and_reported():
    class MyProcessor(transformer_ltx2.LTX2AudioVideoAttnProcessor):
        pass

    model = tiny_model(torch.bfloat16, "2.0")
    model.transformer_blocks[1].attn2.set_processor(MyProcessor())
    call = caller(inputs(torch.bfloat16, "2.0"))
    eager, injected, report = eager_and_injected(model, call)
    assert_same_outputs(injected, eager, torch.bfloat16)
    [(name, reason)] = report.skipped[TEXT_ATTN]
    assert name == "transformer_blocks.1.attn2" and "MyProcessor" in reason
    assert report.patched[TEXT_ATTN] == 3
    expected = expected_ops(FUSIONS, "2.0")
    expected["qk_rmsnorm_rope"] -= 1
    assert count_ltx_ops(lambda: call(model)) == expected


def test_model_hook_then_inject_reports_output_norms():
    from accelerate import cpu_offload_with_hook

    model = tiny_model(torch.bfloat16, "2.0")
    call = caller(inputs(torch.bfloat16, "2.0"))
    with torch.no_grad():
        eager = call(model)
    cpu_offload_with_hook(model, execution_device=torch.device("cpu"))
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    [(name, reason)] = report.skipped[MODEL]
    assert name == "" and "wrapped by a hook" in reason
    with torch.no_grad():
        assert_same_outputs(call(model), eager, torch.bfloat16)
    assert "layernorm_modulate" not in count_ltx_ops(lambda: call(model))


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_inject_then_group_offload(offload_type):
    model = tiny_model(torch.bfloat16, "2.3")
    call = caller(inputs(torch.bfloat16, "2.3"))
    inject_then_group_offload(model, call, offload_type)
    if offload_type == "leaf_level":
        # Hooks on the Linear layers and q/k norms: the FF step calls the hooked projection and
        # the q/k norms run as torch.nn.RMSNorm (then our RoPE); the weightless block norms and
        # the residuals stay fused.
        counts = count_ltx_ops(lambda: call(model))
        assert "linear_gelu" not in counts and "qk_rmsnorm_rope" not in counts
        assert counts["add_rmsnorm_modulate"] == 12 and counts["rope"] == 16


def test_compile_whole_model_fullgraph_no_recompile_cpu():
    torch._dynamo.reset()
    model = tiny_model(torch.float32, "2.5")
    kwargs = inputs(torch.float32, "2.5", "i2v")
    eager, _, _ = eager_and_injected(model, caller(kwargs))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with (
        torch.no_grad(),
        torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True),
    ):
        compiled(**{**kwargs, "timestep": kwargs["timestep"] * 0.5})  # another step's timesteps
        out = compiled(**kwargs)
    for ours, theirs in zip(out, eager, strict=True):
        assert rel_l2(ours, theirs) <= FP32_TOLERANCE


# ------------------------------------------------------------------------------------------------
# Full size: the reports on the meta device, a two-block subset on the GPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("release", list(RELEASES))
def test_full_size_reports_on_meta(release):
    with torch.device("meta"):
        model = LTX2VideoTransformer3DModel(**config(release, full=True))
    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    patched, skipped = report_for(release, 48)
    assert dict(report.patched) == patched and skipped_counts(report) == skipped
    assert ltx_kernels.remove_optimized_kernels(model) == sum(patched.values())


# 121 frames of 768x512 at 24 fps: 16 x 16 x 24 latent tokens, round(121 / 24 * 25) = 126 audio
# latents (LTX2Pipeline), 1024 text tokens (its max_sequence_length).
FULL_CLIP = dict(frames=16, height=16, width=24, audio_frames=126, text=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("release", list(RELEASES))
def test_full_size_two_blocks_gpu(release):
    """Two blocks of the release's real dimensions (and the model's embeddings and output norms),
    bf16, random weights, batch 2 (CFG) of the full clip's token counts: injected vs eager."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LTX2VideoTransformer3DModel(**config(release, full=True, num_layers=2))
    model = model.to(torch.bfloat16).eval()
    call = caller(inputs(torch.bfloat16, release, "i2v", full=True, device="cuda", **FULL_CLIP))
    eager, injected, report = eager_and_injected(model, call)
    assert dict(report.patched) == report_for(release, 2)[0]
    errors = [rel_l2(ours, theirs) for ours, theirs in zip(injected, eager, strict=True)]
    times = _forward_ms(model, call)
    print(
        f"LTX-{release} full size, 2 blocks, 2x(6144 video + 126 audio) tokens, bf16: relative L2 "
        f"vs eager video {errors[0]:.2e}, audio {errors[1]:.2e}; forward {times[0]:.1f} ms "
        f"eager, {times[1]:.1f} ms injected ({times[0] / times[1]:.2f}x)"
    )
    assert all(error <= REL_L2_TOLERANCE[torch.bfloat16] for error in errors)
    assert_remove_restores(model, call, eager)


def _forward_ms(model, call, repeats=5):
    """(eager, injected) milliseconds of one forward of the injected `model`."""
    times = []
    for injected in (False, True):
        if not injected:
            ltx_kernels.remove_optimized_kernels(model)
        else:
            ltx_kernels.inject_optimized_kernels(model, verbose=False)
        with torch.no_grad():
            call(model)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                call(model)
            end.record()
            torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return times


@pytest.mark.gpu
@pytest.mark.parametrize("release", ["2.0", "2.3"])
def test_full_size_bf16_gradients_gpu(release):
    """Two blocks of the release's real dimensions (2.3: gates, text modulation, STG processors),
    bf16, train mode, 2 x (1536 video + 42 audio) tokens, per-token timesteps: every parameter's
    gradient in the injected model is as close to an fp32 evaluation of stock diffusers (same
    weights) as stock bf16 diffusers' gradient is. The CUDA backward kernels on LTX-2's layouts
    (split RoPE on [B, H, S, D/2] tables, per-token modulation, both streams)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        reference = LTX2VideoTransformer3DModel(**config(release, full=True, num_layers=2)).train()
    stock = clone(reference).to(torch.bfloat16)
    injected = clone(stock)
    ltx_kernels.inject_optimized_kernels(injected, verbose=False)
    kwargs = inputs(
        torch.float32,
        release,
        "i2v",
        full=True,
        device="cuda",
        frames=4,
        height=16,
        width=24,
        audio_frames=42,
        text=128,
    )
    bf16_kwargs = {  # the latents and text in the model dtype, timesteps and masks as they are
        k: v.to(torch.bfloat16) if k.endswith("hidden_states") else v for k, v in kwargs.items()
    }
    for model, model_kwargs in ((reference, kwargs), (stock, bf16_kwargs), (injected, bf16_kwargs)):
        video, audio = model(**model_kwargs)
        generator = torch.Generator("cuda").manual_seed(1234)  # the same projection for each
        loss = sum(
            (out.float() * torch.randn(out.shape, device="cuda", generator=generator)).sum()
            for out in (video, audio)
        )
        loss.backward()
    exact = dict(reference.named_parameters())
    ours = dict(injected.named_parameters())
    errors = {}  # name: (stock bf16's error, ours), relative L2 against fp32
    for name, p in stock.named_parameters():
        if p.grad is None:  # unused by this forward (e.g. 2.3's caption projection)
            assert ours[name].grad is None, name
            continue
        assert ours[name].grad is not None, name
        want = exact[name].grad
        errors[name] = (rel_l2(p.grad, want), rel_l2(ours[name].grad, want))
    # bf16 gradients carry rounding noise whose size varies by parameter: reordering the same
    # ops alone (the injected model with ops=[]) moves one parameter's error 16x on a tiny model
    # (a gate bias, 8e-4 -> 1.4e-2). So: no gradient further off than stock's plus the largest
    # stock error (a wrong gradient is off by ~1), and overall no less accurate than stock's
    # (geometric mean of the ratios; tiny models: 0.78-0.93 with the fused ops, 1.0 without).
    noise = max(stock_error for stock_error, _ in errors.values())
    for name, (stock_error, our_error) in errors.items():
        assert our_error <= stock_error + noise, (
            f"{name}: injected bf16 gradient error {our_error:.3g} vs stock bf16 {stock_error:.3g}"
        )
    ratios = [max(ours, 1e-6) / max(stock, 1e-6) for stock, ours in errors.values()]
    mean_ratio = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(
        f"LTX-{release} full size bf16 gradients, relative L2 vs fp32: largest stock {noise:.3g}, "
        f"largest injected {max(ours for _, ours in errors.values()):.3g}; geometric mean "
        f"injected/stock {mean_ratio:.2f}"
    )
    assert mean_ratio <= 1.25
