"""The validator (`intellect validator`): claim announced batches, check them, post verdicts.

For each claimed batch: read it from the pool's rollout store (its COMMIT hash must be the announced one), load
the batch's policy version (fetched through SHARDCAST, the newest `cache_versions` kept loaded), and run every
check of `gpu_workers.checks` against what the pool prescribes, never against what the worker declares:

- fixed data: task ids, groups, seeds, length targets and prompt tokens of the assignment (node key, version,
  k), rebuilt here with the pool's tasks and the version's tokenizer;
- termination, computation (TOPLOC, by prefill) and sampling at the pool's temperature, top-p and max tokens;
- reward: recomputed with the same reward code the worker ran; the verdict carries the recomputed rewards,
  which are what the learner trains on.

A batch that cannot be read (missing, hash mismatch, malformed) is rejected with the reader's error as the
reason. The claim has a lease: a validator that dies loses its claim to another after `lease_s`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from bridge.protocol import BatchRecord, Verdict
from bridge.rollouts import RolloutStore, RolloutStoreError
from bridge.shardcast import ShardcastClient, ShardcastError
from gpu_workers import checks
from gpu_workers.node import NodeBanned, Stop, connect, hardware_report, join, leave, patiently, touch
from gpu_workers.rewards import sample_reward
from gpu_workers.tasks import TaskDataset, prompt_tokens

log = logging.getLogger("validator")


@dataclasses.dataclass(frozen=True)
class ValidatorSettings:
    orchestrator_url: str
    key_path: Path
    weights_dir: Path
    store: str
    declared: checks.Declared  # the pool's sampling parameters, stop tokens and TOPLOC thresholds
    samples_per_prompt: int  # the pool's group size
    length_targets: tuple[int, ...] = ()
    length_penalty: float = 0.0
    length_mode: str = "exact"
    system_prompt: str | None = None
    servers: tuple[str, ...] = ()
    dtype: str = "bfloat16"
    cache_versions: int = 2
    lease_s: float | None = None
    health_file: Path | None = None
    idle_poll_s: float = 1.0
    fetch_timeout_s: float = 30.0
    fetch_direct_io: bool = True
    fetch_buffer_mib: int = 32


@dataclasses.dataclass
class _Loaded:
    prefill: object  # gpu_workers.prefill.Prefill
    tokenizer: object
    stop_token_ids: frozenset[int]


class Validator:
    def __init__(self, settings: ValidatorSettings, tasks: TaskDataset, stop: Stop | None = None):
        self.s = settings
        self.tasks = tasks
        self.stop = stop or Stop()
        self.node_key, self.client = connect(settings.key_path, settings.orchestrator_url)
        self.store = RolloutStore.open(settings.store)
        self.loaded: collections.OrderedDict[int, _Loaded] = collections.OrderedDict()
        self.relays: list[str] = []
        self._shardcast: ShardcastClient | None = None  # kept while the servers stay the same (its buffers)
        self.interval = settings.idle_poll_s
        self.stats = {"batches": 0, "accepted": 0, "rejected": 0, "samples": 0, "seconds": 0.0}
        self._prompt_cache: dict[tuple[int, int, int], list[int]] = {}

    # -- weights ------------------------------------------------------------------------------------------

    def _version(self, version: int) -> _Loaded:
        if version in self.loaded:
            self.loaded.move_to_end(version)
            return self.loaded[version]
        from transformers import AutoTokenizer

        from gpu_workers.prefill import Prefill

        servers = self.relays or list(self.s.servers)
        if not servers:
            raise ShardcastError("no SHARDCAST server: the policy names no relays and shardcast.servers is empty")
        client = self._shardcast
        if client is None or not client.same_servers(servers):
            client = self._shardcast = ShardcastClient(
                servers, timeout=self.s.fetch_timeout_s, direct_io=self.s.fetch_direct_io,
                buffer_bytes=self.s.fetch_buffer_mib << 20)
        path = client.fetch(version, self.s.weights_dir, wait=self.s.fetch_timeout_s).path
        loaded = _Loaded(Prefill(path, self.s.dtype), AutoTokenizer.from_pretrained(path),
                         checks.stop_token_ids(path))
        self.loaded[version] = loaded
        while len(self.loaded) > self.s.cache_versions:
            old, _ = self.loaded.popitem(last=False)
            shutil.rmtree(self.s.weights_dir / f"v{old:06d}", ignore_errors=True)
            log.info("dropped version %d from the cache", old)
        log.info("loaded version %d for prefill (%s)", version, self.s.dtype)
        return loaded

    # -- one batch ----------------------------------------------------------------------------------------

    def _prompt(self, loaded: _Loaded, version: int, task_id: int, target: int) -> Sequence[int]:
        key = (version, task_id, target)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) > 100_000:
                self._prompt_cache.clear()
            self._prompt_cache[key] = prompt_tokens(self.tasks[task_id], loaded.tokenizer, target,
                                                    self.s.system_prompt)
        return self._prompt_cache[key]

    def judge(self, record: BatchRecord) -> Verdict:
        """The verdict on one announced batch (never raises for anything the batch contains)."""
        where = f"batch {record.batch_id} (version {record.version})"
        expected_url = self.store.batch_url(record.version, record.batch_id)
        if record.store_path.rstrip("/") != expected_url.rstrip("/"):
            return Verdict(accepted=False, failed_checks=["store"], num_tokens=0,
                           reason=f"{where}: announced at {record.store_path}, not in the pool's store "
                                  f"({expected_url})")
        loaded = self._version(record.version)
        try:
            batch = self.store.read(record.version, record.batch_id, vocab_size=loaded.prefill.vocab_size,
                                    expect_sha256=record.sha256)
            samples = checks.samples_from_arrays(batch.arrays())
        except (RolloutStoreError, ValueError) as err:
            return Verdict(accepted=False, failed_checks=["store"], num_tokens=0, reason=f"{where}: {err}"[:4000])
        if batch.meta.node_key != record.node_key or int(batch.meta.version) != record.version:
            return Verdict(accepted=False, failed_checks=["store"], num_tokens=int(len(batch.tokens)),
                           reason=f"{where}: meta.json names node {batch.meta.node_key[:16]}... version "
                                  f"{batch.meta.version}, the announcement another")
        declared = dataclasses.replace(self.s.declared, stop_token_ids=loaded.stop_token_ids)
        assignment = checks.Assignment(
            node_key=record.node_key, version=record.version, k=record.assignment_k, num_tasks=len(self.tasks),
            samples_per_prompt=self.s.samples_per_prompt,
            prompt_tokens_of=lambda tid, target: self._prompt(loaded, record.version, tid, target),
            length_targets=self.s.length_targets)

        def reward(sample: checks.Sample) -> float:
            text = loaded.tokenizer.decode(sample.completion_tokens.tolist(), skip_special_tokens=True)
            return sample_reward(self.tasks[sample.task_id], text, len(sample.completion_tokens), sample.target_len,
                                 self.s.length_penalty, self.s.length_mode).value

        result = checks.validate_batch(samples, loaded.prefill, declared, assignment, reward)
        failed = result.failed_checks()
        rewards = [0.0 if r is None else float(r) for r in result.rewards()]
        summary = result.summary()
        log.info("%s from %s...: %s %s worst %s", where, record.node_key[:16],
                 "ACCEPTED" if result.accepted else "REJECTED", failed or "", summary["worst"])
        if result.accepted:
            return Verdict(accepted=True, rewards=rewards, num_tokens=int(len(batch.tokens)))
        return Verdict(accepted=False, failed_checks=sorted(failed), reason="; ".join(result.reasons(8))[:4000],
                       rewards=rewards, num_tokens=int(len(batch.tokens)))

    # -- the loop -----------------------------------------------------------------------------------------

    def _join(self):
        reply = join(self.client, "validator", hardware_report())
        self.relays = list(reply.policy.relays)
        self.interval = min(self.s.idle_poll_s, reply.requirements.heartbeat_interval_s)
        return reply

    def run(self) -> int:
        """Validate until stopped (0), banned or refused (raises)."""
        if patiently(self._join, self.stop, "registering", max_delay_s=10.0) is None:
            return 0
        last_beat = 0.0
        try:
            while not self.stop:
                if time.monotonic() - last_beat >= self.interval:
                    beat = patiently(lambda: self.client.heartbeat([], self._metrics()), self.stop, "heartbeat",
                                     rejoin=self._join)
                    if beat is None:
                        break
                    self.relays = list(beat.policy.relays)
                    last_beat = time.monotonic()
                    touch(self.s.health_file)
                claim = patiently(lambda: self.client.claim(self.s.lease_s), self.stop, "claiming", rejoin=self._join)
                if claim is None:
                    break
                if claim.batch is None:
                    self.stop.wait(self.interval)
                    continue
                self._validate(claim.batch)
        except NodeBanned as err:
            log.error("%s", err)
            raise
        finally:
            self._leave()
        return 0

    def _validate(self, record: BatchRecord) -> None:
        t0 = time.perf_counter()
        try:
            verdict = patiently(lambda: self.judge(record), self.stop, f"validating {record.batch_id}",
                                transient=(ShardcastError, OSError), attempts=5)
        except (ShardcastError, OSError) as err:  # not the worker's fault: no verdict; the lease runs out
            log.error("giving up on %s for now: %s", record.batch_id, err)
            return
        if verdict is None:
            return
        posted = patiently(lambda: self.client.verdict(record.batch_id, verdict), self.stop,
                           f"verdict on {record.batch_id}", rejoin=self._join)
        seconds = time.perf_counter() - t0
        st = self.stats
        st["batches"] += 1
        st["accepted" if verdict.accepted else "rejected"] += 1
        st["samples"] += record.num_samples
        st["seconds"] += seconds
        if posted is not None:
            log.info("verdict on %s posted in %.2f s (%.1f samples/s); %d accepted, %d rejected so far",
                     record.batch_id, seconds, record.num_samples / max(seconds, 1e-9), st["accepted"],
                     st["rejected"])

    def _metrics(self) -> dict[str, float]:
        st = self.stats
        return {"batches": st["batches"], "accepted": st["accepted"], "rejected": st["rejected"],
                "samples_per_s": st["samples"] / st["seconds"] if st["seconds"] else 0.0}

    def _leave(self) -> None:
        leave(self.client)
