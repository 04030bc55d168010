"""`intellect calibrate CONFIG [--model DIR] [--out FILE]`: measure a bfloat16/float16 replay pool's model and
write its validator tolerances and near-tie ledger as a recipe fragment.

The pool's engines run on the model as the pool will run them (`gpu_workers.calibrate.measure`: the workers'
dtype, the validator's prefill, the pool's temperature, top-p, task prompts and batch shape), and the settings
that hold what honest workers did come out: `[validator] replay_logit_tolerance`, `tie_logit_tolerance`,
`max_logprob_diff`, the near-tie budgets and the mean logprob bounds, `[orchestrator] near_tie_rate`,
`near_tie_slack`, recorded with the model's digest (`bridge.weights.model_digest`) and the workers' dtype
(`[validator] calibrated_model`, `calibrated_dtype`).
The recipe includes the file (`include = ["FILE"]` at its top); a bfloat16/float16 replay pool's validators
refuse to start without it (`gpu_workers.calibration.calibration_problem`). The figures are printed, and with
`--json` the whole report as one JSON line.

Run it on the model RL starts from (model.path, or the warm start's export), on the workers' kind of hardware,
and again when the model changes much: docs/verifiable-sampling.md ("Calibrating a pool") says how often.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import textwrap
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="the pool's recipe ([data], [worker], ...)")
    p.add_argument("--model", type=Path, default=None, help="the policy to measure (default: model.path)")
    p.add_argument("--out", type=Path, default=None, help="the fragment to write (default: <run.dir>/calibration.toml)")
    p.add_argument("--samples", type=int, default=256, help="completions whose competing spreads are measured")
    p.add_argument("--tie-samples", type=int, default=2048, help="replayable completions whose near ties count")
    p.add_argument("--batch", type=int, default=64, help="completions generated together for the spreads")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the pool's completion cap, at most 256")
    p.add_argument("--logprobs", type=int, default=20, help="top logprobs the worker lists per position")
    p.add_argument("--safety", type=float, default=2.0, help="room of the tolerances over what honest workers did")
    p.add_argument(
        "--tie-quantile", type=float, default=0.9, help="quantile of honest near-tie gaps the tie margin holds"
    )
    p.add_argument("--rate-safety", type=float, default=2.0, help="near_tie_rate over the honest cost per token")
    p.add_argument("--json", action="store_true", help="print the whole report as one JSON line on stdout")


def fragment(cal, digest: str, command: str) -> str:
    """The recipe fragment of a calibration (`gpu_workers.calibrate.Calibration`) of the model `digest`."""
    from gpu_workers.calibration import freedom_warning

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    settings = cal.settings()
    free, warning = cal.near_tie_freedom, freedom_warning(cal.near_tie_freedom, cal.worker_dtype)
    lines = [
        f"# {command}",
        f"# {when}: {cal.model}, {cal.worker_dtype} worker and {cal.validator_dtype} validator, T {cal.temperature:g}, "
        f"top-p {cal.top_p:g}",
        f"# competing spreads over {cal.positions} positions of {cal.samples} completions: p99 "
        f"{cal.spread_quantiles['0.99']}, max {cal.spread_max}; honest near ties {cal.honest_near_ties} in "
        f"{cal.tie_tokens} tokens, gaps' {cal.tie_quantile:g} quantile {cal.honest_gap_held}, max "
        f"{cal.honest_gap_quantiles['1.0']}",
        f"# honest near-tie cost {cal.honest_near_tie_cost_per_token} per token x {cal.rate_safety:g} = "
        f"near_tie_rate; costliest honest batch {cal.honest_batch_cost_max} x {cal.rate_safety:g} (at least 2) = "
        "near_tie_slack",
        f"# largest honest |stored - recomputed| logprob {cal.honest_logprob_diff_max} x {cal.safety:g} = "
        "max_logprob_diff; mean |difference| "
        f"{cal.honest_logprob_abs_mean} and |mean difference| {cal.honest_logprob_bias} x {cal.safety:g} (at least "
        "the defaults) = mean_logprob_diff and mean_signed_logprob_diff;",
        f"# largest need of a sample beyond them {cal.honest_logprob_sample_excess_max} x {cal.safety:g} (at least "
        "0.1) = logprob_diff_allowance",
        f"# near-tie freedom: the ledger leaves a worker {free['cost']} cost per sample of "
        f"{cal.mean_completion_tokens} tokens beyond its rounding, {free['choices_low']}-{free['choices_high']} "
        "near-tie choices it may make unseen (none of which trains: the learner leaves out the samples with a near "
        f"tie, {cal.honest_near_tie_sample_share:.1%} of honest ones here)",
        *(f"# WARNING: {line}" for line in textwrap.wrap(warning or "", 106)),
        '# A recipe takes it with include = ["THIS FILE"] at its top; validators check calibrated_model against',
        "# the digest of model.path (bridge.weights.model_digest).",
        "",
        "[validator]",
        f'calibrated_model = "{digest}"',
        f'calibrated_dtype = "{cal.worker_dtype}"',
        *(f"{key} = {value}" for key, value in settings["validator"].items()),
        "",
        "[orchestrator]",
        *(f"{key} = {value}" for key, value in settings["orchestrator"].items()),
    ]
    return "\n".join(lines) + "\n"


class _Bar:
    """A rich progress bar on stderr (where stderr is not a terminal, a line per tenth of each phase); the callback
    for `measure`'s `progress`."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.bar = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        self.tasks: dict[str, int] = {}
        self.printed: dict[str, int] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(phase, total=total)
        self.bar.update(self.tasks[phase], completed=done)
        tenth = 10 * done // max(total, 1)
        if not self.console.is_terminal and self.printed.get(phase, -1) < tenth:
            self.printed[phase] = tenth
            print(f"calibrate: {phase}: {done} of {total} completions", file=sys.stderr, flush=True)

    def __enter__(self) -> _Bar:
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()


