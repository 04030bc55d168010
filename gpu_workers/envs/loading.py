"""The environment a pool names (`data.env`, `data.env_config`), as every role loads it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_workers.envs.base import Environment, get_environment


def load_environment(name: str, config: Mapping[str, Any] | None = None) -> Environment:
    """`data.env`: a registered name (retry, guess, python_tool, verifiers). Raises ValueError naming what is wrong."""
    import gpu_workers.envs  # noqa: F401  (registers the shipped environments)

    try:
        return get_environment(name, config)
    except KeyError as err:
        raise ValueError(f"data.env: {err.args[0]}") from None


def prepare(env: Environment | None, allow_unsandboxed: bool) -> str | None:
    """Where a worker, validator or evaluation starts: None without an environment or when it runs no code;
    "sandboxed" otherwise. An environment whose tools run model-written code needs the code sandbox on every
    node (its tool outputs must be the same bytes everywhere; see `gpu_workers.envs.python_tool`): without one,
    `SandboxUnavailable` says how to get it, whatever `allow_unsandboxed` says."""
    if env is None or not env.uses_sandbox():
        return None
    from gpu_workers.rewards.code import SandboxUnavailable, sandbox_status

    why = sandbox_status()
    if why is None:
        return "sandboxed"
    raise SandboxUnavailable(
        f"data.env {env.name!r} runs model-written programs as tool calls and they cannot be sandboxed here: {why}. "
        "Install bubblewrap (apt-get install bubblewrap) and allow user namespaces (in Docker: run with "
        "--security-opt seccomp=unconfined); tool outputs outside the sandbox differ between nodes"
        + (" (data.allow_unsandboxed_code does not apply to tool environments)" if allow_unsandboxed else "")
    )
