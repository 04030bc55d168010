"""Workers and a validator as users run them (`intellect worker|validator CONFIG`), with a real orchestrator and a
SHARDCAST origin, all processes on 127.0.0.1, on a tiny model:

- version 0 batches from two workers are accepted, with the validator's rewards, which are recomputed here
  independently from the stored tokens;
- a new version is exported and announced: the workers fetch it and their next batches carry it;
- a worker running tampered weights (cheating_worker.py) has every batch rejected for computation and is banned;
- the orchestrator is killed and restarted mid-run: the workers carry on;
- SIGTERM: a worker leaves cleanly and deregisters.
"""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import OrchestratorProcess, free_port

from bridge.protocol import OrchestratorClient, load_or_create_key, public_key_hex
from bridge.rollouts import RolloutStore

TOKEN = "itest-admin"
CHEATER = Path(__file__).with_name("cheating_worker.py")  # a worker running tampered weights
CONFIG = """
[run]
dir = "{run}"
log_level = "INFO"
[data]
task = "sort"
digits = 3
num_tasks = 64
eval_tasks = 0
prompts_per_step = 4
samples_per_prompt = 4
max_prompt_len = 64
max_new_tokens = 12
solve_rate_min = 0.0
[trainer]
batch_size = 16
micro_batch_size = 16
async_level = 1
[loss]
temperature = 1.0
[orchestrator]
allow_cpu_nodes = true
admin_token = "{token}"
prompts_per_assignment = 2
heartbeat_interval_s = 1.0
unhealthy_after_s = 4.0
dead_after_s = 30.0
ban_after_rejections = 2
max_inflight_per_node = 1
[shardcast]
port = {origin_port}
[worker]
orchestrator_url = "{url}"
dtype = "float32"
temperature = 1.0
kv_cache_gib = 1.0
verify_swaps = 0
[validator]
orchestrator_url = "{url}"
dtype = "float32"
"""


def wait_until(predicate, timeout: float, what: str, procs=(), step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args[3]} exited with {p.returncode} while waiting for {what}")
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def export_version(model_dir: Path, weights: Path, version: int, noise: float = 0.0) -> None:
    """Export the tiny model (plus a small perturbation, as a training step would make) as weights/vNNNNNN."""
    import jax
    from flax import nnx

    from jax_trainer.models import export_hf, load_hf

    model = load_hf(model_dir, param_dtype="float32", compute_dtype="float32")
    if noise:
        graph, params = nnx.split(model)
        leaves, tree = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(version), len(leaves))
        leaves = [x + noise * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
        model = nnx.merge(graph, jax.tree.unflatten(tree, leaves))
    export_hf(model, weights / f"v{version:06d}", version=version, source_dir=model_dir, dtype="float32")


class Pool:
    def __init__(self, tmp: Path, model_dir: Path):
        self.tmp, self.model_dir = tmp, model_dir
        self.run_dir = tmp / "run"
        self.weights = self.run_dir / "weights"
        self.weights.mkdir(parents=True)
        (tmp / "logs").mkdir()
        self.orch_port, self.origin_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.orch_port}"
        self.config = tmp / "pool.toml"
        self.config.write_text(CONFIG.format(run=self.run_dir, token=TOKEN, url=self.url, origin_port=self.origin_port))
        self.procs: dict[str, subprocess.Popen] = {}
        self.orchestrator = OrchestratorProcess(tmp / "logs" / "orchestrator.log", self.config, port=self.orch_port)
        self.admin = OrchestratorClient(self.url, admin_token=TOKEN)

    def start(self, name: str, *argv: str, program: tuple[str, ...] = ("-m", "intellect")) -> subprocess.Popen:
        log = open(self.tmp / "logs" / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, *program, *argv], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        self.procs[name] = proc
        return proc

    def node(self, role: str, name: str) -> tuple[subprocess.Popen, str]:
        key = self.tmp / "keys" / f"{name}.key"
        public = public_key_hex(load_or_create_key(key))
        return self.start(name, role, str(self.config), f"--{role}.key_path", str(key)), public

    def log(self, name: str) -> str:
        return (self.tmp / "logs" / f"{name}.log").read_text(errors="replace")

    def batches(self, status: str) -> list:
        listed = self.admin.all_batches(status, after=0)[0]
        if status == "accepted" and listed:  # the test plays the learner: it takes what it reads (frees the window)
            self.admin.announce_policy(self.admin.policy().version, consumed=[b.batch_id for b in listed][-4096:])
        return listed

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(15)
        self.orchestrator.kill()
        self.admin.close()


@pytest.fixture
def pool(tmp_path, tiny_model):
    p = Pool(tmp_path, tiny_model("qwen2"))
    yield p
    p.close()


