"""`intellect doctor` and setup.py's choice of the jax build (INTELLECT_JAX, the NVIDIA driver)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from intellect import cli, doctor

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module: its functions and lists, without running `setup()` (that only runs as __main__)."""
    spec = importlib.util.spec_from_file_location("intellect_setup_py", REPO / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- setup.py ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["cpu", "cuda12", "cuda13", "tpu"])
def test_intellect_jax_overrides_the_guess(setup_py, variant):
    assert setup_py.jax_variant({"INTELLECT_JAX": variant.upper()}, driver=590) == variant
    assert setup_py.jax_variant({"INTELLECT_JAX": variant}, driver=None) == variant


def test_the_guess_follows_the_nvidia_driver(setup_py):
    assert setup_py.jax_variant({}, driver=None) == "cpu"
    assert setup_py.jax_variant({}, driver=535) == "cuda12"  # CUDA 13 wheels need driver 580
    assert setup_py.jax_variant({}, driver=580) == "cuda13"


def test_an_unknown_variant_is_refused(setup_py):
    with pytest.raises(ValueError, match="INTELLECT_JAX='cuda11': choose one of cpu, cuda12, cuda13, tpu"):
        setup_py.jax_variant({"INTELLECT_JAX": "cuda11"})


def test_the_requirement_carries_the_variant_extra(setup_py):
    assert setup_py.jax_requirement("jax==1.2.3", "cpu") == "jax==1.2.3"
    assert setup_py.jax_requirement("jax==1.2.3", "cuda12") == "jax[cuda12]==1.2.3"
    assert setup_py.jax_requirement("jax==1.2.3", "tpu") == "jax[tpu]==1.2.3"


@pytest.mark.parametrize(
    "text,major",
    [
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\nGCC 12", 550),
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder)", 580),
        ("something else", None),
    ],
)
def test_driver_version_is_read_from_proc(setup_py, tmp_path, text, major):
    version = tmp_path / "version"
    version.write_text(text)
    assert setup_py.nvidia_driver_major(str(version)) == major
    assert setup_py.nvidia_driver_major(str(tmp_path / "missing")) is None


def test_this_cpu_machine_installs_the_pinned_cpu_jax(setup_py):
    if os.path.exists(setup_py.NVIDIA_DRIVER) or os.environ.get("INTELLECT_JAX"):
        pytest.skip("this machine has an NVIDIA driver or sets INTELLECT_JAX")
    pins = [line.strip() for line in (REPO / "constraints.txt").read_text().splitlines() if line.startswith("jax==")]
    assert pins and pins[0] in setup_py.TRAINER


# ---- intellect doctor ----------------------------------------------------------------------------------------
def test_doctor_reports_what_this_process_sees(capsys):
    import jax

    assert cli.main(["doctor", "--json", "--timeout", "300"]) == (1 if doctor.visible_gpus() else 0)
    report = json.loads(capsys.readouterr().out)
    assert report["jax"]["error"] is None and report["torch"]["error"] is None, report
    assert report["jax"]["version"] == jax.__version__ and report["jax"]["backend"] == jax.default_backend()
    assert len(report["jax"]["devices"]) == len(jax.devices())  # the child inherits XLA_FLAGS
    assert report["torch"]["version"] == importlib.metadata.version("torch")  # torch itself: not imported here
    if not report["gpus"]:
        assert report["torch"]["backend"] == "cpu"
    if not report["gpus"]:
        assert report["warnings"] == []


def test_doctor_warns_when_a_gpu_is_present_but_jax_runs_on_cpu(monkeypatch, capsys):
    monkeypatch.setattr(doctor, "visible_gpus", lambda: ["GPU 0: NVIDIA H200 (UUID: GPU-0)"])
    probes = [
        doctor.Probe("jax", "0.10.2", "cpu", ["cpu:0 cpu"]),
        doctor.Probe("torch", "2.11.0", "cuda", ["NVIDIA H200"]),
    ]
    monkeypatch.setattr(doctor, "probe_libraries", lambda timeout: probes)
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, out  # torch is on the GPU: no warning for it
    assert "GPU 0: NVIDIA H200" in warnings[0] and "jax would run on cpu" in warnings[0]
    assert "INTELLECT_JAX=cuda12" in warnings[0]


def test_a_broken_or_hanging_import_is_reported_not_fatal():
    broken = doctor._finish("jax", doctor._start("import jax_is_not_installed_here"), timeout=60)
    assert broken.backend is None and "ModuleNotFoundError" in broken.error
    hanging = doctor._finish("torch", doctor._start("import time; time.sleep(60)"), timeout=0.5)
    assert hanging.error == "importing torch and listing its devices took over 0.5 s"
    report = doctor.diagnose(["GPU 0: x"], [broken, hanging])
    assert report.warnings == [] and "not usable" in report.to_text()


def test_gpus_come_from_nvidia_smi_or_the_device_files(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\nprint('GPU 0: NVIDIA H200 (UUID: GPU-1)')\nprint('GPU 1: NVIDIA H200')\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert doctor.visible_gpus() == ["GPU 0: NVIDIA H200 (UUID: GPU-1)", "GPU 1: NVIDIA H200"]

    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    devices = ["/dev/nvidiactl", "/dev/nvidia1", "/dev/nvidia-uvm", "/dev/nvidia0"]
    monkeypatch.setattr(doctor.glob, "glob", lambda pattern: devices)
    assert doctor.visible_gpus() == ["/dev/nvidia0", "/dev/nvidia1"]
