"""Runs diffusers' own test suites for every model family ltx_kernels maps, stock and with the
kernels injected into every model the tests build (the pytest plugin diffusers_suites_plugin.py),
and prints per family the outcomes side by side and every test that passes stock but not injected,
with the first line of its error.

The tests come from a diffusers source snapshot (a git repository: its tests/ tree is exported to
a folder outside this repository) and run against the installed diffusers (the pinned release).
Each family's test files run in one pytest process per column, from the export's root (the tests
import their helpers relatively: `from ...testing_utils import ...`), offline (HF_HUB_OFFLINE=1:
tests that need a checkpoint or a tokenizer from the Hub fail or skip alike in both columns).

    python scripts/diffusers_suites.py --repo ~/diffusers     # every family, on the CPU
    python scripts/diffusers_suites.py --repo ~/diffusers --families ltx,flux --device cuda
    python scripts/diffusers_suites.py --tests /tmp/diffusers-src --suites pipelines -k "not lora"

--device picks diffusers' test device (its tests read DIFFUSERS_TEST_DEVICE; on the CPU they skip
what needs an accelerator). --suites pipelines runs the family's pipeline suites instead
(tests/pipelines/<dir>; they import parameterized and requests_mock: pip install parameterized
requests-mock); most build their text encoders and tokenizers from hf-internal-testing checkpoints
on the Hub, so offline those fail in both columns. Exit status: 1 when a test passes stock and not
injected (or a run timed out), else 0. The per-test records (JSON) and pytest's output (logs) go
to --out.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGIN = "diffusers_suites_plugin"
MODELS = "tests/models/transformers/test_models_transformer_{}.py"

#: family -> (the model test files, by the suffix of test_models_transformer_*.py; the pipeline
#: suites, folders of tests/pipelines). Beyond the family's own model: the models whose blocks a
#: patcher matches by class name (Wan's: WanAnimate's and ChronoEdit's copies of
#: WanTransformerBlock, WanVACE, SkyReels-V2; HunyuanVideo's: Framepack).
FAMILIES = {
    "ltx": (("ltx",), ("ltx",)),
    "ltx2": (("ltx2",), ("ltx2",)),
    "flux": (("flux",), ("flux",)),
    "wan": (
        ("wan", "wan_animate", "wan_vace", "skyreels_v2", "chronoedit"),
        ("wan", "skyreels_v2", "chronoedit"),
    ),
    "sd3": (("sd3",), ("stable_diffusion_3",)),
    "hunyuan_video_1_5": (("hunyuan_1_5",), ("hunyuan_video1_5",)),
    "hunyuan_video": (("hunyuan_video", "hunyuan_video_framepack"), ("hunyuan_video",)),
}
COLUMNS = ("stock", "injected")
PASSED = ("passed", "xpassed")
#: How outcomes are counted in the table: pass (xpassed too), fail, skip (xfailed too), error.
COUNTED = {
    "passed": "pass",
    "xpassed": "pass",
    "failed": "fail",
    "skipped": "skip",
    "xfailed": "skip",
    "error": "err",
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="diffusers' test device (DIFFUSERS_TEST_DEVICE): cpu (default) or cuda",
    )
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3600,
        help="seconds for one pytest run (a family's files, one column; default 3600)",
    )
    parser.add_argument(
        "--test-timeout",
        type=float,
        default=600,
        help="seconds for one test's setup, call or teardown (0: none; default 600)",
    )
    parser.add_argument(
        "--tests",
        type=Path,
        default=None,
        help="a diffusers source tree holding tests/ (default: export from --repo)",
    )
    parser.add_argument(
        "--repo",
        default=os.environ.get("DIFFUSERS_REPO"),
        help="a diffusers git repository (clone or bare) to export tests/ from (default: "
        "$DIFFUSERS_REPO)",
    )
    parser.add_argument("--rev", default="HEAD", help="revision to export (default: HEAD)")
    parser.add_argument(
        "--suites",
        default="models",
        help="models (default), pipelines, or models,pipelines: the family's model test files, "
        "its pipeline suites",
    )
    parser.add_argument(
        "--columns",
        default=",".join(COLUMNS),
        help="stock,injected (default) or one of them",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="pytest runs at a time (default 1; the durations are then each run's wall time "
        "under contention)",
    )
    parser.add_argument(
        "--online", action="store_true", help="let the tests reach the Hub (no HF_HUB_OFFLINE)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/diffusers_suites"),
        help="folder for the per-test JSON and the pytest logs (default: results/diffusers_suites)",
    )
    args = parser.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown or not args.families:
        parser.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    if args.tests is None and not args.repo:
        parser.error("give --repo (or set DIFFUSERS_REPO) or --tests: where diffusers' tests are")
    args.suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    if not args.suites or set(args.suites) - {"models", "pipelines"}:
        parser.error("--suites: models, pipelines, or both")
    args.columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    if not args.columns or set(args.columns) - set(COLUMNS):
        parser.error(f"--columns: from {', '.join(COLUMNS)}")
    return args


def export_tests(repo: str, rev: str, dest: Path) -> Path:
    """Writes `rev`'s tests/ tree of the git repository `repo` under dest; returns dest."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "-C", repo, "archive", rev, "tests"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait():
        raise SystemExit(f"git archive {rev} tests failed in {repo}")
    return dest


