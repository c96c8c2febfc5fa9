"""pytest plugin: runs diffusers' own test suites with ltx_kernels injected into every diffusers
model the tests construct (scripts/diffusers_suites.py runs it, stock and injected).

Load it by module name, with scripts/ on the import path, from the root of a diffusers source tree
(the folder holding tests/, so that the tests' relative imports resolve):

    PYTHONPATH=/path/to/ltx_kernels/scripts python -m pytest -p diffusers_suites_plugin \\
        tests/models/transformers/test_models_transformer_ltx.py

Injection: every subclass of diffusers' ModelMixin, those defined before the plugin loads and
those defined after, gets its __init__ wrapped; when the outermost ModelMixin __init__ of a model
returns (a model built inside another model's __init__ is injected with its owner), the model goes
through `ltx_kernels.inject_optimized_kernels(model, verbose=False)`. That covers every way a test
builds one: the constructor, from_config, from_pretrained (which constructs under accelerate's
init_empty_weights, on the meta device, then loads the weights), `with torch.device("meta")`.
An exception from the injection propagates: the construction, and so the test, fails with it.

Options:
  --ltx-kernels {inject,off}  off: record outcomes only (the stock column); default inject
  --ltx-kernels-json PATH     per test: outcome, first line of its error or skip reason, duration
                              and the models injected (class, modules patched); a file that fails
                              to collect is one error; rewritten after every test, so a run killed
                              midway keeps what it recorded
  --ltx-kernels-test-timeout S  fails a test whose setup, call or teardown runs longer than S
                              seconds (SIGALRM, the main thread); 0 (default): no limit

The terminal summary gets one line: models injected, modules patched, tests that built a model.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
import time
from pathlib import Path

import pytest

_WRAPPED = "_ltx_kernels_suites_wrapped"
_local = threading.local()  # .depth: ModelMixin __init__ calls in progress on this thread


class _Recorder:
    def __init__(self, inject: bool, json_path: Path | None, test_timeout: float):
        self.inject = inject
        self.json_path = json_path
        self.test_timeout = test_timeout
        self.current = "<collection>"  # the node id models are credited to
        self.models: dict[str, list] = {}  # node id -> [[class name, modules patched], ...]
        self.tests: dict[str, dict] = {}  # node id -> outcome record
        self.started = time.time()

    def injected(self, model, patched: int) -> None:
        self.models.setdefault(self.current, []).append([type(model).__name__, patched])

    def write(self) -> None:
        if self.json_path is None:
            return
        payload = {
            "inject": self.inject,
            "seconds": round(time.time() - self.started, 1),
            "tests": self.tests,
            "models": self.models,
        }
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(self.json_path)


_recorder: _Recorder | None = None


def _inject(model) -> None:
    import ltx_kernels

    report = ltx_kernels.inject_optimized_kernels(model, verbose=False)
    if _recorder is not None:
        _recorder.injected(model, report.total_patched)


def _wrap_init(cls: type) -> None:
    """Wraps `cls.__init__` (when cls defines one): the outermost call injects the model it built.
    functools.wraps keeps the signature that diffusers' ConfigMixin reads."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, _WRAPPED, False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _local.depth = depth
        if depth == 0 and _recorder is not None and _recorder.inject:
            _inject(self)

    setattr(__init__, _WRAPPED, True)
    cls.__init__ = __init__


def _install() -> None:
    """Wraps the __init__ of every ModelMixin subclass defined so far and of every one defined
    later (diffusers imports its model modules lazily)."""
    from diffusers.models.modeling_utils import ModelMixin

    if getattr(ModelMixin, _WRAPPED, False):
        return
    setattr(ModelMixin, _WRAPPED, True)
    parent_hook = ModelMixin.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if parent_hook is not None:
            parent_hook.__func__(cls, **kwargs)
        else:
            super(ModelMixin, cls).__init_subclass__(**kwargs)
        _wrap_init(cls)

    ModelMixin.__init_subclass__ = classmethod(__init_subclass__)
    pending = [ModelMixin]
    while pending:
        cls = pending.pop()
        _wrap_init(cls)
        pending.extend(cls.__subclasses__())


def pytest_addoption(parser):
    group = parser.getgroup("ltx_kernels", "ltx_kernels injection into diffusers' test suites")
    group.addoption("--ltx-kernels", choices=("inject", "off"), default="inject")
    group.addoption("--ltx-kernels-json", type=Path, default=None)
    group.addoption("--ltx-kernels-test-timeout", type=float, default=0.0)


def pytest_configure(config):
    global _recorder
    _recorder = _Recorder(
        inject=config.getoption("--ltx-kernels") == "inject",
        json_path=config.getoption("--ltx-kernels-json"),
        test_timeout=config.getoption("--ltx-kernels-test-timeout"),
    )
    if _recorder.inject:
        _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _recorder.current = item.nodeid
    yield
    _recorder.current = "<between tests>"  # (class- and module-scoped fixture teardowns)
    _recorder.write()


def _timed_out(signum, frame):
    raise TimeoutError(f"ltx_kernels: over --ltx-kernels-test-timeout={_recorder.test_timeout} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _alarm():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _alarm():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _alarm():
        yield


class _alarm:
    """SIGALRM after --ltx-kernels-test-timeout seconds, on the main thread only."""

    def __enter__(self):
        self.armed = (
            _recorder.test_timeout > 0 and threading.current_thread() is threading.main_thread()
        )
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, _timed_out)
            signal.setitimer(signal.ITIMER_REAL, _recorder.test_timeout)

    def __exit__(self, *exc):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)


def _first_line(report) -> str:
    """The first line of a failure's exception message (with the exception's type), or a skip's
    reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        text = longrepr[2]
    else:
        crash = getattr(longrepr, "reprcrash", None)
        text = crash.message if crash is not None else str(longrepr)
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "RuntimeError:" over a message on its own lines
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def pytest_runtest_logreport(report):
    """Per test: passed, failed (the call), error (setup or teardown), skipped, xfailed, xpassed;
    the first non-passed phase decides, and its message is kept."""
    record = _recorder.tests.setdefault(
        report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0}
    )
    record["seconds"] = round(record["seconds"] + report.duration, 3)
    if record["outcome"] not in ("passed", "xpassed"):
        return
    if report.passed:
        if hasattr(report, "wasxfail"):
            record["outcome"] = "xpassed"
        return
    if report.skipped:
        outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.when == "call":
        outcome = "failed"
    else:
        outcome = "error"
    record["outcome"] = outcome
    record["message"] = _first_line(report)


def pytest_collectreport(report):
    """A file that fails to import or collect: one "error" record under its node id, with the
    exception's line (the last `E` line of pytest's report)."""
    if report.failed:
        text = str(report.longrepr)
        errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        _recorder.tests[report.nodeid] = {
            "outcome": "error",
            "message": "collection: " + (errors[-1] if errors else _first_line(report)),
            "seconds": 0.0,
        }


def pytest_terminal_summary(terminalreporter):
    if not _recorder.inject:
        return
    built = [nodeid for nodeid in _recorder.models if nodeid in _recorder.tests]
    counts = [patched for models in _recorder.models.values() for _, patched in models]
    terminalreporter.write_line(
        f"ltx_kernels: {len(counts)} models injected ({sum(1 for c in counts if c)} with patched "
        f"modules, {sum(counts)} modules patched in all) in {len(built)} of "
        f"{len(_recorder.tests)} tests"
    )


def pytest_sessionfinish(session):
    if _recorder is not None:
        _recorder.write()
