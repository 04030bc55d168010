"""Hostile batches against a real validator (issue 17, point 3): a real orchestrator, a SHARDCAST origin and a
real `intellect validator` process, all on 127.0.0.1 with the tiny model (`test_worker_validator`'s pool).

A worker registered with bridge.protocol's client takes its assignments and answers them with batches built
by the public APIs (`RolloutBatch.from_samples`, `RolloutStore.write`): a short batch (fewer samples than
assigned), a task id of 10**12, an oversized batch (3,000 samples for an 8-sample assignment) and a size
bomb (a few KB whose metadata declares 1 GiB of arrays, no chunks stored). Each crashed or exhausted the
validator before; now each is rejected, the orchestrator records the rejections, and the validator process
survives them all, its peak memory unmoved by the bomb.
"""

from __future__ import annotations

import json
import time

import pytest
from test_worker_validator import Pool, export_version, wait_until

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.protocol import BatchAnnouncement, HardwareReport, OrchestratorClient, load_or_create_key
from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from gpu_workers.node import join
from gpu_workers.tasks import prompt_tokens, synthetic_tasks

TASKS = synthetic_tasks("sort", 64, 0, 3)  # the pool's [data]: task "sort", digits 3, num_tasks 64
STOP = 0  # the tiny model's eos id


@pytest.fixture
def pool(tmp_path, tiny_model):
    p = Pool(tmp_path, tiny_model("qwen2"))
    config = p.config.read_text()  # room for four assignments at once, and no ban before the fourth rejection
    p.config.write_text(  # the hostile worker writes the store itself, as in a pool with worker_store_writes
        config.replace("ban_after_rejections = 2", "ban_after_rejections = 50").replace(
            "max_inflight_per_node = 1", "max_inflight_per_node = 4\nworker_store_writes = true"
        )
    )
    yield p
    p.close()


