"""ltx_kernels' attention as diffusers attention backends: after `register_attention_backends()`,
`model.set_attention_backend("ltx_kernels")` (our bf16 `attention` op) or
`model.set_attention_backend("ltx_kernels_int8")` (8-bit attention, `int8_attention`: a numerics
change) works on a stock diffusers model, without inject_optimized_kernels.

Registration is explicit (importing ltx_kernels changes nothing in diffusers): it adds the members
LTX_KERNELS / LTX_KERNELS_INT8 to diffusers' AttentionBackendName enum (as the enum's class
statement would have made them: lookup by value and name, iteration, `in`) and registers the two
backend functions in its _AttentionBackendRegistry with the NATIVE backend's checks (run where
DIFFUSERS_ATTN_CHECKS is on). inject_optimized_kernels does not call it: its processors choose
their attention with `attention=` and do not need the backend; the two compose (an injected
processor that attends through diffusers' dispatch reaches these backends when one is set).

Each backend attends with our op where it applies, and with diffusers' NATIVE backend
(F.scaled_dot_product_attention) as dispatched everywhere else, so no call is ever wrong:
- applies: no mask, or a boolean key-padding mask ([B, Sk] or [B|1, 1, 1, Sk]) whose valid keys
  lead every row and number at least one (read on the host: padded_key_lengths; the same keys
  for every element are sliced off, mixed lengths reach the op as key lengths); dropout_p 0; not
  causal; q/k/v [B, S, H, D] of one device with k/v of q's batch, heads and head_dim (no GQA);
  autograd not recording through them (no backward yet); the dtypes, head dims and devices the op
  takes (attention.py: `_op_takes` for the bf16 op, `_int8_takes` for int8 attention);
  return_lse only for the bf16 op (lse [B, Sq, H], diffusers' layout);
- falls back: every other mask (additive, dense [B, 1, Sq, Sk], keys not leading, a row with no
  valid key: SDPA's NaN kept), a mask on an empty batch, masks under torch.compile or CUDA-graph
  capture (not read on the host), and context parallelism.
Context parallelism: the backends are registered without context-parallel support, so diffusers'
enable_parallelism / set_attention_backend raise their error naming the backends that have it
(inject_optimized_kernels' ulysses_attention is the path for our attention under Ulysses); a call
that reaches them with a parallel config anyway attends with NATIVE's context-parallel attention.
"""

from __future__ import annotations

import torch

from .attention import (
    _int8_takes,
    _op_takes,
    _recording,
    int8_attention,
    lengths_tensor,
    padded_key_lengths,
)

#: diffusers' backend name -> the AttentionBackendName member name register_attention_backends adds.
ATTENTION_BACKENDS = {"ltx_kernels": "LTX_KERNELS", "ltx_kernels_int8": "LTX_KERNELS_INT8"}

#: What register_attention_backends uses of diffusers.models.attention_dispatch (as in 0.42):
#: name -> its attributes used.
_REQUIRED = {
    "AttentionBackendName": (
        "_member_map_",
        "_value2member_map_",
        "_member_names_",
        "_new_member_",
    ),
    "_AttentionBackendRegistry": (
        "register",
        "_backends",
        "_constraints",
        "_supported_arg_names",
        "_supports_context_parallel",
    ),
    "_native_attention": (),
    "_check_device": (),
    "_check_shape": (),
}


def register_attention_backends() -> tuple[str, ...]:
    """Adds "ltx_kernels" and "ltx_kernels_int8" to diffusers' attention backends (the module
    docstring), so that `model.set_attention_backend(name)` and diffusers' `attention_backend(name)`
    context take them. Idempotent. Returns the names. Raises RuntimeError naming what is missing
    where diffusers' attention dispatch is not the one this was written against."""
    from .. import _library

    _library()  # raises with the build error when the extension did not load
    dispatch = _attention_dispatch()
    functions = {
        "ltx_kernels": ltx_kernels_attention,
        "ltx_kernels_int8": ltx_kernels_int8_attention,
    }
    for value, name in ATTENTION_BACKENDS.items():
        member = _enum_member(dispatch.AttentionBackendName, name, value)
        constraints = [dispatch._check_device, dispatch._check_shape]
        dispatch._AttentionBackendRegistry.register(member, constraints)(functions[value])
    return tuple(ATTENTION_BACKENDS)


def _attention_dispatch():
    """diffusers.models.attention_dispatch, checked for what registration uses (_REQUIRED)."""
    try:
        import diffusers
        from diffusers.models import attention_dispatch
    except ImportError as error:
        raise RuntimeError(
            "ltx_kernels.register_attention_backends needs diffusers with attention backends "
            f"(diffusers.models.attention_dispatch): {error}"
        ) from error
    missing = []
    for name, attrs in _REQUIRED.items():
        owner = getattr(attention_dispatch, name, None)
        if owner is None:
            missing.append(name)
        else:
            missing += [f"{name}.{attr}" for attr in attrs if not hasattr(owner, attr)]
    if missing:
        raise RuntimeError(
            f"ltx_kernels.register_attention_backends: diffusers {diffusers.__version__}'s "
            f"attention_dispatch lacks {', '.join(missing)} (written against diffusers 0.42); "
            "attend through inject_optimized_kernels(..., attention=...) instead"
        )
    return attention_dispatch


