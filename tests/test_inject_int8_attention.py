"""inject_optimized_kernels(..., attention="int8") (issue 34 item 4): 8-bit attention through the
attention seam (attention.int8_attention: q, k and v quantized by our ops, then attention_int8)
wherever it applies (on a GPU also where it measured faster: test_inject_attention's
test_int8_follows_the_measured_table; here every length, conftest.int8_at_every_length), "auto"
elsewhere; attention_bf16_blocks keeping the first/last blocks out of
8 bits; the report. (Compiled blocks and autograd recording, the fallback:
test_inject_attention.py, for both attention choices.) On the CPU the C twins run the same
quantization and the attention of the dequantized operands in double (the CUDA kernel also
rounds the probabilities to e4m3)."""

import pytest
import torch

import ltx_kernels
from inject_helpers import OpCounter, clone, output_of, rel_l2
from ltx_kernels import reference
from ltx_kernels.integration import attention, injector
from ltx_kernels.integration.quant import QuantRows
from model_zoo import MODELS, ltx, ltx2, wan

#: (tiny calls: on a GPU they take the 8-bit path at every length, conftest.int8_at_every_length)
pytestmark = pytest.mark.usefixtures("int8_at_every_length")

#: Relative L2 of 8-bit attention against exact attention: v in e4m3 (3 mantissa bits: 2.5e-2
#: alone on _qkv's inputs), q and k in INT8 (steps of 1/127 of each block's amax, which _qkv's
#: 8x outlier channel of k makes coarse for the other channels): 3.6e-2 to 5.2e-2 measured on
#: the CPU (the twins keep p exact) in fp32 and bf16 over 60 seeds of _qkv. The bound holds for
#: any draw, not one: the CPU's random stream differs between machines (vectorized paths).
INT8_TOLERANCE = 6e-2
#: The CUDA kernel also rounds the probabilities (times 448) to e4m3 before p.v: 6.6e-2 (head_dim
#: 64) and 7.1e-2 (128) measured against SDPA on an H100 on _qkv's inputs.
INT8_TOLERANCE_CUDA = 8e-2
#: Noise the quantization must leave: an "int8" path that attended in 16 or 32 bits stays below.
QUANTIZED_AT_LEAST = 1e-4
#: SD3 (no q/k norm) keeps diffusers' processor: nothing of ours attends.
NO_PROCESSOR = {"sd3"}
#: The block lists of FLUX.1 and HunyuanVideo, in block order.
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


class _Processor:
    ops = frozenset(injector.FUSIONS)
    attention = "int8"
    _attention_backend = None


def _qkv(q_len, kv_len, dtype, device="cpu", heads=3, head_dim=16):
    torch.manual_seed(0)
    q = torch.randn(2, q_len, heads, head_dim, dtype=dtype, device=device)
    # keys with a per-channel offset (what smoothing removes) and outlier channels
    k = torch.randn(2, kv_len, heads, head_dim, dtype=dtype, device=device)
    k = k + torch.linspace(-4, 4, head_dim, device=device).to(dtype)
    k[..., 3] *= 8
    v = torch.randn(2, kv_len, heads, head_dim, dtype=dtype, device=device)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [None, (150, 70), (150, 0)])
def test_int8_attention_is_attention_within_8_bit_noise(dtype, lengths):
    # 37 queries over 150 keys (two k-scale blocks, the second partial), strided q/k/v views:
    # within 8-bit noise of exact attention, not exact (quantized), and the keys past each length
    # never read (garbage there changes nothing; a length of 0 gives zeros).
    q, k, v = _qkv(37, 150, dtype)
    key_lengths = None if lengths is None else torch.tensor(lengths)
    out = attention.int8_attention(
        q, k.transpose(1, 2).contiguous().transpose(1, 2), v, key_lengths
    )
    assert out.dtype == dtype and out.shape == q.shape
    exact = reference.attention(q, k, v, key_lengths, compute_dtype=torch.float64)
    error = rel_l2(out.double(), exact)
    assert QUANTIZED_AT_LEAST < error <= INT8_TOLERANCE, error
    if lengths is not None:
        k[1, 70:], v[1, 70:] = 1e4, -1e4  # (past the second element's length)
        garbage = attention.int8_attention(q, k, v, key_lengths)
        torch.testing.assert_close(garbage[1], out[1], rtol=0, atol=0)
        if lengths[1] == 0:
            assert torch.equal(out[1], torch.zeros_like(out[1]))
        elif dtype == torch.float32:
            # k smoothed by the mean of the attended keys alone (not pulled towards the keys
            # past the length): attends as the same op on its 70 keys, to fp32 rounding.
            alone = attention.int8_attention(q[1:], k[1:, :70], v[1:, :70])
            torch.testing.assert_close(out[1:], alone, rtol=1e-5, atol=1e-6)