def suite_files(root: Path, family: str, suites: list[str]) -> list[str]:
    """The family's test paths (relative to root) of `suites` that exist in this snapshot."""
    models, pipeline_dirs = FAMILIES[family]
    paths = [MODELS.format(name) for name in models] if "models" in suites else []
    if "pipelines" in suites:
        paths += [f"tests/pipelines/{name}" for name in pipeline_dirs]
    return [path for path in paths if (root / path).exists()]


def run_column(root: Path, files: list[str], column: str, args, stem: Path) -> dict:
    """One pytest run over `files`; returns the plugin's record plus seconds, returncode and
    timed_out."""
    record = stem.with_suffix(".json")
    record.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        *files,
        "-c",
        os.devnull,  # no ini file from the folders above the export
        "--rootdir",
        str(root),
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-p",
        PLUGIN,
        f"--ltx-kernels={'inject' if column == 'injected' else 'off'}",
        f"--ltx-kernels-json={record}",
        f"--ltx-kernels-test-timeout={args.test_timeout}",
        "-q",
        "-rfE",
        "-W",
        "ignore::DeprecationWarning",
    ]
    if args.keyword:
        command += ["-k", args.keyword]
    env = dict(os.environ, DIFFUSERS_TEST_DEVICE=args.device)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    if not args.online:
        env["HF_HUB_OFFLINE"] = "1"
    start = time.perf_counter()
    timed_out = False
    with stem.with_suffix(".log").open("w") as log:
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = process.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)  # (pytest and any worker it started)
            returncode = process.wait()
    seconds = time.perf_counter() - start
    result = json.loads(record.read_text()) if record.exists() else {"tests": {}, "models": {}}
    result.update(seconds=seconds, returncode=returncode, timed_out=timed_out)
    return result


def counts(tests: dict) -> dict:
    totals = dict.fromkeys(("pass", "fail", "skip", "err"), 0)
    for record in tests.values():
        totals[COUNTED[record["outcome"]]] += 1
    return totals


def regressions(stock: dict, injected: dict) -> list[tuple[str, str, str]]:
    """(node id, injected outcome, its first line) of each test that passes stock and not
    injected (a test missing from the injected run: the run stopped before it)."""
    found = []
    for nodeid, record in stock.items():
        if record["outcome"] not in PASSED:
            continue
        other = injected.get(nodeid)
        if other is None:
            found.append((nodeid, "not run", "the injected run stopped before it"))
        elif other["outcome"] not in PASSED:
            found.append((nodeid, other["outcome"], other["message"]))
    return found


def failure_kinds(tests: dict, shown: int = 5) -> list[tuple[int, str]]:
    """The commonest first lines (to 120 characters) of the failures and errors, with counts."""
    kinds = collections.Counter(
        record["message"][:120]
        for record in tests.values()
        if record["outcome"] in ("failed", "error")
    )
    return [(count, message) for message, count in kinds.most_common(shown)]


def injection_summary(result: dict) -> str:
    """Models injected and modules patched in a run, and the tests whose models all patched
    nothing (a model with none of the mapped blocks)."""
    models = [m for nodeid, ms in result.get("models", {}).items() for m in ms]
    patched = sum(count for _, count in models)
    classes = sorted({name for name, count in models if count})
    unpatched = sorted({name for name, count in models if not count} - set(classes))
    line = f"{len(models)} models injected, {patched} modules patched"
    if classes:
        line += f" ({', '.join(classes)})"
    if unpatched:
        line += f"; nothing patched in {', '.join(unpatched)}"
    return line


