"""The learner's step across 2 processes on 127.0.0.1 (4 fake CPU devices each) equals 1 process with 8."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import free_port

SCRIPT = Path(__file__).with_name("multihost_step.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(pid: int, nproc: int, port: int, devices: int) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(pid), str(nproc), str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_match_one():
    single = _result(_launch(0, 1, 0, 8))
    port = free_port()
    procs = [_launch(pid, 2, port, 4) for pid in range(2)]
    multi = [_result(p) for p in procs]
    assert single["devices"] == 8 and all(r["devices"] == 8 and r["processes"] == 2 for r in multi)
    for r in multi:
        for a, b in zip(r["losses"], single["losses"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (r["losses"], single["losses"])
