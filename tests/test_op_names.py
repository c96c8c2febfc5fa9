"""The op list (`ltx_kernels._op_names.OPS`, with BACKWARD_OPS) is the one list of ops: the compiled
library registers exactly those ops, and every piece that exists per op (wrapper, reference, fake,
environment-report inputs) has each op and no other. On the C++ side (parsed from the files, no
build needed): the schema table, impls, autograd registrations, C launchers, argument rules and
build lists agree with it and with the files on disk (docs/adding_an_op.md)."""

import inspect
import re
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import torch

import ltx_kernels
from ltx_kernels import ATTENTION_OPS, BACKWARD_OPS, OPS, QUANT_OPS, _fake, ops, reference
from ltx_kernels import _op_names as op_table
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
    # (and the row quantization rule the quantized ops' references share, and v8's column order
    # the 8-bit attention ops' references share)
    "references (reference.<op>)": lambda: _functions_defined_in(
        reference, but={"quantize_rows", "dequantize_rows", "v8_columns", "v8_keys"}
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
    fusions = (
        "fused_projections",
        "fused_qkv_mlp",
        "recompute_norms",
        "ulysses_attention",
        "drop_padded_keys",
    )
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


# --- The C++ side: schema table, impls, autograd, launchers, checks and build lists ----------------
# Parsed from the files (no build needed), so that a piece forgotten when adding an op fails here
# with a message naming it (docs/adding_an_op.md). Everything derives from _op_names.py and from
# the files on disk; each check takes a {path: text} tree, so the tests below also feed it copies
# with one piece taken out and check that it names that piece.

ROOT = Path(__file__).resolve().parents[1]
C_SUFFIXES = (".cu", ".cuh", ".c", ".h", ".cpp")


def _source_tree() -> dict:
    """{path relative to the repository: text} of the C/C++/CUDA sources and the build files."""
    tree = {
        p.relative_to(ROOT).as_posix(): p.read_text()
        for folder in ("kernel_src", "torch-ext")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in C_SUFFIXES and p.is_file()
    }
    for name in ("setup.py", "build.toml", ".gitignore"):
        tree[name] = (ROOT / name).read_text()
    return tree


def op_names_listed(module=op_table) -> set:
    """Every op name _op_names.py lists: its constants named *_OP and *_OPS (names, tuples and
    tables of names; OPS itself)."""
    names = set()
    for key, value in vars(module).items():
        if not (key == "OPS" or key.endswith(("_OP", "_OPS"))):
            continue
        if isinstance(value, str):
            names.add(value)
        elif isinstance(value, tuple):
            names.update(value)
        elif isinstance(value, dict):
            names.update(value, *[[v] for v in value.values()])
    return names


def ops_defined_in_python() -> set:
    """The registered ops whose schema a Python module of the package defines (not the C++
    table), as the dispatcher records where each schema was registered."""
    return {
        op
        for op in op_names_listed()
        if re.search(
            r"^debug: registered at .*\.py:\d+$",
            torch._C._dispatch_dump(f"ltx_kernels::{op}"),
            re.MULTILINE,
        )
    }


def _schema_defs(tree) -> list:
    """(op, impl name, impl function or None, composite) per def(...) of torch_binding.cpp."""
    text = tree["torch-ext/torch_binding.cpp"]
    defs = []
    for match in re.finditer(r'\bdef\(\s*"(\w+)\((.*?)\);', text, re.DOTALL):
        body = match.group(2)
        names = re.findall(r'"\s*,\s*"(\w+)"\s*,\s*&', body)
        function = re.search(r"&(\w+)\s*\)*\s*$", body)
        defs.append(
            (
                match.group(1),
                names[0] if names else None,
                function.group(1) if function else None,
                "torch::dispatch(" in body,
            )
        )
    return defs


def _c_files(tree, folder, suffixes) -> dict:
    return {p: t for p, t in tree.items() if p.startswith(folder + "/") and p.endswith(suffixes)}


def _defines(text, function) -> bool:
    """Whether text defines `function` (its name, the parameter list, then a body)."""
    return re.search(rf"\b{function}\([^;{{]*\)\s*\{{", text) is not None


def _declares(text, function) -> bool:
    return re.search(rf"\b{function}\([^;{{]*\)\s*;", text) is not None


def check_schema_table(tree, listed=None, in_python=None) -> list:
    """torch_binding.cpp's schema table holds exactly the ops of _op_names.py that no Python module
    defines, and each def registers its impl under its own name."""
    listed = op_names_listed() if listed is None else listed
    in_python = ops_defined_in_python() if in_python is None else in_python
    defs = _schema_defs(tree)
    table = {op for op, *_ in defs}
    problems = [
        f"torch_binding.cpp: no schema for op {op!r} (listed in _op_names.py)"
        for op in sorted(listed - in_python - table)
    ]
    problems += [
        f"torch_binding.cpp defines op {op!r}, which _op_names.py does not list"
        for op in sorted(table - listed)
    ]
    problems += [
        f"torch_binding.cpp: the schema of {op!r} registers its impl as {name!r}"
        for op, name, _, composite in defs
        if not composite and name != op
    ]
    return problems


def check_impls(tree) -> list:
    """Each schema's impl function is declared in torch_binding.h and defined in a torch-ext .cpp."""
    header = tree["torch-ext/torch_binding.h"]
    sources = _c_files(tree, "torch-ext", (".cpp",))
    problems = []
    for op, _, function, _ in _schema_defs(tree):
        if function is None:
            problems.append(f"torch_binding.cpp: the schema of {op!r} names no impl function")
            continue
        if not _declares(header, function):
            problems.append(f"torch_binding.h: no declaration of {function}() (op {op!r})")
        if not any(_defines(text, function) for text in sources.values()):
            problems.append(f"torch-ext/*.cpp: no definition of {function}() (op {op!r})")
    return problems


def check_autograd(tree) -> list:
    """Every op of the schema table but the composite ones (which autograd traces through) has
    its Autograd-key registration in autograd_ops.cpp, and that block names no other op."""
    text = tree["torch-ext/autograd_ops.cpp"]
    block = re.search(r"TORCH_LIBRARY_IMPL_EXPAND\(\w+,\s*Autograd,\s*\w+\)\s*\{(.*)\}", text, re.S)
    registered = set(re.findall(r'"(\w+)"', block.group(1))) if block else set()
    defs = _schema_defs(tree)
    needed = {op for op, _, _, composite in defs if not composite}
    problems = [
        f"autograd_ops.cpp: no Autograd registration of op {op!r}"
        for op in sorted(needed - registered)
    ]
    problems += [
        f"autograd_ops.cpp registers autograd for {name!r}, which the schema table lacks"
        for name in sorted(registered - {op for op, *_ in defs})
    ]
    return problems


def check_launchers(tree) -> list:
    """Each C launcher family of ltx_kernels.h (ltx_<f>_cuda and ltx_<f>_cpu) is defined in a .cu
    file and a C twin, called by the binding, and has its argument rule ltx_check_<f> declared in
    checks.h, defined in checks.c and run by both the CUDA launcher and the C twin; no rule or
    backend without the other pieces."""
    api = tree["kernel_src/ltx_kernels.h"]
    checks_h, checks_c = tree["kernel_src/checks.h"], tree["kernel_src/checks.c"]
    kernels = _c_files(tree, "kernel_src", (".cu",))
    twins = _c_files(tree, "kernel_src", (".c",))
    binding = "\n".join(_c_files(tree, "torch-ext", (".cpp",)).values())
    families = {
        backend: set(re.findall(rf"\bint\s+ltx_(\w+)_{backend}\(", api))
        for backend in ("cuda", "cpu")
    }
    rules = set(re.findall(r"\bltx_check_t\s+ltx_check_(\w+)\(", checks_h))
    problems = [
        f"ltx_kernels.h: ltx_{f}_{backend} has no ltx_{f}_{other} beside it"
        for backend, other in (("cuda", "cpu"), ("cpu", "cuda"))
        for f in sorted(families[backend] - families[other])
    ]
    problems += [
        f"checks.h: ltx_check_{f} checks no launcher of ltx_kernels.h"
        for f in sorted(rules - families["cuda"] - families["cpu"])
    ]
    for f in sorted(families["cuda"] | families["cpu"]):
        defined_in = {}
        for backend, files in (("cuda", kernels), ("cpu", twins)):
            launcher = f"ltx_{f}_{backend}"
            if not _declares(api, launcher):
                continue
            where = [p for p, text in files.items() if _defines(text, launcher)]
            if not where:
                kind = "kernel_src/*.cu" if backend == "cuda" else "kernel_src/*_cpu.c"
                problems.append(f"{kind}: no definition of {launcher}()")
            else:
                defined_in[backend] = where[0]
            if not re.search(rf"\b{launcher}\(", binding):
                problems.append(f"torch-ext/*.cpp: no call of {launcher}() (the binding)")
        rule = f"ltx_check_{f}"
        if f not in rules:
            problems.append(f"checks.h: no declaration of {rule}() (launcher family {f!r})")
        if not _defines(checks_c, rule):
            problems.append(f"checks.c: no definition of {rule}()")
        for path in defined_in.values():
            if not re.search(rf"\b{rule}\(", tree[path]):
                problems.append(f"{path}: does not run {rule}() (launcher family {f!r})")
    return problems


def _includes(tree, path) -> set:
    """The repository files `path` includes with #include "...", transitively (resolved against
    its own folder, then kernel_src/, as the builds' include paths)."""
    found, todo = set(), [path]
    while todo:
        current = todo.pop()
        for name in re.findall(r'^\s*#include\s+"([^"]+)"', tree.get(current, ""), re.M):
            for base in (PurePosixPath(current).parent, PurePosixPath("kernel_src")):
                candidate = _normalize(base / name)
                if candidate in tree:
                    if candidate not in found:
                        found.add(candidate)
                        todo.append(candidate)
                    break
    return found


def _normalize(path: PurePosixPath) -> str:
    parts = []
    for part in path.parts:
        if part == "..":
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts)


