"""`intellect run` as a user runs it: the whole pool on this machine, killed with SIGKILL mid-run (launcher and
every role at once), then `--resume`d to the end, with the rollout store on an S3 API server (moto, IAM enforced):
workers upload their batches to the orchestrator's ingest, which writes them to the bucket; the validator reads
them there and the learner reads them with the digest check and deletes old versions (retention), all with the
pool's credentials, which the launcher does not hand to the workers.

Checked: the resumed learner starts from its last checkpoint; no rollout batch is trained on twice; every
batch accepted before the kill is still recorded as accepted, and the ledger only grows; the final policy is
an HF directory that transformers loads and generates with; the run's charts are written. The model is the
random tiny one with the length reward (a random model solves nothing, but its completions' lengths vary, so
groups have advantages to train on), without online filtering so that a step never waits for a group that varies.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import S3Server

CONFIG = """
[run]
dir = "{run}"
num_workers = 1
num_validators = 1
num_relays = 1
[model]
path = "{model}"
param_dtype = "float32"
compute_dtype = "float32"
remat = false
max_seq_len = 128
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
length_targets = [2, 12]
length_penalty = 0.1
online_filter = false           # a random model may collapse to one length: its steps must still come
[trainer]
batch_size = 16
micro_batch_size = 16
steps = 5
async_level = 1
checkpoint_interval = 2
export_dtype = "float32"
rollout_keep_versions = 2
[loss]
temperature = 1.0
[optim]
lr = 1e-4
warmup_steps = 0
grad_clip = 1.0
[ingest]
store_url = '{store}'
[orchestrator]
allow_cpu_nodes = true
prompts_per_assignment = 2
heartbeat_interval_s = 1.0
unhealthy_after_s = 4.0
dead_after_s = 30.0
[worker]
dtype = "float32"
temperature = 1.0
kv_cache_gib = 1.0
verify_swaps = 0
[validator]
dtype = "float32"
"""


def learner_records(run: Path) -> list[dict]:
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the line being written when the run was killed
            continue
        if record.get("role") == "learner":
            out.append(record)
    return out


def accepted_in_db(run: Path) -> set[str]:
    with sqlite3.connect(run / "orchestrator.db") as db:
        return {row[0] for row in db.execute("SELECT batch_id FROM assignments WHERE state = 'accepted'")}


def intellect_processes(run: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "intellect" in cmd and str(run.parent) in cmd:
                found.append(cmd)
    return found


@pytest.fixture
def s3(tmp_path):
    server = S3Server(tmp_path / "moto.log").start()
    yield server
    server.stop()


def test_kill_9_everything_then_resume_to_the_end(tmp_path, tiny_model, s3):
    run = tmp_path / "run"
    config = tmp_path / "run.toml"
    config.write_text(CONFIG.format(run=run, model=tiny_model("qwen2"), store=s3.spec("run/")))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **s3.credentials("pool")}
    argv = [sys.executable, "-m", "intellect", "run", str(config)]
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    from jax_trainer.checkpoint import Checkpointer

    deadline = time.monotonic() + 420
    while time.monotonic() < deadline:
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        steps = [r["step"] for r in learner_records(run)] if (run / "metrics.jsonl").exists() else []
        if steps and max(steps) >= 3:
            break
        time.sleep(1)
    else:
        pytest.fail("the learner did not reach step 3 in time:\n" + (tmp_path / "first.log").read_text()[-3000:])
    os.killpg(first.pid, signal.SIGKILL)  # the launcher and every role at once: nothing runs its shutdown code
    first.wait(30)
    time.sleep(2)
    assert intellect_processes(run) == []
    restored = Checkpointer(run / "checkpoints").latest_step()
    assert restored is not None and restored >= 2
    before = accepted_in_db(run)
    assert before
    count_before = len(learner_records(run))

    out = subprocess.run([*argv, "--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["final_version"] == 5

    records = learner_records(run)
    resumed = records[count_before:]
    assert resumed and resumed[0]["step"] == restored + 1  # the resumed learner starts after its checkpoint
    last_by_step = {r["step"]: r["batch_ids"] for r in records}  # a step redone after the restore: its last run
    assert sorted(last_by_step) == list(range(1, 6))
    ids = [b for step in sorted(last_by_step) for b in last_by_step[step]]
    assert len(ids) == len(set(ids)), "a batch was trained on twice"
    assert before <= accepted_in_db(run), "a batch accepted before the kill is no longer recorded as accepted"
    with sqlite3.connect(run / "orchestrator.db") as db:
        assert db.execute("SELECT count(*) FROM assignments WHERE state = 'accepted'").fetchone()[0] >= len(before)
        # every accepted batch has the validator's logprobs beside it, and the learner (logprob_source "validator", a
        # pool's default: pi_old is theirs) read each one under the digest its verdict carried
        unsalted, no_logprobs = db.execute(
            "SELECT sum(salt IS NULL), sum(logprobs_sha256 IS NULL) FROM assignments WHERE state = 'accepted'"
        ).fetchone()
        assert (unsalted, no_logprobs) == (0, 0)
    assert not any(r.get("invalid_batches") for r in records), [r for r in records if r.get("invalid_batches")]
    assert all("mismatch_kl" in r for r in records)

    # the batches are in the bucket, every one of a version the retention keeps (the last step, index 4, pruned
    # versions below 4 - 2 + 1 = 3) unless its upload ended after that prune (an assignment still in the async
    # window when the run ended); the workers never held the bucket's credentials
    stored = s3.snapshot("run/")
    committed = [key.split("/")[1:3] for key in stored if key.endswith("/COMMIT")]
    assert committed and max(int(v[1:]) for v, _ in committed) >= 4, sorted(committed)
    last = records[-1]
    floor = (last["step"] - 1) - 2 + 1
    pruned_at = last["time"] - last["step_s"]  # the pipeline prunes as it hands the step its batch
    with sqlite3.connect(run / "orchestrator.db") as db:
        announced = dict(db.execute("SELECT batch_id, announced_at FROM assignments WHERE batch_id IS NOT NULL"))
    kept_old = [(v, b, announced.get(b)) for v, b in committed if int(v[1:]) < floor]
    assert all(at is not None and at > pruned_at for _, _, at in kept_old), (floor, pruned_at, kept_old)
    assert any(r.get("pruned_batches", 0) > 0 for r in learner_records(run))
    assert "uploaded batch" in (run / "logs" / "worker0.log").read_text()
    final = Path(summary["final_policy"])
    assert (final / "STABLE").exists()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(final)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Sort the digits: 3 1 2"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert {Path(p).name for p in summary["plots"]} >= {"reward.png", "verdicts.png", "summary.png"}
