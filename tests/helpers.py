"""Helpers shared by the tests (tests/ is on `sys.path`, as tests/conftest.py's directory: `from helpers import`).

`OrchestratorProcess` starts `intellect orchestrator` as a child process on this machine and waits until it
answers; it runs exactly as a user starts it: `python -m intellect orchestrator`. `free_port` is the
launcher's."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from intellect.launcher import free_port

__all__ = ["OrchestratorProcess", "free_port"]


class OrchestratorProcess:
    """`intellect orchestrator [config] --orchestrator.port PORT [overrides]`, its output in `log_path`."""

    def __init__(
        self,
        log_path: str | Path,
        config: str | Path | None = None,
        overrides: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int | None = None,
    ):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(log_path)
        self.argv = [
            sys.executable,
            "-m",
            "intellect",
            "orchestrator",
            *([str(config)] if config else []),
            "--orchestrator.host",
            host,
            "--orchestrator.port",
            str(self.port),
            *overrides,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> OrchestratorProcess:
        """Start the process and return once GET /healthz answers; raises with the log if it does not."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"orchestrator exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"orchestrator did not answer on {self.url} within {timeout_s:g} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM (a clean shutdown), then SIGKILL if it has not exited within `timeout_s`."""
        if self.proc is None:
            return 0
        self.proc.terminate()
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.kill()

    def kill(self) -> int:
        """SIGKILL: no shutdown code runs."""
        if self.proc is None:
            return 0
        self.proc.kill()
        return self.proc.wait(15)

    def __enter__(self) -> OrchestratorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
