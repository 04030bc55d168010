"""`intellect run CONFIG [--resume] [--section.key value ...]`: the whole system on this machine.

See `intellect.launcher` for what runs and how. On a terminal a live table shows the step, the policy
version, the reward, held-out accuracy, accepted and rejected batches, staleness, the learner's tokens/s and
busy fraction, and each role's state; elsewhere the same is printed as a line every 15 s. The run ends with a
JSON summary (accuracy by step, wall-clock, final policy directory, plot paths) on stdout.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")
    p.add_argument("--resume", action="store_true", help="continue the run in run.dir from its last checkpoint")


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class View:
    """A rich Live table on a terminal, a status line every 15 s elsewhere."""

    def __init__(self, console, live: bool):
        self.console, self.live_mode = console, live
        self.live = None
        self.last_line = 0.0

    def __enter__(self):
        if self.live_mode:
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=2)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, st: dict) -> None:
        acc = (
            "-"
            if st["accuracy"] is None
            else f"{st['accuracy']:.1%} (step {st['accuracy_step']}; start {st['first_accuracy']:.1%})"
        )
        if st.get("best_constant") is not None:
            acc += f"; best constant answer {st['best_constant']:.1%}"
        if st.get("format_rate") is not None:
            acc += f"; {st['format_rate']:.0%} in format"
        rows = [
            ("step", f"{st['step']} / {st['steps']}"),
            ("policy version", _fmt(st["version"], "")),
            ("reward (mean)", _fmt(st["reward"])),
            ("held-out accuracy", acc),
            ("batches accepted / rejected", f"{st['accepted']} / {st['rejected']}"),
            ("staleness (mean)", _fmt(st["staleness"], ".2f")),
            ("learner tokens/s", _fmt(st["tokens_per_s"], ".0f")),
            ("learner busy", _fmt(st["busy"], ".0%")),
            ("roles", " ".join(f"{n}:{s}" for n, s in st["roles"].items())),
        ]
        if self.live is not None:
            from rich.table import Table

            table = Table(title="intellect run", show_header=False)
            for k, v in rows:
                table.add_row(k, v)
            self.live.update(table)
        elif time.monotonic() - self.last_line >= 15:
            self.last_line = time.monotonic()
            print(" | ".join(f"{k} {v}" for k, v in rows[:-1]), flush=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from intellect.cli import config_from_args
    from intellect.launcher import Launcher, RoleFailed

    cfg = config_from_args(args)

    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # stop every role on SIGTERM as on Ctrl-C
    console = Console(stderr=True)
    launcher = Launcher(cfg, args.config, args.overrides, resume=args.resume, console=console)
    try:
        summary = launcher.run(View(console, console.is_terminal))
    except RoleFailed as err:
        console.print(f"[red]intellect run: {err}[/]")
        return 1
    except KeyboardInterrupt:
        console.print("intellect run: interrupted; every role stopped (continue with --resume)")
        return 130
    print(json.dumps(summary))
    for path in summary["plots"]:
        console.print(f"plot: {path}")
    return 0
