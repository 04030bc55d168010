"""Multi-turn and tool-using environments (see `gpu_workers.envs.base` for the interface)."""

from gpu_workers.envs.base import (
    REGISTRY,
    Environment,
    EnvTurn,
    Episode,
    EpisodeLimits,
    get_environment,
    register,
)

__all__ = ["REGISTRY", "EnvTurn", "Environment", "Episode", "EpisodeLimits", "get_environment", "register"]
