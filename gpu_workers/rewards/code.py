"""Code answers run against the task's tests in a sandbox, identically on worker and validator.

The program is the completion's last ```python block (or the whole completion if there is none). Each test
feeds `input` on stdin and expects `output` on stdout (trailing whitespace ignored); the reward is the
fraction of tests passed. A HumanEval-style task (`Task.check`) runs one program instead: the prompt's code,
the completion's code, the test code and `check(entry_point)`; reward 1 when it exits cleanly, 0 on a failing
assert, an exception or a limit (`check_program`).

The program is model-written, so hostile. Each test runs it under bubblewrap (`bwrap`), where it can touch
nothing of the node:
- its own mount namespace holding only /usr (and the Python installation, when it lives elsewhere) read-only,
  a minimal /dev and a `scratch_mb` tmpfs at /scratch (its working directory and HOME, holding main.py): no
  /home, /root, /etc, /proc, /tmp, run directory, key or weights; nothing writable outside /scratch, which
  vanishes with it;
- no network (a network namespace with only a down loopback), its own user (65534), PID, IPC and UTS
  namespaces, no capabilities, a new session, killed with its parent;
- a seccomp filter that refuses fork, vfork, clone without CLONE_THREAD, clone3 and execve: one process, its
  threads bounded by the address space; RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE and no core files; a wall clock
  (the process group is killed) and at most `output_mb` of output read.
Where no sandbox can be made (no bwrap, or user namespaces refused, as in a default Docker container),
code rewards are refused (`SandboxUnavailable`; workers and validators do not start) unless the operator
opts in with `data.allow_unsandboxed_code` (`allow_unsandboxed(True)`): then the program runs with the same
limits and seccomp filter, in a scratch directory, with `unshare --net` where permitted, but sees the
node's filesystem as the node's user does. Every node of a pool must run code rewards the same way, or
honest workers' rewards differ from their validators'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import platform
import re
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

from gpu_workers.rewards.base import RewardResult

log = logging.getLogger(__name__)
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 5
    memory_mb: int = 1024
    wall_s: float = 10.0
    scratch_mb: int = 64  # the /scratch tmpfs; also the largest file the program may write (RLIMIT_FSIZE)
    output_mb: int = 8  # stdout read at most; more fails the test


class SandboxUnavailable(RuntimeError):
    """Code rewards cannot be run isolated here, and the operator has not allowed running them without."""


_allow_unsandboxed = False


def allow_unsandboxed(allowed: bool) -> None:
    """The operator's `data.allow_unsandboxed_code`: run code rewards without the sandbox where none can be
    made (trusted pools only)."""
    global _allow_unsandboxed
    _allow_unsandboxed = bool(allowed)


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


# ---- seccomp: one process, no exec --------------------------------------------------------------------

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# fork, vfork, execve, execveat, clone3, clone (allowed with CLONE_THREAD) by architecture
_SYSCALLS = {
    "x86_64": dict(deny=(57, 58, 59, 322), nosys=(435,), clone=56),
    "aarch64": dict(deny=(221, 281), nosys=(435,), clone=220),
}
_CLONE_THREAD = 0x00010000
_EPERM, _ENOSYS = 1, 38


def seccomp_filter(machine: str | None = None) -> bytes:
    """A classic BPF program for SECCOMP_MODE_FILTER: fork, vfork, execve and execveat fail with EPERM, clone
    too unless it makes a thread (CLONE_THREAD), clone3 with ENOSYS (so threads fall back to clone), and any
    other architecture's syscalls (x86_64's x32 and i386 entry points) with EPERM. b"" where unsupported."""
    machine = machine or platform.machine()
    if machine not in _SYSCALLS:
        return b""
    calls = _SYSCALLS[machine]
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | _EPERM, 0x00050000 | _ENOSYS
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    prog: list[tuple[int, int, int, int]] = [
        (ld, 0, 0, 4),
        (jeq, 1, 0, _AUDIT_ARCH[machine]),
        (ret, 0, 0, eperm),
        (ld, 0, 0, 0),
    ]
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 ABI
    for nr in calls["deny"]:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    for nr in calls["nosys"]:
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, enosys)]
    prog += [
        (jeq, 0, 3, calls["clone"]),
        (ld, 0, 0, 16),
        (jset, 1, 0, _CLONE_THREAD),
        (ret, 0, 0, eperm),
        (ret, 0, 0, allow),
    ]
    return b"".join(struct.pack("=HBBI", *insn) for insn in prog)


# The child applies its own limits and seccomp filter, then runs the program: no `preexec_fn`, which is unsafe
# to fork from a multithreaded parent (a worker's engine, a validator's torch threads).
_BOOT = (
    "import ctypes, resource, runpy, sys\n"
    "cpu, mem, fsize, bpf, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), "
    "bytes.fromhex(sys.argv[4]), sys.argv[5]\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "if bpf:\n"
    "    libc = ctypes.CDLL(None, use_errno=True)\n"
    "    class Prog(ctypes.Structure):\n"
    "        _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_char_p)]\n"
    "    prog = Prog(len(bpf) // 8, bpf)\n"
    "    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(prog), 0, 0):\n"
    "        sys.exit('sandbox: cannot install the seccomp filter (errno %d)' % ctypes.get_errno())\n"
    "del ctypes, resource, cpu, mem, fsize, bpf\n"
    "sys.argv = [path]\n"
    "runpy.run_path(path, run_name='__main__')\n"
)

SCRATCH = "/scratch"
_SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}


def _python() -> tuple[str, list[str]]:
    """The interpreter to run programs with (this one, resolved) and the directories it needs beyond /usr."""
    exe = os.path.realpath(sys.executable)
    extra = [
        d
        for d in {os.path.realpath(sys.base_prefix), os.path.dirname(exe)}
        if d != "/usr" and not d.startswith("/usr/")
    ]
    return exe, sorted(extra)


def _bwrap_command(bwrap: str, program_fd: int, limits: Limits, bpf: bytes) -> list[str]:
    exe, extra = _python()
    cmd = [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--hostname",
        "sandbox",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for top in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged-/usr symlinks, or the real directories
        path = f"/{top}"
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    for d in extra:
        cmd += ["--ro-bind", d, d]
    # the root (a tmpfs holding the mount points, among them the parents of `extra`) and /dev (/dev/shm) are
    # made read-only: only the bounded /scratch is writable
    cmd += [
        "--dev",
        "/dev",
        "--perms",
        "0777",
        "--size",
        str(limits.scratch_mb << 20),
        "--tmpfs",
        SCRATCH,
        "--perms",
        "0644",
        "--file",
        str(program_fd),
        f"{SCRATCH}/main.py",
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        SCRATCH,
        "--clearenv",
    ]
    for key, value in _SANDBOX_ENV.items():
        cmd += ["--setenv", key, value]
    return cmd + [
        "--",
        exe,
        "-I",
        "-S",
        "-c",
        _BOOT,
        str(limits.cpu_s),
        str(limits.memory_mb << 20),
        str(limits.scratch_mb << 20),
        bpf.hex(),
        f"{SCRATCH}/main.py",
    ]


_SELF_TEST = (
    "import os, socket\n"
    "try:\n    os.fork()\nexcept OSError:\n    pass\nelse:\n    raise SystemExit('fork allowed')\n"
    "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\nexcept OSError:\n    pass\n"
    "else:\n    raise SystemExit('network reachable')\n"
    "print(' '.join(sorted(os.listdir('/'))))\n"
)


@functools.lru_cache(maxsize=1)
def _sandbox() -> tuple[str | None, str]:
    """(the bwrap binary, "") once a sandboxed program has run here as it must; (None, why not) otherwise."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bubblewrap (bwrap) is not installed"
    if not seccomp_filter():
        return None, f"no seccomp filter for this architecture ({platform.machine()})"
    ok, out = _run(_SELF_TEST, "", Limits(), bwrap)
    if not ok or not out.strip():
        return None, f"bwrap cannot make the sandbox here ({out.strip()[-300:] or 'no output'})"
    allowed = {"bin", "sbin", "lib", "lib32", "lib64", "usr", "dev", SCRATCH.strip("/")}
    allowed |= {d.strip("/").split("/")[0] for d in _python()[1]}
    if not set(out.split()) <= allowed:
        return None, f"bwrap's sandbox shows more than it should at / ({out.strip()[:300]})"
    return bwrap, ""