def test_the_seam_passes_key_lengths_and_falls_back_where_8_bits_do_not_apply(monkeypatch):
    calls = []

    def recorded(query, key, value, key_lengths=None):
        calls.append((key.shape[1], None if key_lengths is None else key_lengths.tolist()))
        return torch.zeros_like(query)

    monkeypatch.setattr(attention, "int8_attention", recorded)
    q, k, v = _qkv(9, 11, torch.float32)
    attention.attend(_Processor(), q, k, v, key_lengths=(11, 4))  # mixed lengths: as lengths
    attention.attend(_Processor(), q, k, v, key_lengths=(7, 7))  # the same: the keys sliced
    assert calls == [(11, [11, 4]), (7, None)]
    # a mask, autograd recording, float64 (the quantizers take float16/bfloat16/float32) and
    # q/k/v of different dtypes attend as "auto" (here: diffusers')
    attention.attend(_Processor(), q, k, v, mask=torch.ones(2, 1, 1, 11, dtype=torch.bool))
    with torch.enable_grad():
        attention.attend(_Processor(), q.clone().requires_grad_(), k, v)
    attention.attend(_Processor(), q.double(), k.double(), v.double())
    assert not attention._int8_takes(q, k.bfloat16(), v)
    assert len(calls) == 2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_family_attends_in_8_bits(name):
    # Every family and variant, fp32 on the CPU: "int8" runs our 8-bit ops in every patched
    # attention and stays within 8-bit noise of "diffusers".
    torch.manual_seed(0)
    model, inputs = MODELS[name].build(torch.float32), MODELS[name].inputs(torch.float32)
    outputs, counts = {}, {}
    for choice in ("diffusers", "int8"):
        injected = clone(model)
        ltx_kernels.inject_optimized_kernels(injected, verbose=False, attention=choice)
        with torch.no_grad(), OpCounter() as counter:
            outputs[choice] = output_of(injected(**inputs))
        counts[choice] = counter.counts
    assert "attention_int8" not in counts["diffusers"]
    if name in NO_PROCESSOR:
        assert torch.equal(outputs["int8"], outputs["diffusers"])
        return
    calls = counts["int8"]
    assert calls["attention_int8"] > 0, calls
    assert calls["attention_int8"] == calls["quantize_attention_k"] == calls["quantize_attention_v"]
    assert rel_l2(outputs["int8"], outputs["diffusers"]) <= INT8_TOLERANCE


#: The families whose processors have the q/k norm op quantize the query (query_format) in every
#: attention that runs in 8 bits: LTX-Video's and Wan's text-to-video ones (I2V's attend the query
#: twice: left a tensor); per attention in 8 bits, how many keep diffusers' attention and the
#: plain qk_rmsnorm_rope (LTX-Video: the cross-attention under its text mask).
QUERY_IN_THE_NORM_PASS = {
    "ltx": 1,
    "ltx_per_token": 1,
    "wan": 0,
    "wan_ti2v": 0,
    "skyreels_v2": 0,
    "skyreels_v2_df": 0,
}