def _print_table(cal, out: Path, console) -> None:
    from rich.table import Table

    table = Table(title=f"calibration of {cal.model} ({cal.seconds:.0f} s)")
    table.add_column("measured")
    table.add_column("honest workers", justify="right")
    table.add_column("setting")
    table.add_column("value", justify="right")
    settings = {**cal.settings()["validator"], **cal.settings()["orchestrator"]}
    widest = max(cal.spread_max, cal.honest_gap_quantiles["1.0"])
    rows = [
        ("largest spread or near-tie gap (logits)", widest, "replay_logit_tolerance"),
        (f"near-tie gap, {cal.tie_quantile:g} quantile", cal.honest_gap_held, "tie_logit_tolerance"),
        ("largest |stored - recomputed| logprob", cal.honest_logprob_diff_max, "max_logprob_diff"),
        ("near-tie cost per token", cal.honest_near_tie_cost_per_token, "near_tie_rate"),
        ("costliest honest batch", cal.honest_batch_cost_max, "near_tie_slack"),
        ("near-tie cost beyond 1 per token of a sample", cal.honest_sample_excess_per_token_max, "near_ties_per_token"),
        ("near-tie cost per token of a batch", cal.honest_batch_cost_per_token_max, "near_ties_per_batch_token"),
        ("mean |stored - recomputed| logprob", cal.honest_logprob_abs_mean, "mean_logprob_diff"),
        ("|mean stored - recomputed| logprob", cal.honest_logprob_bias, "mean_signed_logprob_diff"),
        ("a sample's logprob need beyond those", cal.honest_logprob_sample_excess_max, "logprob_diff_allowance"),
    ]
    for label, measured, key in rows:
        table.add_row(label, str(measured), key, str(settings[key]))
    table.add_row("honest near ties", f"{cal.honest_near_ties} in {cal.tie_tokens} tokens", "", "")
    table.add_row("honest samples with a near tie (not trained)", f"{cal.honest_near_tie_sample_share:.1%}", "", "")
    free = cal.near_tie_freedom
    table.add_row(
        "near-tie choices a worker may make unseen, per sample",
        f"{free['choices_low']}-{free['choices_high']}",
        "",
        "",
    )
    console.print(table)
    console.print(f'written: {out} (include it in the pool\'s recipe: include = ["{out}"])')


def measure_pool(cfg, model: Path, args: argparse.Namespace, progress=None):
    """The calibration's measurement (`gpu_workers.calibrate.measure`) on the pool's training prompts, at its
    temperature, top-p, dtypes and batch shape; `args` holds the measurement's options (samples, tie_samples,
    batch, max_tokens, logprobs, safety, tie_quantile, rate_safety), as `intellect calibrate` and
    benchmarks/replay_margin.py parse them."""
    import numpy as np
    from transformers import AutoTokenizer

    from gpu_workers.calibrate import measure
    from gpu_workers.config import completion_cap
    from gpu_workers.tasks import prompt_tokens
    from intellect.tasks_setup import training_tasks

    tie_samples = args.samples if args.tie_samples is None else args.tie_samples
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tasks = training_tasks(cfg.data)
    picks = np.random.default_rng(0).integers(0, len(tasks), max(args.samples, tie_samples))
    prompts = [prompt_tokens(tasks[int(i)], tokenizer, 0, cfg.data.system_prompt) for i in picks]
    group = cfg.data.samples_per_prompt
    return measure(
        model,
        prompts,
        worker_dtype=cfg.worker.dtype,
        validator_dtype=cfg.validator.dtype,
        temperature=cfg.worker.temperature,
        top_p=cfg.worker.top_p,
        group=group,
        per_batch=cfg.orchestrator.prompts_per_assignment * group,
        max_tokens=args.max_tokens or min(completion_cap(cfg.worker, cfg.data), 256),
        samples=args.samples,
        tie_samples=tie_samples,
        batch=args.batch,
        logprobs=args.logprobs,
        safety=args.safety,
        tie_quantile=args.tie_quantile,
        rate_safety=args.rate_safety,
        progress=progress,
    )


def run(args: argparse.Namespace) -> int:
    from bridge.weights import WeightsError, model_digest
    from gpu_workers.calibration import freedom_warning, needs_calibration
    from intellect.cli import config_from_args
    from intellect.config import ConfigError

    cfg = config_from_args(args)
    model = args.model or Path(cfg.model.path)
    try:
        digest = model_digest(model)
    except (OSError, WeightsError) as err:
        raise ConfigError(f"intellect calibrate: {err}") from None
    out = args.out or Path(cfg.run.dir) / "calibration.toml"
    if not needs_calibration(cfg.worker):
        print(
            f"intellect calibrate: a {cfg.worker.dtype} pool with the {cfg.worker.sampler} sampler needs no "
            "calibration (its validators start without one); measuring anyway",
            file=sys.stderr,
        )
    with _Bar() as bar:
        cal = measure_pool(cfg, model, args, progress=bar)
    command = " ".join(map(str, ["intellect calibrate", args.config or "", "--model", model, *args.overrides]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(fragment(cal, digest, command))
    _print_table(cal, out, bar.console)
    warning = freedom_warning(cal.near_tie_freedom, cal.worker_dtype)
    if warning:
        bar.console.print(f"[bold yellow]warning:[/] {warning}")
    if args.json:
        print(json.dumps({**cal.report(), "calibrated_model": digest, "out": str(out)}))
    return 0