def sandbox_status() -> str | None:
    """None when code runs sandboxed here; else why it cannot."""
    return _sandbox()[1] or None


def prepare(tasks, allow: bool) -> str | None:
    """Called where a worker, validator or evaluation starts: None when its tasks run no code; "sandboxed" or
    "unsandboxed" (the operator allowed it) otherwise. Raises SandboxUnavailable, saying what to do, when
    the tasks need code rewards, no sandbox can be made and `allow` is false."""
    allow_unsandboxed(allow)
    if not any(getattr(t, "reward", None) == "code" for t in tasks):
        return None
    why = sandbox_status()
    if why is None:
        return "sandboxed"
    if not allow:
        raise SandboxUnavailable(
            f"this task set runs model-written programs (code rewards) and they cannot be sandboxed here: {why}. "
            "Install bubblewrap (apt-get install bubblewrap) and allow user namespaces (in Docker: run with "
            "--security-opt seccomp=unconfined, and apparmor=unconfined on Ubuntu hosts), or, in a pool of "
            "trusted nodes only, set data.allow_unsandboxed_code = true on every worker and validator"
        )
    log.warning(
        "code rewards run WITHOUT a sandbox (%s): data.allow_unsandboxed_code is set; model-written "
        "programs can read and change what this node's user can",
        why,
    )
    return "unsandboxed"