@pytest.mark.parametrize("name", sorted(QUERY_IN_THE_NORM_PASS))
def test_the_query_is_quantized_in_the_norm_pass(name, monkeypatch):
    # q from qk_rmsnorm_rope_quant (no quantize pass of int8_attention's own) in every attention
    # of the model, bit for bit what quantizing the bf16 op's q gives (query_format refused).
    torch.manual_seed(0)
    model, inputs = MODELS[name].build(torch.float32), MODELS[name].inputs(torch.float32)
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention="int8")
    with torch.no_grad(), OpCounter() as counter:
        fused = output_of(model(**inputs))
    calls = counter.counts
    assert calls["qk_rmsnorm_rope_quant"] == calls["attention_int8"] > 0, calls
    assert "quantize" not in calls, calls
    plain_per_int8 = QUERY_IN_THE_NORM_PASS[name]
    assert calls.get("qk_rmsnorm_rope", 0) == plain_per_int8 * calls["attention_int8"], calls
    monkeypatch.setattr(attention, "query_format", lambda *args, **kwargs: None)
    with torch.no_grad(), OpCounter() as counter:
        separate = output_of(model(**inputs))
    assert counter.counts["quantize"] == counter.counts["attention_int8"]
    # each norm pass that quantized q is the plain op there; the others are the same
    plain = calls.get("qk_rmsnorm_rope", 0) + calls["qk_rmsnorm_rope_quant"]
    assert counter.counts["qk_rmsnorm_rope"] == plain, (calls, counter.counts)
    assert torch.equal(fused, separate)


#: The tiny models' configs at a head_dim (LTX-Video's text width is its inner width, 2 heads).
AT_HEAD_DIM = {
    "ltx": (
        ltx,
        lambda head_dim: dict(attention_head_dim=head_dim, cross_attention_dim=2 * head_dim),
    ),
    "wan": (wan, lambda head_dim: dict(attention_head_dim=head_dim)),
}


@pytest.mark.parametrize("name", sorted(AT_HEAD_DIM))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kernels_head_dims_quantize_the_query_in_the_norm_pass(
    device, name, head_dim, monkeypatch
):
    # The same in bf16 at the head dims the CUDA kernel takes (on a Hopper GPU: the CUDA ops).
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 8-bit kernel is Hopper's (compute capability 9.0)")
    torch.manual_seed(0)
    family, config = AT_HEAD_DIM[name]
    model = family.tiny_model(torch.bfloat16, **config(head_dim)).to(device)
    inputs = {
        key: value.to(device) if isinstance(value, torch.Tensor) else value
        for key, value in family.tiny_inputs(torch.bfloat16).items()
    }
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention="int8")
    with torch.no_grad(), OpCounter() as counter:
        fused = output_of(model(**inputs))
    calls = counter.counts
    assert calls["qk_rmsnorm_rope_quant"] == calls["attention_int8"] > 0, calls
    assert "quantize" not in calls, calls
    plain_per_int8 = QUERY_IN_THE_NORM_PASS[name]
    assert calls.get("qk_rmsnorm_rope", 0) == plain_per_int8 * calls["attention_int8"], calls
    monkeypatch.setattr(attention, "query_format", lambda *args, **kwargs: None)
    with torch.no_grad():
        assert torch.equal(fused, output_of(model(**inputs)))


@pytest.mark.parametrize("release", ["2.0", "2.3"])
@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_ltx2_self_attention_quantizes_the_query_in_the_norm_pass(release, rope_type, monkeypatch):
    # LTX-2's self-attentions (video and audio: q and k rotated by one table) take q from
    # qk_rmsnorm_rope_quant, split into heads; the audio-video attentions (queries and keys rotated
    # by their own tables, apart from the norms) quantize it in int8_attention; bit for bit the
    # output of every attention quantizing its own (query_format refused).
    torch.manual_seed(0)
    model = ltx2.tiny_model(torch.float32, release=release, rope_type=rope_type)
    inputs = ltx2.inputs(torch.float32, release=release)
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention="int8")
    with torch.no_grad(), OpCounter() as counter:
        fused = output_of(model(**inputs))
    calls = counter.counts
    self_attentions = 2 * ltx2.TINY["num_layers"]
    assert calls["qk_rmsnorm_rope_quant"] == self_attentions, calls
    assert calls["quantize"] + self_attentions == calls["attention_int8"], calls
    monkeypatch.setattr(attention, "query_format", lambda *args, **kwargs: None)
    with torch.no_grad(), OpCounter() as counter:
        separate = output_of(model(**inputs))
    assert counter.counts["quantize"] == counter.counts["attention_int8"] == calls["attention_int8"]
    assert "qk_rmsnorm_rope_quant" not in counter.counts
    assert torch.equal(fused, separate)