def _hostile(tokenizer, node_key: str, a, batch_id: str, prompts: int, task_id: int | None = None) -> RolloutBatch:
    """`prompts` groups shaped as assignment `a` asks (its tasks, seeds and prompts; completions of 4 tokens
    ending in the stop token), with sample 0's task id replaced by `task_id` if given."""
    group = a.samples_per_prompt
    n = prompts * group
    ids = [t for t in assigned_task_ids(node_key, a.version, a.k, len(TASKS), prompts, a.salt) for _ in range(group)]
    if task_id is not None:
        ids[0] = task_id
    prompt_of = {t: prompt_tokens(TASKS[t], tokenizer) for t in set(ids) if t < len(TASKS)}
    tokens = [prompt_of.get(t, [5, 6, 7]) + [9, 10, 11, STOP] for t in ids]
    return RolloutBatch.from_samples(
        BatchMeta(batch_id, node_key, a.version, a.id, {"temperature": 1.0}),
        tokens=tokens,
        prompt_lens=[len(t) - 4 for t in tokens],
        logprobs=[[0.0] * (len(t) - 4) + [-1.0] * 4 for t in tokens],
        task_ids=ids,
        group_ids=[i // group for i in range(n)],
        seeds=assigned_sample_seeds(node_key, a.version, a.k, n, a.salt),
        finish=[0] * n,
        rewards=[0.0] * n,
        proofs=[b"\0" * 258] * n,
    )


def _bomb(store: RolloutStore, batch: RolloutBatch) -> None:
    """Rewrite a committed batch's metadata to declare 2**27 tokens (1 GiB of tokens and logprobs) with no
    chunk stored beyond the real ones; COMMIT stays the one announced."""
    prefix = f"v{batch.meta.version:06d}/{batch.meta.batch_id}/"
    huge = 1 << 27
    for key, change in (
        (prefix + "tokens/zarr.json", "shape"),
        (prefix + "logprobs/zarr.json", "shape"),
        (prefix + "meta.json", "num_tokens"),
    ):
        doc = json.loads(store.kvstore.read(key).result().value)
        if change == "shape":
            doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"] = [huge], [1 << 20]
        else:
            doc["num_tokens"] = huge
        store.kvstore.write(key, json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).result()


def _peak_rss_mib(pid: int, reset: bool = False) -> float:
    if reset:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_the_validator_process_rejects_hostile_batches_and_survives(pool):
    from transformers import AutoTokenizer

    t0 = time.monotonic()
    export_version(pool.model_dir, pool.weights, 0)
    pool.orchestrator.start()
    origin = pool.start("origin", "shardcast", "origin", str(pool.config), "--dir", str(pool.weights))
    pool.admin.announce_policy(0, relays=[f"http://127.0.0.1:{pool.origin_port}"])
    validator, _ = pool.node("validator", "validator")
    procs = [validator, origin]

    key = load_or_create_key(pool.tmp / "keys" / "hostile.key")
    worker = OrchestratorClient(pool.url, key=key)
    node_key = join(worker, "worker", HardwareReport.this_machine_cpu_only()).node_key
    store = RolloutStore.open(pool.run_dir / "rollouts")
    tokenizer = AutoTokenizer.from_pretrained(pool.model_dir)
    used: set[int] = set()

    def assignment():
        def fresh():
            return next((a for a in worker.heartbeat([], {}).assignments if a.id not in used), None)

        a = wait_until(fresh, 30, "an assignment for the hostile worker", procs)
        used.add(a.id)
        return a

    def announce(batch: RolloutBatch, a, bomb: bool = False) -> str:
        digest = store.write(batch)
        if bomb:
            _bomb(store, batch)
        worker.announce_batch(
            BatchAnnouncement(
                batch_id=batch.meta.batch_id,
                assignment_id=a.id,
                version=a.version,
                store_path=store.batch_url(a.version, batch.meta.batch_id),
                sha256=digest,
                num_samples=a.prompts * a.samples_per_prompt,
                num_tokens=len(batch.tokens),
            )
        )
        return batch.meta.batch_id

    def rejected(ids: set[str]):
        found = {b.batch_id: b for b in pool.batches("rejected") if b.batch_id in ids}
        return found if len(found) == len(ids) else None

    try:
        a = assignment()
        assert a.prompts * a.samples_per_prompt == 8
        short = announce(_hostile(tokenizer, node_key, a, "short", prompts=1), a)
        a = assignment()
        foreign = announce(_hostile(tokenizer, node_key, a, "foreign", prompts=a.prompts, task_id=10**12), a)
        a = assignment()
        oversized = announce(_hostile(tokenizer, node_key, a, "oversized", prompts=750), a)  # 3,000 samples
        records = wait_until(lambda: rejected({short, foreign, oversized}), 120, "three rejections", procs)

        base = _peak_rss_mib(validator.pid, reset=True)
        a = assignment()
        bomb = announce(_hostile(tokenizer, node_key, a, "bomb", prompts=a.prompts), a, bomb=True)
        records.update(wait_until(lambda: rejected({bomb}), 60, "the size bomb's rejection", procs))
        growth = _peak_rss_mib(validator.pid) - base
    finally:
        worker.close()

    assert records[short].failed_checks == ["store"] and "meta.num_samples: 4 samples" in records[short].reason
    assert records[oversized].failed_checks == ["store"] and "3000 samples" in records[oversized].reason
    assert records[foreign].failed_checks == ["fixed_data", "reward"]
    assert "outside the task list" in records[foreign].reason
    assert records[bomb].failed_checks == ["store"] and "meta.num_tokens: declares 134217728" in records[bomb].reason
    assert all(r.node_key == node_key and r.validator_key for r in records.values())
    assert growth < 100, f"the validator's peak memory grew by {growth:.0f} MiB reading the size bomb"
    assert validator.poll() is None, pool.log("validator")[-3000:]
    log = pool.log("validator")
    assert "Traceback" not in log and log.count("REJECTED") + log.count("verdict on") >= 4
    print(f"hostile batches judged in {time.monotonic() - t0:.1f} s from the start; bomb: +{growth:.1f} MiB peak")