def _communicate(proc: subprocess.Popen, data: bytes, limits: Limits) -> tuple[str | None, bytes, bytes]:
    """Feed stdin, read stdout (at most `output_mb`) and the end of stderr until both close, then wait for the
    exit; (None: done, or what limit it hit, stdout, stderr)."""
    deadline = time.monotonic() + limits.wall_s
    max_out = limits.output_mb << 20
    out, err = bytearray(), bytearray()
    sel = selectors.DefaultSelector()
    pending = memoryview(data)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "wall-clock limit", bytes(out), bytes(err)
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        pending = pending[os.write(f.fileno(), pending[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(f)
                        f.close()
                    continue
                chunk = os.read(f.fileno(), 1 << 16)
                if not chunk:
                    sel.unregister(f)
                elif f is proc.stdout:
                    out += chunk
                    if len(out) > max_out:
                        return "output limit", bytes(out[:max_out]), bytes(err)
                else:
                    err = (err + chunk)[-4096:]
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return "wall-clock limit", bytes(out), bytes(err)
        return None, bytes(out), bytes(err)
    finally:
        sel.close()


def _run(program: str, stdin: str, limits: Limits, bwrap: str | None) -> tuple[bool, str]:
    bpf = seccomp_filter()
    with tempfile.TemporaryDirectory(prefix="intellect-code-") as scratch:
        if bwrap is not None:
            fd = os.memfd_create("main.py")
            try:
                os.write(fd, program.encode())
                os.lseek(fd, 0, os.SEEK_SET)
                proc = subprocess.Popen(
                    _bwrap_command(bwrap, fd, limits, bpf),
                    cwd=scratch,
                    pass_fds=(fd,),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env={},
                    start_new_session=True,
                )
            finally:
                os.close(fd)
        else:  # the operator's opt-in: limits and the filter only, in a scratch directory of the node's
            path = os.path.join(scratch, "main.py")
            with open(path, "w") as f:
                f.write(program)
            cmd = _net_isolation() + [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _BOOT,
                str(limits.cpu_s),
                str(limits.memory_mb << 20),
                str(limits.scratch_mb << 20),
                bpf.hex(),
                path,
            ]
            proc = subprocess.Popen(
                cmd,
                cwd=scratch,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"},
                start_new_session=True,
            )
        try:
            limit, out, err = _communicate(proc, stdin.encode(), limits)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if not f.closed:
                    f.close()
    if limit is not None:
        return False, limit
    if proc.returncode != 0:
        return False, f"exit {proc.returncode}: {err.decode(errors='replace').strip()[-200:]}"
    return True, out.decode(errors="replace")


def run_test(program: str, stdin: str, limits: Limits) -> tuple[bool, str]:
    """(passed output, what happened) for one test; the stdout is compared by the caller. Raises
    SandboxUnavailable where no sandbox can be made and the operator has not allowed running without."""
    bwrap, why = _sandbox()
    if bwrap is None and not _allow_unsandboxed:
        raise SandboxUnavailable(f"code rewards are not run without a sandbox ({why}); see data.allow_unsandboxed_code")
    return _run(program, stdin, limits, bwrap)


def check_program(check, completion: str) -> str:
    """The program of a HumanEval-style task (`Task.check`): its prefix (the prompt's code), the completion's
    code (a body continuing the prompt's function, or a whole function that redefines it), the test code and
    the call `check(entry_point)`."""
    prefix = check.prefix if check.prefix.endswith("\n") else check.prefix + "\n"
    return f"{prefix}{extract_program(completion)}\n\n{check.test}\n\ncheck({check.entry_point})\n"


def code_reward(task, completion: str, limits: Limits = Limits()) -> RewardResult:
    if getattr(task, "check", None) is not None:
        ok, out = run_test(check_program(task.check, completion), "", limits)
        return RewardResult(1.0, None) if ok else RewardResult(0.0, f"check failed: {out}")
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
