"""`intellect plot RUN_DIR`: charts from a synthetic metrics.jsonl with every role, series checked against values
computed here from the raw per-sample draws, PNGs checked with PIL, and the bad-input cases."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from intellect import cli
from intellect.plot import build_series, charts, read_metrics, render, rolling_mean

REPO = Path(__file__).resolve().parents[3]
STEPS = 40
EVAL_EVERY = 10
LEARNER_CHARTS = {"reward", "completion_length", "staleness", "throughput", "loss", "summary"}
ALL_CHARTS = LEARNER_CHARTS | {"heldout_accuracy", "length_targets", "verdicts", "sft"}
TARGETS = (6, 12, 18)  # the evaluation's length targets


def synthetic_run(seed: int = 0, roles=("sft", "learner", "eval", "pool")) -> tuple[list[dict], dict]:
    """Records as the roles write them, and the raw draws they were made from (the independent reference)."""
    rng = np.random.default_rng(seed)
    raw = {
        "reward": [],
        "lens": [],
        "staleness": [],
        "tokens_per_s": [],
        "busy": [],
        "loss": [],
        "clip_high": [],
        "eval_steps": [],
        "eval_acc": [],
        "eval_len": [],
        "eval_abs_err": {t: [] for t in TARGETS},
        "eval_target_acc": {t: [] for t in TARGETS},
        "pool_steps": [],
        "accepted": [],
        "rejected": [],
        "sft_loss": [],
        "sft_acc": [],
    }
    records = []
    if "sft" in roles:
        for step in range(1, 11):
            raw["sft_loss"].append(float(rng.uniform(0.5, 3.0)))
            raw["sft_acc"].append(float(rng.uniform(0.0, 1.0)))
            records.append(
                {
                    "role": "sft",
                    "step": step,
                    "time": 1e9 + step,
                    "loss": raw["sft_loss"][-1],
                    "accuracy": raw["sft_acc"][-1],
                    "tokens": 512.0,
                    "grad_norm": 1.0,
                }
            )
    accepted = rejected = 0
    for step in range(1, STEPS + 1):
        n = int(rng.integers(4, 17))
        lens = rng.integers(3, 40, size=n)
        stale = rng.integers(0, 3, size=n)
        raw["reward"].append(float(rng.uniform(0, 1)))
        raw["lens"].append(lens)
        raw["staleness"].append(stale)
        raw["tokens_per_s"].append(float(rng.uniform(100, 1000)))
        raw["busy"].append(float(rng.uniform(0.2, 1.0)))
        raw["loss"].append(float(rng.normal()))
        raw["clip_high"].append(float(rng.uniform(0, 0.1)))
        hist = collections.Counter(int(s) for s in stale)
        records.append(
            {
                "role": "learner",
                "step": step,
                "time": 1e9 + 100 + step,
                "loss": raw["loss"][-1],
                "pg_loss": 0.5,
                "grad_norm": 1.0,
                "tokens": float(lens.sum()),
                "entropy": 2.0,
                "clip_low_frac": 0.01,
                "clip_high_frac": raw["clip_high"][-1],
                "clip_delta_frac": 0.0,
                "ratio_mean": 1.0,
                "samples": float(n + 4),
                "samples_trained": float(n),
                "groups": 4.0,
                "dropped_groups": 1.0,
                "reward_mean": raw["reward"][-1],
                "staleness_mean": float(stale.mean()),
                "staleness_max": float(stale.max()),
                "wait_s": 0.1,
                "step_s": 1.0,
                "tokens_per_s": raw["tokens_per_s"][-1],
                "busy_frac": raw["busy"][-1],
                "staleness_hist": {str(k): c for k, c in sorted(hist.items())},
                "batch_ids": [f"v{step}/b"],
            }
        )
        if "eval" in roles and (step == 1 or step % EVAL_EVERY == 0):
            raw["eval_steps"].append(step)
            raw["eval_acc"].append(float(rng.uniform(0, 1)))
            raw["eval_len"].append(float(rng.uniform(5, 30)))
            per_target = {}
            for t in TARGETS:
                raw["eval_abs_err"][t].append(float(rng.uniform(0, 12)))
                raw["eval_target_acc"][t].append(float(rng.uniform(0, 1)))
                per_target |= {
                    f"length_abs_err/{t}": raw["eval_abs_err"][t][-1],
                    f"length_mean/{t}": float(t),
                    f"accuracy/{t}": raw["eval_target_acc"][t][-1],
                }
            records.append(
                {
                    "role": "eval",
                    "step": step,
                    "time": 1e9 + 100 + step,
                    "accuracy": raw["eval_acc"][-1],
                    "n": 64,
                    "samples": 1,
                    "mean_completion_len": raw["eval_len"][-1],
                    "version": step,
                    "length_abs_err": float(np.mean([raw["eval_abs_err"][t][-1] for t in TARGETS])),
                    **per_target,
                }
            )
        if "pool" in roles and step % 3 == 0:
            accepted += int(rng.integers(0, 4))
            rejected += int(rng.integers(0, 2))
            raw["pool_steps"].append(step)
            raw["accepted"].append(accepted)
            raw["rejected"].append(rejected)
            records.append(
                {
                    "role": "pool",
                    "step": step,
                    "time": 1e9 + 100 + step,
                    "accepted_batches": accepted,
                    "rejected_batches": rejected,
                    "accepted_samples": 16 * accepted,
                    "workers": 2,
                    "validators": 1,
                }
            )
    return records, raw


def write_run(run_dir: Path, records: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def plot(run_dir: Path, capsys) -> tuple[int, str, str]:
    rc = cli.main(["plot", str(run_dir)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 10_000, f"{path}: only {len(data)} bytes"
    from PIL import Image

    with Image.open(path) as img:
        assert img.format == "PNG" and img.width >= 600 and img.height >= 400, (path, img.size)
        pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50, f"{path}: nearly blank"


def test_series_equal_the_input():
    records, raw = synthetic_run()
    series, notes = build_series(records, window=5)
    assert notes == []
    steps = np.arange(1, STEPS + 1)

    def check(name, want_steps, want_values):
        got_steps, got_values = series[name]
        np.testing.assert_array_equal(got_steps, want_steps, err_msg=name)
        np.testing.assert_allclose(got_values, want_values, rtol=1e-12, err_msg=name)

    check("reward_mean", steps, raw["reward"])
    check("reward_rolling", steps, [np.mean(raw["reward"][max(0, i - 4) : i + 1]) for i in range(STEPS)])
    check("completion_len", steps, [np.mean(lens) for lens in raw["lens"]])
    check("staleness_mean", steps, [s.mean() for s in raw["staleness"]])
    check("staleness_max", steps, [s.max() for s in raw["staleness"]])
    shares = np.array([np.bincount(s, minlength=3) / len(s) for s in raw["staleness"]])
    for k in range(3):
        check(f"staleness_hist/{k}", steps, shares[:, k])
    check("tokens_per_s", steps, raw["tokens_per_s"])
    check("busy_frac", steps, raw["busy"])
    check("loss", steps, raw["loss"])
    check("clip_high_frac", steps, raw["clip_high"])
    check("eval_accuracy", raw["eval_steps"], raw["eval_acc"])
    check("eval_completion_len", raw["eval_steps"], raw["eval_len"])
    for t in TARGETS:
        check(f"eval_length_abs_err/{t}", raw["eval_steps"], raw["eval_abs_err"][t])
        check(f"eval_accuracy/{t}", raw["eval_steps"], raw["eval_target_acc"][t])
    check("eval_length_abs_err", raw["eval_steps"], np.mean([raw["eval_abs_err"][t] for t in TARGETS], axis=0))
    check("accepted_batches", raw["pool_steps"], raw["accepted"])
    check("rejected_batches", raw["pool_steps"], raw["rejected"])
    check("sft_loss", np.arange(1, 11), raw["sft_loss"])
    check("sft_accuracy", np.arange(1, 11), raw["sft_acc"])


@pytest.mark.parametrize("window", [1, 3, 10, 100])
def test_rolling_mean_is_the_trailing_window_mean(window):
    values = np.random.default_rng(window).normal(size=37)
    want = [values[max(0, i - window + 1) : i + 1].mean() for i in range(len(values))]
    np.testing.assert_allclose(rolling_mean(values, window), want, rtol=1e-12)


def test_drawn_lines_carry_the_series():
    records, raw = synthetic_run()
    series, _ = build_series(records)
    by_name = {c.name: c for c in charts(10)}
    fig = render(by_name["reward"], series)
    mean_line = next(line for line in fig.axes[0].lines if line.get_label() == "mean per step")
    np.testing.assert_array_equal(mean_line.get_xdata(), np.arange(1, STEPS + 1))
    np.testing.assert_allclose(mean_line.get_ydata(), raw["reward"])
    fig = render(by_name["verdicts"], series)
    lines = {line.get_label(): line for line in fig.axes[0].lines}
    np.testing.assert_array_equal(lines["accepted"].get_xdata(), raw["pool_steps"])
    np.testing.assert_array_equal(lines["rejected"].get_ydata(), raw["rejected"])
    fig = render(by_name["length_targets"], series)  # a line per target, each with its own draws
    errors = {line.get_label(): line for line in fig.axes[0].lines}
    assert set(errors) == {"mean over targets"} | {f"target {t}" for t in TARGETS}
    for t in TARGETS:
        np.testing.assert_array_equal(errors[f"target {t}"].get_xdata(), raw["eval_steps"])
        np.testing.assert_allclose(errors[f"target {t}"].get_ydata(), raw["eval_abs_err"][t])
    accuracy = {line.get_label(): line for line in fig.axes[1].lines}
    np.testing.assert_allclose(accuracy["all targets"].get_ydata(), raw["eval_acc"])
    no_targets = [{k: v for k, v in r.items() if "/" not in k and k != "length_abs_err"} for r in records]
    assert render(by_name["length_targets"], build_series(no_targets)[0]) is None  # accuracy alone draws none


def test_every_chart_is_written_as_a_png(tmp_path):
    """As a user runs it: a process, paths on stdout, nothing to note on stderr."""
    records, _ = synthetic_run()
    write_run(tmp_path / "run", records)
    result = subprocess.run(
        [sys.executable, "-m", "intellect", "plot", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "intellect plot:" not in result.stderr  # no notes: every chart had its data
    paths = [Path(line) for line in result.stdout.splitlines()]
    assert {p.stem for p in paths} == ALL_CHARTS and len(paths) == len(ALL_CHARTS)
    assert all(p.parent == tmp_path / "run" / "plots" for p in paths)
    for path in paths:
        assert_png(path)


def test_learner_only_run_gives_learner_charts_and_notes_the_rest(tmp_path, capsys):
    records, _ = synthetic_run(roles=("learner",))
    write_run(tmp_path, records)
    rc, out, err = plot(tmp_path, capsys)
    assert rc == 0, err
    written = {Path(line).stem for line in out.splitlines()}
    assert written == LEARNER_CHARTS
    assert {p.stem for p in (tmp_path / "plots").iterdir()} == LEARNER_CHARTS
    for name in ALL_CHARTS - LEARNER_CHARTS:
        assert f"{name}.png skipped" in err
    assert_png(tmp_path / "plots" / "summary.png")


def test_truncated_last_line_is_skipped_with_a_note(tmp_path):
    records, raw = synthetic_run(roles=("learner",))
    path = write_run(tmp_path, records, tail='{"role": "learner", "step": 41, "loss": 0.1')
    got, notes = read_metrics(path)
    assert got == records
    assert len(notes) == 1 and f"{path}:{len(records) + 1}:" in notes[0] and "truncated" in notes[0]
    series, _ = build_series(got)
    np.testing.assert_allclose(series["reward_mean"][1], raw["reward"])


def test_a_bad_line_before_the_end_is_an_error_naming_file_and_line(tmp_path, capsys):
    records, _ = synthetic_run(roles=("learner",))
    lines = [json.dumps(r) for r in records]
    lines[2] = lines[2][:30]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rc, out, err = plot(tmp_path, capsys)
    assert rc == 2 and out == ""
    assert f"{tmp_path / 'metrics.jsonl'}:3: not a JSON line" in err and "Traceback" not in err
    assert not (tmp_path / "plots").exists()


@pytest.mark.parametrize(
    "line, message",
    [
        ('["role", "learner"]', 'expected a JSON object with a "role"'),
        ('{"step": 3, "time": 1}', 'expected a JSON object with a "role"'),
        ('{"role": "learner", "step": "3"}', '"step" must be an integer'),
    ],
)
def test_records_without_role_or_integer_step_are_errors(tmp_path, line, message):
    records, _ = synthetic_run(roles=("learner",))
    path = tmp_path / "metrics.jsonl"
    path.write_text(line + "\n" + "".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=f"{path}:1: " + message.replace("(", r"\(")):
        read_metrics(path)


def test_a_non_numeric_metric_names_the_record(tmp_path, capsys):
    records, _ = synthetic_run(roles=("learner",))
    records[4]["reward_mean"] = "high"
    write_run(tmp_path, records)
    rc, _, err = plot(tmp_path, capsys)
    assert rc == 2 and "learner record of step 5: reward_mean must be a number, got 'high'" in err


def test_missing_or_empty_metrics_file_is_a_clear_error(tmp_path, capsys):
    rc, _, err = plot(tmp_path, capsys)
    assert rc == 2 and f"{tmp_path / 'metrics.jsonl'}: no such metrics file" in err
    (tmp_path / "metrics.jsonl").write_text("\n\n")
    rc, _, err = plot(tmp_path, capsys)
    assert rc == 2 and "the metrics file is empty" in err and "Traceback" not in err


def test_a_resumed_run_plots_the_latest_record_of_a_repeated_step():
    records, raw = synthetic_run(roles=("learner",))
    stale = [dict(r, reward_mean=-1.0) for r in records[20:25]]  # steps 21..25, written before a kill -9
    series, notes = build_series(records[:20] + stale + records[20:])
    np.testing.assert_array_equal(series["reward_mean"][0], np.arange(1, STEPS + 1))
    np.testing.assert_allclose(series["reward_mean"][1], raw["reward"])
    assert notes == ["5 records repeat an earlier step (a resumed run); the latest of each is plotted"]
