"""The learner's input pipeline over the rollout store: accepted batches in, packed step batches out.

`RolloutPipeline` is the production `BatchSource` (`jax_trainer/source.py`). Its input is the list of batches
the validators accepted, behind the small `AcceptedBatches` interface: the orchestrator client
(`GET /v1/batches?status=accepted&min_version=`, docs/design.md section 8) implements it for a pool;
`StoreListing` implements it over a store's own listing for tests and single-box runs.

Structure, and why:

    AcceptedStream (grain IterDataset) -> .map(load) -> ThreadPrefetchIterDataset      background thread
        polls the listing, yields each     reads the batch through      holds up to `prefetch`
        new accepted record once           RolloutStore.read (COMMIT,   loaded batches
                                           validation, rewards check)
    RolloutPipeline.next(step)                                                           learner's thread
        takes loaded batches in order, skips those outside the async window (counted), gathers
        `samples_per_step` samples, computes advantages from the validator's rewards, drops zero groups
        and packs (`build_step_batch`).

- The accepted list is a live, growing stream, not an indexable data set, so the source is an `IterDataset`
  (a `MapDataset` needs a fixed length). Reading is I/O-bound and tensorstore already decodes an array's
  chunks and a batch's arrays in parallel on its own threads, releasing the GIL, so one grain prefetch thread
  keeps the learner fed; processes (`mp_prefetch`) would pickle every batch across a pipe and could not share a
  `memory://` store.
- Everything that depends on the step (the async window, advantages across the batches of one step, packing)
  runs in `next(step)`, after prefetching, because the step is not known when a batch is read ahead.
- The position is what the learner consumed, not what grain prefetched: `cursor()` holds the ids of consumed
  batches (trained on, or skipped as stale, ahead or invalid) whose version is still listed; a restored
  pipeline lists again, skips exactly those, and so yields what the uninterrupted one would have. A batch that
  was read ahead but not consumed is read again after a restore. The listing is asked for versions
  >= step - async_level - stale_lookback, so older ids cannot come back and are dropped from the cursor.
- A batch is never silently lost: a stale one (step - version > async_level), one from a policy newer than the
  step (a learner restored from an earlier checkpoint) and one that fails verification (`RolloutStoreError`,
  after `read_retries` retries) are consumed, logged with the reason, and counted in the step's stats and in
  the cursor's totals. The `stale_lookback` versions below the window are still listed so that batches
  accepted too late (a validator lagging) are seen and counted; a batch accepted more than that many
  versions late is not listed at all, and only the orchestrator can count it.
- Rewards come from the accepted record (the validator's), never from the worker's `rewards` array, except in
  the explicit single-box mode `StoreListing(trust_worker_rewards=True)`, whose records carry no rewards.
- The engine logprobs the loss's ratios read (`engine_logprobs`): "validator", the logprobs the validator wrote
  beside the batch, read under the digest of its verdict (`bridge.validator_logprobs`; a batch without them,
  or whose file does not hash to the digest, is invalid), so no worker's claim enters a ratio; or "worker",
  the batch's own (`full_logprobs` where the worker recorded them), for trusted single-box runs and
  `logprob_source = "inference"`.
- Samples whose replay took a near tie (the verdict's `near_tie_samples`: a token within the engines' rounding of
  the seed's choice but not it, where a worker could have chosen among tokens and the validator cannot tell) are
  left out (`near_tie_samples = "drop"`, `[loss] near_tie_samples`): no near-tie choice trains, whatever it was
  chosen for. Their group's advantages come from the samples left; the step's stats count them
  (`near_tie_samples_dropped`). float32 pools have next to none; a bfloat16 pool of a real model loses the share
  of its samples with an honest rounding flip (docs/verifiable-sampling.md).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grain
import numpy as np

from bridge.rollouts import RolloutBatch, RolloutStore, RolloutStoreError, batch_path
from bridge.validator_logprobs import read_validator_logprobs
from jax_trainer.advantages import group_advantages
from jax_trainer.source import Rollout, StepBatch, build_step_batch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AcceptedBatch:
    """A batch a validator accepted: where it is, what it hashes to, and the validator's rewards."""

    batch_id: str
    version: int
    rewards: np.ndarray | None  # float32 [n], one per sample; None only in single-box trusted mode (see module)
    sha256: str | None = None  # the COMMIT digest the validator checked; None: not pinned
    store_url: str | None = None  # the store holding it; None: the pipeline's own store
    logprobs_sha256: str | None = None  # digest of the validator's logprobs beside it; None: it wrote none
    near_tie_samples: tuple[int, ...] = ()  # samples whose replay took a near tie (the verdict's): left out by default

    def __post_init__(self):
        if isinstance(self.version, bool) or not isinstance(self.version, (int, np.integer)) or self.version < 0:
            raise ValueError(f"accepted batch {self.batch_id!r}: version {self.version!r} is not an integer >= 0")
        if not isinstance(self.batch_id, str):
            raise ValueError(f"accepted batch {self.batch_id!r}: batch_id must be a string")


