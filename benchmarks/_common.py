"""Helpers shared by the benchmarks (each is run as a script, so benchmarks/ is on `sys.path`:
`from _common import ...`).

`OrchestratorProcess` starts `intellect orchestrator` as a child process on this machine, exactly as a user
starts it, and waits until it answers. `free_port` is the launcher's. `peaked_copy` makes a peaked policy from a
model directory.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from intellect.launcher import free_port

__all__ = ["OrchestratorProcess", "free_port", "peaked_copy"]


def peaked_copy(model: Path, out: Path, scale: float) -> Path:
    """A copy of the HF model directory `model` at `out` whose final norm is scaled by `scale` (every logit scales
    with it: a peaked policy for scale > 1)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        save_file({k: v * scale if k == "model.norm.weight" else v for k, v in tensors.items()}, str(f))
    return out


class OrchestratorProcess:
    """`intellect orchestrator CONFIG --orchestrator.port PORT` on 127.0.0.1, its output in `log_path`; a context
    manager that starts it, waits for GET /healthz, and stops it (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, log_path: Path, config: Path, host: str = "127.0.0.1"):
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.log_path = log_path
        self.argv = [
            sys.executable,
            "-m",
            "intellect",
            "orchestrator",
            str(config),
            "--orchestrator.host",
            host,
            "--orchestrator.port",
            str(self.port),
        ]
        self.proc: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self, timeout_s: float = 60.0) -> OrchestratorProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.__exit__()
        raise RuntimeError(f"orchestrator did not answer on {self.url}:\n{self.log()}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
