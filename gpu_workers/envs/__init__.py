"""Multi-turn and tool-using environments (`gpu_workers.envs.base` for the interface, `gpu_workers.envs.episode`
for the protocol a worker plays and a validator re-runs, `gpu_workers.envs.tokens` for the token layout).

Shipped: `retry` and `guess` (`gpu_workers.envs.feedback`: the environment answers each attempt),
and `python_tool` (`gpu_workers.envs.python_tool`: a sandboxed Python interpreter as a tool). An adapter for
`verifiers`' classic MultiTurnEnv/ToolEnv is not written yet (the package is not installed here).
"""

from gpu_workers.envs import feedback, python_tool  # noqa: F401  (they register their environments)
from gpu_workers.envs.base import (
    REGISTRY,
    Demonstration,
    Environment,
    EnvTurn,
    Episode,
    EpisodeLimits,
    get_environment,
    register,
)

__all__ = [
    "REGISTRY",
    "Demonstration",
    "EnvTurn",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "get_environment",
    "register",
]