class AcceptedBatches(Protocol):
    def accepted(self, min_version: int) -> Sequence[AcceptedBatch]:
        """Accepted batches of version >= min_version, in acceptance order (new ones come after old ones)."""


class StoreListing:
    """Every committed batch of `store` counts as accepted: tests and single-box runs.

    Rewards come from `rewards` (batch id -> per-sample rewards; batches without an entry are not accepted),
    or, with `trust_worker_rewards=True`, from each batch's own `rewards` array: the worker's claim, acceptable
    only when the workers are trusted (one box, one user). Records are ordered by version, then batch id.
    """

    def __init__(
        self,
        store: RolloutStore,
        *,
        rewards: Mapping[str, Sequence[float]] | None = None,
        trust_worker_rewards: bool = False,
    ):
        if (rewards is None) == (not trust_worker_rewards):
            raise ValueError(
                "StoreListing: give validator rewards, or trust_worker_rewards=True (single box), "
                "not both and not neither"
            )
        self.store, self.rewards = store, rewards

    def accepted(self, min_version: int) -> list[AcceptedBatch]:
        refs = sorted(self.store.list(min_version), key=lambda r: (r.version, r.batch_id))
        if self.rewards is None:
            return [AcceptedBatch(r.batch_id, r.version, None) for r in refs]
        return [
            AcceptedBatch(r.batch_id, r.version, np.asarray(self.rewards[r.batch_id], np.float32))
            for r in refs
            if r.batch_id in self.rewards
        ]


@dataclasses.dataclass
class _Loaded:
    """A record after reading: the verified batch and the rewards to train on, or why it is unusable."""

    record: AcceptedBatch
    batch: RolloutBatch | None = None
    rewards: np.ndarray | None = None
    error: str | None = None
    engine_logprobs: np.ndarray | None = None  # float32 [T]: what the ratios divide by (the validator's or the batch's)
    informative: int | None = None  # samples in groups whose rewards differ (RolloutPipeline._informative)

    @property
    def key(self) -> tuple[int, str]:
        return (int(self.record.version), self.record.batch_id)

    @property
    def samples(self) -> int:
        return 0 if self.batch is None else self.batch.num_samples


MAX_TAKEN = 4096  # batch ids kept for the next announcement (PolicyAnnouncement.consumed's limit)


class _AcceptedStream(grain.IterDataset):
    """grain source: each new record of the accepted listing, once; `None` while the learner waits for data."""

    def __init__(self, pipeline: RolloutPipeline):
        super().__init__()
        self._pipeline = pipeline

    def __iter__(self) -> _AcceptedIterator:
        return _AcceptedIterator(self._pipeline)


