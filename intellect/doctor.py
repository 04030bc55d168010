"""`intellect doctor`: which backend and devices JAX and torch will use on this machine, and whether that
matches the hardware.

JAX and torch are each imported in a child process with a time limit (`--timeout`), so a broken or hanging
install is reported (its error, or that it timed out) instead of taking the command down. An NVIDIA GPU counts
as present when `nvidia-smi -L` lists one or a /dev/nvidiaN device exists. The command warns, and exits 1,
when a GPU is present but JAX (the learner) or torch (workers, validators) would run on the CPU: the usual
cause is an install that picked the CPU build (setup.py's INTELLECT_JAX / INTELLECT_VLLM choose the build).
`--json` prints one JSON object instead of text.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

JAX_PROBE = """
import json, jax
devices = jax.devices()
print(json.dumps({"version": jax.__version__, "backend": jax.default_backend(),
                  "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]}))
"""
TORCH_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
print(json.dumps({"version": torch.__version__, "backend": "cuda" if cuda else "cpu",
                  "cuda_build": torch.version.cuda, "devices": devices}))
"""
GPU_BACKENDS = {"jax": ("gpu", "cuda", "rocm"), "torch": ("cuda",)}
INSTALL_HINT = {
    "jax": "install the CUDA jax: INTELLECT_JAX=cuda12 (or cuda13) pip install -e '.[trainer]' -c constraints.txt",
    "torch": "install a CUDA torch build (pip's default torch wheel on Linux, not the +cpu one)",
}


@dataclass
class Probe:
    """What one library reported: version, backend, devices; or the error that stopped it."""

    name: str
    version: str | None = None
    backend: str | None = None
    devices: list[str] = field(default_factory=list)
    error: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Report:
    gpus: list[str]
    probes: list[Probe]
    warnings: list[str]

    def to_json(self) -> str:
        return json.dumps(
            {"python": sys.version.split()[0], "gpus": self.gpus, **{p.name: asdict(p) for p in self.probes}}
            | {"warnings": self.warnings},
            indent=2,
        )

    def to_text(self) -> str:
        lines = [f"python  {sys.version.split()[0]} ({sys.executable})"]
        lines.append(f"gpus    {', '.join(self.gpus) if self.gpus else 'none visible'}")
        for p in self.probes:
            if p.error:
                lines.append(f"{p.name:<7} not usable: {p.error}")
            else:
                lines.append(f"{p.name:<7} {p.version}: backend {p.backend}, devices {', '.join(p.devices)}")
        lines += [f"WARNING {w}" for w in self.warnings]
        return "\n".join(lines)


def visible_gpus(timeout: float = 10.0) -> list[str]:
    """NVIDIA GPUs on this machine: `nvidia-smi -L`'s lines, else the /dev/nvidiaN device files."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=timeout)
            gpus = [line.strip() for line in out.stdout.splitlines() if line.startswith("GPU ")]
            if gpus:
                return gpus
        except (OSError, subprocess.TimeoutExpired):
            pass
    return sorted(p for p in glob.glob("/dev/nvidia*") if p.removeprefix("/dev/nvidia").isdigit())


def _start(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(name: str, proc: subprocess.Popen, timeout: float) -> Probe:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return Probe(name, error=f"importing {name} and listing its devices took over {timeout:g} s")
    if proc.returncode != 0:
        last = [line for line in err.strip().splitlines() if line.strip()]
        return Probe(name, error=f"exit {proc.returncode}: {last[-1] if last else 'no output'}")
    try:
        data = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return Probe(name, error=f"unreadable probe output: {out.strip()[-200:]!r}")
    return Probe(
        name,
        version=data.pop("version"),
        backend=data.pop("backend"),
        devices=data.pop("devices"),
        extra=data,
    )


def probe_libraries(timeout: float) -> list[Probe]:
    """JAX's and torch's backend and devices, each from its own child process (run side by side)."""
    procs = {"jax": _start(JAX_PROBE), "torch": _start(TORCH_PROBE)}
    return [_finish(name, proc, timeout) for name, proc in procs.items()]


def diagnose(gpus: list[str], probes: list[Probe]) -> Report:
    """The report, with a warning for each library that would run on the CPU although a GPU is present."""
    warnings = []
    if gpus:
        for p in probes:
            if p.error is None and p.backend not in GPU_BACKENDS[p.name]:
                warnings.append(
                    f"an NVIDIA GPU is present ({gpus[0]}) but {p.name} would run on {p.backend}: "
                    f"{INSTALL_HINT[p.name]}"
                )
    return Report(gpus, probes, warnings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds each library may take to import (default 120)"
    )


def run(args: argparse.Namespace) -> int:
    report = diagnose(visible_gpus(), probe_libraries(args.timeout))
    print(report.to_json() if args.json else report.to_text())
    return 1 if report.warnings else 0
