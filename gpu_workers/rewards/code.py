"""Code answers run against the task's tests in a sandboxed subprocess, identically on worker and validator.

The program is the completion's last ```python block (or the whole completion if there is none). Each test
feeds `input` on stdin and expects `output` on stdout (trailing whitespace ignored); the reward is the
fraction of tests passed. Limits per test: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), wall clock
(the process group is killed), a fresh scratch directory as the working directory, an environment without
the parent's variables, and no network where the OS allows it (`unshare --net`, when permitted; otherwise
the limits still apply and the missing isolation is logged once).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from gpu_workers.rewards.base import RewardResult

log = logging.getLogger(__name__)
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    memory_mb: int = 1024
    wall_s: float = 10.0


def extract_program(completion: str) -> str:
    blocks = _BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


@functools.lru_cache(maxsize=1)
def _net_isolation() -> list[str]:
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "--net", "--map-root-user", "true"], capture_output=True).returncode == 0:
        return [unshare, "--net", "--map-root-user"]
    if unshare and subprocess.run([unshare, "--net", "true"], capture_output=True).returncode == 0:
        return [unshare, "--net"]
    log.warning("code reward: cannot create a network namespace here; tests run without network isolation")
    return []


# The child applies its own limits, then runs the program: no `preexec_fn`, which is unsafe to fork from a
# multithreaded parent (a worker's engine, a validator's torch threads).
_BOOT = ("import resource, runpy, sys\n"
         "cpu, mem = int(sys.argv[1]), int(sys.argv[2])\n"
         "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
         "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
         "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
         "path = sys.argv[3]\n"
         "sys.argv = [path]\n"
         "runpy.run_path(path, run_name='__main__')\n")


def run_test(program: str, stdin: str, limits: Limits) -> tuple[bool, str]:
    """(passed output, what happened) for one test; the stdout is compared by the caller."""
    with tempfile.TemporaryDirectory(prefix="intellect-code-") as scratch:
        path = os.path.join(scratch, "main.py")
        with open(path, "w") as f:
            f.write(program)
        cmd = _net_isolation() + [sys.executable, "-I", "-S", "-c", _BOOT, str(limits.cpu_s),
                                  str(limits.memory_mb * 1024 * 1024), path]
        proc = subprocess.Popen(cmd, cwd=scratch, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={"PATH": "/usr/bin:/bin", "HOME": scratch},
                                start_new_session=True, text=True)
        try:
            out, err = proc.communicate(stdin, timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, "wall-clock limit"
        if proc.returncode != 0:
            return False, f"exit {proc.returncode}: {err.strip()[-200:]}"
        return True, out


def code_reward(task, completion: str, limits: Limits = Limits()) -> RewardResult:
    if not task.tests:
        return RewardResult(0.0, "task has no tests")
    program = extract_program(completion)
    passed, failures = 0, []
    for i, test in enumerate(task.tests):
        ok, out = run_test(program, str(test.get("input", "")), limits)
        if ok and out.rstrip() == str(test.get("output", "")).rstrip():
            passed += 1
        else:
            failures.append(f"test {i}: {out if not ok else 'wrong output'}")
    reason = None if not failures else "; ".join(failures[:3])
    return RewardResult(passed / len(task.tests), reason)