def test_flux_quantizes_both_streams_queries_in_their_norm_passes(monkeypatch):
    # FLUX.1's double blocks take the text and the image query from their own norm passes
    # (qk_rmsnorm_rope_quant) and concatenate the codes (cat_queries), the single blocks theirs:
    # no quantize pass of int8_attention's own; bit for bit the output of every attention
    # quantizing its own (query_format refused).
    torch.manual_seed(0)
    model, inputs = MODELS["flux"].build(torch.float32), MODELS["flux"].inputs(torch.float32)
    double, single = len(model.transformer_blocks), len(model.single_transformer_blocks)
    ltx_kernels.inject_optimized_kernels(model, verbose=False, attention="int8")
    with torch.no_grad(), OpCounter() as counter:
        fused = output_of(model(**inputs))
    calls = counter.counts
    assert calls["qk_rmsnorm_rope_quant"] == 2 * double + single, calls
    assert calls["attention_int8"] == double + single and "quantize" not in calls, calls
    monkeypatch.setattr(attention, "query_format", lambda *args, **kwargs: None)
    with torch.no_grad(), OpCounter() as counter:
        separate = output_of(model(**inputs))
    assert counter.counts["quantize"] == counter.counts["attention_int8"] == double + single
    assert torch.equal(fused, separate)


def test_cat_queries_quantizes_a_tensor_part_as_the_whole():
    # A joint attention's parts concatenated: tensors as torch.cat; a quantized part beside a
    # tensor one: the codes and scales of quantizing the whole (rows per token and head).
    torch.manual_seed(0)
    q = torch.randn(2, 7, 3, 16)
    text, image = q[:, :3], q[:, 3:]
    assert torch.equal(attention.cat_queries([text, image]), q)
    whole = ltx_kernels.quantize(q, format="i8_row")
    image_rows = QuantRows(*ltx_kernels.quantize(image, format="i8_row"), "i8_row")
    mixed = attention.cat_queries([text, image_rows])
    assert mixed.format == "i8_row"
    assert torch.equal(mixed.data, whole[0]) and torch.equal(mixed.scale, whole[1])


