"""The diffusers code the families share: the version guard of the code our patches reproduce
(fingerprints), diffusers' LoRA scaling of a model forward, and diffusers' RoPE as the fused steps
call it. No diffusers import at import time (it is imported when a patch first runs).

Version guard: a family declares, as REPRODUCED, the fingerprint of every diffusers function its
patches reproduce ("Class.method" -> fingerprint of the diffusers version it was written
against); a patcher patches a class only where `reproduces(cls, method, REPRODUCED)`, and
otherwise reports `differs(...)`, so another diffusers version or a subclass that changed the
code runs it unpatched instead of silently losing the change.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import textwrap
import tokenize

#: The diffusers version the REPRODUCED fingerprints were taken from.
DIFFUSERS_VERSION = "0.42.1"


#: Tokens that carry no code: layout, comments, the encoding marker.
_LAYOUT_TOKENS = frozenset(
    (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENCODING,
        tokenize.ENDMARKER,
    )
)


@functools.cache
def fingerprint(function) -> str | None:
    """sha256 of a function's code tokens, joined without whitespace, its docstring left out:
    comments, blank lines and formatting do not count, nor does the Python version (3.12
    tokenizes f-strings in pieces that join to the same text; syntax-tree dumps differ between
    versions). None when the source cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError):
        return None
    tokens = [
        token
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type not in _LAYOUT_TOKENS
    ]
    definition = ast.parse(source).body[0]
    first = definition.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):  # the docstring
        docstring = (first.lineno, first.col_offset)
        tokens = [t for t in tokens if t.start != docstring]
    code = "".join(token.string for token in tokens)
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def reproduces(cls: type, method: str, reproduced: dict) -> bool:
    """Whether cls.method is the diffusers code a patch of it reproduces: its fingerprint is the
    one `reproduced` (a family's REPRODUCED) records for "Class.method"."""
    return fingerprint(getattr(cls, method)) == reproduced.get(f"{cls.__name__}.{method}")


def differs(cls: type, method: str) -> str:
    """The report's reason for a class whose `method` is not the code its patch reproduces."""
    return (
        f"{cls.__name__}.{method} ({cls.__module__}) is not the diffusers {DIFFUSERS_VERSION} "
        "code the fused one reproduces; it runs unpatched"
    )


def lora_scaled(forward):
    """`forward` (a patched model forward) with the LoRA scaling diffusers' model forward carries
    (`apply_lora_scale("attention_kwargs")`: peft LoRA layers scaled by attention_kwargs["scale"]
    for the call); a diffusers without it (scale_lora_layers inside forward, not supported here):
    forward as it is. The decorator is looked up at the first call."""

    decorated = []  # the decorated forward, once looked up

    @functools.wraps(forward)
    def scaled_forward(self, *args, **kwargs):
        if not decorated:
            try:
                from diffusers.utils.peft_utils import apply_lora_scale
            except ImportError:
                decorated.append(forward)
            else:
                decorated.append(apply_lora_scale("attention_kwargs")(forward))
        return decorated[0](self, *args, **kwargs)

    return scaled_forward


def rope_bshd(x, cos_sin):
    """diffusers' embeddings.apply_rotary_emb of x [B, S, H, D] (sequence_dim=1), as FLUX's and
    HunyuanVideo's processors call it."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, cos_sin, sequence_dim=1)
