"""The diffusers code the families share: the version guard of the code our patches reproduce,
diffusers' LoRA scaling of a model forward, and diffusers' RoPE as the fused steps call it. No
diffusers import at import time (it is imported at injection, or when a patch first runs).

Version guard: every family declares REPRODUCED, a `Reproduced`: the diffusers modules its classes
come from, and the fingerprint of every diffusers function a patch of it reproduces ("Class.method"
-> the fingerprint of that code in DIFFUSERS_VERSION). A patcher patches a class only where
`REPRODUCED.unpatched(cls, method)` is None; otherwise the class runs its own code, reported with
the reason: another diffusers version or a fork whose code differs (it would silently lose its
change), or a same-named class from another module (a user's fork).
"""

from __future__ import annotations

import ast
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Reproduced:
    """A family's diffusers code: `modules` (the diffusers modules its classes come from) and `code`
    ("Class.method" -> fingerprint of the DIFFUSERS_VERSION code its patch reproduces)."""

    family: str
    modules: frozenset[str]
    code: dict[str, str]

    def unpatched(self, cls: type, method: str) -> str | None:
        """None where cls.method may be patched (cls from one of the modules, its method the code
        the patch reproduces); otherwise why it runs unpatched (for the report)."""
        key = f"{cls.__name__}.{method}"
        if key in self.code and fingerprint(getattr(cls, method)) != self.code[key]:
            return (
                f"{key} ({cls.__module__}) is not the diffusers {DIFFUSERS_VERSION} code the "
                "fused one reproduces; it runs unpatched"
            )
        if cls.__module__ not in self.modules:
            return (
                f"class from {cls.__module__}, not a diffusers {self.family} module; left unpatched"
            )
        return None

    def is_stock(self, processor) -> bool:
        """Whether an attention processor runs the diffusers code our processor reproduces."""
        return self.unpatched(type(processor), "__call__") is None


def diffusers_modules(*names: str) -> frozenset[str]:
    """The modules `diffusers.models.<name>` (e.g. "normalization", "transformers.transformer_wan")."""
    return frozenset(f"diffusers.models.{name}" for name in names)


#: The attribute lora_scaled sets on a model forward.
_LORA_SCALED = "_ltx_kernels_lora_scaled"


def lora_scaled(forward):
    """Marks `forward` (a patched model forward) as one that carries the LoRA scaling diffusers'
    model forward carries (`apply_lora_scale("attention_kwargs")`: peft LoRA layers scaled by
    attention_kwargs["scale"] for the call); the patched class runs it decorated (with_lora_scale).
    Returns `forward`."""
    setattr(forward, _LORA_SCALED, True)
    return forward


def with_lora_scale(forward):
    """The forward a patched class runs for patch forward `forward`: a lora_scaled one decorated
    with diffusers' apply_lora_scale("attention_kwargs") (a diffusers without it, which scales
    inside forward: not supported here, as it is), any other as it is. Resolved when the class is
    made, never inside a call: a lookup at the first call would change what torch.compile's guards
    see between the first and the second call (one recompile)."""
    if not getattr(forward, _LORA_SCALED, False):
        return forward
    try:
        from diffusers.utils.peft_utils import apply_lora_scale
    except ImportError:
        return forward
    return apply_lora_scale("attention_kwargs")(forward)


def rope_bshd(x, cos_sin):
    """diffusers' embeddings.apply_rotary_emb of x [B, S, H, D] (sequence_dim=1), as FLUX's and
    HunyuanVideo's processors call it."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, cos_sin, sequence_dim=1)
