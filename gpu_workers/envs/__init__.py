"""Multi-turn and tool-using environments (`gpu_workers.envs.base` for the interface, `gpu_workers.envs.episode`
for the protocol a worker plays and a validator re-runs, `gpu_workers.envs.tokens` for the token layout).

Shipped: `retry` and `guess` (`gpu_workers.envs.feedback`: the environment answers each attempt),
`python_tool` (`gpu_workers.envs.python_tool`: a sandboxed Python interpreter as a tool), and `verifiers`
(`gpu_workers.envs.verifiers_adapter`: an environment written against `verifiers`' classic MultiTurnEnv/ToolEnv
API; the package is imported only when a pool names it).
"""

from gpu_workers.envs import feedback, python_tool, verifiers_adapter  # noqa: F401  (they register their environments)
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
