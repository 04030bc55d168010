"""The deterministic assignment (docs/design.md section 8): which prompts a node's k-th assignment at version v holds.

The orchestrator hands out assignment numbers, not free choices: the task ids and the sampling seeds of a
node's k-th assignment at policy version v follow from (node key, v, k) and the assignment's salt alone. A
validator recomputes them (the fixed-data check), so a worker cannot pick easy prompts or re-roll samples until
it likes the reward.

The salt is the orchestrator's secret mixed in (`assignment_salt`: an HMAC of (node key, v, k) under a secret
the orchestrator keeps in its database), handed to the worker with its assignment and to the validator with the
batch it claims. Without it the draws were a public function of (node key, v, k): a worker could compute the
first assignment of many keys it had not registered yet and register only the one whose prompts it liked
(best-of-N with nothing to abandon, so no strike). With it, a key's draws are unknown until the orchestrator
issues them, and they stay deterministic (the secret survives restarts) for an exact resume and for the
validator.

The seed is the first 8 bytes of sha256("intellect-assignment/v2|{node_key}|{version}|{k}|{salt}"), fed to
numpy's PCG64 (salt None: the unsalted "intellect-assignment/v1|{node_key}|{version}|{k}" of protocol 1, which
tests and benchmarks without an orchestrator still use); numpy guarantees that stream across versions for
`Generator.choice`/`integers`, and nothing else (no process state, no hash randomisation) enters it.
"""

from __future__ import annotations

import hashlib
import hmac
import re

import numpy as np

_DOMAIN = "intellect-assignment/v1"
_SALTED_DOMAIN = "intellect-assignment/v2"
_SALT_DOMAIN = "intellect-assignment-salt/v1"
SALT_PATTERN = r"^[0-9a-f]{64}$"
_SALT = re.compile(SALT_PATTERN)


def assignment_salt(secret: bytes, node_key: str, version: int, k: int) -> str:
    """The salt of assignment k of `node_key` at `version` under the orchestrator's `secret`: 64 lowercase hex
    digits of HMAC-SHA256(secret, "intellect-assignment-salt/v1|{node_key}|{version}|{k}")."""
    if len(secret) < 16:
        raise ValueError(f"assignment: the orchestrator's secret must hold at least 16 bytes, got {len(secret)}")
    message = f"{_SALT_DOMAIN}|{node_key.lower()}|{int(version)}|{int(k)}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def assignment_seed(node_key: str, version: int, k: int, salt: str | None = None) -> int:
    """64-bit seed of assignment k of `node_key` (hex public key) at policy `version` with the orchestrator's
    `salt` (None: the unsalted protocol-1 seed)."""
    if version < 0 or k < 0:
        raise ValueError(f"assignment: version ({version}) and k ({k}) must be >= 0")
    if salt is None:
        text = f"{_DOMAIN}|{node_key.lower()}|{int(version)}|{int(k)}"
    elif not isinstance(salt, str) or not _SALT.fullmatch(salt):
        raise ValueError(f"assignment: salt must be 64 lowercase hex digits, got {salt!r:.80}")
    else:
        text = f"{_SALTED_DOMAIN}|{node_key.lower()}|{int(version)}|{int(k)}|{salt}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def assigned_task_ids(
    node_key: str,
    version: int,
    k: int,
    num_tasks: int,
    count: int,
    salt: str | None = None,
    level: int = 0,
    levels: int = 1,
) -> list[int]:
    """The `count` dataset indices of the assignment: distinct while count <= the slice's size, otherwise with
    repeats. With a curriculum (`levels` > 1) the task list is `levels` equal slices, easiest first, and the
    draw is from the slice of `level` (`bridge.curriculum`); one level draws exactly as before."""
    if num_tasks <= 0 or count <= 0:
        raise ValueError(f"assignment: num_tasks ({num_tasks}) and count ({count}) must be positive")
    if levels < 1 or num_tasks % levels or not 0 <= level < levels:
        raise ValueError(f"assignment: level {level} of {levels} over {num_tasks} tasks (equal slices) is not valid")
    size = num_tasks // levels
    rng = np.random.Generator(np.random.PCG64(assignment_seed(node_key, version, k, salt)))
    return [level * size + int(i) for i in rng.choice(size, size=count, replace=count > size)]


def assigned_sample_seeds(node_key: str, version: int, k: int, count: int, salt: str | None = None) -> list[int]:
    """One sampling seed per sample of the assignment (uint63, what vLLM's `SamplingParams(seed=)` accepts)."""
    rng = np.random.Generator(np.random.PCG64(assignment_seed(node_key, version, k, salt) ^ 0x5EED))
    return [int(s) for s in rng.integers(0, 2**63 - 1, size=count, dtype=np.int64)]