def _on_disk(tree) -> set:
    """The C/C++/CUDA files of the tree that git tracks (less what .gitignore names: files
    kernel-builder generates into the tree)."""
    ignored = {line.strip() for line in tree[".gitignore"].splitlines()}
    return {p for p in tree if p.endswith(C_SUFFIXES) and p not in ignored}


def check_build_lists(tree) -> list:
    """setup.py compiles every .cu, .c and binding .cpp on disk; each build.toml section lists
    the files it compiles and the headers they include from its folder, and no missing file; the
    Hub build's C++ unit includes every C twin; every source is in a build.toml section."""
    disk = _on_disk(tree)
    problems = []
    # setup.py: the files its globs take
    globs = re.findall(r'\(ROOT / "([\w-]+)"\)\.(r?glob)\("([^"]+)"\)', tree["setup.py"])
    taken = {
        p
        for folder, how, pattern in globs
        for p in disk
        if p.startswith(folder + "/")
        and (how == "rglob" or "/" not in p[len(folder) + 1 :])
        and PurePosixPath(p).match(pattern)
    }
    hub_units = {  # a .cpp in kernel_src that compiles the C twins as C++ (Hub builds only)
        p for p in disk if p.startswith("kernel_src/") and p.endswith(".cpp")
    }
    compiled = {
        p
        for p in disk
        if p.endswith((".cu", ".c")) or (p.startswith("torch-ext/") and p.endswith(".cpp"))
    }
    problems += [f"setup.py: its source globs miss {p}" for p in sorted(compiled - taken)]
    # build.toml
    config = tomllib.loads(tree["build.toml"])
    sections = {"[torch]": config.get("torch", {}).get("src", [])} | {
        f"[kernel.{name}]": kernel.get("src", [])
        for name, kernel in config.get("kernel", {}).items()
    }
    listed_anywhere = set()
    for section, src in sections.items():
        listed = set(src)
        listed_anywhere |= listed
        problems += [f"build.toml {section} src: {p} is not on disk" for p in sorted(listed - disk)]
        for unit in sorted(p for p in listed if p.endswith((".cu", ".cpp", ".c"))):
            folder = unit.split("/")[0]
            needed = {h for h in _includes(tree, unit) if h.startswith(folder + "/")}
            problems += [
                f"build.toml {section} src lacks {h} (included by {unit})"
                for h in sorted(needed - listed)
            ]
    problems += [
        f"build.toml: no section's src lists {p}"
        for p in sorted((compiled | hub_units) - listed_anywhere)
    ]
    twins = {p for p in disk if p.startswith("kernel_src/") and p.endswith(".c")}
    for unit in sorted(hub_units):
        problems += [
            f"{unit} does not include {p} (the Hub build would lack it)"
            for p in sorted(twins - _includes(tree, unit))
        ]
    return problems