class _AcceptedIterator(grain.DatasetIterator):
    def __init__(self, pipeline: RolloutPipeline):
        super().__init__()
        self._p = pipeline
        self._queue: collections.deque[AcceptedBatch] = collections.deque()
        self._seen = set(pipeline._consumed)

    def __next__(self) -> AcceptedBatch | None:
        p = self._p
        while not p._stop.is_set():
            if not self._queue:
                self._refill()
            if self._queue:
                return self._queue.popleft()
            if p._waiting.is_set():
                return None  # lets the learner's thread check its deadline
            p._stop.wait(p.poll_interval)
        raise StopIteration

    def _refill(self) -> None:
        floor = self._p._floor
        try:
            records = self._p.accepted.accepted(floor)
        except Exception as e:  # the orchestrator may be briefly unreachable: keep polling, report it on timeout
            self._p._listing_error = f"{type(e).__name__}: {e}"
            log.warning("accepted-batch listing failed (will retry): %s", self._p._listing_error)
            return
        self._p._listing_error = None
        self._seen = {k for k in self._seen if k[0] >= floor}
        for record in records:
            key = (int(record.version), record.batch_id)
            if key not in self._seen:
                self._seen.add(key)
                self._queue.append(record)

    def get_state(self) -> dict[str, Any]:
        return {}  # the position is the pipeline's cursor (what was consumed), not what this thread listed

    def set_state(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError("the accepted-batch stream resumes from RolloutPipeline.restore, not grain state")


class RolloutPipeline:
    """`BatchSource` over the rollout store (module docstring).

    samples_per_step: samples gathered per step (whole batches, so a step may hold a little more);
    rows, seq_len, multiple_of, micro_batches, truncate: packing (`jax_trainer.packing.pack`); advantage_mode,
    drop_zero_groups: `jax_trainer.advantages`; async_level: step n uses versions n - async_level .. n;
    vocab_size: token ids are checked against it on read; prefetch: loaded batches held ahead;
    stale_lookback: versions below the window still listed, to count late batches as stale (module docstring);
    poll_interval: seconds between listings when nothing new is there; keep_versions: if set, delete store
    versions older than step - keep_versions + 1 (>= async_level + 1); read_retries: extra read attempts
    before a batch counts as invalid; engine_logprobs: whose logprobs the ratios divide by, "validator" (read
    beside each batch under its verdict's digest) or "worker" (the batch's own; module docstring);
    near_tie_samples: "drop" leaves out the samples each verdict names as having taken a near tie (module
    docstring), "train" trains them; dynamic_sampling: gather until the informative groups hold samples_per_step
    samples, at most max_gather x samples_per_step samples in all (module docstring).
    """

    def __init__(
        self,
        store: RolloutStore,
        accepted: AcceptedBatches,
        *,
        samples_per_step: int,
        rows: int,
        seq_len: int,
        multiple_of: int = 1,
        micro_batches: int | None = None,
        advantage_mode: str = "std",
        drop_zero_groups: bool = True,
        truncate: bool = False,
        async_level: int = 2,
        vocab_size: int | None = None,
        prefetch: int = 4,
        stale_lookback: int = 2,
        poll_interval: float = 0.2,
        keep_versions: int | None = None,
        read_retries: int = 1,
        engine_logprobs: str = "worker",
        near_tie_samples: str = "drop",
        dynamic_sampling: bool = False,
        max_gather: float = 4.0,
    ):
        if (
            samples_per_step <= 0
            or prefetch <= 0
            or poll_interval <= 0
            or min(async_level, stale_lookback, read_retries) < 0
        ):
            raise ValueError(
                "RolloutPipeline: samples_per_step, prefetch and poll_interval must be positive, "
                "async_level, stale_lookback and read_retries non-negative"
            )
        if engine_logprobs not in ("worker", "validator"):
            raise ValueError(f"RolloutPipeline: engine_logprobs {engine_logprobs!r} is not 'worker' or 'validator'")
        if near_tie_samples not in ("drop", "train"):
            raise ValueError(f"RolloutPipeline: near_tie_samples {near_tie_samples!r} is not 'drop' or 'train'")
        if dynamic_sampling and not drop_zero_groups:
            raise ValueError("RolloutPipeline: dynamic_sampling gathers informative groups: it needs drop_zero_groups")
        if max_gather < 1:
            raise ValueError(f"RolloutPipeline: max_gather must be >= 1, got {max_gather}")
        if keep_versions is not None and keep_versions < async_level + 1:
            raise ValueError(
                f"RolloutPipeline: keep_versions ({keep_versions}) must be at least async_level + 1 "
                f"({async_level + 1}), or rollouts still in the window would be deleted"
            )
        self.store, self.accepted = store, accepted
        self.samples_per_step = samples_per_step
        self.pack_args = dict(
            rows=rows,
            seq_len=seq_len,
            multiple_of=multiple_of,
            micro_batches=micro_batches,
            advantage_mode=advantage_mode,
            drop_zero_groups=drop_zero_groups,
            truncate=truncate,
        )
        self.async_level, self.vocab_size = async_level, vocab_size
        self.prefetch, self.poll_interval, self.stale_lookback = prefetch, poll_interval, stale_lookback
        self.keep_versions, self.read_retries = keep_versions, read_retries
        self.engine_logprobs, self.drop_near_ties = engine_logprobs, near_tie_samples == "drop"
        self.dynamic_sampling, self.max_gather = dynamic_sampling, int(max_gather * samples_per_step)
        self.release: Callable[[], None] | None = None  # reports taken batches to the pool (module docstring)
        self._released: set[tuple[int, str]] = set()  # pending batches already reported as taken
        self._stores: dict[str, RolloutStore] = {}
        self._consumed: set[tuple[int, str]] = set()
        self._totals: collections.Counter[str] = collections.Counter()
        self._floor = 0
        self._pending: list[_Loaded] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._iter: grain.DatasetIterator | None = None
        self._stop, self._waiting = threading.Event(), threading.Event()
        self._listing_error: str | None = None
        self._taken: list[str] = []  # batch ids consumed since the last take_consumed()
        self._pruned_before = 0

    # ------------------------------------------------------------------ background side (grain thread)

    def _store_for(self, url: str | None) -> RolloutStore:
        if url is None or url == self.store.url:
            return self.store
        if url not in self._stores:
            self._stores[url] = RolloutStore.open(url, context=self.store.context)
        return self._stores[url]

    def _load(self, record: AcceptedBatch | None) -> _Loaded | None:
        if record is None:
            return None
        try:
            where = batch_path(record.version, record.batch_id)
        except RolloutStoreError as e:  # an id that would leave the store: nothing to retry
            return _Loaded(record, error=str(e))
        for attempt in range(self.read_retries + 1):
            try:
                store = self._store_for(record.store_url)
                batch = store.read(
                    record.version, record.batch_id, vocab_size=self.vocab_size, expect_sha256=record.sha256
                )
                if self.engine_logprobs == "validator":
                    engine = read_validator_logprobs(store, batch, record.sha256, record.logprobs_sha256)
                else:  # full-distribution logprobs where the worker recorded them
                    engine = batch.logprobs if batch.full_logprobs is None else batch.full_logprobs
                break
            except (RolloutStoreError, ValueError) as e:  # ValueError: a store URL that does not open
                error = str(e)
                if attempt < self.read_retries:
                    self._stop.wait(self.poll_interval)
        else:
            return _Loaded(record, error=error)
        if record.rewards is None:
            return _Loaded(record, batch, batch.rewards, engine_logprobs=engine)
        rewards = np.asarray(record.rewards, np.float32)
        if rewards.shape != (batch.num_samples,) or not np.all(np.isfinite(rewards)):
            return _Loaded(
                record,
                error=f"rollout batch {where}: validator rewards: shape {rewards.shape} for "
                f"{batch.num_samples} samples, or non-finite values",
            )
        return _Loaded(record, batch, rewards, engine_logprobs=engine)

    def start(self, step: int) -> None:
        """Begin listing and reading ahead for `step` (`next` calls it; call it early to overlap a compile)."""
        self._set_floor(step)
        if self._iter is None:
            self._stop.clear()
            dataset = grain.experimental.ThreadPrefetchIterDataset(
                _AcceptedStream(self).map(self._load), prefetch_buffer_size=self.prefetch
            )
            self._iter = iter(dataset)
            self._iter.start_prefetch()

    def close(self) -> None:
        """Stop the background thread; loaded but unconsumed batches are dropped (not in the cursor)."""
        self._stop.set()
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        self._pending = []
        self._released = set()

    def __enter__(self) -> RolloutPipeline:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ learner side

    def _set_floor(self, step: int) -> None:
        """The lowest version listed (and kept in the cursor) while working on `step`."""
        self._floor = max(0, int(step) - self.async_level - self.stale_lookback)
        self._consumed = {k for k in self._consumed if k[0] >= self._floor}

    def _pull(self, step: int, deadline: float | None, have: int) -> _Loaded:
        self._waiting.set()
        try:
            while True:
                item = next(self._iter)
                if item is not None:
                    return item
                if deadline is not None and time.monotonic() >= deadline:
                    extra = f"; last listing error: {self._listing_error}" if self._listing_error else ""
                    if self._counts.get("filtered_batches"):
                        extra += (
                            f"; {self._counts['filtered_batches']} accepted batches were filtered out because every "
                            "group's rewards were equal (zero advantage; see data.online_filter)"
                        )
                    raise TimeoutError(
                        f"rollout pipeline: step {step} has {have} of {self.samples_per_step} "
                        f"samples and no further accepted batch arrived in time{extra}"
                    )
        finally:
            self._waiting.clear()

    def _skip(self, item: _Loaded, step: int) -> bool:
        """Consume and count `item` if it cannot be used at `step`; True when skipped."""
        version, batch_id = item.key
        staleness = step - version
        name = f"rollout batch v{version:06d}/{batch_id}"
        if staleness > self.async_level:
            reason, kind = f"{name}: stale: step {step} - version {version} > async_level {self.async_level}", "stale"
        elif staleness < 0:
            reason = f"{name}: version {version} is ahead of step {step} (restored from an older checkpoint?)"
            kind = "ahead"
        elif item.error is not None:
            reason, kind = item.error, "invalid"
        else:
            return False
        log.warning("rollout pipeline: skipped %s", reason)
        self._consumed.add(item.key)
        if item.key not in self._released:
            self._taken.append(item.key[1])
        self._released.discard(item.key)
        for counter in (self._counts, self._totals):
            counter[f"{kind}_batches"] += 1
            counter[f"{kind}_samples"] += item.samples
        return True

    def _informative(self, item: _Loaded) -> int:
        """Samples of `item` in groups whose rewards differ (what trains of it), after the near-tie drop."""
        if item.informative is None:
            b = item.batch
            keep = np.ones(b.num_samples, bool)
            if self.drop_near_ties:
                keep[[i for i in item.record.near_tie_samples if i < b.num_samples]] = False
            if not keep.any():
                item.informative = 0
            else:
                adv = group_advantages(item.rewards[keep], b.group_ids[keep], self.pack_args["advantage_mode"])
                item.informative = int(adv.keep.sum())
        return item.informative

    def _report_taken(self) -> None:
        """Tell the pool (`release`) which pending batches this step has taken, so that their room in the async
        window goes to new work while the step gathers more."""
        fresh = [item.key for item in self._pending if item.key not in self._released]
        if fresh and self.release is not None:
            self._taken.extend(batch_id for _, batch_id in fresh)
            self._released.update(fresh)
            self.release()

    def _rollouts(self, items: Sequence[_Loaded]) -> list[Rollout]:
        out: list[Rollout] = []
        groups = 0
        for item in items:
            b = item.batch
            _, local = np.unique(b.group_ids, return_inverse=True)  # groups never span batches
            name = batch_path(*item.key)
            left_out = set(item.record.near_tie_samples) if self.drop_near_ties else set()
            if left_out:
                self._counts["near_tie_samples_dropped"] += len(left_out)
                self._totals["near_tie_samples_dropped"] += len(left_out)
            for i in range(b.num_samples):
                if i in left_out:  # a token of it was a near tie the worker could have chosen: it trains nothing
                    continue
                out.append(
                    Rollout(
                        b.sample_tokens(i),
                        int(b.prompt_lens[i]),
                        item.engine_logprobs[b.offsets[i] : b.offsets[i + 1]],  # `engine_logprobs`' choice
                        float(item.rewards[i]),
                        groups + int(local[i]),
                        int(b.meta.version),
                        f"{name}#{i}",
                        None if b.sampled is None else b.sample_mask(i),  # a multi-turn episode's model turns
                    )
                )
            groups += int(local.max()) + 1
        return out

    def next(self, step: int, timeout: float | None = None) -> StepBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.start(step)
        while True:
            self._pending = [item for item in self._pending if not self._skip(item, step)]
            have = sum(item.samples for item in self._pending)
            while have < self.samples_per_step:
                item = self._pull(step, deadline, have)
                if not self._skip(item, step):
                    self._pending.append(item)
                    have += item.samples
            if self.dynamic_sampling:
                self._fill(step, deadline, have)
            items = self._pending
            batch = build_step_batch(self._rollouts(items), step, **self.pack_args)  # PackingError: items stay
            self._pending = []
            self._consumed.update(item.key for item in items)
            self._taken.extend(item.key[1] for item in items if item.key not in self._released)
            self._released.difference_update(item.key for item in items)
            del self._taken[:-MAX_TAKEN]  # bounded where nothing takes them (a process that does not announce)
            self._counts["batches"] += len(items)
            self._totals["batches"] += len(items)
            if batch is not None:
                break
            self._counts["filtered_batches"] += len(items)  # every group had zero advantage: gather again
            self._totals["filtered_batches"] += len(items)
        stats = {**batch.stats, **{k: float(v) for k, v in self._counts.items()}}  # staleness: mean, max
        self._counts = collections.Counter()
        if self.keep_versions is not None and step - self.keep_versions + 1 > self._pruned_before:
            self._pruned_before = step - self.keep_versions + 1
            stats["pruned_batches"] = float(len(self.store.prune(self._pruned_before)))
        return StepBatch(batch.packed, stats, tuple(f"v{item.key[0]}/{item.key[1]}" for item in items))

    def _fill(self, step: int, deadline: float | None, have: int) -> None:
        """Dynamic sampling: pull more batches until the pending ones' informative groups hold samples_per_step
        samples or max_gather samples are pending. A time-out while some group is informative ends the gathering
        (the step trains on those); with none it is the step's time-out."""
        informative = sum(self._informative(item) for item in self._pending)
        while informative < self.samples_per_step and have < self.max_gather:
            self._report_taken()
            try:
                item = self._pull(step, deadline, have)
            except TimeoutError:
                if informative:
                    log.warning(
                        "rollout pipeline: step %d trains %d informative samples (of %d wanted): no further accepted "
                        "batch arrived in time",
                        step,
                        informative,
                        self.samples_per_step,
                    )
                    return
                raise
            if not self._skip(item, step):
                self._pending.append(item)
                have += item.samples
                informative += self._informative(item)
                self._counts["dynamic_batches"] += 1

    def take_consumed(self) -> list[str]:
        """The ids of the batches consumed (trained on, or skipped) since the last call: the learner's policy
        announcement reports them, and the orchestrator frees their room in the async window."""
        taken, self._taken = self._taken, []
        return taken

    def give_back_consumed(self, batch_ids: list[str]) -> None:
        """Ids `take_consumed` returned that could not be reported: they go with the next announcement."""
        self._taken[:0] = batch_ids

    def cursor(self) -> dict[str, Any]:
        return {
            "consumed": sorted([v, b] for v, b in self._consumed),
            "floor": self._floor,
            "totals": dict(self._totals),
        }

    def restore(self, cursor: dict[str, Any]) -> None:
        """Continue after the batches `cursor` says were consumed (stops any read-ahead first)."""
        try:
            consumed = {(int(v), str(b)) for v, b in cursor["consumed"]}
            floor, totals = int(cursor["floor"]), {str(k): int(v) for k, v in cursor["totals"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"rollout pipeline: malformed cursor ({type(e).__name__}: {e}); expected "
                "{'consumed': [[version, batch_id], ...], 'floor': int, 'totals': {...}}"
            ) from e
        self.close()
        self._consumed, self._floor = consumed, floor
        self._totals, self._counts = collections.Counter(totals), collections.Counter()


class OrchestratorListing:
    """Accepted batches as the orchestrator lists them (`GET /v1/batches?status=accepted&min_version=`), with
    the validators' per-sample rewards, the digest each validator checked and that of its logprobs. `client` is a
    `bridge.protocol.OrchestratorClient` holding the operator token. The batches are read from the pipeline's
    own store (one store per run)."""

    def __init__(self, client):
        self.client = client
        self._after = 0  # verdict cursor: each poll asks only for batches judged since the previous one
        self._known: dict[tuple[int, str], AcceptedBatch] = {}  # what earlier polls returned, still >= the floor

    def accepted(self, min_version: int) -> list[AcceptedBatch]:
        """Every accepted batch of version >= min_version (those seen before from memory, new ones from the
        orchestrator), so that a poll costs what is new, not the whole history."""
        records, self._after = self.client.all_batches("accepted", min_version=min_version, after=self._after)
        for r in records:
            rewards = None if r.rewards is None else np.asarray(r.rewards, np.float32)
            self._known[(r.version, r.batch_id)] = AcceptedBatch(
                r.batch_id,
                r.version,
                rewards,
                r.sha256,
                logprobs_sha256=r.logprobs_sha256,
                near_tie_samples=tuple(r.near_tie_samples),
            )
        self._known = {k: v for k, v in self._known.items() if k[0] >= min_version}
        return list(self._known.values())  # in the order the validators judged them
