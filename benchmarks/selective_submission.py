"""Selective submission (issue 36): workers that generate honestly and choose which of their draws train. Every token of
theirs is honestly sampled, so no sampling check sees them; what stops them is the orchestrator's rule that every
assignment drawn is announced before its deadline or costs a strike (lost and expired assignments are never
validated). The run is the real orchestrator (the in-process app of `intellect orchestrator`, the demo's pool shape,
on a simulated clock, so hours of pool time take seconds) with honest workers, one attacker, a validator that accepts
every batch with its rewards, and a learner that reads the accepted batches and announces a version per step. A
sample's reward is honest and fixed by its assignment: 1 with its task's success probability (task difficulties drawn
from Beta(`--beta`), mean 0.5 like the demo's policy after its warm start), drawn from the sample's assigned seed.
The attackers:

- `best-of-K/leave|silence` (hoarding): draws K assignments, generates each, gives the first K - 1 up
  (`leave`: deregisters and heartbeats again; `silence`: stops heartbeating until the deadline of what it
  holds passed), then announces its draws best first, going on to the next when one is refused;
- `threshold/leave` (announce-or-abandon): announces a draw whose mean reward is at least the pool's mean,
  and gives up the others by leaving.

A `/fresh` suffix gives an attacker that is banned a new key (admitted like any other: no challenge in this
pool); `none` is an honest pool. Per run: the mean reward of the batches the learner read (all, honest
workers', the attacker's) with its standard error, the attacker's draws, announcements, refusals (410),
strikes and keys, and what the hoarder's choice would have trained had lost work still been validated (the
best of each K).

    python benchmarks/selective_submission.py [--hours 4] [--honest 3] [--seeds 2] [--beta 1.0]
                                                [--attackers none,best-of-2/leave,threshold/leave/fresh,...]

`python benchmarks/poisoning.py selection ...` runs the same.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def log(text: str) -> None:
    print(f"[selection {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


SELECTION_POOL = {  # the demo's pool shape (configs/demo.toml) and the orchestrator's defaults for strikes
    "trainer.async_level": 2,
    "data.prompts_per_step": 32,
    "data.samples_per_prompt": 8,
    "trainer.batch_size": 256,
    "trainer.micro_batch_size": 8,
    "orchestrator.prompts_per_assignment": 8,
    "orchestrator.assignment_deadline_s": 600,
    "orchestrator.ban_after_rejections": 3,
    "orchestrator.rejection_window_s": 3600,
    "orchestrator.allow_cpu_nodes": "true",
    "orchestrator.worker_store_writes": "true",
    "orchestrator.num_tasks": 1000,
    "orchestrator.submit_burst": 1000,
    "orchestrator.public_cache_s": 0,
}
TICK_S = 60.0  # simulated seconds per round: one assignment generated per worker and round


class SimClock:
    def __init__(self, start: float = 1_800_000_000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t


class SimPool:
    """The orchestrator's app in process on a simulated clock, and signed clients of it."""

    def __init__(self, tmp: Path, clock: SimClock, rng):
        from fastapi.testclient import TestClient

        from intellect.config_io import load_config
        from intellect.orchestrator_cli import build_app

        overrides = {"run.dir": tmp, "orchestrator.admin_token": "selection", **SELECTION_POOL}
        cfg = load_config(None, [f"--{k}={v}" for k, v in overrides.items()], env={})
        self.clock, self.rng = clock, rng  # the nodes' keys come from `rng`: a run is repeatable from its seed
        self.app = build_app(cfg, clock=clock)
        self.svc = self.app.state.orchestrator
        self.http = TestClient(self.app)
        self.admin = self.client(admin_token="selection")
        self.per_step = -(-cfg.data.prompts_per_step // cfg.orchestrator.prompts_per_assignment)

    def client(self, key=None, admin_token=None):
        from bridge.protocol import OrchestratorClient, RetryPolicy

        return OrchestratorClient(
            "http://testserver",
            key=key,
            admin_token=admin_token,
            clock=self.clock,
            retry=RetryPolicy(attempts=1),
            http=self.http,
        )

    def join(self, role: str):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from bridge.protocol import HardwareReport

        node = self.client(Ed25519PrivateKey.from_private_bytes(self.rng.bytes(32)))
        reply = node.register(role, HardwareReport(cpu_count=2, memory_gib=4))
        if reply.status != "admitted":
            raise RuntimeError(f"selection: the pool refused a {role}: {reply.reasons}")
        return node


class SimLearner:
    """The learner's side of the simulation: it reads the accepted batches, and every `per_step` of them make a
    step, announced as the next version with the batches it took (which frees their room in the async window)."""

    def __init__(self, pool: SimPool):
        self.pool, self.cursor, self.version, self.taken = pool, 0, 0, []

    def poll(self) -> list:
        """The accepted batches not read before, oldest first."""
        page = self.pool.admin.batches(status="accepted", after=self.cursor, limit=1000)
        self.cursor = page.next_after or self.cursor
        for record in page.batches:
            self.taken.append(record.batch_id)
            if len(self.taken) >= self.pool.per_step:
                self.version += 1
                self.pool.admin.announce_policy(self.version, consumed=self.taken)
                self.taken = []
        return page.batches


def honest_rewards(a, difficulty) -> list[float]:
    """The rewards an honest generation of assignment `a` earns: sample i of prompt p succeeds with its task's
    probability, drawn from the sample's assigned seed (who generates it does not matter)."""
    import numpy as np

    group = a.samples_per_prompt
    return [
        float(np.random.default_rng(seed).random() < difficulty[a.task_ids[i // group]])
        for i, seed in enumerate(a.sample_seeds)
    ]


class SimWorker:
    """A worker of the simulated pool: honest (announces every draw), or an attacker (`kind`)."""

    def __init__(self, pool: SimPool, name: str, kind: str, k: int, abandon: str, fresh_keys: bool, mean: float):
        self.pool, self.name, self.kind, self.k, self.abandon = pool, name, kind, k, abandon
        self.fresh_keys, self.mean = fresh_keys, mean
        self.node = pool.join("worker")
        self.keys, self.banned = 1, False
        self.held: list[tuple[float, object]] = []  # (mean reward, assignment) drawn and generated, not announced
        self.silent_until = -math.inf
        self.stats = {
            "draws": 0,
            "announced": 0,
            "refused_410": 0,
            "given_up": 0,
            "draw_rewards": [],
            "chosen_if_lost_work_counted": [],
        }
        self.batch_no = 0

    def _announce(self, a, rewards: list[float]) -> str | None:
        """The batch's id if the orchestrator took it, None if it refused it (410)."""
        from bridge.protocol import BatchAnnouncement, OrchestratorError

        self.batch_no += 1
        batch_id = f"{self.node.node_key[:16]}-{self.batch_no}"
        n = a.prompts * a.samples_per_prompt
        note = BatchAnnouncement(
            batch_id=batch_id,
            assignment_id=a.id,
            version=a.version,
            num_samples=n,
            num_tokens=10 * n,
            store_path=f"file:///store/v{a.version:06d}/{batch_id}",
            sha256="ab" * 32,
        )
        try:
            self.node.announce_batch(note)
        except OrchestratorError as err:
            if err.status != 410:
                raise
            self.stats["refused_410"] += 1
            return None
        self.stats["announced"] += 1
        self.pool.rewards[batch_id] = (self.name, rewards)
        return batch_id

    def _give_up(self) -> None:
        self.stats["given_up"] += 1
        if self.abandon == "leave":
            self.node.deregister()
        else:  # silence: no heartbeat until the deadline of what it holds has passed
            self.silent_until = self.pool.clock() + float(SELECTION_POOL["orchestrator.assignment_deadline_s"])

    def step(self, difficulty) -> None:
        from bridge.protocol import OrchestratorError

        if self.banned or self.pool.clock() < self.silent_until:
            return
        try:
            work = self.node.heartbeat().assignments
        except OrchestratorError as err:
            if err.status != 403 or "banned" not in str(err.detail):
                raise
            if not self.fresh_keys:
                self.banned = True
                return
            self.node, self.keys, self.held = self.pool.join("worker"), self.keys + 1, []
            work = self.node.heartbeat().assignments
        if not work:
            return
        a = work[0]
        rewards = honest_rewards(a, difficulty)
        value = sum(rewards) / len(rewards)
        self.stats["draws"] += 1
        self.stats["draw_rewards"].append(value)
        if self.kind == "honest":
            self._announce(a, rewards)
        elif self.kind == "threshold":
            if value >= self.mean:
                self._announce(a, rewards)
            else:
                self._give_up()
        else:  # best-of-k: hold the draw; give it up unless it is the k-th, then announce the best that is taken
            self.held.append((value, a, rewards))
            if len(self.held) < self.k:
                self._give_up()
                return
            self.stats["chosen_if_lost_work_counted"].append(max(v for v, _, _ in self.held))
            for _, held, held_rewards in sorted(self.held, key=lambda x: -x[0]):
                if self._announce(held, held_rewards) is not None:
                    break
            self.held = []


def selection_run(
    kind: str | None, k: int, abandon: str, fresh_keys: bool, honest: int, hours: float, seed: int, beta: float
) -> dict:
    """One simulated pool: `honest` honest workers and, unless `kind` is None, one attacker."""
    import tempfile

    import numpy as np

    from bridge.protocol import Verdict

    rng = np.random.default_rng(seed)
    difficulty = rng.beta(beta, beta, size=int(SELECTION_POOL["orchestrator.num_tasks"]))
    mean = float(difficulty.mean())
    with tempfile.TemporaryDirectory() as tmp:
        clock = SimClock()
        pool = SimPool(Path(tmp), clock, rng)
        pool.rewards = {}
        validator = pool.join("validator")
        workers = [SimWorker(pool, f"honest{i}", "honest", 1, abandon, False, mean) for i in range(honest)]
        if kind is not None:
            workers.append(SimWorker(pool, "attacker", kind, k, abandon, fresh_keys, mean))
        trained: list[tuple[str, float]] = []
        learner = SimLearner(pool)
        order = list(range(len(workers)))
        for _ in range(int(hours * 3600 / TICK_S)):
            rng.shuffle(order)  # no worker always first to the window's room
            for i in order:
                workers[i].step(difficulty)
            while (claim := validator.claim().batch) is not None:
                name, rewards = pool.rewards[claim.batch_id]
                validator.verdict(claim.batch_id, Verdict(accepted=True, rewards=rewards, num_tokens=10 * len(rewards)))
            for record in learner.poll():
                name, rewards = pool.rewards[record.batch_id]
                trained.append((name, sum(rewards) / len(rewards)))
            clock.t += TICK_S
            pool.svc.sweep()
        ledger = {e.node_key: e for e in pool.admin.ledger(limit=10_000).entries}
        pool.svc.close()

    def summary(values: list[float]) -> dict:
        if not values:
            return {"batches": 0}
        v = np.asarray(values)
        sem = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
        return {"batches": len(v), "mean_reward": round(float(v.mean()), 4), "sem": sem and round(sem, 4)}

    out = {
        "task_mean_success": round(mean, 4),
        "trained_all": summary([r for _, r in trained]),
        "trained_honest": summary([r for n, r in trained if n != "attacker"]),
    }
    if kind is not None:
        attacker = workers[-1]
        st = attacker.stats
        strikes = sum(e.lost_assignments + e.expired_assignments + e.rejected_batches for e in ledger.values())
        out["attacker"] = {
            "kind": kind if kind == "threshold" else f"best-of-{k}",
            "abandon": abandon,
            "fresh_keys": fresh_keys,
            "keys_used": attacker.keys,
            "banned_at_end": attacker.banned,
            "trained": summary([r for n, r in trained if n == "attacker"]),
            "draws": st["draws"],
            "draws_mean_reward": round(float(np.mean(st["draw_rewards"])), 4) if st["draw_rewards"] else None,
            "announced": st["announced"],
            "refused_410": st["refused_410"],
            "given_up": st["given_up"],
            "strikes_in_pool_ledger": strikes,
            "mean_of_its_choices_had_lost_work_trained": (
                round(float(np.mean(st["chosen_if_lost_work_counted"])), 4)
                if st["chosen_if_lost_work_counted"]
                else None
            ),
        }
    return out


def selection_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="selective_submission.py", description="selective submission (issue 36)")
    p.add_argument("--hours", type=float, default=4.0, help="simulated pool time per run")
    p.add_argument("--honest", type=int, default=3, help="honest workers beside the attacker")
    p.add_argument("--seeds", type=int, default=2, help="runs per attacker (task difficulties, keys, draws)")
    p.add_argument("--beta", type=float, default=1.0, help="task success probabilities ~ Beta(beta, beta)")
    p.add_argument(
        "--attackers",
        default="none,best-of-2/leave,best-of-4/leave,best-of-2/silence,best-of-2/leave/fresh,threshold/leave,"
        "threshold/leave/fresh",
        help="comma-separated: none (an honest pool), best-of-K/leave|silence[/fresh], threshold/leave[/fresh]",
    )
    args = p.parse_args(argv)
    import logging

    logging.getLogger("orchestrator").setLevel(logging.ERROR)
    t0 = time.monotonic()
    result = {"pool": SELECTION_POOL, "tick_s": TICK_S, "hours": args.hours, "honest_workers": args.honest}
    runs = {}
    for spec in args.attackers.split(","):
        parts = spec.strip().split("/")
        kind, k = (None, 1) if parts[0] == "none" else ("threshold", 1)
        if parts[0].startswith("best-of-"):
            kind, k = "best-of-k", int(parts[0][len("best-of-") :])
        abandon = parts[1] if len(parts) > 1 else "leave"
        if abandon not in ("leave", "silence") or (parts[0] != "none" and kind is None):
            p.error(f"--attackers: cannot read {spec!r}")
        fresh = len(parts) > 2 and parts[2] == "fresh"
        runs[spec.strip()] = [
            selection_run(kind, k, abandon, fresh, args.honest, args.hours, seed, args.beta)
            for seed in range(args.seeds)
        ]
        log(f"selection: {spec.strip()} done ({time.monotonic() - t0:.0f} s)")
    result["runs"] = runs
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(selection_main(sys.argv[1:]))