CPP_CHECKS = {
    "schema table": check_schema_table,
    "impls": check_impls,
    "autograd": check_autograd,
    "launchers": check_launchers,
    "build lists": check_build_lists,
}


@pytest.mark.parametrize("check", CPP_CHECKS)
def test_cpp_side_agrees(check):
    problems = CPP_CHECKS[check](_source_tree())
    assert not problems, "\n".join(problems)


def test_the_cpp_checks_see_every_op():
    # The parsers find what they look for (a parser finding nothing would pass every check).
    tree = _source_tree()
    defs = _schema_defs(tree)
    assert {op for op, *_ in defs} == op_names_listed() - ops_defined_in_python()
    assert all(function for _, _, function, _ in defs)
    assert len(re.findall(r"\bint\s+ltx_\w+_cuda\(", tree["kernel_src/ltx_kernels.h"])) >= 8
    assert _includes(tree, "kernel_src/cpu_kernels.cpp") >= {"kernel_src/ltx_kernels.h"}


def _first(pattern, text):
    return re.search(pattern, text).group(1)


def _without_schema(tree):
    op = _schema_defs(tree)[0][0]
    text = tree["torch-ext/torch_binding.cpp"]
    start = text.index(f'def("{op}(')
    tree["torch-ext/torch_binding.cpp"] = text[:start] + text[text.index(");", start) + 2 :]
    return "schema table", f"no schema for op {op!r}"


