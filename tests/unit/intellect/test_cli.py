"""The `intellect` command line: the command list, `config show`, lazy command modules."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from intellect import cli
from intellect.config_io import load_config

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.toml"
ALL_COMMANDS = [
    "run",
    "train",
    "worker",
    "validator",
    "orchestrator",
    "calibrate",
    "shardcast",
    "export",
    "import",
    "import-gguf",
    "eval",
    "sft",
    "plot",
    "config",
    "make-tiny-model",
    "parity",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The commands read os.environ: keep the tester's INTELLECT_* variables out."""
    for name in list(os.environ):
        if name.upper().startswith("INTELLECT_"):
            monkeypatch.delenv(name)


def intellect(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("INTELLECT_")}
    return subprocess.run(
        [sys.executable, "-m", "intellect", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_help_lists_every_command():
    result = intellect("--help")
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("    ") and line.split()}
    assert set(ALL_COMMANDS) <= listed


def test_console_script_help():
    script = Path(sys.executable).parent / "intellect"
    if not script.exists():
        pytest.skip("the package is not installed as a console script in this environment")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and all(name in result.stdout for name in ALL_COMMANDS)


def test_help_imports_no_heavy_framework():
    code = (
        "import sys; from intellect.cli import main; rc = main(['--help']); "
        "heavy = [m for m in ('jax', 'torch', 'vllm', 'transformers', 'pydantic') if m in sys.modules]; "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "HEAVY []" in result.stdout


def test_config_show_round_trips(tmp_path, capsys):
    flags = ["--optim.lr", "1e-6", "--run.name=shown"]
    assert cli.main(["config", "show", str(DEMO), *flags]) == 0
    text = capsys.readouterr().out
    parsed = tomllib.loads(text)
    assert parsed["optim"]["lr"] == 1e-6 and parsed["run"]["name"] == "shown"
    assert parsed["model"]["path"] == "runs/demo/tiny-model"  # as demo.toml states it
    path = tmp_path / "shown.toml"
    path.write_text(text)
    assert load_config(path, env={}) == load_config(DEMO, flags, env={})


def test_config_show_without_config_prints_defaults(capsys):
    assert cli.main(["config", "show"]) == 0
    parsed = tomllib.loads(capsys.readouterr().out)
    assert parsed["optim"]["lr"] == 3e-7 and parsed["loss"]["delta"] == 4.0
    assert parsed["data"]["samples_per_prompt"] == 16


def test_config_show_applies_env_below_flags(monkeypatch, capsys):
    monkeypatch.setenv("INTELLECT_OPTIM__LR", "2e-6")
    monkeypatch.setenv("INTELLECT_RUN__NAME", "from-env")
    assert cli.main(["config", "show", "--optim.lr", "3e-6"]) == 0
    parsed = tomllib.loads(capsys.readouterr().out)
    assert parsed["optim"]["lr"] == 3e-6 and parsed["run"]["name"] == "from-env"


def test_config_error_exits_2_without_traceback():
    result = intellect("config", "show", "configs/demo.toml", "--optimm.lr", "1")
    assert result.returncode == 2
    assert "optimm" in result.stderr and "--optim.lr" in result.stderr and "Traceback" not in result.stderr


def test_broken_command_module_is_listed_and_reports_its_import_error(monkeypatch, capsys):
    broken = cli.Command("broken", "a command whose module cannot be imported", module="intellect._no_such_module")
    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, broken))
    monkeypatch.setitem(cli._BY_NAME, "broken", broken)
    assert cli.main(["--help"]) == 0
    assert "broken" in capsys.readouterr().out
    assert cli.main(["broken", "--anything"]) == 1
    err = capsys.readouterr().err
    assert "intellect._no_such_module" in err and "ModuleNotFoundError" in err


def test_split_overrides():
    argv = ["config", "show", "a.toml", "--optim.lr", "1e-6", "--run.name=x", "--loss.delta", "-3", "--", "--b.c"]
    rest, overrides = cli.split_overrides(argv)
    assert rest == ["config", "show", "a.toml", "--", "--b.c"]
    assert overrides == ["--optim.lr", "1e-6", "--run.name=x", "--loss.delta", "-3"]


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_threads_bound_torch_in_a_fresh_process(threads):
    """`[worker]`/`[validator]` cpu_threads: torch, imported after the setting, computes on that many threads
    (OpenMP reads OMP_NUM_THREADS once, at torch's import); 0 leaves the environment as it was."""
    code = (
        "import os\n"
        "from intellect.worker_cli import limit_cpu_threads\n"
        f"limit_cpu_threads({threads}); limit_cpu_threads(0)\n"
        "import torch\n"
        "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])\n"
    )
    # a minimal environment: nothing an earlier test or library left in this process's environment
    env = {k: os.environ[k] for k in ("PATH", "HOME", "PYTHONPATH", "VIRTUAL_ENV") if k in os.environ}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(threads), str(threads)]
