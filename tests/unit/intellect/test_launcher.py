"""The launcher's supervision of its roles, with small real processes standing in for the roles: a role that
exits is named with the end of its log and stops the run, or is restarted when configured; stopping leaves no
process behind; a child dies with the launcher (PR_SET_PDEATHSIG)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from intellect.config_io import load_config
from intellect.launcher import Launcher, Role, RoleFailed, gain_summary


class NoView:
    def update(self, status):
        self.last = status


def launcher(tmp_path, **overrides):
    flags = [f"--run.dir={tmp_path / 'run'}", *(f"--{k}={v}" for k, v in overrides.items())]
    la = Launcher(load_config(None, flags, env={}), None, [], console=None)
    la.orch_url = "http://127.0.0.1:9"  # nothing listens: the status view must cope
    return la


def role(tmp_path, name, code):
    return Role(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_a_dying_role_is_named_with_its_log_and_stops_the_run(tmp_path):
    la = launcher(tmp_path)
    la.roles = {
        "learner": role(tmp_path, "learner", "import time; time.sleep(60)"),
        "worker0": role(tmp_path, "worker0", "print('cuda out of memory, giving up'); raise SystemExit(7)"),
    }
    for r in la.roles.values():
        r.start()
    try:
        with pytest.raises(RoleFailed) as err:
            la.supervise(NoView())
        assert "worker0 exited with 7" in str(err.value) and "cuda out of memory" in str(err.value)
    finally:
        la.stop_all()
    assert all(not r.alive() for r in la.roles.values())


def test_restart_failed_starts_the_role_again_and_the_run_ends_with_the_learner(tmp_path):
    la = launcher(tmp_path, **{"run.restart_failed": "true"})
    la.roles = {
        "learner": role(tmp_path, "learner", "import time; time.sleep(4)"),
        "validator0": role(tmp_path, "validator0", "raise SystemExit(1)"),
    }
    for r in la.roles.values():
        r.start()
    la.supervise(NoView())
    la.stop_all()
    assert la.roles["validator0"].restarts >= 1
    assert la.roles["learner"].proc.returncode == 0


def test_children_die_with_the_launcher(tmp_path):
    code = (
        "import sys, time; sys.path.insert(0, %r); from intellect.launcher import Role; "
        "r = Role('child', [sys.executable, '-c', 'import time; time.sleep(120)'], __import__('pathlib').Path(%r)); "
        "r.start(); print(r.proc.pid, flush=True); time.sleep(120)"
    ) % (os.getcwd(), str(tmp_path / "child.log"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail("the child outlived its launcher")


def test_run_refuses_a_bfloat16_replay_pool_without_a_calibration_of_its_base_model(tmp_path, tiny_model):
    """`intellect run` of a bfloat16 replay pool stops before it starts anything, naming the model RL starts from
    (the warm start's export, when there is one) and the command to run; a float32 pool, or one that allows it,
    goes on."""
    from bridge.weights import model_digest

    model = tiny_model()
    pool = {"model.path": model, "worker.dtype": "bfloat16", "validator.dtype": "bfloat16"}
    la = launcher(tmp_path, **pool, **{"run.sft_steps": 5})
    with pytest.raises(RoleFailed, match="intellect calibrate") as err:
        la.check_calibration()
    assert f"--model {la.sft_dir}" in str(err.value)  # the warm start's export is the pool's base model
    launcher(tmp_path, **{**pool, "worker.dtype": "float32", "validator.dtype": "float32"}).check_calibration()
    launcher(tmp_path, **pool, **{"validator.allow_uncalibrated": "true"}).check_calibration()
    calibrated = {
        **pool,
        "validator.calibrated_model": model_digest(model),
        "validator.calibrated_dtype": "bfloat16",
        "orchestrator.near_tie_rate": 0.002,
    }
    launcher(tmp_path, **calibrated).check_calibration()
    with pytest.raises(RoleFailed, match="near_tie_rate"):  # the ledger left out of the recipe
        launcher(tmp_path, **{**calibrated, "orchestrator.near_tie_rate": "none"}).check_calibration()


def test_workers_get_no_store_credentials_or_pool_secrets(monkeypatch, tmp_path):
    """Workers upload their batches: the launcher's worker processes inherit none of the store's credentials
    (nor the admin token) that the trusted roles read the store and the orchestrator with."""
    from intellect.launcher import WORKER_WITHHELD_ENV, Role

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.setenv(name, "secret")
    monkeypatch.setenv("PATH_FOR_TEST", "kept")
    trusted = Role("validator0", [], tmp_path / "v.log", {"INTELLECT_ORCHESTRATOR__ADMIN_TOKEN": "tok"})
    worker = Role("worker0", [], tmp_path / "w.log", withheld=WORKER_WITHHELD_ENV)
    assert trusted.environment()["AWS_SECRET_ACCESS_KEY"] == "secret"
    env = worker.environment()
    assert env["PATH_FOR_TEST"] == "kept"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS"} & set(env)
    assert "INTELLECT_ORCHESTRATOR__ADMIN_TOKEN" not in env


def test_a_runs_gain_is_counted_above_the_better_of_its_start_and_the_best_constant_answer():
    def record(step, acc, fmt):
        return {
            "role": "eval",
            "step": step,
            "accuracy": acc,
            "format_rate": fmt,
            "accuracy_in_format": acc / fmt,
            "best_constant_accuracy": 0.68,
            "best_constant_answer": "Yes",
        }

    # a policy that learned the constant: 9% -> 68% held-out is no gain over answering "Yes" to everything
    constant = gain_summary([record(0, 0.09, 0.2), record(10, 0.5, 0.9), record(20, 0.68, 1.0)])
    assert constant["gain"] == pytest.approx(0.0) and constant["best_constant_answer"] == "Yes"
    assert constant["format_rate"] == {0: 0.2, 10: 0.9, 20: 1.0}
    learned = gain_summary([record(0, 0.70, 1.0), record(20, 0.85, 1.0)])  # the start beats the constant
    assert learned["gain"] == pytest.approx(0.15)
    no_rule = gain_summary([{"role": "eval", "step": 0, "accuracy": 0.1}, {"role": "eval", "step": 5, "accuracy": 0.4}])
    assert no_rule["gain"] is None and no_rule["best_constant_accuracy"] is None
    assert gain_summary([])["gain"] is None
