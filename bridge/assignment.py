"""The deterministic assignment (docs/design.md section 8): which prompts a node's k-th assignment at version v holds.

The orchestrator hands out assignment numbers, not free choices: the task ids and the sampling seeds of a
node's k-th assignment at policy version v follow from (node key, v, k) alone. A validator recomputes them
(the fixed-data check), so a worker cannot pick easy prompts or re-roll samples until it likes the reward.

The seed is the first 8 bytes of sha256("intellect-assignment/v1|{node_key}|{version}|{k}"), fed to numpy's
PCG64; numpy guarantees that stream across versions for `Generator.choice`/`integers`, and nothing else
(no process state, no hash randomisation) enters it.
"""

from __future__ import annotations

import hashlib

import numpy as np

_DOMAIN = "intellect-assignment/v1"


def assignment_seed(node_key: str, version: int, k: int) -> int:
    """64-bit seed of assignment k of `node_key` (hex public key) at policy `version`."""
    if version < 0 or k < 0:
        raise ValueError(f"assignment: version ({version}) and k ({k}) must be >= 0")
    digest = hashlib.sha256(f"{_DOMAIN}|{node_key.lower()}|{int(version)}|{int(k)}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def assigned_task_ids(node_key: str, version: int, k: int, num_tasks: int, count: int) -> list[int]:
    """The `count` dataset indices of the assignment: distinct while count <= num_tasks, otherwise with repeats."""
    if num_tasks <= 0 or count <= 0:
        raise ValueError(f"assignment: num_tasks ({num_tasks}) and count ({count}) must be positive")
    rng = np.random.Generator(np.random.PCG64(assignment_seed(node_key, version, k)))
    return [int(i) for i in rng.choice(num_tasks, size=count, replace=count > num_tasks)]


def assigned_sample_seeds(node_key: str, version: int, k: int, count: int) -> list[int]:
    """One sampling seed per sample of the assignment (uint63, what vLLM's `SamplingParams(seed=)` accepts)."""
    rng = np.random.Generator(np.random.PCG64(assignment_seed(node_key, version, k) ^ 0x5EED))
    return [int(s) for s in rng.integers(0, 2**63 - 1, size=count, dtype=np.int64)]