def _enum_member(enum_class, name: str, value: str):
    """The member `name` = `value` of the str Enum `enum_class`, added as the enum's class
    statement adds one (Python 3.11's EnumType: member made by _new_member_, _name_/_value_/
    _sort_order_, listed in _member_names_, _member_map_ and _value2member_map_, a class
    attribute) where it is not there yet."""
    member = enum_class._value2member_map_.get(value)
    if member is None and name not in enum_class._member_map_:
        member = enum_class._new_member_(enum_class, value)
        member._value_, member._name_ = value, name
        member.__objclass__ = enum_class
        member._sort_order_ = len(enum_class._member_names_)
        enum_class._member_names_.append(name)
        enum_class._member_map_[name] = member
        enum_class._value2member_map_[value] = member
        type.__setattr__(enum_class, name, member)  # (EnumType.__setattr__ guards members only)
    if enum_class._member_map_.get(name) is not member or enum_class(value) is not member:
        raise RuntimeError(
            f"ltx_kernels.register_attention_backends: {enum_class.__name__} already has "
            f"{name!r} or {value!r} for something else, or did not take the new member"
        )
    return member


def ltx_kernels_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
):
    """diffusers backend "ltx_kernels": ltx_kernels.attention of q/k/v [B, S, H, D] where it
    applies (the module docstring), diffusers' NATIVE backend elsewhere. Arguments as NATIVE's."""
    from ..ops import attention

    call = (query, key, value, attn_mask, dropout_p, is_causal, _parallel_config)
    ours = _ours(*call, takes=_op_takes)
    if ours is None:
        return _native(*call, scale, enable_gqa, return_lse)
    if not return_lse:
        return attention(query, *ours, scale)
    out, lse = attention(query, *ours, scale, return_lse=True)
    return out, lse.transpose(1, 2)  # [B, H, Sq] -> diffusers' [B, Sq, H]


def ltx_kernels_int8_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _parallel_config=None,
):
    """diffusers backend "ltx_kernels_int8": 8-bit attention (attention.int8_attention: q, k, v
    quantized by our ops, then attention_int8) of q/k/v [B, S, H, D] where it applies (the module
    docstring; no return_lse), diffusers' NATIVE backend elsewhere. Arguments as NATIVE's."""
    call = (query, key, value, attn_mask, dropout_p, is_causal, _parallel_config)
    ours = None if return_lse else _ours(*call, takes=_int8_takes)
    if ours is None:
        return _native(*call, scale, enable_gqa, return_lse)
    return int8_attention(query, *ours, scale=scale)


def _ours(query, key, value, attn_mask, dropout_p, is_causal, parallel_config, *, takes):
    """(key, value, key lengths) for an op of ours that takes q/k/v where `takes(q, k, v)`, or
    None where the call falls back (the module docstring). A key-padding mask becomes key lengths
    (a [B] tensor on q's device, reused while the lengths are the same: lengths_tensor) or, where
    every element attends the same keys, k/v sliced to those keys (the same attention in math, no
    lengths)."""
    if (
        dropout_p
        or is_causal
        or parallel_config is not None
        or query.ndim != 4
        or key.shape != value.shape
        or key.shape[0] != query.shape[0]
        or key.shape[2:] != query.shape[2:]
        or not (query.device == key.device == value.device)
        or _recording(query, key, value)
        or not takes(query, key, value)
    ):
        return None
    if attn_mask is None:
        return key, value, None
    lengths = _key_padding_lengths(attn_mask, query.shape[0], key.shape[1])
    if lengths is None or min(lengths) == 0:  # (a row with no valid key: SDPA's NaN, kept)
        return None
    if len(set(lengths)) == 1:
        return key[:, : lengths[0]], value[:, : lengths[0]], None
    return key, value, lengths_tensor(lengths, key.device)


def _key_padding_lengths(mask: torch.Tensor, batch: int, keys: int) -> tuple[int, ...] | None:
    """The per-element key lengths of a boolean key-padding mask, [batch, keys] or
    [batch or 1, 1, 1, keys] (True: attended), whose valid keys lead every row; None for any other
    mask, an empty batch, or a mask not readable on the host (padded_key_lengths: under
    torch.compile or capture)."""
    if batch == 0 or mask.dtype != torch.bool or mask.shape[-1] != keys:
        return None
    if mask.shape != (batch, keys) and not (
        mask.ndim == 4 and mask.shape[0] in (1, batch) and mask.shape[1:3] == (1, 1)
    ):
        return None
    lengths = padded_key_lengths(mask)
    return None if lengths is None else lengths * (batch // len(lengths))


def _native(
    query,
    key,
    value,
    attn_mask,
    dropout_p,
    is_causal,
    parallel_config,
    scale,
    enable_gqa,
    return_lse,
):
    """The call attended by diffusers' NATIVE backend (F.scaled_dot_product_attention; its
    context-parallel attention with a parallel config)."""
    from diffusers.models.attention_dispatch import _native_attention

    return _native_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        return_lse=return_lse,
        _parallel_config=parallel_config,
    )
