"""benchmarks/accelerator.py's harness: each stage in its own process with its own limit, a failing and a hanging
stage reported while the others still run, one JSON line per stage as it finishes; and the summary's arithmetic.
The stages themselves are measured by running the script (`--small` here, full size on a lent GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

STAGE_MODULE = """
import os, time

def first(small):
    return {"x": 1, "small": small, "pid": os.getpid()}

def fails(small):
    raise ValueError("broken on purpose")

def hangs(small):
    time.sleep(120)

def last(small):
    return {"y": 2, "pid": os.getpid()}

STAGES = {"first": first, "fails": fails, "hangs": hangs, "last": last}
"""


@pytest.fixture(scope="module")
def accelerator():
    spec = importlib.util.spec_from_file_location("accelerator_under_test", ROOT / "benchmarks" / "accelerator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_failing_and_hanging_stages_are_reported_and_the_others_run(accelerator, tmp_path):
    module = tmp_path / "stages.py"
    module.write_text(STAGE_MODULE)
    limits = {"first": 60, "fails": 60, "hangs": 1, "last": 60}
    stages = [accelerator.Stage(name, module, limit) for name, limit in limits.items()]
    out = tmp_path / "run.jsonl"
    records = accelerator.run_stages(stages, out, small=True, budget_s=300)

    assert records["first"]["ok"] and records["first"]["result"]["x"] == 1 and records["first"]["result"]["small"]
    assert not records["fails"]["ok"]
    assert records["fails"]["error"] == "exit 1: ValueError: broken on purpose"
    assert "Traceback" in records["fails"]["log_tail"]
    assert not records["hangs"]["ok"] and records["hangs"]["error"] == "timed out after 1 s"
    assert records["last"]["ok"] and records["last"]["result"]["y"] == 2
    assert records["first"]["result"]["pid"] != records["last"]["result"]["pid"]  # a process per stage
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["stage"] for line in lines] == list(limits)  # appended in order, as each finished
    assert lines == [records[name] for name in limits]


def test_a_spent_budget_skips_the_remaining_stages(accelerator, tmp_path):
    module = tmp_path / "stages.py"
    module.write_text(STAGE_MODULE)
    records = accelerator.run_stages([accelerator.Stage("first", module, 60)], None, small=True, budget_s=5)
    assert not records["first"]["ok"] and records["first"]["error"].startswith("skipped: ")


def test_the_workers_stages_join_ours(accelerator, tmp_path):
    workers = tmp_path / "workers.py"
    workers.write_text("STAGES = {'decode': None, 'prefill': None}\n")
    names = [s.name for s in accelerator.all_stages(small=True, workers=workers)]
    assert names == [*accelerator.STAGES, "decode", "prefill"]
    assert [s.name for s in accelerator.all_stages(small=True, workers=tmp_path / "absent.py")] == list(
        accelerator.STAGES
    )


def test_summary_divides_by_the_measured_and_the_nominal_peak(accelerator):
    def ok(result):
        return {"ok": True, "result": result}

    jax_step = {"tokens_per_s": 80_000.0, "model_tflops": 300.0, "mfu_nominal": 300 / 989}
    jax_step |= {"first_step_s": 20.0, "init_random_s": 3.0, "load_hf_s": 4.0}
    records = {
        "matmul_jax": ok({"tflops": 750.0}),
        "grpo_jax_0.5b": ok(jax_step),
        "grpo_torch_0.5b": ok({"tokens_per_s": 50_000.0}),
        "grpo_jax_0.5b_4layers": ok({**jax_step, "first_step_s": 16.0}),
        "grpo_jax_1.5b": {"ok": False, "error": "timed out after 150 s"},
    }
    summary = accelerator.summary(records)
    assert summary["0.5b"]["mfu_measured_peak"] == pytest.approx(0.4)
    assert summary["0.5b"]["ratio_vs_torch"] == pytest.approx(1.6)
    assert summary["first_step_24_over_4_layers"] == pytest.approx(1.25)
    assert "1.5b" not in summary
    assert accelerator.nominal_tflops("NVIDIA H200") == 989.0 and accelerator.nominal_tflops("cpu") is None
