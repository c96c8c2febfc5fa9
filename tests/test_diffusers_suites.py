"""scripts/diffusers_suites_plugin.py and scripts/diffusers_suites.py on a stand-in for diffusers'
test tree (diffusers' own tests are not part of this repository): the plugin injects into every
model a test builds (constructor, from_pretrained, init_empty_weights, a model built inside
another model's __init__ once, with its owner), records outcomes, first lines and modules patched;
--ltx-kernels=off records without injecting; the script's table and its list of tests that pass
stock but not injected."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("accelerate")

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# A test file as diffusers' suites write them: tiny models built every way a suite builds them.
SUITE = textwrap.dedent(
    """
    import os
    import time

    import accelerate
    import pytest
    import torch
    from diffusers import LTXVideoTransformer3DModel
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin

    INJECTED = os.environ.get("EXPECT_INJECTED") == "1"
    INIT = dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=1, caption_channels=16,
    )


    def patched(model):
        return hasattr(type(model.transformer_blocks[0]), "_ltx_kernels_original_class")


    class Outer(ModelMixin, ConfigMixin):  # defined after the plugin loaded
        @register_to_config
        def __init__(self, layers: int = 1):
            super().__init__()
            self.inner = LTXVideoTransformer3DModel(**INIT)


    def test_constructor():
        assert patched(LTXVideoTransformer3DModel(**INIT)) == INJECTED


    def test_from_pretrained(tmp_path):
        LTXVideoTransformer3DModel(**INIT).save_pretrained(tmp_path)
        model = LTXVideoTransformer3DModel.from_pretrained(tmp_path)
        assert patched(model) == INJECTED
        assert model.transformer_blocks[0].attn1.to_q.weight.device.type == "cpu"


    def test_meta_device():
        with accelerate.init_empty_weights():
            model = LTXVideoTransformer3DModel(**INIT)
        assert patched(model) == INJECTED


    def test_nested_model_is_injected_with_its_owner():
        assert patched(Outer().inner) == INJECTED


    def test_fails_injected_only():
        assert not patched(LTXVideoTransformer3DModel(**INIT)), "patched\\nsecond line"


    def test_skipped():
        pytest.skip("no accelerator")


    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False


    def test_slow():
        time.sleep(60)
    """
)


def run_plugin(tmp_path: Path, inject: bool, *extra) -> dict:
    (tmp_path / "test_suite.py").write_text(SUITE)
    record = tmp_path / f"record-{inject}.json"
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS), EXPECT_INJECTED=str(int(inject)))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_suite.py",
            "-c",
            os.devnull,
            "-p",
            "no:cacheprovider",
            "-p",
            "diffusers_suites_plugin",
            f"--ltx-kernels={'inject' if inject else 'off'}",
            f"--ltx-kernels-json={record}",
            "--ltx-kernels-test-timeout=8",
            "-q",
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(record.read_text())


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return {
        inject: run_plugin(tmp_path_factory.mktemp(f"inject{inject}"), inject)
        for inject in (True, False)
    }


def test_plugin_injects_every_model_a_test_builds(records):
    injected = records[True]
    outcome = {node.split("::")[1]: r["outcome"] for node, r in injected["tests"].items()}
    assert outcome == {
        "test_constructor": "passed",
        "test_from_pretrained": "passed",
        "test_meta_device": "passed",
        "test_nested_model_is_injected_with_its_owner": "passed",
        "test_fails_injected_only": "failed",
        "test_skipped": "skipped",
        "test_xfail": "xfailed",
        "test_slow": "failed",
    }
    models = {node.split("::")[1]: m for node, m in injected["models"].items()}
    # 5 = the block, its two attention processors, the fused q/k/v, the output norm
    one = ["LTXVideoTransformer3DModel", 5]
    assert models["test_constructor"] == [one]
    assert models["test_from_pretrained"] == [one, one]  # the saved one and the loaded one
    assert models["test_meta_device"] == [one]
    assert models["test_nested_model_is_injected_with_its_owner"] == [["Outer", 5]]


def test_plugin_records_first_lines_and_the_timeout(records):
    tests = {node.split("::")[1]: r for node, r in records[True]["tests"].items()}
    assert tests["test_fails_injected_only"]["message"].startswith("AssertionError: patched")
    assert "second line" not in tests["test_fails_injected_only"]["message"]
    assert tests["test_skipped"]["message"] == "Skipped: no accelerator"
    assert tests["test_slow"]["message"] == (
        "TimeoutError: ltx_kernels: over --ltx-kernels-test-timeout=8.0 s"
    )
    assert 8 <= tests["test_slow"]["seconds"] < 30


def test_plugin_off_records_without_injecting(records):
    stock = records[False]
    assert stock["inject"] is False and stock["models"] == {}
    outcome = {node.split("::")[1]: r["outcome"] for node, r in stock["tests"].items()}
    assert outcome["test_constructor"] == outcome["test_fails_injected_only"] == "passed"
    assert outcome["test_nested_model_is_injected_with_its_owner"] == "passed"


def test_collection_error_is_one_error(tmp_path):
    (tmp_path / "test_broken.py").write_text("import not_a_module\n")
    record = tmp_path / "r.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_broken.py",
            "-c",
            os.devnull,
            "-p",
            "diffusers_suites_plugin",
            f"--ltx-kernels-json={record}",
            "-q",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(SCRIPTS)),
        capture_output=True,
        timeout=600,
    )
    tests = json.loads(record.read_text())["tests"]
    assert tests == {
        "test_broken.py": {
            "outcome": "error",
            "message": "collection: ModuleNotFoundError: No module named 'not_a_module'",
            "seconds": 0.0,
        }
    }


# ---- the script ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def suites():
    sys.path.insert(0, str(SCRIPTS))
    import diffusers_suites

    return diffusers_suites


def test_script_prints_both_columns_and_the_injected_only_failures(suites, tmp_path, capsys):
    """main() over a stand-in diffusers tree (tests/testing_utils.py, the LTX model file): the
    table's two columns and the one test that passes stock only, with its first line."""
    tree = tmp_path / "diffusers"
    models = tree / "tests" / "models" / "transformers"
    models.mkdir(parents=True)
    (tree / "tests" / "testing_utils.py").write_text("")
    suite = SUITE.replace('os.environ.get("EXPECT_INJECTED") == "1"', "False")
    (models / "test_models_transformer_ltx.py").write_text(
        suite.replace("def test_slow():\n    time.sleep(60)\n", "")
    )
    status = suites.main(
        [
            "--tests",
            str(tree),
            "--families",
            "ltx",
            "--out",
            str(tmp_path / "out"),
            "-k",
            "not nested",
        ]
    )
    printed = capsys.readouterr().out
    assert status == 1
    node = "tests/models/transformers/test_models_transformer_ltx.py"
    # -k "not nested": 6 tests. Stock: the 4 that assert "not patched" pass; injected they fail.
    assert re.search(r"\nltx +\| +4 +0 +2 +0 +\| +0 +4 +2 +0 +\|", printed), printed
    assert "pass stock, not injected: 4" in printed
    assert f"{node}::test_fails_injected_only\n      failed: AssertionError: patched" in printed
    # constructor 1, from_pretrained 2 (saved, loaded), meta 1, fails_injected_only 1
    assert "injection: 5 models injected, 25 modules patched (LTXVideoTransformer3DModel)" in (
        printed
    )
    assert "injected failed/error x1: AssertionError: patched" in printed
    summary = json.loads((tmp_path / "out" / "summary-models-cpu.json").read_text())
    assert set(summary["ltx"]) == {"stock", "injected"}


def test_regressions_and_counts(suites):
    stock = {
        "a": {"outcome": "passed", "message": ""},
        "b": {"outcome": "passed", "message": ""},
        "c": {"outcome": "failed", "message": "x"},
        "d": {"outcome": "xpassed", "message": ""},
        "e": {"outcome": "passed", "message": ""},
    }
    injected = {
        "a": {"outcome": "passed", "message": ""},
        "b": {"outcome": "error", "message": "RuntimeError: y"},
        "c": {"outcome": "failed", "message": "x"},
        "d": {"outcome": "xfailed", "message": "z"},
    }
    assert suites.regressions(stock, injected) == [
        ("b", "error", "RuntimeError: y"),
        ("d", "xfailed", "z"),
        ("e", "not run", "the injected run stopped before it"),
    ]
    assert suites.counts(injected) == {"pass": 1, "fail": 1, "skip": 1, "err": 1}
