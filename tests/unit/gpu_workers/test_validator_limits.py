"""Hostile batches against the validator's bounds (issue 17, point 3), each written as the attack, then the
defence: a batch cannot make `RolloutStore.read` allocate beyond what its assignment allows, a batch with
another sample count or a task id beyond the task list is rejected before any prefill, any exception the
content raises in the checks is a rejection naming it, and a verdict the orchestrator refuses neither crashes
the validator nor makes it judge the batch again and again.

The batches are built with the public APIs (`RolloutBatch.from_samples`, `RolloutStore.write`, the
assignment's task ids and seeds); the size bombs then edit the stored metadata, as a worker can. The
validator runs with the tiny model's tokenizer and a prefill stand-in that counts its calls (prefill must
not run for these batches; where it does, its made-up outputs only fail computation).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types

import numpy as np
import pytest
import torch

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.protocol import BatchRecord, OrchestratorError, Verdict
from bridge.rollouts import CODECS, BatchMeta, ReadLimits, RolloutBatch, RolloutStore, RolloutStoreError
from bridge.shardcast import ShardcastError
from gpu_workers import checks
from gpu_workers.node import Stop
from gpu_workers.prefill import Prefilled
from gpu_workers.tasks import prompt_tokens, synthetic_tasks

NODE = "ab" * 32
VERSION, K = 0, 3
PROMPTS, GROUP = 2, 2
ASSIGNED = PROMPTS * GROUP
MAX_TOKENS = 12
MAX_MODEL_LEN = 256 + MAX_TOKENS
STOP = 0  # the tiny model's eos id
TASKS = synthetic_tasks("sort", 64, 0, 3)


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak resident set size to the current one
        f.write("5")


def _peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("qwen2"))


def assigned_batch(
    tokenizer, *, batch_id: str = "b-1", prompts: int = PROMPTS, completion: int = 5, task_ids: list[int] | None = None
) -> RolloutBatch:
    """A batch shaped as the assignment (NODE, VERSION, K) asks, `prompts` prompts of GROUP samples (the
    assignment's task ids, seeds and prompts), each completion `completion` tokens ending in the stop token."""
    n = prompts * GROUP
    ids = task_ids or [t for t in assigned_task_ids(NODE, VERSION, K, len(TASKS), prompts) for _ in range(GROUP)]
    tokens, prompt_lens, logprobs = [], [], []
    for i in range(n):
        prompt = prompt_tokens(TASKS[ids[i]], tokenizer) if ids[i] < len(TASKS) else [5, 6, 7]
        body = [5 + (i + j) % 7 for j in range(completion - 1)] + [STOP]
        tokens.append(prompt + body)
        prompt_lens.append(len(prompt))
        logprobs.append([0.0] * len(prompt) + [-1.0] * len(body))
    return RolloutBatch.from_samples(
        BatchMeta(batch_id, NODE, VERSION, K, {"temperature": 1.0}),
        tokens=tokens,
        prompt_lens=prompt_lens,
        logprobs=logprobs,
        task_ids=ids,
        group_ids=[i // GROUP for i in range(n)],
        seeds=assigned_sample_seeds(NODE, VERSION, K, n),
        finish=[0] * n,
        rewards=[0.0] * n,
        proofs=[b"\0" * 258 * math.ceil(completion / 32)] * n,
    )


def limits(n: int = ASSIGNED) -> ReadLimits:
    return ReadLimits.for_assignment(n, MAX_TOKENS, MAX_MODEL_LEN)


def _edit_json(store: RolloutStore, key: str, **changes) -> None:
    doc = json.loads(store.kvstore.read(key).result().value)
    for name, value in changes.items():
        if name == "chunk":
            doc["chunk_grid"]["configuration"]["chunk_shape"] = [value]
        else:
            doc[name] = value
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    store.kvstore.write(key, raw).result()


# -- the store's limits ----------------------------------------------------------------------------------


def test_a_size_bomb_is_refused_from_its_metadata_without_allocating(tmp_path, tokenizer):
    """Attack: a ~10 KB batch whose meta.json and zarr.json declare 2**27 tokens (1 GiB of tokens and
    logprobs, no chunks stored: tensorstore fills them with zeros). Defence: the read is refused from
    meta.json's counts, naming the field, and the reader's peak memory does not grow."""
    store = RolloutStore.open(tmp_path / "store")
    digest = store.write(assigned_batch(tokenizer))
    huge = 1 << 27
    for name in ("tokens", "logprobs"):
        _edit_json(store, f"v000000/b-1/{name}/zarr.json", shape=[huge], chunk=1 << 20)
    _edit_json(store, "v000000/b-1/meta.json", num_tokens=huge)
    _peak_rss_reset()
    before = _peak_rss_mib()
    with pytest.raises(RolloutStoreError) as refused:
        store.read(VERSION, "b-1", expect_sha256=digest, limits=limits())
    assert _peak_rss_mib() - before < 32
    assert refused.value.field == "meta.num_tokens" and refused.value.batch == "v000000/b-1"
    assert f"declares {huge} tokens" in str(refused.value)


def test_an_array_declaring_more_than_meta_json_is_refused_by_name(tmp_path, tokenizer):
    """Attack: meta.json stays honest, but proofs/zarr.json declares 2**30 bytes (1 GiB, no chunks stored).
    Defence: the array's declared shape is checked against the limit before it is read."""
    store = RolloutStore.open(tmp_path / "store")
    digest = store.write(assigned_batch(tokenizer))
    _edit_json(store, "v000000/b-1/proofs/zarr.json", shape=[1 << 30], chunk=1 << 20)
    _peak_rss_reset()
    before = _peak_rss_mib()
    with pytest.raises(RolloutStoreError) as refused:
        store.read(VERSION, "b-1", expect_sha256=digest, limits=limits())
    assert _peak_rss_mib() - before < 32
    assert refused.value.field == "proofs" and "more than the" in refused.value.reason


def test_chunks_far_larger_than_their_array_are_refused(tmp_path, tokenizer):
    """Attack: the honest offsets rewritten in one chunk of 2**24 elements (zstd: a few KB stored; the
    canonical digest is unchanged): the 5-element array would be decoded as a 128 MiB chunk, and so could
    every other array. Defence: refused by name."""
    import tensorstore as ts

    store = RolloutStore.open(tmp_path / "store")
    batch = assigned_batch(tokenizer)
    digest = store.write(batch)
    key = "v000000/b-1/offsets/"
    doc = json.loads(store.kvstore.read(key + "zarr.json").result().value)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 24]
    doc["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, CODECS["zstd"](8)]
    store.kvstore.delete_range(ts.KvStore.KeyRange(key.encode(), b"v000000/b-1/offsets0")).result()
    array = ts.open(
        {"driver": "zarr3", "metadata": doc}, kvstore=store.kvstore / key, context=store.context, create=True
    ).result()
    array.write(batch.offsets).result()
    assert len(store.kvstore.read(key + "0").result().value) < 64 << 10
    with pytest.raises(RolloutStoreError) as refused:
        store.read(VERSION, "b-1", expect_sha256=digest, limits=limits())
    assert refused.value.field == "offsets" and "chunk shape" in refused.value.reason


@pytest.mark.parametrize("prompts", [1, 3 * PROMPTS], ids=["fewer", "more"])
def test_a_batch_with_another_sample_count_is_refused_before_any_array_is_read(tmp_path, tokenizer, prompts):
    """Attack: a batch of 2 or 12 samples for a 4-sample assignment (3,000 samples for 64 were all
    prefilled; fewer crashed the validator when the orchestrator refused its acceptance). Defence: meta.json's
    sample count must be the assignment's."""
    store = RolloutStore.open(tmp_path / "store")
    digest = store.write(assigned_batch(tokenizer, prompts=prompts))
    with pytest.raises(RolloutStoreError) as refused:
        store.read(VERSION, "b-1", expect_sha256=digest, limits=limits())
    assert refused.value.field == "meta.num_samples"
    assert f"{prompts * GROUP} samples; the reader expects exactly {ASSIGNED}" in refused.value.reason


def test_a_sample_longer_than_the_pool_allows_is_refused(tmp_path, tokenizer):
    """Attack: one sample of 300 completion tokens when the pool allows a prompt of 256 + 12 tokens; the
    totals stay within the batch's bounds. Defence: the per-sample bound."""
    store = RolloutStore.open(tmp_path / "store")
    long = assigned_batch(tokenizer, completion=300)
    digest = store.write(long)
    with pytest.raises(RolloutStoreError) as refused:
        store.read(
            VERSION,
            "b-1",
            expect_sha256=digest,
            limits=ReadLimits(min_samples=ASSIGNED, max_samples=ASSIGNED, max_sample_tokens=MAX_MODEL_LEN),
        )
    assert refused.value.field == "offsets" and f"more than the {MAX_MODEL_LEN}" in refused.value.reason
    assert store.read(VERSION, "b-1", expect_sha256=digest).num_samples == ASSIGNED  # no limits: as before


# -- the checks ----------------------------------------------------------------------------------------


class CountingPrefill:
    """Stands in for `gpu_workers.prefill.Prefill`: counts the samples it is asked to prefill and returns
    made-up hidden states and logits (or raises `error`)."""

    vocab_size = 512

    def __init__(self, error: Exception | None = None):
        self.samples, self.error = 0, error

    def run(self, samples):
        if self.error is not None:
            raise self.error
        self.samples += len(samples)
        gen = torch.Generator().manual_seed(0)
        return [
            Prefilled(torch.randn(len(c), 128, generator=gen), torch.randn(len(c), self.vocab_size, generator=gen))
            for _, c in samples
        ]


def _samples(batch: RolloutBatch) -> list[checks.Sample]:
    return checks.samples_from_arrays(batch.arrays())


def _assignment(tokenizer, num_samples: int | None = ASSIGNED, prompt_of=None) -> checks.AssignedWork:
    def prompt(task_id: int, target: int):
        return prompt_tokens(TASKS.tasks[task_id], tokenizer, target)  # raises IndexError beyond the list

    return checks.AssignedWork(NODE, VERSION, K, len(TASKS), GROUP, prompt_of or prompt, num_samples=num_samples)


DECLARED = checks.Declared(
    temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, stop_token_ids=frozenset({STOP}), max_model_len=MAX_MODEL_LEN
)


def test_a_task_id_beyond_the_task_list_is_a_fixed_data_failure(tokenizer):
    """Attack: sample 0 claims task 10**12 (it passes the store's checks; the prompt lookup raised
    IndexError and crashed every validator that claimed the batch). Defence: fixed data names it, the prompt
    lookup is only asked for assigned tasks, and no prefill runs."""
    honest = assigned_batch(tokenizer)
    ids = honest.task_ids.tolist()
    ids[0] = 10**12
    asked = []

    def prompt(task_id: int, target: int):
        asked.append(task_id)
        return prompt_tokens(TASKS.tasks[task_id], tokenizer, target)

    samples = _samples(assigned_batch(tokenizer, task_ids=ids))
    verdict = checks.check_fixed_data(samples, _assignment(tokenizer, prompt_of=prompt))
    assert not verdict.passed
    assert any(f"outside the task list (0..{len(TASKS) - 1}; sample 0: {10**12})" in r for r in verdict.reasons)
    assert 10**12 not in asked and len(asked) == ASSIGNED - 1
    prefill = CountingPrefill()
    result = checks.validate_batch(samples, prefill, DECLARED, _assignment(tokenizer), lambda s: 0.0)
    assert not result.accepted and prefill.samples == 0
    assert set(result.failed_checks()) == {"fixed_data"}
    assert all(
        v.reasons == ("not run: batch failed fixed_data",)
        for s in result.samples
        for v in s.verdicts
        if v.check in ("computation", "sampling")
    )


def test_a_sample_count_other_than_the_assignments_is_a_fixed_data_failure(tokenizer):
    """Attack: a whole number of groups, but one prompt instead of the assignment's two. Defence: the
    assignment's sample count is part of fixed data (for callers that did not read with limits)."""
    samples = _samples(assigned_batch(tokenizer, prompts=1))
    verdict = checks.check_fixed_data(samples, _assignment(tokenizer))
    assert not verdict.passed and verdict.reasons == (
        f"{GROUP} samples; the assignment has {ASSIGNED} ({PROMPTS} prompts x {GROUP})",
    )


def test_no_prefill_once_every_sample_failed_termination(tokenizer):
    """Attack: every completion runs past max_tokens (the validator prefilled them all). Defence: no prefill;
    computation and sampling say they did not run and are not counted as failed. One failing sample out of
    four still has the batch prefilled, for its numbers."""
    too_long = _samples(assigned_batch(tokenizer, completion=MAX_TOKENS + 1))
    prefill = CountingPrefill()
    result = checks.validate_batch(too_long, prefill, DECLARED, _assignment(tokenizer))
    assert prefill.samples == 0 and not result.accepted
    assert result.failed_checks() == {"termination": ASSIGNED}
    assert result.reasons(20)[-2:] == [
        "computation: not run: batch failed termination",
        "sampling: not run: batch failed termination",
    ]
    one_bad = _samples(assigned_batch(tokenizer))
    one_bad[0] = checks.Sample(**{**vars(one_bad[0]), "finish": 1})
    result = checks.validate_batch(one_bad, prefill, DECLARED, _assignment(tokenizer))
    assert prefill.samples == ASSIGNED and result.failed_checks()["termination"] == 1


# -- the validator ---------------------------------------------------------------------------------------


class FakeClient:
    """The orchestrator as the validator's loop sees it: `refuse(verdict)` -> an HTTP status to refuse it with."""

    base_url = "http://fake"

    def __init__(self, refuse=lambda verdict: None):
        self.refuse, self.posted = refuse, []

    def verdict(self, batch_id: str, verdict: Verdict):
        status = self.refuse(verdict)
        if status:
            raise OrchestratorError(status, "refused by the test", "POST", f"/v1/batches/{batch_id}/verdict")
        self.posted.append(verdict)
        return types.SimpleNamespace(batch_id=batch_id)


@pytest.fixture
def validator(tmp_path, tiny_model, tokenizer):
    from bridge.shardcast.config import ShardcastConfig
    from gpu_workers.config import DataConfig, ValidatorConfig, WorkerConfig
    from gpu_workers.validator import Validator, _Loaded

    pool = WorkerConfig(orchestrator_url="http://127.0.0.1:9", temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS)
    data = DataConfig(samples_per_prompt=GROUP, max_prompt_len=MAX_MODEL_LEN - MAX_TOKENS, max_new_tokens=MAX_TOKENS)
    v = Validator(
        ValidatorConfig(orchestrator_url="http://127.0.0.1:9", allow_uncalibrated=True),  # not about calibration
        pool,
        data,
        ShardcastConfig(),
        TASKS,
        key_path=tmp_path / "v.key",
        weights_dir=tmp_path / "weights",
        store=str(tmp_path / "store"),
        stop=Stop(install=False),
    )
    assert v.declared == dataclasses.replace(DECLARED, stop_token_ids=frozenset())  # each version's own in _judge
    v.client.close()
    v.client = FakeClient()
    v.loaded[VERSION] = _Loaded(CountingPrefill(), tokenizer, checks.stop_token_ids(tiny_model("qwen2")))
    yield v
    v.client = types.SimpleNamespace(close=lambda: None)


def _announce(v, batch: RolloutBatch, num_samples: int = ASSIGNED) -> BatchRecord:
    digest = v.store.write(batch)
    return BatchRecord(
        batch_id=batch.meta.batch_id,
        node_key=NODE,
        assignment_id=7,
        assignment_k=K,
        version=VERSION,
        store_path=v.store.batch_url(VERSION, batch.meta.batch_id),
        sha256=digest,
        num_samples=num_samples,
        num_tokens=len(batch.tokens),
        status="submitted",
        announced_at=0.0,
    )


def test_the_validator_rejects_other_sample_counts_and_foreign_task_ids_without_prefill(validator, tokenizer):
    """Attack: the short, the oversized and the out-of-range batches of the issue, as claimed batches.
    Defence: each is a rejection (store, store, fixed data), none reaches prefill, none raises."""
    ids = assigned_batch(tokenizer).task_ids.tolist()
    ids[-1] = 10**12
    cases = {
        "short": (assigned_batch(tokenizer, batch_id="short", prompts=1), ["store"]),
        "over": (assigned_batch(tokenizer, batch_id="over", prompts=6 * PROMPTS), ["store"]),
        "task": (assigned_batch(tokenizer, batch_id="task", task_ids=ids), ["fixed_data", "reward"]),
    }
    for name, (batch, failed) in cases.items():
        verdict = validator.judge(_announce(validator, batch))
        assert not verdict.accepted and verdict.failed_checks == failed, (name, verdict)
    assert "task id 1000000000000 is outside the task list" in verdict.reason
    assert validator.loaded[VERSION].prefill.samples == 0


def test_a_rejection_with_many_long_reasons_is_still_a_verdict(validator, tokenizer):
    """Attack: a batch whose every sample fails computation and sampling (here against made-up prefill
    outputs), or whose content raises an exception with a long message: the reasons ran past the protocol's
    1000 characters, and building the Verdict raised out of the validator. Defence: the reason is cut to fit."""
    verdict = validator.judge(_announce(validator, assigned_batch(tokenizer, batch_id="noisy")))
    assert not verdict.accepted and "computation" in verdict.failed_checks and len(verdict.reason) <= 1000
    validator.loaded[VERSION].prefill.error = ValueError("token \x00" + "x" * 5000)
    verdict = validator.judge(_announce(validator, assigned_batch(tokenizer, batch_id="loud")))
    assert verdict.failed_checks == ["validator"] and len(verdict.reason) == 1000
    assert "ValueError: token \\x00xxx" in verdict.reason


def test_an_exception_raised_by_a_batchs_content_is_a_rejection_naming_it(validator, tokenizer, monkeypatch, caplog):
    """Attack: content that makes the checks raise (here: the prompt lookup, then prefill, made to raise as
    a bug would). Defence: a rejection, "validator", with the exception's type and message, logged with its
    traceback; a reward function that raises is that sample's reward failure."""
    import gpu_workers.validator as module

    def exploding(*args, **kwargs):
        raise RuntimeError("the chat template choked on this prompt")

    monkeypatch.setattr(module, "prompt_tokens", exploding)
    verdict = validator.judge(_announce(validator, assigned_batch(tokenizer, batch_id="p")))
    assert verdict.failed_checks == ["validator"] and not verdict.accepted
    assert "RuntimeError: the chat template choked on this prompt" in verdict.reason
    assert any(r.exc_info and "choked" in str(r.exc_info[1]) for r in caplog.records)
    monkeypatch.undo()

    validator.loaded[VERSION].prefill.error = IndexError("index 9 is out of bounds")
    verdict = validator.judge(_announce(validator, assigned_batch(tokenizer, batch_id="q")))
    assert verdict.failed_checks == ["validator"] and "IndexError: index 9 is out of bounds" in verdict.reason
    validator.loaded[VERSION].prefill.error = None

    def reward_raises(*args, **kwargs):
        raise ZeroDivisionError("reward")

    monkeypatch.setattr(module, "sample_reward", reward_raises)
    verdict = validator.judge(_announce(validator, assigned_batch(tokenizer, batch_id="r")))
    assert "reward" in verdict.failed_checks and "reward function raised ZeroDivisionError" in verdict.reason


def test_the_validators_own_trouble_still_posts_nothing(validator, tokenizer, monkeypatch):
    """Not the batch's fault: a SHARDCAST fetch or an OSError reading the store are raised, as before (no
    verdict; the claim's lease lapses)."""
    record = _announce(validator, assigned_batch(tokenizer))

    def unreachable(version):
        raise ShardcastError("no relay answers")

    monkeypatch.setattr(validator, "_version", unreachable)
    with pytest.raises(ShardcastError):
        validator.judge(record)
    monkeypatch.undo()

    def disk_error(*args, **kwargs):
        raise OSError("EIO")

    monkeypatch.setattr(validator.store, "read", disk_error)
    with pytest.raises(OSError):
        validator.judge(record)


def test_a_refused_acceptance_becomes_a_rejection_and_the_validator_goes_on(validator, tokenizer, monkeypatch):
    """Attack: a verdict the orchestrator refuses (422 for an acceptance whose rewards do not fit the batch;
    it was raised out of the loop and stopped the validator). Defence: logged, a bare rejection is posted
    instead; a 409 (judged already) posts nothing; neither raises."""
    record = _announce(validator, assigned_batch(tokenizer))
    monkeypatch.setattr(validator, "judge", lambda r: Verdict(accepted=True, rewards=[0.0], num_tokens=9))
    validator.client = FakeClient(lambda verdict: 422 if verdict.accepted else None)
    validator._validate(record)
    (posted,) = validator.client.posted
    assert not posted.accepted and posted.failed_checks == ["verdict"] and posted.rewards == []
    assert "refused the validator's acceptance (HTTP 422: refused by the test)" in posted.reason
    assert validator.stats["rejected"] == 1 and validator.stats["accepted"] == 0

    validator.client = FakeClient(lambda verdict: 409)
    validator._validate(record)
    assert validator.client.posted == [] and validator.stats["batches"] == 1


def test_a_batch_the_orchestrator_takes_no_verdict_on_is_not_judged_again_and_again(validator, tokenizer, monkeypatch):
    """Attack: every verdict on a batch refused (422), while each claim hands the same batch back. Defence: the
    loop judges it once, then waits on the claim without judging it again, and stops cleanly."""
    record = _announce(validator, assigned_batch(tokenizer))
    judged = []
    monkeypatch.setattr(
        validator,
        "judge",
        lambda r: judged.append(r) or Verdict(accepted=False, reason="x", failed_checks=["store"], num_tokens=0),
    )
    claims = []

    class Loop(FakeClient):
        def register(self, role, hardware, challenge_answer=None):
            policy = types.SimpleNamespace(version=0, relays=[], manifests={})
            return types.SimpleNamespace(
                status="admitted",
                challenge=None,
                node_key=NODE,
                policy=policy,
                requirements=types.SimpleNamespace(heartbeat_interval_s=0.01),
            )

        def heartbeat(self, versions, metrics):
            return types.SimpleNamespace(policy=types.SimpleNamespace(relays=[], manifests={}))

        def claim(self, lease_s):
            claims.append(1)
            if len(claims) >= 6:
                validator.stop.event.set()
            return types.SimpleNamespace(batch=record, manifest_sha256=None)

        def deregister(self):
            return None

        def close(self):
            return None

    validator.client = Loop(lambda verdict: 422)
    monkeypatch.setattr("gpu_workers.validator.leave", lambda client: None)
    assert validator.run() == 0
    assert len(judged) == 1 and len(claims) >= 6 and validator.client.posted == []


def test_the_verdict_names_the_device_that_judged_it(validator, tokenizer, monkeypatch, caplog):
    """The replay check runs on the validator's device ([validator] device: "auto", the CPU without a GPU),
    and the verdict's log line and the heartbeat's metrics name that device."""
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert validator.device == expected
    validator.loaded[VERSION].prefill.device = expected
    replayed_on = []
    real = checks.check_replay_batch
    monkeypatch.setattr(checks, "check_replay_batch", lambda *a, **k: replayed_on.append(k["device"]) or real(*a, **k))
    with caplog.at_level(logging.INFO, logger="validator"):
        validator._validate(_announce(validator, assigned_batch(tokenizer)))
    assert replayed_on == [expected] and len(validator.client.posted) == 1
    assert f"(judged on {expected})" in caplog.text
    assert validator._metrics()[f"batches_on_{expected}"] == 1


def test_a_multi_turn_batch_in_a_single_turn_pool_is_refused_without_prefill(validator, tokenizer):
    """Attack: a schema-2 batch (a sampled mask that calls some completion tokens the environment's) sent to a
    pool without data.env, whose checks would not read the mask. Defence: a store rejection naming it."""
    honest = assigned_batch(tokenizer, batch_id="mask")
    masks = [
        np.r_[np.zeros(p), np.ones(len(honest.sample_tokens(i)) - p)].astype(np.uint8)
        for i, p in enumerate(honest.prompt_lens)
    ]
    batch = RolloutBatch.from_samples(
        honest.meta,
        tokens=[honest.sample_tokens(i) for i in range(honest.num_samples)],
        prompt_lens=honest.prompt_lens,
        logprobs=[honest.sample_logprobs(i) for i in range(honest.num_samples)],
        task_ids=honest.task_ids,
        group_ids=honest.group_ids,
        seeds=honest.seeds,
        finish=honest.finish,
        rewards=honest.rewards,
        proofs=[honest.sample_proof(i) for i in range(honest.num_samples)],
        sampled=masks,
    )
    assert batch.schema == 2
    verdict = validator.judge(_announce(validator, batch))
    assert not verdict.accepted and verdict.failed_checks == ["store"], verdict
    assert "a multi-turn batch (schema 2, a sampled mask) in a pool without data.env" in verdict.reason
    assert validator.loaded[VERSION].prefill.samples == 0
