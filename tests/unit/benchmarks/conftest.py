"""Running a script of benchmarks/ the way a user runs it: its own process, from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def run_benchmark():
    """`run_benchmark(script, args, env=None, timeout=300)`: benchmarks/<script> with `args` and this process's
    environment plus `env` (PYTHONPATH set to the repository; a value of None removes the variable); asserts
    that it exited 0, showing its stderr if not, and returns the completed process."""

    def run(script: str, args: list[str], env: dict[str, str | None] | None = None, timeout: int = 300):
        full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        full = {k: v for k, v in full.items() if v is not None}
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    return run
