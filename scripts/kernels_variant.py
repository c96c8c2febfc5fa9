"""Lays the setuptools build out as a `kernels` build variant, so that the `kernels` package loads
it like a Hub build:

    pip install -e . --no-build-isolation   # or: python setup.py build_clib build_ext --inplace
    python scripts/kernels_variant.py       # -> build/torch211-cxx11-cu130-x86_64-linux/
    python -c "import kernels, pathlib; print(kernels.get_local_kernel(pathlib.Path('.')))"

The variant folder holds the package's Python files at its top (the flat layout that
`kernels.get_local_kernel` imports first), the compiled `_C` extension and metadata.json. Its name
and metadata follow what `kernels` 0.17.2 reads (variants.py: torch<maj><min>-cxx11-cu<maj><min>-
<cpu>-<os>, matched against the running torch; the Metadata fields of huggingface/kernels'
kernels-data/src/metadata.rs). Name, version and license come from build.toml.

The setuptools build registers its ops under torch.ops.ltx_kernels, so the metadata id is
`ltx_kernels` (kernels imports the variant as the module named by the id, and the kernel
requirements ask that ops live under torch.ops.<id>). Load the variant in a process that has not
imported ltx_kernels from elsewhere: there kernels would reuse the loaded `ltx_kernels._C`, and a
second copy of the library aborts the process (its TORCH_LIBRARY registers ltx_kernels again).
"""

import argparse
import json
import platform
import re
import runpy
import shutil
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import torch

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch-ext" / "ltx_kernels"


def fail(message: str) -> None:
    sys.exit(f"kernels_variant: {message}")


def cuda_archs(gencode_flags) -> list:
    """kernels' arch names for setup.py's -gencode flags: code=sm_90a -> "9.0a" (machine code),
    code=compute_90 -> "9.0+PTX" (PTX, which newer GPUs JIT-compile)."""
    archs = set()
    for flag in gencode_flags:
        match = re.search(r"code=(sm|compute)_(\d+)(\d)([af]?)$", flag)
        if match is None:
            fail(f"cannot read the target of {flag!r}")
        kind, major, minor, suffix = match.groups()
        archs.add(f"{major}.{minor}{suffix}" + ("+PTX" if kind == "compute" else ""))
    return sorted(archs)


def variant_name(torch_version: str, cuda_version: str) -> str:
    """torch211-cxx11-cu130-x86_64-linux for torch 2.11 with CUDA 13.0 on x86-64 Linux."""
    torch_tag = "torch" + "".join(torch_version.split("+")[0].split(".")[:2])
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    cuda_tag = "cu" + "".join(cuda_version.split(".")[:2])
    machine = platform.machine()
    cpu = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine.lower(), machine)
    return f"{torch_tag}-{abi}-{cuda_tag}-{cpu}-{platform.system().lower()}"


def lay_out(out_dir: Path) -> Path:
    """Writes out_dir/<variant>/ from the in-place build in torch-ext/ltx_kernels; returns it."""
    extensions = sorted(PACKAGE.glob("_C.*.so"))
    if len(extensions) != 1:
        fail(
            f"expected one built extension _C.*.so in {PACKAGE}, found {len(extensions)}; "
            "build it first with `pip install -e . --no-build-isolation` (or `python setup.py "
            "build_clib build_ext --inplace`)"
        )
    build = runpy.run_path(str(PACKAGE / "_build_info.py"))  # written by setup.py
    if build["TORCH_VERSION"] != torch.__version__:
        fail(
            f"the extension was built against torch {build['TORCH_VERSION']}, this is torch "
            f"{torch.__version__}; run this script with the Python that built it"
        )
    general = tomllib.loads((ROOT / "build.toml").read_text())["general"]

    variant = out_dir / variant_name(build["TORCH_VERSION"], build["TORCH_CUDA_VERSION"])
    if variant.exists():
        shutil.rmtree(variant)
    for source in PACKAGE.rglob("*.py"):
        # _ops.py only exists as kernel-builder's generated module (see _op_namespace.py).
        if source.name == "_ops.py" and source.parent == PACKAGE:
            continue
        target = variant / source.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    shutil.copy2(extensions[0], variant / extensions[0].name)
    metadata = {
        "name": general["name"],
        "id": "ltx_kernels",  # the module name kernels imports it as = its torch.ops namespace
        "version": general["version"],
        "license": general["license"],
        "python-depends": [],
        "backend": {"type": "cuda", "archs": cuda_archs(build["GENCODE_FLAGS"])},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return variant


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "build",
        help="folder to write the variant folder into (default: build/)",
    )
    variant = lay_out(parser.parse_args(argv).out)
    print(f"kernels_variant: wrote {variant}")
    return variant


if __name__ == "__main__":
    main()
