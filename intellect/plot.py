"""`intellect plot RUN_DIR`: PNG charts of a run's `metrics.jsonl`, written into `RUN_DIR/plots/`.

The roles append one JSON object a line to `RUN_DIR/metrics.jsonl`, each with "role", "step" and "time":
- "learner" (jax_trainer/learner.py, one per step): `reward_mean`, `tokens` and `samples_trained` (their ratio is
  the mean completion length of the trained samples: loss-mask tokens per sample), `staleness_mean`,
  `staleness_max`, `staleness_hist` (samples per staleness), `tokens_per_s`, `busy_frac`, `loss`, `pg_loss`
  and the clip fractions (with `loss.mismatch`, the masked fractions);
- "eval" (`intellect eval --metrics`): held-out pass@1 `accuracy` and `mean_completion_len` (with
  `format_rate`, `accuracy_in_format` and `best_constant_accuracy` where the task has a format rule); with length
  targets also `length_abs_err` and, per target T, `length_abs_err/T`, `length_mean/T` and `accuracy/T`
  (the `length_targets` chart);
- "pool" (the launcher, about every 10 s): cumulative `accepted_batches` and `rejected_batches`;
- "sft" (`intellect sft`): `loss` and token `accuracy`.

The x-axis is the learner step (the SFT chart's: the SFT step). A learner, eval or sft step recorded more than
once (a resumed run redid it) is plotted with its latest record; pool records are plotted in file order. A chart
whose data is absent is skipped with a note; `summary.png` is a grid of the main charts. A truncated last line (a
run killed mid-write) is skipped with a note; any other line that is not a JSON object with a role and an integer
step is an error that names the file and the line. `plot_run(run_dir)` does the same from Python (the launcher's
closing charts).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # name -> (steps, values)


class MetricsError(ValueError):
    """A metrics file that cannot be plotted; the message names the file and line, or the record."""


@dataclass(frozen=True)
class Line:
    series: str  # a name in the Series
    label: str  # legend text
    fmt: str = "-"  # matplotlib format: "-" a line, "o-" marked points, "o" points only
    width: float = 1.6
    alpha: float = 1.0
    color: str | None = None  # matplotlib colour (None: the next of the cycle)


@dataclass(frozen=True)
class Panel:
    ylabel: str
    lines: tuple[Line, ...] = ()
    stack: str | None = None  # stacked areas of every series named `stack + key`, in numeric key order
    each: str | None = None  # besides `lines`, a marked line for every series named `each + key` (key: a target)
    ylim: tuple[float, float] | None = None


@dataclass(frozen=True)
class Chart:
    name: str  # the file is `{name}.png`
    title: str
    panels: tuple[Panel, ...]
    missing: str  # what the note says when none of the chart's series has data
    summary: bool = True  # its first panel is one cell of summary.png
    xlabel: str = "learner step"
    requires: str | None = None  # a series without which the chart is skipped (its panels may share others)


def charts(window: int) -> tuple[Chart, ...]:
    """The charts `intellect plot` draws, in order (`window`: the steps of the reward's rolling mean)."""
    clips = tuple(
        Line(k, k.removesuffix("_frac").replace("_", " "))
        for k in (
            "clip_low_frac",
            "clip_high_frac",
            "clip_delta_frac",
            "mismatch_masked_frac",  # loss.mismatch: tokens dropped, and samples (those lines only when set)
            "mismatch_masked_sample_frac",
        )
    )
    return (
        Chart(
            "reward",
            "Reward",
            (
                Panel(
                    "reward",
                    (
                        Line("reward_mean", "mean per step", width=1.0, alpha=0.5),
                        Line("reward_rolling", f"rolling mean ({window} steps)", width=2.4),
                    ),
                ),
            ),
            "no learner reward_mean",
        ),
        Chart(
            "heldout_accuracy",
            "Held-out accuracy (pass@1)",
            (
                Panel(
                    "pass@1",
                    (
                        Line("eval_accuracy", "held-out accuracy", "o-", width=2.2),
                        Line("eval_accuracy_in_format", "among answers in the expected format", "s--"),
                        Line("eval_format_rate", "share of answers in the expected format", ":", color="0.5"),
                        Line("eval_best_constant_accuracy", "best constant answer", "--", color="C3"),
                    ),
                    ylim=(-0.02, 1.02),
                ),
            ),
            "no eval records (`intellect eval --metrics`)",
        ),
        Chart(
            "length_targets",
            "Length targets (held-out, greedy)",
            (
                Panel(
                    "mean |length - target| (tokens)",
                    (Line("eval_length_abs_err", "mean over targets", "s--", width=2.4, color="C0"),),
                    each="eval_length_abs_err/",
                ),
                Panel(
                    "pass@1",
                    (Line("eval_accuracy", "all targets", "s--", width=2.4, color="C0"),),
                    each="eval_accuracy/",
                    ylim=(-0.02, 1.02),
                ),
                Panel("mean length (tokens)", each="eval_length_mean/"),
            ),
            "no eval records with length targets (data.length_targets)",
            requires="eval_length_abs_err",
        ),
        Chart(
            "completion_length",
            "Completion length",
            (
                Panel(
                    "tokens",
                    (
                        Line("completion_len", "trained samples (mean)"),
                        Line("eval_completion_len", "held-out eval (mean)", "o-", width=2.2),
                    ),
                ),
            ),
            "no learner tokens/samples_trained nor eval mean_completion_len",
        ),
        Chart(
            "staleness",
            "Staleness (steps between a rollout's policy and the learner)",
            (
                Panel("steps behind", (Line("staleness_mean", "mean"), Line("staleness_max", "max", "--"))),
                Panel("share of samples", stack="staleness_hist/", ylim=(0.0, 1.0)),
            ),
            "no learner staleness_mean/staleness_max/staleness_hist",
        ),
        Chart(
            "throughput",
            "Learner throughput",
            (
                Panel("tokens/s", (Line("tokens_per_s", "learner tokens/s"),)),
                Panel("busy fraction", (Line("busy_frac", "learner busy fraction"),), ylim=(-0.02, 1.02)),
            ),
            "no learner tokens_per_s/busy_frac",
        ),
        Chart(
            "verdicts",
            "Validator verdicts (cumulative)",
            (Panel("rollout batches", (Line("accepted_batches", "accepted"), Line("rejected_batches", "rejected"))),),
            "no pool records (written by `intellect run`)",
        ),
        Chart(
            "loss",
            "Loss and clipping",
            (
                Panel("loss", (Line("loss", "loss"), Line("pg_loss", "policy-gradient loss", "--"))),
                Panel("fraction of tokens", clips),
            ),
            "no learner loss",
            summary=False,
        ),
        Chart(
            "sft",
            "Supervised warm start",
            (
                Panel("loss", (Line("sft_loss", "SFT loss"),)),
                Panel("token accuracy", (Line("sft_accuracy", "SFT token accuracy"),), ylim=(-0.02, 1.02)),
            ),
            "no sft records (`intellect sft`)",
            summary=False,
            xlabel="SFT step",
        ),
    )


# ---- reading ---------------------------------------------------------------------------------------------
def read_metrics(path: str | Path) -> tuple[list[dict], list[str]]:
    """The records of a metrics.jsonl and notes about what was skipped (a truncated last line)."""
    path = Path(path)
    if not path.is_file():
        raise MetricsError(f"{path}: no such metrics file (is {path.parent} a run directory?)")
    lines = path.read_bytes().split(b"\n")
    filled = [i for i, line in enumerate(lines, 1) if line.strip()]
    if not filled:
        raise MetricsError(f"{path}: the metrics file is empty (the run wrote no step yet)")
    records, notes = [], []
    for i in filled:
        try:
            record = json.loads(lines[i - 1].decode())
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            if i == filled[-1]:
                notes.append(f"{path}:{i}: skipped the truncated last line (the run stopped mid-write?)")
                continue
            raise MetricsError(f"{path}:{i}: not a JSON line ({exc}): {lines[i - 1][:80]!r}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("role"), str):
            raise MetricsError(f'{path}:{i}: expected a JSON object with a "role", got {lines[i - 1][:80]!r}')
        if not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise MetricsError(f'{path}:{i}: "step" must be an integer, got {record.get("step")!r}')
        records.append(record)
    return records, notes


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` points (fewer at the start)."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _latest_per_step(records: list[dict], role: str) -> tuple[list[dict], int]:
    by_step: dict[int, dict] = {}
    rows = [r for r in records if r["role"] == role]
    for r in rows:
        by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)], len(rows) - len(by_step)


def _number(record: dict, key: str) -> float | None:
    value = record.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MetricsError(f"{record['role']} record of step {record['step']}: {key} must be a number, got {value!r}")
    return float(value)


def _histogram(record: dict) -> dict[int, float]:
    hist = record["staleness_hist"]
    try:
        return {int(k): float(v) for k, v in hist.items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise MetricsError(
            f"learner record of step {record['step']}: staleness_hist must map staleness to a count, got {hist!r}"
        ) from exc


def _column(rows: list[dict], key: str, name: str, out: Series) -> None:
    pairs = [(r["step"], v) for r in rows if (v := _number(r, key)) is not None]
    if pairs:
        out[name] = (np.array([s for s, _ in pairs], np.int64), np.array([v for _, v in pairs], np.float64))


def build_series(records: list[dict], window: int = 10) -> tuple[Series, list[str]]:
    """Every plotted series, by name, from the records; and notes (repeated steps, unknown roles)."""
    out: Series = {}
    notes = []
    learner, repeated = _latest_per_step(records, "learner")
    for key in (
        "reward_mean",
        "staleness_mean",
        "staleness_max",
        "tokens_per_s",
        "busy_frac",
        "loss",
        "pg_loss",
        "clip_low_frac",
        "clip_high_frac",
        "clip_delta_frac",
        "mismatch_masked_frac",
        "mismatch_masked_sample_frac",
    ):
        _column(learner, key, key, out)
    if "reward_mean" in out:
        steps, reward = out["reward_mean"]
        out["reward_rolling"] = (steps, rolling_mean(reward, window))
    lens = [
        (r["step"], t / n)
        for r in learner
        if (t := _number(r, "tokens")) is not None and (n := _number(r, "samples_trained"))
    ]
    if lens:
        out["completion_len"] = (np.array([s for s, _ in lens], np.int64), np.array([v for _, v in lens]))
    hists = [(r["step"], _histogram(r)) for r in learner if r.get("staleness_hist")]
    if hists:  # the share of each staleness among a step's samples
        steps = np.array([s for s, _ in hists], np.int64)
        counts = {k: np.array([h.get(k, 0.0) for _, h in hists]) for k in sorted({k for _, h in hists for k in h})}
        total = np.maximum(np.sum(list(counts.values()), axis=0), 1e-12)
        for k, c in counts.items():
            out[f"staleness_hist/{k}"] = (steps, c / total)
    evals, repeated_evals = _latest_per_step(records, "eval")
    _column(evals, "accuracy", "eval_accuracy", out)
    _column(evals, "mean_completion_len", "eval_completion_len", out)
    _column(evals, "length_abs_err", "eval_length_abs_err", out)
    for key in ("format_rate", "accuracy_in_format", "best_constant_accuracy"):
        _column(evals, key, f"eval_{key}", out)
    per_target = {k for r in evals for k in r if k.startswith(("length_abs_err/", "length_mean/", "accuracy/"))}
    for key in sorted(per_target):
        _column(evals, key, f"eval_{key}", out)
    sft, repeated_sft = _latest_per_step(records, "sft")
    _column(sft, "loss", "sft_loss", out)
    _column(sft, "accuracy", "sft_accuracy", out)
    pool = [r for r in records if r["role"] == "pool"]
    _column(pool, "accepted_batches", "accepted_batches", out)
    _column(pool, "rejected_batches", "rejected_batches", out)
    if repeated + repeated_evals + repeated_sft:
        notes.append(
            f"{repeated + repeated_evals + repeated_sft} records repeat an earlier step (a resumed run); "
            "the latest of each is plotted"
        )
    unknown = sorted({r["role"] for r in records} - {"learner", "eval", "sft", "pool"})
    if unknown:
        notes.append(f"ignored the records of role(s) {', '.join(unknown)}")
    return out, notes


# ---- drawing ---------------------------------------------------------------------------------------------
def _panel_series(panel: Panel, series: Series) -> list[Line]:
    if panel.stack is not None:  # series built together, so they share their steps (see build_series)
        return [
            Line(name, f"{name.removeprefix(panel.stack)} behind") for name in series if name.startswith(panel.stack)
        ]
    lines = [line for line in panel.lines if line.series in series]
    if panel.each is not None:
        keys = sorted(
            (name.removeprefix(panel.each) for name in series if name.startswith(panel.each)),
            key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k),
        )
        # a target keeps its colour in every panel (C0 is left to the panel's own lines)
        lines += [Line(panel.each + k, f"target {k}", "o-", width=1.8, color=f"C{i + 1}") for i, k in enumerate(keys)]
    return lines


def draw_panel(ax, panel: Panel, series: Series, xlabel: str) -> None:
    """One panel on a matplotlib Axes: its lines, or its stacked areas, against the step."""
    present = _panel_series(panel, series)
    if panel.stack is not None:
        ax.stackplot(
            series[present[0].series][0],
            *[series[line.series][1] for line in present],
            labels=[line.label for line in present],
            alpha=0.85,
        )
    else:
        for line in present:
            steps, values = series[line.series]
            ax.plot(
                steps,
                values,
                line.fmt,
                label=line.label,
                linewidth=line.width,
                alpha=line.alpha,
                markersize=5,
                color=line.color,
            )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(panel.ylabel)
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")


def render(chart: Chart, series: Series):
    """The chart as a matplotlib Figure (Agg canvas) with its panels that have data; None when none has."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [p for p in chart.panels if _panel_series(p, series)]
    if not panels or (chart.requires is not None and chart.requires not in series):
        return None
    fig = Figure(figsize=(8, 3.2 + 2.6 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        draw_panel(ax, panel, series, chart.xlabel if ax is axes[-1] else "")  # shared step axis: labelled once
    fig.suptitle(chart.title)
    return fig


def render_summary(chart_list: tuple[Chart, ...], series: Series):
    """A grid of the first panel (with data) of each summary chart; None when no summary chart has data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cells = [
        (c, p)
        for c in chart_list
        if c.summary and (c.requires is None or c.requires in series)
        for p in [next((p for p in c.panels if _panel_series(p, series)), None)]
        if p is not None
    ]
    if not cells:
        return None
    cols = min(3, len(cells))
    rows = math.ceil(len(cells) / cols)
    fig = Figure(figsize=(5.2 * cols, 3.8 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (chart, panel) in zip(axes, cells):
        draw_panel(ax, panel, series, chart.xlabel)
        ax.set_title(chart.title, fontsize="medium")
    for ax in axes[len(cells) :]:
        ax.set_visible(False)
    return fig


def write_plots(series: Series, out_dir: str | Path, window: int = 10) -> tuple[list[Path], list[str]]:
    """Write every chart with data (and summary.png) into `out_dir`; returns their paths and skip notes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    chart_list = charts(window)
    paths, notes = [], []
    for chart in chart_list:
        fig = render(chart, series)
        if fig is None:
            notes.append(f"{chart.name}.png skipped: {chart.missing}")
            continue
        paths.append(out_dir / f"{chart.name}.png")
        fig.savefig(paths[-1])
    fig = render_summary(chart_list, series)
    if fig is None:
        notes.append("summary.png skipped: none of its charts has data")
    else:
        paths.append(out_dir / "summary.png")
        fig.savefig(paths[-1])
    return paths, notes


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, window: int = 10) -> tuple[list[Path], list[str]]:
    """Charts of `run_dir/metrics.jsonl` into `out_dir` (default `run_dir/plots`): the PNG paths written, and notes
    on what was skipped. Raises MetricsError when the metrics file cannot be plotted."""
    run_dir = Path(run_dir)
    records, notes = read_metrics(run_dir / "metrics.jsonl")
    series, more = build_series(records, window)
    paths, skipped = write_plots(series, out_dir or run_dir / "plots", window)
    return paths, notes + more + skipped


# ---- command ---------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="the run directory (holds metrics.jsonl)")
    p.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RUN_DIR/plots)")
    p.add_argument("--window", type=int, default=10, help="steps in the reward's rolling mean")


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        print(f"intellect plot: --window must be at least 1, got {args.window}", file=sys.stderr)
        return 2
    try:
        paths, notes = plot_run(args.run_dir, args.out, args.window)
    except MetricsError as exc:
        print(f"intellect plot: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"intellect plot: {note}", file=sys.stderr)
    for path in paths:
        print(path)
    return 0
