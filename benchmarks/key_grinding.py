"""Grinding keys offline: can a worker pick, before it registers, a key whose first assignment holds easy prompts?

Under protocol 1 an assignment's prompts and seeds were a public function of (node key, version, k)
(`bridge.assignment` without a salt). A worker could then make many keys offline (ed25519 keys cost about
0.2 ms each), compute each one's first assignment at the current version, register only the key whose draw it
liked best and announce that batch: best-of-N with nothing abandoned, so no strike. Now the orchestrator mixes a
secret of its own into every draw (the assignment's salt), so the same computation predicts nothing.

The run is the real orchestrator (the in-process app of `intellect orchestrator`, the demo's pool shape on a
simulated clock, as `selective_submission.py`), `--honest` honest workers, a validator that accepts every batch
with its rewards and a learner that reads the accepted batches and announces a version per step. A sample's
reward is honest and fixed by its assignment: 1 with its task's success probability (Beta(`--beta`) over the
tasks), drawn from its assigned seed (`selective_submission.honest_rewards`). The grinder, for every batch it makes:
draws `--keys` fresh keys, computes each key's first assignment at the current version with the public function
(what protocol 1 handed out), scores it by its tasks' mean success probability (the grinder is given the true
difficulties, the best it could know), registers the best key, generates what the orchestrator hands that key
honestly and announces it.

Reported: the mean reward (and standard error) of the batches the learner read from the honest workers and from
the grinder, and what the grinder's chosen keys would have earned had the orchestrator handed out the public
draws (its gain under protocol 1); and how many of the grinder's predictions matched what it was handed
(task ids and seeds).

    python benchmarks/key_grinding.py [--batches 32] [--keys 500] [--honest 3] [--seeds 2] [--beta 1.0]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from selective_submission import SELECTION_POOL, TICK_S, SimClock, SimLearner, SimPool, honest_rewards  # noqa: E402


def _predicted(key_hex: str, version: int, prompts: int, samples: int, num_tasks: int):
    """The first assignment of a key at `version` as protocol 1 computed it (no salt): (task ids, seeds)."""
    from bridge.assignment import assigned_sample_seeds, assigned_task_ids

    return (
        assigned_task_ids(key_hex, version, 0, num_tasks, prompts),
        assigned_sample_seeds(key_hex, version, 0, prompts * samples),
    )


class Grinder:
    """For each batch: `keys` fresh keys ground offline, the best predicted one registered and used once."""

    def __init__(self, pool: SimPool, rng, keys: int, difficulty: np.ndarray):
        self.pool, self.rng, self.keys, self.difficulty = pool, rng, keys, difficulty
        self.node, self.prediction = None, None
        self.stats = {"registered": 0, "announced": 0, "task_matches": 0, "seed_matches": 0, "if_public": []}

    def _grind(self) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from bridge.protocol import HardwareReport

        version = self.pool.admin.policy().version
        prompts = int(SELECTION_POOL["orchestrator.prompts_per_assignment"])
        samples = int(SELECTION_POOL["data.samples_per_prompt"])
        best = None
        for _ in range(self.keys):
            private = Ed25519PrivateKey.from_private_bytes(self.rng.bytes(32))
            raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            key_hex = raw.hex()
            tasks, seeds = _predicted(key_hex, version, prompts, samples, len(self.difficulty))
            value = float(self.difficulty[tasks].mean())
            if best is None or value > best[0]:
                best = (value, private, tasks, seeds)
        _, private, tasks, seeds = best
        self.node = self.pool.client(private)
        if self.node.register("worker", HardwareReport(cpu_count=2, memory_gib=4)).status != "admitted":
            raise RuntimeError("key_grinding: the pool refused the grinder's key")
        self.prediction = (version, tasks, seeds)
        self.stats["registered"] += 1

    def step(self) -> None:

        if self.node is None:
            self._grind()
        work = self.node.heartbeat().assignments
        if not work:
            return
        a = work[0]
        version, tasks, seeds = self.prediction
        self.stats["task_matches"] += int(a.version == version and list(a.task_ids) == tasks)
        self.stats["seed_matches"] += int(a.version == version and list(a.sample_seeds) == seeds)
        public = a.model_copy(update={"task_ids": tasks, "sample_seeds": seeds})
        self.stats["if_public"].append(float(np.mean(honest_rewards(public, self.difficulty))))
        rewards = honest_rewards(a, self.difficulty)
        batch_id = f"{self.node.node_key[:16]}-1"
        announce(self.node, a, batch_id, len(rewards))
        self.pool.rewards[batch_id] = ("grinder", rewards)
        self.stats["announced"] += 1
        self.node.deregister()  # nothing open is left: no strike; the next batch comes from a new ground key
        self.node = None


def announce(node, a, batch_id: str, n: int) -> None:
    """Announce a batch of `n` samples for assignment `a` (rewards live in the simulation, not in a store)."""
    from bridge.protocol import BatchAnnouncement

    node.announce_batch(
        BatchAnnouncement(
            batch_id=batch_id,
            assignment_id=a.id,
            version=a.version,
            num_samples=n,
            num_tokens=10 * n,
            store_path=f"file:///store/v{a.version:06d}/{batch_id}",
            sha256="ab" * 32,
        )
    )


def _summary(values: list[float]) -> dict:
    if not values:
        return {"batches": 0}
    v = np.asarray(values)
    sem = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
    return {"batches": len(v), "mean_reward": round(float(v.mean()), 4), "sem": sem and round(sem, 4)}


def grinding_run(batches: int, keys: int, honest: int, seed: int, beta: float) -> dict:
    from bridge.protocol import Verdict

    rng = np.random.default_rng(seed)
    difficulty = rng.beta(beta, beta, size=int(SELECTION_POOL["orchestrator.num_tasks"]))
    with tempfile.TemporaryDirectory() as tmp:
        clock = SimClock()
        pool = SimPool(Path(tmp), clock, rng)
        pool.rewards = {}
        validator = pool.join("validator")
        workers = [pool.join("worker") for _ in range(honest)]
        grinder = Grinder(pool, rng, keys, difficulty)
        trained: list[tuple[str, float]] = []
        learner, made = SimLearner(pool), 0
        for _ in range(100 * batches):
            if grinder.stats["announced"] >= batches:
                break
            for i, node in enumerate(workers):
                work = node.heartbeat().assignments
                if work:
                    a, made = work[0], made + 1
                    rewards = honest_rewards(a, difficulty)
                    batch_id = f"honest{i}-{made}"
                    announce(node, a, batch_id, len(rewards))
                    pool.rewards[batch_id] = (f"honest{i}", rewards)
            grinder.step()
            while (claim := validator.claim().batch) is not None:
                _, rewards = pool.rewards[claim.batch_id]
                validator.verdict(claim.batch_id, Verdict(accepted=True, rewards=rewards, num_tokens=10 * len(rewards)))
            for record in learner.poll():
                name, rewards = pool.rewards[record.batch_id]
                trained.append((name, sum(rewards) / len(rewards)))
            clock.t += TICK_S
            pool.svc.sweep()
        ledger = pool.admin.ledger(limit=10_000).entries
        pool.svc.close()
    st = grinder.stats
    return {
        "task_mean_success": round(float(difficulty.mean()), 4),
        "honest": _summary([r for n, r in trained if n != "grinder"]),
        "grinder": _summary([r for n, r in trained if n == "grinder"]),
        "grinder_if_draws_were_public": _summary(st["if_public"]),
        "grinder_keys_registered": st["registered"],
        "predicted_task_ids_matched": st["task_matches"],
        "predicted_seeds_matched": st["seed_matches"],
        "strikes_in_pool_ledger": sum(e.lost_assignments + e.expired_assignments + e.rejected_batches for e in ledger),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=32, help="batches the grinder makes per run")
    p.add_argument("--keys", type=int, default=500, help="keys ground offline per batch")
    p.add_argument("--honest", type=int, default=3, help="honest workers beside the grinder")
    p.add_argument("--seeds", type=int, default=2, help="runs (task difficulties, keys, draws)")
    p.add_argument("--beta", type=float, default=1.0, help="task success probabilities ~ Beta(beta, beta)")
    args = p.parse_args()
    import logging

    logging.getLogger("orchestrator").setLevel(logging.ERROR)
    t0 = time.monotonic()
    runs = [grinding_run(args.batches, args.keys, args.honest, seed, args.beta) for seed in range(args.seeds)]
    print(json.dumps({"pool": SELECTION_POOL, "keys_per_batch": args.keys, "runs": runs,
                      "seconds": round(time.monotonic() - t0, 1)}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