def test_workers_and_validator_with_new_versions_a_cheater_and_an_orchestrator_restart(pool):
    export_version(pool.model_dir, pool.weights, 0)
    pool.orchestrator.start()
    origin = pool.start("origin", "shardcast", "origin", str(pool.config), "--dir", str(pool.weights))
    origin_url = f"http://127.0.0.1:{pool.origin_port}"
    pool.admin.announce_policy(0, relays=[origin_url])
    w1, key1 = pool.node("worker", "worker1")
    w2, key2 = pool.node("worker", "worker2")
    val, _ = pool.node("validator", "validator")
    procs = [w1, w2, val, origin]

    # version 0: both workers' batches are accepted, with rewards a reference scoring agrees with
    seen: dict[str, list] = {}

    def accepted_from(keys: set[str], version: int) -> bool:
        for b in pool.batches("accepted"):
            seen.setdefault(b.batch_id, b)
        return keys <= {b.node_key for b in seen.values() if b.version == version}

    wait_until(lambda: accepted_from({key1, key2}, 0), 240, "accepted version-0 batches of both workers", procs)
    with sqlite3.connect(pool.run_dir / "orchestrator.db") as conn:  # the verdicts' numbers of the near-tie ledger
        judged = conn.execute(
            "SELECT near_tie_tokens, near_tie_cost, num_tokens FROM assignments WHERE state = 'accepted'"
        ).fetchall()
    assert judged and all(0 < tokens < total and cost >= 0 for tokens, cost, total in judged), judged
    store = RolloutStore.open(pool.run_dir / "rollouts")
    from transformers import AutoTokenizer

    from intellect.config import DataConfig
    from intellect.tasks_setup import training_tasks

    tasks = training_tasks(DataConfig(task="sort", digits=3, num_tasks=64, eval_tasks=0))
    tok = AutoTokenizer.from_pretrained(pool.model_dir)
    record = next(b for b in seen.values() if b.version == 0)
    batch = store.read(0, record.batch_id, expect_sha256=record.sha256)
    assert batch.num_samples == 2 * 4 and len(record.rewards) == 8
    for i in range(batch.num_samples):
        completion = batch.sample_tokens(i)[batch.prompt_lens[i] :]
        text = tok.decode(completion, skip_special_tokens=True).strip().splitlines()
        expected = float(bool(text) and text[-1].strip().rstrip(".") == tasks[int(batch.task_ids[i])].answer)
        assert record.rewards[i] == expected == batch.rewards[i]
    assert np.all(batch.logprobs[batch.offsets[0] : batch.offsets[0] + batch.prompt_lens[0]] == 0)
    # the replayable sampler's kept mass reaches the store: full-distribution logprobs for the learner's ratios
    assert batch.full_logprobs is not None and np.all(batch.full_logprobs <= batch.logprobs + 1e-4)

    # a new version: the workers fetch it and their next batches carry it
    export_version(pool.model_dir, pool.weights, 1, noise=0.02)
    pool.admin.announce_policy(1)
    wait_until(lambda: accepted_from({key1, key2}, 1), 240, "accepted version-1 batches of both workers", procs)

    # a worker with tampered weights: rejected for computation, banned after 2 rejections
    cheat = pool.start(
        "cheater",
        "0.3",
        str(pool.config),
        "--worker.key_path",
        str(pool.tmp / "keys" / "c.key"),
        program=(str(CHEATER),),
    )
    cheat_key = public_key_hex(load_or_create_key(pool.tmp / "keys" / "c.key"))

    def banned():
        accepted_from(set(), 1)  # read accepted batches, as the learner does: it frees room for new assignments
        return next((n for n in pool.admin.nodes().nodes if n.key == cheat_key and n.banned), None)

    node = wait_until(banned, 240, "the tampered worker's ban", procs)
    assert "rejected" in (node.ban_reason or "")
    rejected = [b for b in pool.batches("rejected") if b.node_key == cheat_key]
    assert len(rejected) >= 2 and all("computation" in b.failed_checks for b in rejected)
    assert not [b for b in seen.values() if b.node_key == cheat_key]
    assert cheat.wait(60) == 3 and "banned" in pool.log("cheater")

    # the orchestrator dies and comes back on the same database: the workers carry on
    before = {b.batch_id for b in pool.batches("accepted")} | set(seen)
    pool.orchestrator.kill()
    time.sleep(3)
    pool.orchestrator.start()
    wait_until(
        lambda: {b.node_key for b in pool.batches("accepted") if b.batch_id not in before} >= {key1, key2},
        240,
        "accepted batches of both workers after the restart",
        procs,
    )
    assert w1.poll() is None and w2.poll() is None and val.poll() is None

    # SIGTERM: the worker finishes what it holds, deregisters and exits 0
    w1.send_signal(signal.SIGTERM)
    assert w1.wait(120) == 0
    assert "deregistered" in pool.log("worker1")
    state = next(n for n in pool.admin.nodes().nodes if n.key == key1)
    assert state.state == "dead" and state.open_assignments == 0
