"""The code reward's sandbox (issue 18, finding 11): model-written programs that try to read the node's key, run
directory or home, write outside their scratch directory, reach the network or fork without bound all fail,
while a correct program still gets its reward; where no sandbox can be made, code rewards are refused unless
the operator opts in.

Each attack is a real program run through `code_reward`/`run_test` as a worker or validator runs it; the
files it goes for are real files made by the test (stand-ins for the node's key, run directory and home),
and the socket it tries is a real listener on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from gpu_workers.rewards import code
from gpu_workers.rewards.code import Limits, SandboxUnavailable, code_reward, run_test
from gpu_workers.tasks.dataset import Task

ECHO = Task(
    prompt="echo", reward="code", tests=[{"input": "3 4\n", "output": "7"}, {"input": "10 -2\n", "output": "8"}]
)
GOOD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture
def sandboxed():
    why = code.sandbox_status()
    if why is not None:
        pytest.skip(f"no sandbox on this machine: {why} (.ci/run installs bubblewrap)")


@pytest.fixture
def node(tmp_path):
    """Stand-ins for what a node holds: its key in its run directory, and a secret in its home."""
    run = tmp_path / "run"
    (run / "keys").mkdir(parents=True)
    key = run / "keys" / "worker.key"
    key.write_text("-----BEGIN PRIVATE KEY----- the node's identity")
    home_secret = Path.home() / f".intellect-sandbox-test-{uuid.uuid4().hex}"
    home_secret.write_text("a secret in the node's home")
    try:
        yield {"run": run, "key": key, "home": home_secret}
    finally:
        home_secret.unlink(missing_ok=True)


def outcome(program: str, stdin: str = "", limits: Limits = Limits(cpu_s=5, wall_s=20)) -> tuple[bool, str]:
    return run_test(program, stdin, limits)


def test_a_correct_program_gets_its_reward(sandboxed):
    assert code_reward(ECHO, GOOD).value == 1.0
    scratch = (
        "import os, tempfile, threading\n"
        "open('notes.txt', 'w').write('kept')\n"
        "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('t'); f.seek(0); t = f.read()\n"
        "r = []\nth = threading.Thread(target=lambda: r.append(1)); th.start(); th.join()\n"
        "print(open('notes.txt').read(), t, r, os.getcwd(), os.path.expanduser('~'))"
    )
    assert outcome(scratch) == (True, "kept t [1] /scratch /scratch\n")  # scratch, temp files, threads work


def test_programs_cannot_read_the_nodes_key_run_directory_or_home(sandboxed, node):
    attempts = {
        "key": f"print(open({str(node['key'])!r}).read())",
        "run dir": f"import os\nprint(os.listdir({str(node['run'])!r}))",
        "home file": f"print(open({str(node['home'])!r}).read())",
        "home dir": f"import os\nprint(os.listdir({str(node['home'].parent)!r}))",
        "expanded home": f"import os\nprint(open(os.path.expanduser('~/{node['home'].name}')).read())",
        "etc": "print(open('/etc/passwd').read())",
        "proc": "print(open('/proc/1/environ').read())",
        "parent's cwd": f"import os\nprint(os.listdir({os.getcwd()!r}))",
    }
    for what, program in attempts.items():
        ok, out = outcome(program)
        # a listing of a directory the sandbox needs (the Python installation's parents) shows only that
        assert not ok or what == "home dir", (what, out)
        assert "identity" not in out and "secret" not in out, (what, out)
    assert node["home"].name not in outcome(attempts["home dir"])[1]
    task = Task(prompt="x", reward="code", tests=[{"input": "", "output": node["key"].read_text()}])
    assert code_reward(task, attempts["key"]).value == 0.0


def test_programs_cannot_write_outside_their_scratch_directory(sandboxed, node):
    targets = [
        node["run"] / "planted",
        node["key"],
        Path.home() / f"planted-{uuid.uuid4().hex}",
        Path("/planted"),
        Path("/usr/planted"),
        Path("/dev/shm/planted"),
        Path("/tmp/planted"),
    ]
    for target in targets:
        ok, out = outcome(f"open({str(target)!r}, 'w').write('owned')\nprint('wrote')")
        assert not ok and "Error" in out, (target, out)
    for target in targets:
        if target == node["key"]:
            assert target.read_text().endswith("the node's identity")
        else:
            assert not target.exists(), target
    ok, out = outcome(f"import shutil\nshutil.rmtree({str(node['run'])!r})\nprint('gone')")
    assert not ok and node["key"].exists()
    ok, out = outcome(
        "open('big', 'wb').write(b'x' * (200 << 20))\nprint('filled')",
        limits=Limits(cpu_s=5, wall_s=20, memory_mb=1024, scratch_mb=16),
    )
    assert not ok, out  # the scratch tmpfs is bounded (RLIMIT_FSIZE, then its size)


def test_programs_have_no_network(sandboxed):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []
    listener.settimeout(0.2)

    def accept():
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    for program in [
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')",
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint('out')",
        "import socket\nprint(socket.getaddrinfo('example.com', 80))",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "s.sendto(b'x', ('8.8.8.8', 53))\nprint('sent')",
    ]:
        ok, out = outcome(program)
        assert not ok and ("Error" in out or "gaierror" in out), (program, out)
    listener.close()
    t.join(timeout=20)
    assert accepted == []


def test_programs_cannot_start_processes_and_a_fork_bomb_fails_fast(sandboxed):
    t0 = time.monotonic()
    ok, out = outcome("import os\nwhile True:\n    os.fork()")
    assert not ok and "PermissionError" in out and time.monotonic() - t0 < 10, out
    for program in [
        "import subprocess\nsubprocess.run(['/usr/bin/true'])\nprint('ran')",
        "import os\nos.execv('/usr/bin/true', ['true'])",
        "import multiprocessing as mp\np = mp.Process(target=print)\np.start()\np.join()\nprint('ran')",
    ]:
        ok, out = outcome(program)
        assert not ok and "Error" in out, (program, out)
    ok, out = outcome(
        "import threading\nts = []\nwhile True:\n"
        "    t = threading.Thread(target=threading.Event().wait); t.daemon = True; t.start(); ts.append(t)",
        limits=Limits(cpu_s=5, wall_s=20, memory_mb=512),
    )
    assert not ok, out  # threads: bounded by the address space


def test_output_and_time_are_bounded(sandboxed):
    ok, out = outcome(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", limits=Limits(cpu_s=5, wall_s=20, output_mb=1)
    )
    assert (ok, out) == (False, "output limit")
    ok, out = outcome("import time\ntime.sleep(60)", limits=Limits(cpu_s=5, wall_s=1))
    assert (ok, out) == (False, "wall-clock limit")


def test_without_a_sandbox_code_rewards_are_refused_unless_the_operator_opts_in(monkeypatch):
    monkeypatch.setattr(code.shutil, "which", lambda name: None)
    code._sandbox.cache_clear()
    try:
        assert "bubblewrap (bwrap) is not installed" in code.sandbox_status()
        with pytest.raises(SandboxUnavailable, match="data.allow_unsandboxed_code"):
            code.prepare([ECHO], allow=False)
        with pytest.raises(SandboxUnavailable):
            run_test(GOOD, "1 2\n", Limits())
        assert code.prepare([Task(prompt="p", reward="math", answer="1")], allow=False) is None  # no code: fine
        assert code.prepare([ECHO], allow=True) == "unsandboxed"
        assert code_reward(ECHO, GOOD).value == 1.0  # the opt-in runs it, with the limits and the filter
        ok, out = run_test("import os\nos.fork()", "", Limits())
        assert not ok and "PermissionError" in out
    finally:
        code.allow_unsandboxed(False)
        code._sandbox.cache_clear()


def test_the_seccomp_filter_is_well_formed():
    for machine in ("x86_64", "aarch64"):
        bpf = code.seccomp_filter(machine)
        assert bpf and len(bpf) % 8 == 0 and len(bpf) // 8 < 64
    assert code.seccomp_filter("riscv64") == b""


@pytest.mark.parametrize("role", ["worker", "validator"])
def test_a_node_with_code_tasks_and_no_sandbox_refuses_to_start(tmp_path, role):
    """`intellect worker|validator` with code tasks where bwrap cannot be found: exit 2 naming the opt-in, before
    it contacts anyone (the orchestrator URL here answers nothing)."""
    import json
    import subprocess
    import sys

    tasks = tmp_path / "code.jsonl"
    tasks.write_text(
        "".join(
            json.dumps({"prompt": f"add {i}", "reward": "code", "tests": [{"input": "1 2\n", "output": "3"}]}) + "\n"
            for i in range(4)
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("INTELLECT_")}
    env["PATH"] = str(tmp_path / "no-bin")  # no bwrap (and no unshare) on it
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "intellect",
            role,
            "--run.dir",
            str(tmp_path / "run"),
            "--data.path",
            str(tasks),
            "--data.task",
            "code",
            "--data.eval_tasks",
            "0",
            f"--{role}.orchestrator_url",
            "http://127.0.0.1:9",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "cannot be sandboxed here" in proc.stderr and "data.allow_unsandboxed_code" in proc.stderr
