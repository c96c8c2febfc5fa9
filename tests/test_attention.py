"""The attention seam (integration/attention.py) and masks as key lengths (issue 34, item 1): `attend`
with key lengths against SDPA with the mask they stand for; `padded_key_lengths`; HunyuanVideo and
HunyuanVideo-1.5 blocks with padded text (batch 2, same and different lengths) against stock
diffusers on every row, padded text rows included, and no [B, 1, S, S] mask built."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from inject_helpers import eager_and_injected, rel_l2
from ltx_kernels.integration import FUSIONS, attention
from model_zoo.hunyuan import tiny_model

from diffusers.models import attention_dispatch  # noqa: E402  (inject_helpers skips without diffusers)

FP32_TOLERANCE = 1e-6  # relative L2: the summation order of the softmax and P·V differs
BF16_TOLERANCE = 1e-2
#: Every fusion but the rmsnorm op: with these inputs diffusers' per-head RMSNorm rounds one bf16
#: element of HunyuanVideo-1.5's q/k the other way (test_inject_hunyuan.py's caveat), which the
#: attention then spreads; without it the blocks are bit for bit where the attention is.
OPS = frozenset(FUSIONS) - {"rmsnorm"}


class _Processor:
    """What attend reads off a fused processor."""

    ops = frozenset(FUSIONS)
    attention = "auto"
    _attention_backend = None


def _qkv(batch=2, queries=9, keys=11, heads=2, head_dim=8, dtype=torch.float64):
    torch.manual_seed(0)
    return (
        torch.randn(batch, queries, heads, head_dim, dtype=dtype),
        torch.randn(batch, keys, heads, head_dim, dtype=dtype),
        torch.randn(batch, keys, heads, head_dim, dtype=dtype),
    )


def _reference(query, key, value, mask=None):
    """SDPA in [B, S, H, D] with a boolean mask [B, 1, Sq or 1, Sk]."""
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (query, key, value)), attn_mask=mask
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize("lengths", [(11, 11), (7, 7), (1, 1), (7, 3), (11, 1)])
def test_key_lengths_are_the_key_mask_they_stand_for(lengths):
    query, key, value = _qkv()
    valid = torch.arange(key.shape[1]) < torch.tensor(lengths)[:, None]
    expected = _reference(query, key, value, valid[:, None, None, :])
    out = attention.attend(_Processor(), query, key, value, key_lengths=lengths)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_uniform_key_lengths_drop_the_padded_keys(monkeypatch):
    # Every batch element the same length: k/v sliced, no mask reaches diffusers' dispatch.
    calls = []
    dispatch = attention_dispatch.dispatch_attention_fn

    def recorded(query, key, value, attn_mask=None, **kwargs):
        calls.append((key.shape[1], attn_mask))
        return dispatch(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", recorded)
    query, key, value = _qkv()
    attention.attend(_Processor(), query, key, value, key_lengths=(6, 6))
    attention.attend(_Processor(), query, key, value, key_lengths=(6, 4))
    (same_keys, same_mask), (mixed_keys, mixed_mask) = calls
    assert same_keys == 6 and same_mask is None
    assert mixed_keys == 11 and mixed_mask.shape == (2, 1, 1, 11) and mixed_mask.dtype == torch.bool


def test_key_lengths_with_a_mask_or_under_ring_attention_raise():
    """Key lengths under context parallelism run under Ulysses only (test_context_parallel.py
    runs them): ring attention raises."""
    query, key, value = _qkv()
    with pytest.raises(ValueError, match="key_lengths or mask"):
        attention.attend(
            _Processor(), query, key, value, key_lengths=(3, 3), mask=torch.ones(2, 1, 1, 11)
        )
    ring = SimpleNamespace(
        ring_degree=2, ulysses_degree=1, ulysses_anything=False, ring_anything=False
    )
    parallel = SimpleNamespace(context_parallel_config=ring)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        attention.attend(
            _Processor(), query, key, value, key_lengths=(3, 3), parallel_config=parallel
        )


def test_sdpa_is_torch_sdpa_bit_for_bit():
    query, key, value = _qkv(dtype=torch.bfloat16)
    out = attention.attend(_Processor(), query, key, value, sdpa=True)
    assert torch.equal(out, _reference(query, key, value))


def test_padded_key_lengths():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert attention.padded_key_lengths(mask) == (3, 2)
    assert attention.padded_key_lengths(mask[:, None, None, :]) == (3, 2)
    assert attention.padded_key_lengths(torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)) is None
    assert attention.padded_key_lengths(torch.zeros(1, 3, dtype=torch.bool)) == (0,)
    # Read once per mask tensor, again after it is written.
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert attention.padded_key_lengths(mask) == (5, 5)
    mask[:, 4] = False
    assert attention.padded_key_lengths(mask) == (4, 4)
    # Under torch.compile the mask is not read on the host: None (the caller attends with it).
    seen = []

    def lengths(mask):
        seen.append(attention.padded_key_lengths(mask))
        return mask.float()

    torch.compile(lengths, backend="eager", fullgraph=True)(mask.clone())
    assert seen == [None]


# ------------------------------------------------------------------------------------------------
# HunyuanVideo: padded text as key lengths
# ------------------------------------------------------------------------------------------------
def _blocks_call(v15, dtype, text_lengths, image_rows=32, text_rows=6):
    """(blocks, call) of a HunyuanVideo(-1.5) double block (and 1.0's single block) with text of
    `text_lengths` valid leading rows per batch element, as the models hand their masks:
    1.0 a [B, 1, 1, S] key mask, 1.5 a [B, S_txt] text mask. call returns every row."""
    model = tiny_model(dtype, v15)
    rope = model.rope(torch.zeros(1, 4, 2, 4, 4))
    torch.manual_seed(0)
    batch = len(text_lengths)
    hidden = torch.randn(batch, image_rows, 32, dtype=dtype)
    text, temb = torch.randn(batch, text_rows, 32, dtype=dtype), torch.randn(batch, 32, dtype=dtype)
    text_mask = torch.arange(text_rows) < torch.tensor(text_lengths)[:, None]
    if v15:
        blocks, mask = model.transformer_blocks[:1], text_mask
    else:
        blocks = torch.nn.ModuleList(
            [model.transformer_blocks[0], model.single_transformer_blocks[0]]
        )
        mask = torch.cat([torch.ones(batch, image_rows, dtype=torch.bool), text_mask], 1)
        mask = mask[:, None, None]

    def call(modules):
        h, e = hidden, text
        for block in modules:
            h, e = block(h, e, temb, mask, rope)
        return torch.cat([h, e], dim=1)

    return blocks, call


def _masks_dispatched(monkeypatch):
    """The attention masks diffusers' dispatch gets from our seam while the test runs."""
    masks = []
    dispatch = attention_dispatch.dispatch_attention_fn

    def recorded(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return dispatch(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(attention_dispatch, "dispatch_attention_fn", recorded)
    return masks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("text_lengths", [(4, 4), (6, 6), (2, 5)], ids=["same", "full", "mixed"])
@pytest.mark.parametrize("v15", [False, True], ids=["hunyuan_video", "hunyuan_video15"])
def test_padded_text_matches_stock_on_every_row(v15, text_lengths, dtype, monkeypatch):
    # Same lengths: the padded keys (1.5: and queries, their rows zero as under stock's mask) are
    # dropped, exact in math (stock's summation order differs); mixed: a [B, 1, 1, S] key mask,
    # bf16 bit for bit. Without drop_padded_keys: bf16 bit for bit in every case.
    blocks, call = _blocks_call(v15, dtype, text_lengths)
    with torch.no_grad():
        stock = call(blocks)
    masks = _masks_dispatched(monkeypatch)
    eager, injected, _ = eager_and_injected(blocks, call, ops=OPS)
    assert torch.equal(eager, stock) and torch.isfinite(injected).all()
    dropped = len(set(text_lengths)) == 1
    _assert_matches(injected, eager, dtype, bit_identical=not dropped)
    ours = list(masks)  # (stock's processors hold their own reference to the dispatch)
    assert ours and not any(m is not None and m.shape[-2] > 1 for m in ours)  # no [B, 1, S, S]
    if dropped:
        assert all(m is None for m in ours)

    ltx_kernels_remove(blocks)
    _, injected, _ = eager_and_injected(blocks, call, ops=OPS - {"drop_padded_keys"})
    _assert_matches(injected, eager, dtype, bit_identical=True)


def _assert_matches(injected, eager, dtype, bit_identical):
    """bf16: bit for bit (every fused step rounds where diffusers' code rounds) unless the padded
    keys were dropped (the softmax sums in another order); fp32: within its summation-order noise."""
    if dtype == torch.bfloat16 and bit_identical:
        assert torch.equal(injected, eager)
    else:
        error = rel_l2(injected, eager)
        assert error <= (FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE), error


def ltx_kernels_remove(module):
    import ltx_kernels

    assert ltx_kernels.remove_optimized_kernels(module) > 0


def test_hunyuan_video15_padded_query_rows_are_zero():
    # Stock's [B, 1, S, S] mask leaves a padded text query no key: SDPA gives it zeros, which
    # the block's text stream then carries (to_add_out's bias, the residual, the FF).
    blocks, call = _blocks_call(True, torch.float32, (3, 3))
    attn = blocks[0].attn
    outputs = {}

    def keep(module, args, output):
        outputs[len(outputs)] = output[1]  # the text stream's attention output

    handle = attn.register_forward_hook(keep)
    try:
        eager, injected, _ = eager_and_injected(blocks, call)
    finally:
        handle.remove()
    bias = attn.to_add_out.bias
    for text in outputs.values():
        assert torch.equal(text[:, 3:], bias.expand_as(text[:, 3:]))


def test_benchmark_fails_where_ours_refuses_or_a_reference_failed(monkeypatch):
    # A column whose reference column failed has no error to report (n/a, never itself as its
    # reference), and fails the run, as ours refusing a case does; other backends may refuse.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import benchmark_attention

    def refusing(*args):
        raise RuntimeError("cudnn refuses")

    columns = benchmark_attention.columns  # (the reference: the first, "default" on the CPU)
    monkeypatch.setattr(
        benchmark_attention,
        "columns",
        lambda *args: {
            name: (refusing if name == reference else fn, reference, prepare)
            for name, (fn, reference, prepare) in columns(*args).items()
        },
    )
    case = benchmark_attention.scaled(benchmark_attention.CASES["ltx-video 49f"], 64)
    rows = benchmark_attention.run_case("ltx-video 49f", case, "cpu", torch.float32, 1)
    by_column = {row["column"]: row for row in rows}
    assert "error" in by_column["default"] and benchmark_attention._passed(by_column["default"])
    ours = by_column["ours int8"]
    assert ours["rel_l2"] is None and not benchmark_attention._passed(ours)
    assert "its reference failed" in benchmark_attention._table([ours])
    assert not benchmark_attention._passed({"column": "ours wgmma", "error": "refused"})


def test_benchmark_smoke_run_on_the_cpu(capsys):
    # benchmarks/benchmark_attention.py at 1/64 of every sequence: every case and column runs and
    # agrees with its reference (the mask forms with the dense mask); timing needs a GPU.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import benchmark_attention

    assert benchmark_attention.main(["--device", "cpu", "--scale", "64"]) == 0
    out = capsys.readouterr().out
    for case in benchmark_attention.CASES:
        assert case in out
    for form in benchmark_attention.MASK_FORMS:
        assert f"| {form}" in out

    # --columns: those columns and the ones they are checked against (the mask forms: dense)
    args = ["--device", "cpu", "--scale", "64", "--cases", "hunyuanvideo-1.5 480p 121f"]
    assert benchmark_attention.main([*args, "--columns", "ours int8,seam"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    columns = {row.split("|")[1].strip() for row in rows}
    assert columns == {"default", "ours int8", "dense", "seam"}
    with pytest.raises(SystemExit):
        benchmark_attention.main([*args, "--columns", "cudnn,nonsense"])