def print_report(results: dict, columns: list[str]) -> int:
    """The table, then per family the injection counts and the regressions; returns their
    number (timed-out runs count)."""
    header = f"{'family':<18}"
    for column in columns:
        header += f" | {column + ': pass fail skip  err':>26}"
    header += " | " + "  ".join(f"{c + ' s':>10}" for c in columns)
    print(header)
    print("-" * len(header))
    for family, by_column in results.items():
        line = f"{family:<18}"
        for column in columns:
            c = counts(by_column[column]["tests"])
            cells = f"{c['pass']:4d} {c['fail']:4d} {c['skip']:4d} {c['err']:4d}"
            line += f" | {cells:>26}"
        line += " | " + "  ".join(
            f"{by_column[c]['seconds']:9.0f}{'!' if by_column[c]['timed_out'] else ' '}"
            for c in columns
        )
        print(line)
    if any(r[c]["timed_out"] for r in results.values() for c in columns):
        print("(!: the run timed out; the counts are the tests it finished)")
    bad = 0
    for family, by_column in results.items():
        print(f"\n{family}:")
        for column in columns:
            if by_column[column]["returncode"] not in (0, 1, 5) or by_column[column]["timed_out"]:
                print(f"  {column}: pytest exited {by_column[column]['returncode']}")
                bad += by_column[column]["timed_out"]
        if "injected" in by_column:
            print(f"  injection: {injection_summary(by_column['injected'])}")
        for column in columns:
            for count, message in failure_kinds(by_column[column]["tests"]):
                print(f"  {column} failed/error x{count}: {message}")
        if set(columns) != set(COLUMNS):
            continue
        found = regressions(by_column["stock"]["tests"], by_column["injected"]["tests"])
        fixed = regressions(by_column["injected"]["tests"], by_column["stock"]["tests"])
        bad += len(found)
        print(f"  pass stock, not injected: {len(found)}")
        for nodeid, outcome, message in found:
            print(f"    {nodeid}\n      {outcome}: {message[:300]}")
        if fixed:
            print(f"  pass injected, not stock: {len(fixed)}")
            for nodeid, outcome, message in fixed:
                print(f"    {nodeid}\n      stock {outcome}: {message[:300]}")
    return bad


def main(argv=None) -> int:
    args = parse_args(argv)
    temporary = None
    if args.tests is None:
        temporary = Path(tempfile.mkdtemp(prefix="diffusers-tests-"))
        root = export_tests(args.repo, args.rev, temporary)
        print(f"tests: {args.repo} at {args.rev}, exported to {root}")
    else:
        root = args.tests.resolve()
        if not (root / "tests" / "testing_utils.py").exists():
            raise SystemExit(f"--tests: {root} holds no diffusers tests/ tree")
        print(f"tests: {root}")
    import diffusers
    import torch

    print(
        f"diffusers {diffusers.__version__}, torch {torch.__version__}, device {args.device}"
        + ("" if args.online else ", offline")
    )
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []  # (family, column, files)
    for family in args.families:
        files = suite_files(root, family, args.suites)
        if not files:
            print(f"{family}: no test files in this snapshot")
        runs += [(family, column, files) for column in args.columns if files]

    def run(family, column, files):
        suites = "-".join(args.suites)
        stem = (args.out / f"{family}-{suites}-{args.device}-{column}").resolve()
        result = run_column(root, files, column, args, stem)
        c = counts(result["tests"])
        print(
            f"{family} {column}: {c['pass']} passed, {c['fail']} failed, {c['skip']} skipped, "
            f"{c['err']} errors in {result['seconds']:.0f} s ({stem}.log)",
            flush=True,
        )
        return result

    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = [pool.submit(run, *entry) for entry in runs]
            results = {}
            for (family, column, _), future in zip(runs, futures):
                results.setdefault(family, {})[column] = future.result()
    finally:
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
    print()
    bad = print_report(results, args.columns)
    summary = args.out / f"summary-{'-'.join(args.suites)}-{args.device}.json"
    summary.write_text(json.dumps(results, indent=1))
    print(f"\nper-test records: {summary}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
