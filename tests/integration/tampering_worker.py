"""A worker for test_episode_pool.py that tampers with the environment's side of its multi-turn batches:
`intellect worker` whose first batch is left as played and every later one has one environment token of its
first multi-turn sample changed (its id plus one) before the worker writes and uploads it with its own key,
through the pool's upload path. Built from the public pieces: the worker's batch builder wrapped in place.

    python tampering_worker.py CONFIG [--section.key value ...]
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import numpy as np

import gpu_workers.worker
from intellect.cli import main

log = logging.getLogger("tampering_worker")
_honest_build = gpu_workers.worker.Worker._build_episodes
_built = [0]


def tamper(batch):
    """The batch with one environment token (a token after the prompt that the model did not sample) changed,
    or None when no sample holds one."""
    for i in range(batch.num_samples):
        start, end = int(batch.offsets[i]), int(batch.offsets[i + 1])
        env = np.flatnonzero(batch.sampled[start + int(batch.prompt_lens[i]) : end] == 0)
        if len(env):
            j = start + int(batch.prompt_lens[i]) + int(env[len(env) // 2])
            tokens = batch.tokens.copy()
            tokens[j] = (int(tokens[j]) + 1) % 400
            log.warning("TAMPERED sample %d: token at %d changed %d -> %d", i, j, batch.tokens[j], tokens[j])
            return dataclasses.replace(batch, tokens=tokens)
    return None


def build_episodes(self, a, task_ids):
    batch = _honest_build(self, a, task_ids)
    _built[0] += 1
    if _built[0] == 1:
        return batch
    return tamper(batch) or batch


if __name__ == "__main__":
    gpu_workers.worker.Worker._build_episodes = build_episodes
    sys.exit(main(["worker", *sys.argv[1:]]))
