"""The learner's input pipeline (jax_trainer/data.py) over a real rollout store.

References: advantages are recomputed here with numpy from the validator's rewards (per batch and group, std
with ddof=1); the packed arrays are traced back to the stored samples through their token sequences; a
resumed pipeline is compared with an uninterrupted one over the same store.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

import numpy as np
import pytest

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from jax_trainer.data import AcceptedBatch, RolloutPipeline, StoreListing

PACK = dict(rows=2, seq_len=128)


def write(
    store: RolloutStore,
    version: int,
    batch_id: str,
    *,
    groups: int = 2,
    size: int = 4,
    seed: int = 0,
    worker_reward: float = 0.0,
    vocab: int = 1000,
) -> RolloutBatch:
    """A committed batch whose worker-claimed rewards are all `worker_reward` (the validator's differ)."""
    rng = np.random.default_rng([seed, version, sum(map(ord, batch_id))])
    n = groups * size
    tokens, prompts, logprobs, proofs = [], [], [], []
    for _ in range(n):
        length = int(rng.integers(10, 40))
        prompt = int(rng.integers(1, length - 1))
        lp = np.zeros(length, np.float32)
        lp[prompt:] = -rng.exponential(1.0, length - prompt)
        tokens.append(rng.integers(0, vocab, length))
        prompts.append(prompt)
        logprobs.append(lp)
        proofs.append(bytes(258 * -(-(length - prompt) // 32)))
    meta = BatchMeta(batch_id=batch_id, node_key="cd" * 32, version=version, assignment_id=batch_id)
    batch = RolloutBatch.from_samples(
        meta,
        tokens=tokens,
        prompt_lens=prompts,
        logprobs=logprobs,
        task_ids=np.arange(n) // size,
        group_ids=np.arange(n) // size,
        seeds=np.arange(n),
        finish=np.zeros(n),
        rewards=np.full(n, worker_reward),
        proofs=proofs,
    )
    store.write(batch)
    return batch


class ListAccepted:
    """An accepted list held in memory, as the orchestrator client would return it."""

    def __init__(self, records=(), fail_first: int = 0):
        self.records = list(records)
        self.fail_first = fail_first
        self.calls = 0

    def accepted(self, min_version: int):
        self.calls += 1
        if self.calls <= self.fail_first:
            raise ConnectionError("orchestrator unreachable")
        return [r for r in self.records if r.version >= min_version]


def segments(packed) -> list[tuple[tuple[int, ...], float, np.ndarray]]:
    """(token sequence, advantage, inference logprobs of the completion) of every packed sample."""
    out = []
    tokens, seg = packed.tokens.reshape(-1, packed.shape[-1]), packed.segment_ids.reshape(-1, packed.shape[-1])
    mask = packed.loss_mask.reshape(tokens.shape)
    adv, lp = packed.advantages.reshape(tokens.shape), packed.inference_logprobs.reshape(tokens.shape)
    for r in range(tokens.shape[0]):
        for s in range(1, int(seg[r].max()) + 1):
            where = seg[r] == s
            comp = where & (mask[r] == 1)
            out.append((tuple(tokens[r][where].tolist()), float(adv[r][comp][0]), lp[r][comp]))
    return out


def reference_advantages(batches: dict[str, RolloutBatch], rewards: dict[str, np.ndarray]) -> dict:
    """token sequence -> advantage, per batch and group, ddof=1; None for samples of all-equal groups."""
    out = {}
    for bid, batch in batches.items():
        r = np.asarray(rewards[bid], np.float32).astype(np.float64)  # the pipeline carries float32 rewards
        for g in np.unique(batch.group_ids):
            idx = np.flatnonzero(batch.group_ids == g)
            mean, std = r[idx].mean(), r[idx].std(ddof=1)
            for i in idx:
                key = tuple(batch.sample_tokens(i).tolist())
                out[key] = None if np.all(r[idx] == r[idx][0]) else (r[i] - mean) / (std + 1e-6)
    return out


def test_advantages_come_from_the_validator_rewards_per_batch_and_group():
    store = RolloutStore.open("memory://")
    batches = {bid: write(store, 0, bid, worker_reward=0.0) for bid in ("a", "b")}
    rewards = {"a": np.array([1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5]), "b": np.array([0.2, 0.9, 0.4, 0.1, 1, 0, 0, 0])}
    with RolloutPipeline(store, StoreListing(store, rewards=rewards), samples_per_step=16, **PACK) as pipe:
        step = pipe.next(0, timeout=30)
    ref = reference_advantages(batches, rewards)
    got = segments(step.packed)
    assert sorted(k for k, _, _ in got) == sorted(k for k, v in ref.items() if v is not None)
    for key, adv, lp in got:
        assert adv == pytest.approx(ref[key], rel=1e-5, abs=1e-6)
    # the packed inference logprobs are the stored completion logprobs
    stored = {
        tuple(b.sample_tokens(i).tolist()): b.sample_logprobs(i)[b.prompt_lens[i] :]
        for b in batches.values()
        for i in range(b.num_samples)
    }
    for key, _, lp in got:
        np.testing.assert_array_equal(lp, stored[key])
    assert step.stats["samples"] == 16 and step.stats["samples_trained"] == 12
    assert step.stats["groups"] == 4 and step.stats["dropped_groups"] == 1
    assert step.stats["reward_mean"] == pytest.approx(np.mean(np.concatenate(list(rewards.values()))))
    assert step.stats["batches"] == 2 and step.stats["staleness_max"] == 0 and step.packed.versions == [0] * 12


def test_async_window_skips_stale_and_ahead_batches_and_reports_them(caplog):
    store = RolloutStore.open("memory://")
    for version in range(4):
        write(store, version, f"b{version}", worker_reward=1.0)
    rewards = {f"b{v}": np.arange(8.0) for v in range(4)}
    caplog.set_level(logging.WARNING, logger="jax_trainer.data")
    pipe = RolloutPipeline(
        store, StoreListing(store, rewards=rewards), samples_per_step=8, async_level=1, poll_interval=0.02, **PACK
    )
    with pipe:
        pipe.start(3)
        time.sleep(0.3)  # read ahead in the background: read is not consumed
        assert pipe.take_consumed() == []
        step = pipe.next(3, timeout=30)  # versions 0 and 1 are too old for step 3
        assert [v for v in step.packed.versions] == [2] * 8
        # what the learner's next announcement reports: the two skipped and the one trained on, once
        assert pipe.take_consumed() == ["b0", "b1", "b2"] and pipe.take_consumed() == []
        pipe.give_back_consumed(["b2"])  # an announcement that failed: reported with the next one
        assert pipe.take_consumed() == ["b2"]
        assert step.stats["stale_batches"] == 2 and step.stats["stale_samples"] == 16
        assert step.stats["staleness_mean"] == 1 and step.stats["staleness_max"] == 1
        assert "v000000/b0: stale: step 3 - version 0 > async_level 1" in caplog.text
        assert "v000001/b1: stale" in caplog.text
        assert pipe.next(3, timeout=30).stats.get("stale_batches", 0) == 0
        assert pipe.cursor()["totals"] == {"batches": 2, "stale_batches": 2, "stale_samples": 16}
    # a learner restored to step 1 meets batches of versions 2 and 3: ahead of it, skipped and counted
    pipe = RolloutPipeline(
        store, StoreListing(store, rewards=rewards), samples_per_step=8, async_level=3, poll_interval=0.02, **PACK
    )
    with pipe:
        step = pipe.next(1, timeout=30)
        assert step.packed.versions == [0] * 8
        pipe.next(1, timeout=30)
        with pytest.raises(TimeoutError, match="step 1 has 0 of 8 samples"):
            pipe.next(1, timeout=0.3)
        assert pipe.cursor()["totals"]["ahead_batches"] == 2
    assert "v000003/b3: version 3 is ahead of step 1" in caplog.text


def test_invalid_batches_are_skipped_counted_and_named(caplog):
    store = RolloutStore.open("memory://")
    good = [write(store, 0, f"g{i}") for i in range(2)]
    write(store, 0, "corrupt")
    write(store, 0, "short")
    write(store, 0, "pinned")
    chunk = "v000000/corrupt/rewards/0"
    store.kvstore.write(chunk, store.kvstore.read(chunk).result().value[:-1]).result()
    r8 = np.linspace(0, 1, 8)
    accepted = ListAccepted(
        [
            AcceptedBatch("corrupt", 0, r8),
            AcceptedBatch("g0", 0, r8),
            AcceptedBatch("short", 0, r8[:5]),
            AcceptedBatch("pinned", 0, r8, sha256="f" * 64),
            AcceptedBatch("missing", 0, r8),
            AcceptedBatch("../../etc", 0, r8),
            AcceptedBatch("g1", 0, r8),
        ]
    )
    caplog.set_level(logging.WARNING, logger="jax_trainer.data")
    with RolloutPipeline(store, accepted, samples_per_step=16, read_retries=1, poll_interval=0.01, **PACK) as pipe:
        step = pipe.next(0, timeout=30)
    assert step.stats["invalid_batches"] == 5 and step.stats["batches"] == 2
    want = {tuple(b.sample_tokens(i).tolist()) for b in good for i in range(8)}
    assert {k for k, _, _ in segments(step.packed)} == want
    assert "v000000/corrupt: rewards:" in caplog.text or "v000000/corrupt: COMMIT:" in caplog.text
    assert "v000000/short: validator rewards: shape (5,) for 8 samples" in caplog.text
    pinned = store.commit(0, "pinned")
    assert f"v000000/pinned: COMMIT: sha256 {pinned} differs from the accepted {'f' * 64}" in caplog.text
    assert "v000000/missing: COMMIT: missing" in caplog.text
    assert "v000000/'../../etc': batch_id: must be" in caplog.text


def test_a_sample_longer_than_the_rows_is_an_error_naming_it_and_nothing_is_consumed():
    store = RolloutStore.open("memory://")
    batch = write(store, 0, "long")
    longest = int(np.argmax(batch.lengths))
    with RolloutPipeline(
        store,
        StoreListing(store, rewards={"long": np.arange(8.0)}),
        samples_per_step=8,
        rows=2,
        seq_len=int(batch.lengths.max()) - 1,
    ) as pipe:
        with pytest.raises(ValueError, match=rf"v000000/long#{longest}: {batch.lengths.max()} tokens"):
            pipe.next(0, timeout=30)
        assert pipe.cursor()["consumed"] == []


def _run(pipe: RolloutPipeline, steps) -> list:
    out = []
    for s in steps:
        b = pipe.next(s, timeout=30)
        out.append((b.packed.arrays(), b.packed.versions, b.stats))
    return out


def test_resume_from_cursor_yields_exactly_what_the_uninterrupted_pipeline_yields():
    store = RolloutStore.open("memory://")
    rewards = {}
    for version, ids in enumerate(["abc", "ab", "ab", "a"]):
        for bid in ids:
            write(store, version, f"{bid}{version}")
            rewards[f"{bid}{version}"] = np.random.default_rng(version).random(8)
    make = lambda: RolloutPipeline(
        store,
        StoreListing(store, rewards=rewards),
        samples_per_step=8,
        async_level=2,
        prefetch=3,
        poll_interval=0.02,
        **PACK,
    )
    with make() as straight:
        expected = _run(straight, range(6))
    with make() as first:
        head = _run(first, range(3))
        time.sleep(0.2)  # let it read ahead: those batches were prefetched but not consumed
        cursor = json.loads(json.dumps(first.cursor()))
    assert cursor["consumed"] == [[0, "a0"], [0, "b0"], [0, "c0"]]
    resumed = make()
    resumed.restore(cursor)
    with resumed:
        tail = _run(resumed, range(3, 6))
    assert len(head + tail) == len(expected)
    for (got_arrays, got_versions, got_stats), (want_arrays, want_versions, want_stats) in zip(head + tail, expected):
        assert got_versions == want_versions and got_stats == want_stats
        for name, want in want_arrays.items():
            np.testing.assert_array_equal(got_arrays[name], want, err_msg=name)
    # b1 (step 4: 4 - 1 > 2) and b2 (step 5) are skipped as stale, in both runs
    assert [e[2].get("stale_batches", 0) for e in expected] == [0, 0, 0, 0, 1, 1]
    assert [e[1][0] for e in expected] == [0, 0, 0, 1, 2, 3]


def test_prefetch_reads_ahead_in_the_background():
    reads = []
    event = threading.Event()

    class CountingStore(RolloutStore):
        def read(self, version, batch_id, **kw):
            reads.append((batch_id, threading.current_thread() is threading.main_thread()))
            event.set()
            return super().read(version, batch_id, **kw)

    base = RolloutStore.open("memory://")
    store = CountingStore(base.kvstore, base.context)
    written = [write(store, 0, f"x{i}") for i in range(8)]
    rewards = {f"x{i}": np.arange(8.0) for i in range(8)}
    with RolloutPipeline(
        store,
        StoreListing(store, rewards=rewards),
        samples_per_step=8,
        prefetch=3,
        poll_interval=0.02,
        async_level=8,
        **PACK,
    ) as pipe:
        pipe.start(0)
        deadline = time.monotonic() + 20
        while len(reads) < 4 and time.monotonic() < deadline:  # nothing asked for a batch yet
            event.wait(0.05)
            event.clear()
        assert [r[0] for r in reads[:4]] == ["x0", "x1", "x2", "x3"]
        assert not any(on_main for _, on_main in reads)
        steps = [pipe.next(0, timeout=30), pipe.next(1, timeout=30)]
    ids = [batch_id for batch_id, _ in reads]
    assert len(ids) == len(set(ids))  # the steps took the copies read ahead; nothing was read twice
    for step, batch in zip(steps, written):
        assert {k for k, _, _ in segments(step.packed)} == {tuple(batch.sample_tokens(i).tolist()) for i in range(8)}


def test_timeout_keeps_partial_data_and_reports_listing_errors():
    store = RolloutStore.open("memory://")
    first = write(store, 0, "first")
    accepted = ListAccepted([AcceptedBatch("first", 0, np.arange(8.0))], fail_first=2)
    with RolloutPipeline(store, accepted, samples_per_step=16, poll_interval=0.02, **PACK) as pipe:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="step 0 has 8 of 16 samples"):
            pipe.next(0, timeout=0.5)
        assert time.monotonic() - start < 10
        assert pipe.cursor()["consumed"] == []  # gathered, not trained on
        second = write(store, 0, "second")
        accepted.records.append(AcceptedBatch("second", 0, np.arange(8.0)[::-1]))
        step = pipe.next(0, timeout=30)
    want = {tuple(b.sample_tokens(i).tolist()) for b in (first, second) for i in range(8)}
    assert {k for k, _, _ in segments(step.packed)} == want
    with RolloutPipeline(
        store, ListAccepted([], fail_first=10**6), samples_per_step=8, poll_interval=0.02, **PACK
    ) as pipe:
        with pytest.raises(TimeoutError, match="last listing error: ConnectionError: orchestrator unreachable"):
            pipe.next(0, timeout=0.3)


def test_all_zero_rounds_gather_again_and_trusted_mode_uses_worker_rewards():
    store = RolloutStore.open("memory://")
    write(store, 0, "flat", worker_reward=1.0)  # every group has equal rewards: nothing to learn
    rng = np.random.default_rng(0)
    batch = write(store, 0, "useful", worker_reward=0.0)
    with pytest.raises(ValueError, match="not both and not neither"):
        StoreListing(store)
    rewards = {"flat": np.ones(8), "useful": rng.random(8)}
    with RolloutPipeline(store, StoreListing(store, rewards=rewards), samples_per_step=8, **PACK) as pipe:
        step = pipe.next(0, timeout=30)
    assert step.stats["filtered_batches"] == 1 and step.stats["batches"] == 2
    ref = reference_advantages({"useful": batch}, rewards)
    assert {k: a for k, a, _ in segments(step.packed)} == pytest.approx(ref, rel=1e-5, abs=1e-6)
    with RolloutPipeline(store, StoreListing(store, trust_worker_rewards=True), samples_per_step=16, **PACK) as pipe:
        # worker rewards 1.0 and 0.0 per batch: every group is flat, and the time-out says why nothing came
        with pytest.raises(TimeoutError, match="2 accepted batches were filtered out because every group's rewards"):
            pipe.next(0, timeout=0.5)
        assert pipe.cursor()["totals"] == {"batches": 2, "filtered_batches": 2}


def test_store_listing_only_lists_batches_with_validator_rewards():
    store = RolloutStore.open("memory://")
    for version, bid in [(2, "x"), (0, "y"), (1, "z")]:
        write(store, version, bid)
    listing = StoreListing(store, rewards={"x": [1.0] * 8, "z": [0.0] * 8})
    got = listing.accepted(0)
    assert [(r.version, r.batch_id) for r in got] == [(1, "z"), (2, "x")]
    assert got[1].rewards.dtype == np.float32 and list(got[1].rewards) == [1.0] * 8
    assert [(r.version, r.batch_id) for r in listing.accepted(2)] == [(2, "x")]
    trusted = StoreListing(store, trust_worker_rewards=True).accepted(0)
    assert [(r.version, r.batch_id, r.rewards) for r in trusted] == [(0, "y", None), (1, "z", None), (2, "x", None)]


def test_retention_prunes_versions_behind_the_window():
    store = RolloutStore.open("memory://")
    for version in range(5):
        write(store, version, f"v{version}")
    with pytest.raises(ValueError, match="keep_versions .1. must be at least async_level"):
        RolloutPipeline(
            store,
            StoreListing(store, trust_worker_rewards=True),
            samples_per_step=8,
            async_level=1,
            keep_versions=1,
            **PACK,
        )
    # worker rewards are all 0 here: groups are flat, so use validator rewards
    rewards = {f"v{v}": np.arange(8.0) for v in range(5)}
    with RolloutPipeline(
        store, StoreListing(store, rewards=rewards), samples_per_step=8, async_level=1, keep_versions=2, **PACK
    ) as pipe:
        step = pipe.next(3, timeout=30)
    assert step.stats["pruned_batches"] == 2
    assert [r.version for r in store.list()] == [4, 3, 2]
    counts = collections.Counter(r.version for r in store.list())
    assert counts == {2: 1, 3: 1, 4: 1}


def test_malformed_cursor_is_refused():
    store = RolloutStore.open("memory://")
    pipe = RolloutPipeline(store, StoreListing(store, trust_worker_rewards=True), samples_per_step=8, **PACK)
    with pytest.raises(ValueError, match="malformed cursor"):
        pipe.restore({"position": 3})


def _informative_reference(batches: dict[str, RolloutBatch], rewards: dict[str, np.ndarray]) -> set[tuple]:
    """Token sequences of the samples in groups whose rewards differ, by numpy."""
    out = set()
    for bid, batch in batches.items():
        for g in np.unique(batch.group_ids):
            idx = np.flatnonzero(batch.group_ids == g)
            if np.ptp(np.asarray(rewards[bid])[idx]) > 0:
                out.update(tuple(batch.sample_tokens(i).tolist()) for i in idx)
    return out


# a: one informative group of two; b: none; c: both
DYNAMIC_REWARDS = {
    "a": np.array([1, 0, 0, 1, 1, 1, 1, 1.0]),
    "b": np.array([0, 0, 0, 0, 1, 1, 1, 1.0]),
    "c": np.array([0, 1, 0, 0, 0.5, 0, 1, 0]),
}


def _dynamic_store():
    store = RolloutStore.open("memory://")
    batches = {bid: write(store, 0, bid) for bid in DYNAMIC_REWARDS}
    accepted = ListAccepted([AcceptedBatch(bid, 0, r) for bid, r in DYNAMIC_REWARDS.items()])
    return store, batches, accepted


def test_dynamic_sampling_fills_the_step_with_informative_groups():
    store, batches, accepted = _dynamic_store()
    with RolloutPipeline(store, accepted, samples_per_step=8, poll_interval=0.02, **PACK) as pipe:
        plain = pipe.next(0, timeout=30)  # the first batch alone: its flat group is dropped and shrinks the step
    assert {k for k, _, _ in segments(plain.packed)} == _informative_reference({"a": batches["a"]}, DYNAMIC_REWARDS)
    assert plain.stats["samples_trained"] == 4 and plain.stats["uninformative_group_frac"] == 0.5

    store, batches, accepted = _dynamic_store()
    with RolloutPipeline(
        store, accepted, samples_per_step=8, poll_interval=0.02, dynamic_sampling=True, **PACK
    ) as pipe:
        taken_while_gathering = []
        pipe.release = lambda: taken_while_gathering.append(pipe.take_consumed())
        step = pipe.next(0, timeout=30)
        # a (4 informative) and b (0) were not enough: c was gathered too, and every informative group trains
        assert {k for k, _, _ in segments(step.packed)} == _informative_reference(batches, DYNAMIC_REWARDS)
        assert step.stats["samples"] == 24 and step.stats["samples_trained"] == 12
        assert step.stats["uninformative_group_frac"] == pytest.approx(3 / 6)
        assert step.stats["dynamic_batches"] == 2 and step.stats["batches"] == 3
        # the batches taken while gathering were reported to the pool as they were taken, each batch once in all
        assert taken_while_gathering == [["a"], ["b"]] and pipe.take_consumed() == ["c"]
        assert sorted(b for _, b in pipe.cursor()["consumed"]) == ["a", "b", "c"]


def test_dynamic_sampling_stops_at_its_gathering_cap_and_on_a_time_out_with_informative_groups():
    store, batches, accepted = _dynamic_store()
    kw = dict(samples_per_step=8, poll_interval=0.02, dynamic_sampling=True, **PACK)
    with RolloutPipeline(store, accepted, max_gather=2, **kw) as pipe:
        step = pipe.next(0, timeout=30)  # a and b make 16 samples = 2 x 8: the step trains a's informative group
        assert step.stats["samples"] == 16 and step.stats["samples_trained"] == 4
    want = _informative_reference({"a": batches["a"]}, DYNAMIC_REWARDS)
    assert {k for k, _, _ in segments(step.packed)} == want

    accepted.records = accepted.records[:2]  # c never comes: the step trains what is informative when time is up
    with RolloutPipeline(store, accepted, **kw) as pipe:
        step = pipe.next(0, timeout=1.0)
        assert {k for k, _, _ in segments(step.packed)} == want
    accepted.records = accepted.records[1:2]  # b alone: nothing informative, the time-out is the step's
    with RolloutPipeline(store, accepted, **kw) as pipe:
        with pytest.raises(TimeoutError, match="step 0 has 8 of 8 samples"):
            pipe.next(0, timeout=0.5)


def test_dynamic_sampling_needs_the_online_filter():
    store = RolloutStore.open("memory://")
    with pytest.raises(ValueError, match="dynamic_sampling gathers .* needs drop_zero_groups"):
        RolloutPipeline(
            store, ListAccepted(), samples_per_step=8, dynamic_sampling=True, drop_zero_groups=False, **PACK
        )