@pytest.mark.parametrize("rope", [None, "interleaved", "split"])
def test_ltx2_qk_norm_rope_quantizes_the_query_per_head(rope):
    # ltx2.qk_norm_rope with a query_format, for each table form (none: a cross-attention without
    # a mask): q as QuantRows [B, S, H, Dh] that dequantize to the unquantized path's q within
    # one int8 step, k split into heads bit for bit.
    from ltx_kernels.integration import ltx2 as ltx2_integration

    torch.manual_seed(0)
    attn = ltx2.tiny_model(torch.float32, rope_type=rope or "split").transformer_blocks[0].attn1
    ltx_kernels.inject_optimized_kernels(attn, verbose=False)  # (plain modules: nothing patched)
    attn.norm_q.weight.data.uniform_(0.5, 1.5)
    attn.norm_k.weight.data.uniform_(0.5, 1.5)
    heads, inner = attn.heads, attn.to_q.out_features
    q, k = torch.randn(2, 2, 10, inner).unbind(0)
    tables = None
    if rope == "interleaved":
        angles = torch.randn(1, 10, inner // 2).repeat_interleave(2, -1)
        tables = (angles.cos(), angles.sin())
    elif rope == "split":
        angles = torch.randn(1, heads, 10, inner // heads // 2)
        tables = (angles.cos(), angles.sin())
    ops = frozenset(injector.FUSIONS)
    plain_q, plain_k = ltx2_integration.qk_norm_rope(ops, attn, q, k, tables, None)
    quantized, k_heads = ltx2_integration.qk_norm_rope(ops, attn, q, k, tables, None, "i8_row")
    assert quantized.data.shape == (2, 10, heads, inner // heads) and quantized.format == "i8_row"
    assert torch.equal(k_heads, plain_k.unflatten(2, (heads, -1)))
    dequantized = quantized.data.float() * quantized.scale[..., None]
    step = quantized.scale[..., None]
    assert ((dequantized - plain_q.unflatten(2, (heads, -1))).abs() <= 0.5 * step + 1e-6).all()


def test_the_query_stays_a_tensor_where_8_bits_do_not_apply():
    # query_format asks what attend decides: a mask, context parallelism, autograd recording
    # through the norm's weight, or a choice other than "int8" give None.
    q, k, v = _qkv(9, 11, torch.float32)
    weight = torch.ones(16, requires_grad=True)
    assert attention.query_format(_Processor(), q, k, v) == attention.QUERY_FORMAT
    assert attention.query_format(_Processor(), q, k, v, mask=torch.ones(2, 1, 1, 11)) is None
    assert attention.query_format(_Processor(), q, k, v, params=(None, weight)) is None
    with torch.no_grad():
        assert attention.query_format(_Processor(), q, k, v, params=(None, weight)) is not None
    other = _Processor()
    other.attention = "ltx_kernels"
    assert attention.query_format(other, q, k, v) is None


def test_attend_takes_one_key_length_per_batch_element_or_one_for_all():
    q, k, v = _qkv(9, 11, torch.float32)
    one = attention.attend(_Processor(), q, k, v, key_lengths=(5,))
    torch.testing.assert_close(
        one, attention.attend(_Processor(), q, k, v, key_lengths=(5, 5)), rtol=0, atol=0
    )
    with pytest.raises(ValueError, match="one per batch element, or one for all"):
        attention.attend(_Processor(), q, k, v, key_lengths=(5, 6, 7))


def test_a_quantized_query_never_attends_another_way():
    q, k, v = _qkv(9, 11, torch.float32)
    rows = attention.QuantRows(*ltx_kernels.quantize(q, format="i8_row"), "i8_row")
    torch.testing.assert_close(
        attention.attend(_Processor(), rows, k, v),
        attention.int8_attention(q, k, v),
        rtol=0,
        atol=0,
    )
    with pytest.raises(RuntimeError, match="quantized query"):
        attention.attend(_Processor(), rows, k, v, mask=torch.ones(2, 1, 1, 11, dtype=torch.bool))
    # (int8_attention has no backward: keys or values autograd records through raise, never a
    # gradient silently dropped)
    with torch.enable_grad(), pytest.raises(RuntimeError, match="records through"):
        attention.attend(_Processor(), rows, k, v.clone().requires_grad_())


def test_bf16_blocks_keep_the_first_and_last_blocks_out_of_8_bits():
    torch.manual_seed(0)
    blocks = 4
    model, inputs = wan.tiny_model(torch.float32, num_layers=blocks), wan.tiny_inputs(torch.float32)
    injected = clone(model)
    report = ltx_kernels.inject_optimized_kernels(
        injected, verbose=False, attention="int8", attention_bf16_blocks=1
    )
    choices = [
        [m.processor.attention for m in block.modules() if hasattr(m, "processor")]
        for block in injected.blocks
    ]
    assert choices[0] == choices[-1] == ["auto", "auto"]
    assert all(c == ["int8", "int8"] for c in choices[1:-1])
    kept = report.skipped[injector.INT8_ATTENTION]
    assert kept[0] == ("blocks.0.attn1", "kept bf16 (attention_bf16_blocks)")
    assert len(kept) == 4
    with torch.no_grad(), OpCounter() as counter:
        injected(**inputs)
    assert counter.counts["attention_int8"] == 2 * (blocks - 2)
    for options, message in (
        ({"attention_bf16_blocks": 1}, "needs attention='int8', got attention='auto'"),
        ({"attention": "int8", "attention_bf16_blocks": -1}, "must be >= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=message):
            ltx_kernels.inject_optimized_kernels(clone(model), verbose=False, **options)


#: Per tiny model with our attention processors: the config that gives it 6 blocks and its block
#: lists in block order (HunyuanVideo's token refiner blocks, stock, come before them).
SIX_BLOCKS = {
    "ltx": ({"num_layers": 6}, ("transformer_blocks",)),
    "ltx2": ({"num_layers": 6}, ("transformer_blocks",)),
    "flux": ({"num_layers": 3, "num_single_layers": 3}, BLOCK_LISTS),
    "wan": ({"num_layers": 6}, ("blocks",)),
    "sd35": ({"num_layers": 6}, ("transformer_blocks",)),
    "hunyuan_video": ({"num_layers": 3, "num_single_layers": 3}, BLOCK_LISTS),
    "hunyuan_video15": ({"num_layers": 6}, ("transformer_blocks",)),
}


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("name", SIX_BLOCKS)
def test_bf16_blocks_are_the_first_and_last_of_the_blocks_with_our_attention(name, count):
    """attention_bf16_blocks=count keeps the processors of the first and last `count` blocks that
    hold ours (the report lists each) and only those. (HunyuanVideo's and HunyuanVideo-1.5's
    token refiner blocks were counted: their first block stayed in 8 bits until count 3; SD3.5,
    whose model declares no repeated blocks, kept none.)"""
    config, block_lists = SIX_BLOCKS[name]
    model = MODELS[name].build(torch.float32, **config)
    report = ltx_kernels.inject_optimized_kernels(
        model, verbose=False, attention="int8", attention_bf16_blocks=count
    )
    blocks = [
        (f"{b}.{i}", block) for b in block_lists for i, block in enumerate(model.get_submodule(b))
    ]
    assert len(blocks) == 6
    kept = []
    for index, (block_name, block) in enumerate(blocks):
        ours = [
            (f"{block_name}.{n}", m.processor)
            for n, m in block.named_modules()
            if isinstance(getattr(m, "processor", None), injector.FusedAttnProcessor)
        ]
        assert ours, block_name
        choice = "auto" if index < count or index >= len(blocks) - count else "int8"
        assert [p.attention for _, p in ours] == [choice] * len(ours), block_name
        kept += [path for path, _ in ours] if choice == "auto" else []
    assert report.skipped[injector.INT8_ATTENTION] == [
        (path, "kept bf16 (attention_bf16_blocks)") for path in kept
    ]


def test_report_names_int8_and_what_does_not_take_it():
    torch.manual_seed(0)
    model = ltx.tiny_model(torch.float32)
    report = ltx_kernels.inject_optimized_kernels(clone(model), verbose=False, attention="int8")
    assert "  attention: int8 (8-bit attention" in str(report)
    assert injector.INT8_ATTENTION not in report.skipped  # (the CPU's C twins take head_dim 8)
    # On the meta device (as on a GPU) the tiny heads (8) are not the CUDA kernel's
    report = ltx_kernels.inject_optimized_kernels(
        clone(model).to("meta"), verbose=False, attention="int8"
    )
    skipped = report.skipped[injector.INT8_ATTENTION]
    assert len(skipped) == 2 * ltx.TINY["num_layers"]
    assert skipped[0] == (
        "transformer_blocks.0.attn1",
        "head_dim 8: the CUDA kernel takes 64 or 128; attends as attention='auto'",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_attends_bf16_in_8_bits_within_noise_of_sdpa(head_dim):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the 8-bit kernel is Hopper's (compute capability 9.0)")
    q, k, v = _qkv(300, 300, torch.bfloat16, "cuda", heads=4, head_dim=head_dim)
    assert not attention._int8_takes(*_qkv(8, 8, torch.bfloat16, "cuda", head_dim=96))
    assert attention._int8_takes(q, k, v)
    lengths = (300, 173)
    with OpCounter() as counter:
        out = attention.attend(_Processor(), q, k, v, key_lengths=lengths)
    assert counter.counts["attention_int8"] == 1
    expected = attention.attend(
        type("P", (_Processor,), {"attention": "diffusers"})(), q, k, v, key_lengths=lengths
    )
    assert QUANTIZED_AT_LEAST < rel_l2(out.float(), expected.float()) <= INT8_TOLERANCE_CUDA