def _unlisted_schema(tree):
    op = _schema_defs(tree)[0][0]
    text = tree["torch-ext/torch_binding.cpp"]
    tree["torch-ext/torch_binding.cpp"] = text.replace(f'def("{op}(', 'def("not_an_op(', 1)
    return "schema table", "defines op 'not_an_op', which _op_names.py does not list"


def _undeclared_impl(tree):
    _, _, function, _ = _schema_defs(tree)[0]
    header = tree["torch-ext/torch_binding.h"]
    tree["torch-ext/torch_binding.h"] = re.sub(rf"\b{function}\(", f"{function}_gone(", header)
    return "impls", f"no declaration of {function}()"


def _undefined_impl(tree):
    _, _, function, _ = _schema_defs(tree)[-2]
    for path in _c_files(tree, "torch-ext", (".cpp",)):
        if path != "torch-ext/torch_binding.cpp":
            tree[path] = re.sub(rf"\b{function}\(", f"{function}_gone(", tree[path])
    return "impls", f"no definition of {function}()"


def _no_autograd(tree):
    op = _schema_defs(tree)[0][0]
    text = tree["torch-ext/autograd_ops.cpp"]
    tree["torch-ext/autograd_ops.cpp"] = text.replace(f'"{op}"', '"renamed"')
    return "autograd", f"no Autograd registration of op {op!r}"


def _twin_without_rule(tree):
    family = _first(r"\bint\s+ltx_(\w+)_cpu\(", tree["kernel_src/ltx_kernels.h"])
    path = next(
        p
        for p, t in _c_files(tree, "kernel_src", (".c",)).items()
        if _defines(t, f"ltx_{family}_cpu")
    )
    tree[path] = tree[path].replace(f"ltx_check_{family}(", "ltx_check_other(")
    return "launchers", f"{path}: does not run ltx_check_{family}()"


def _launcher_without_twin(tree):
    family = _first(r"\bint\s+ltx_(\w+)_cuda\(", tree["kernel_src/ltx_kernels.h"])
    api = tree["kernel_src/ltx_kernels.h"]
    tree["kernel_src/ltx_kernels.h"] = api.replace(f"int ltx_{family}_cpu(", "int ltx_gone(")
    return "launchers", f"ltx_{family}_cuda has no ltx_{family}_cpu beside it"


def _rule_not_declared(tree):
    family = _first(r"\bint\s+ltx_(\w+)_cuda\(", tree["kernel_src/ltx_kernels.h"])
    checks = tree["kernel_src/checks.h"]
    tree["kernel_src/checks.h"] = checks.replace(f"ltx_check_{family}(", "ltx_check_gone(")
    return "launchers", f"checks.h: no declaration of ltx_check_{family}()"


def _new_kernel_unlisted(tree):
    tree["kernel_src/new_op.cu"] = '#include "device_utils.cuh"\n'
    return "build lists", "build.toml: no section's src lists kernel_src/new_op.cu"


def _new_twin_not_in_hub_unit(tree):
    tree["kernel_src/new_op_cpu.c"] = '#include "cpu_utils.h"\n'
    return "build lists", "cpu_kernels.cpp does not include kernel_src/new_op_cpu.c"


def _header_unlisted(tree):
    toml = tree["build.toml"]
    tree["build.toml"] = toml.replace('  "kernel_src/rows.h",\n', "", 1)
    return "build lists", "lacks kernel_src/rows.h (included by"


def _listed_file_missing(tree):
    path = next(p for p in tree if p.endswith(".cu"))
    del tree[path]
    return "build lists", f"{path} is not on disk"


def _setup_list(tree):
    tree["setup.py"] = tree["setup.py"].replace('glob("*.cu")', 'glob("rmsnorm.cu")')
    path = next(p for p in sorted(tree) if p.endswith(".cu") and not p.endswith("rmsnorm.cu"))
    return "build lists", f"setup.py: its source globs miss {path}"


@pytest.mark.parametrize(
    "mutate",
    [
        _without_schema,
        _unlisted_schema,
        _undeclared_impl,
        _undefined_impl,
        _no_autograd,
        _twin_without_rule,
        _launcher_without_twin,
        _rule_not_declared,
        _new_kernel_unlisted,
        _new_twin_not_in_hub_unit,
        _header_unlisted,
        _listed_file_missing,
        _setup_list,
    ],
)
def test_a_missing_piece_is_named(mutate):
    tree = _source_tree()
    check, message = mutate(tree)
    problems = CPP_CHECKS[check](tree)
    assert any(message in p for p in problems), (message, problems)
