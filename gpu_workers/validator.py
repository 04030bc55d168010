"""The validator (`intellect validator`): claim announced batches, check them, post verdicts.

For each claimed batch: read it from the pool's rollout store (its COMMIT hash must be the announced one), load
the batch's policy version (fetched through SHARDCAST, the newest `cache_versions` kept loaded), and run every
check of `gpu_workers.checks` against what the pool prescribes, never against what the worker declares:

- fixed data: task ids, groups, seeds, length targets and prompt tokens of the assignment (node key, version,
  k), rebuilt here with the pool's tasks and the version's tokenizer;
- termination, computation (TOPLOC, by prefill) and sampling at the pool's temperature, top-p and max tokens;
- reward: recomputed with the same reward code the worker ran; the verdict carries the recomputed rewards,
  which are what the learner trains on.

Of an accepted batch the validator also writes the logprobs its prefill recomputed beside the batch
(`bridge.validator_logprobs`: each completion token's logprob on the full distribution at the pool's
temperature) and puts their digest in its verdict: the learner divides its ratios by these, not by the
worker's claim, which the sampling check can bound only to the engines' rounding.

The prefill, and the replay check on its logits, run on `[validator] device` ("auto": the first CUDA device
torch sees, else the CPU); the log line of every verdict and the heartbeat's `batches_on_<device>` say which
device judged.

A batch that cannot be read (missing, hash mismatch, malformed) is rejected with the reader's error as the
reason. The claim has a lease: a validator that dies loses its claim to another after `lease_s`.

No batch can crash, stall or exhaust a validator:

- its work is bounded by the assignment before any array is read: the batch must hold exactly the claim's
  `num_samples` (the orchestrator checked it against the assignment, prompts x samples per prompt, when the
  batch was announced), and meta.json's token and proof-byte counts, every array's declared shape, its
  chunking and the size of every metadata file are bounded by that count, the pool's max prompt length +
  max tokens per sample and its max tokens per completion (`bridge.rollouts.ReadLimits`); a batch beyond
  them is rejected ("store") before anything is allocated for its arrays;
- a task id outside the task list is a fixed-data failure: the task list is never indexed with a batch's
  value (`check_fixed_data` asks for the assigned prompts only, the reward names the id);
- no prefill runs for a batch that fixed data or termination has already rejected (`checks.validate_batch`);
- any exception the batch's content raises in the checks becomes a rejection ("validator") naming it, logged
  with its traceback; only the validator's own trouble (a SHARDCAST fetch, an OSError) posts nothing and lets
  the lease lapse;
- a verdict the orchestrator refuses (4xx) is logged: a refused acceptance, or a refused rejection, is
  replaced by a bare rejection saying so; the validator then goes on with the next batch (one it can post
  nothing on is not judged again for `Validator.UNPOSTABLE_S`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bridge.protocol import BatchRecord, OrchestratorError, Verdict
from bridge.rollouts import ReadLimits, RolloutStore, RolloutStoreError
from bridge.shardcast import ShardcastClient, ShardcastError
from bridge.shardcast.config import ShardcastConfig
from bridge.shardcast.disk import held_manifest_sha256
from bridge.validator_logprobs import flat_logprobs, write_validator_logprobs
from gpu_workers import checks
from gpu_workers.adapters import bases_of, drop_merged, servable
from gpu_workers.calibration import CalibrationError, calibration_problem, needs_calibration
from gpu_workers.config import DataConfig, ValidatorConfig, WorkerConfig, completion_cap, episode_limits, sample_caps
from gpu_workers.node import NodeBanned, Stop, connect, hardware_report, join, leave, patiently, touch
from gpu_workers.prefill import resolve_device
from gpu_workers.rewards import sample_reward
from gpu_workers.tasks import TaskDataset, prompt_tokens
from gpu_workers.toploc import Thresholds

log = logging.getLogger("validator")


def _reason(text: str) -> str:
    """A verdict's reason as the protocol takes it (`bridge.protocol.Text`): no NUL, at most 1000 characters
    (a longer one made the Verdict itself raise: a batch with many failing samples stopped the validator)."""
    return text.replace("\x00", "\\x00")[:1000]


@dataclasses.dataclass
class _Loaded:
    prefill: object  # gpu_workers.prefill.Prefill
    tokenizer: object
    stop_token_ids: frozenset[int]
    protocol: object = None  # gpu_workers.envs.episode.Protocol of a pool with data.env


def _completion_mask(sample) -> np.ndarray:
    """The sampled mask over a sample's completion tokens (a schema-1 batch: all of them)."""
    if sample.sampled is None:
        return np.ones(len(sample.completion_tokens), np.uint8)
    return np.asarray(sample.sampled, np.uint8)


class Validator:
    UNPOSTABLE_S = 60.0  # a batch the orchestrator took no verdict on is not judged again for this long

    def __init__(
        self,
        config: ValidatorConfig,
        worker: WorkerConfig,
        data: DataConfig,
        shardcast: ShardcastConfig,
        tasks: TaskDataset,
        *,
        model_dir: Path | None = None,
        key_path: Path,
        weights_dir: Path,
        store: str,
        servers: Sequence[str] = (),
        stop: Stop | None = None,
        idle_poll_s: float = 1.0,
    ):
        """`config`: this validator's section; `worker`: the pool's sampling (temperature, top_p, max_tokens,
        sampler, dtype) that batches are held to; `data`: the pool's group size, lengths, length rewards and
        system prompt; `shardcast`: how weights are fetched; `model_dir`: the pool's base model (`model.path`),
        which a bfloat16/float16 replay pool's calibration must name (`CalibrationError` otherwise, before
        anything starts). Resolved locations as for `Worker`."""
        problem = calibration_problem(config, worker, model_dir)
        if problem is not None:
            raise CalibrationError(problem)
        self.config, self.worker, self.data, self.shardcast = config, worker, data, shardcast
        cap = completion_cap(worker, data)
        self.declared = checks.Declared(  # the stop tokens are each version's own (`_judge`)
            temperature=worker.temperature,
            top_p=worker.top_p,
            max_tokens=cap,
            stop_token_ids=frozenset(),
            max_model_len=sample_caps(worker, data)[1],
            sampler=worker.sampler,
            dtype=worker.dtype,
            thresholds=Thresholds(
                config.max_exp_mismatches, config.max_mantissa_err_mean, config.max_mantissa_err_median
            ),
            tolerance=checks.SamplingTolerance(
                replay_logit_tolerance=config.replay_logit_tolerance,
                tie_logit_tolerance=config.tie_logit_tolerance,
                max_logprob_diff=config.max_logprob_diff,
                mean_logprob_diff=config.mean_logprob_diff,
                mean_signed_logprob_diff=config.mean_signed_logprob_diff,
                logprob_diff_allowance=config.logprob_diff_allowance,
                near_ties_per_token=config.near_ties_per_token,
                near_ties_per_batch_token=config.near_ties_per_batch_token,
            ),
        )
        self.weights_dir, self.servers, self.idle_poll_s = Path(weights_dir), tuple(servers), idle_poll_s
        self.device = resolve_device(config.device)  # a GPU that is not there stops the validator here
        log.info("judging on %s (validator.device = %s)", self.device, config.device)
        if not needs_calibration(worker):
            log.info(
                "a %s pool with the %s sampler: no calibration needed (float32 engines leave no near ties to "
                "price; vLLM's own sampler is not replayed: a trusted pool)",
                worker.dtype,
                worker.sampler,
            )
        elif config.allow_uncalibrated:
            log.warning(
                "validator.allow_uncalibrated: judging a %s replay pool with%s calibration of its model: a trained "
                "policy's honest workers may exceed the dtype's defaults and a near-tie cheater has room within "
                "them; run `intellect calibrate CONFIG` (docs/verifiable-sampling.md, 'Calibrating a pool')",
                worker.dtype,
                "out a" if config.calibrated_model is None else " an unchecked",
            )
        else:
            log.info("calibrated for model %s... in %s", config.calibrated_model[:16], worker.dtype)
        self.tasks = tasks
        self.env = None
        if data.env is not None:  # a multi-turn pool: every batch is re-run in its environment
            from gpu_workers.envs.loading import load_environment

            self.env = load_environment(data.env, data.env_config)
        self.stop = stop or Stop()
        self.node_key, self.client = connect(key_path, config.orchestrator_url)
        self.store = RolloutStore.open(store)
        self.loaded: collections.OrderedDict[int, _Loaded] = collections.OrderedDict()
        self.relays: list[str] = []
        self.pins: dict[int, str] = {}  # manifest sha256 by version, as the orchestrator announced them
        self._shardcast: ShardcastClient | None = None  # kept while the servers stay the same (its buffers)
        self.interval = idle_poll_s
        self.stats = {"batches": 0, "accepted": 0, "rejected": 0, "samples": 0, "seconds": 0.0}
        self._prompt_cache: dict[tuple[int, int, int], list[int]] = {}
        self._unpostable: dict[str, float] = {}  # batch -> when the orchestrator refused every verdict on it

    # -- weights ------------------------------------------------------------------------------------------

    def _pin(self, manifests: dict[int, str]) -> None:
        """Remember announced manifest sha256s (a batch may be judged after its version left the window)."""
        self.pins.update(manifests)
        for old in sorted(self.pins)[:-256]:
            del self.pins[old]

    def _version(self, version: int) -> _Loaded:
        pin = self.pins.get(version)
        if version in self.loaded:
            path = self.weights_dir / f"v{version:06d}"
            if pin is None or held_manifest_sha256(path) == pin:
                self.loaded.move_to_end(version)
                return self.loaded[version]
            log.warning(
                "version %d was loaded from another manifest than the announced %s: fetching it again",
                version,
                pin[:12],
            )
            del self.loaded[version]
        from transformers import AutoTokenizer

        from gpu_workers.prefill import Prefill

        servers = self.relays or list(self.servers)
        if not servers:
            raise ShardcastError("no SHARDCAST server: the policy names no relays and shardcast.servers is empty")
        client = self._shardcast
        if client is None or not client.same_servers(servers):
            client = self._shardcast = ShardcastClient(
                servers,
                timeout=self.shardcast.timeout_s,
                direct_io=self.shardcast.direct_io,
                buffer_bytes=self.shardcast.buffer_mib << 20,
            )
        path = client.fetch(version, self.weights_dir, wait=self.shardcast.timeout_s, manifest_sha256=pin).path

        def fetch_base(base: int) -> Path:
            wait, pinned = self.shardcast.timeout_s, self.pins.get(base)
            return client.fetch(base, self.weights_dir, wait=wait, manifest_sha256=pinned).path

        path = servable(path, self.weights_dir, fetch_base)  # an adapter version: merged into its base
        prefill = Prefill(
            path,
            self.config.dtype,
            self.device,
            memory_share=self.config.gpu_memory_share,
            max_len=self.declared.max_model_len,
        )
        loaded = _Loaded(prefill, AutoTokenizer.from_pretrained(path), checks.stop_token_ids(path))
        if self.env is not None:
            from gpu_workers.envs.episode import Protocol

            limits = episode_limits(self.worker, self.data)
            loaded.protocol = Protocol.for_tokenizer(
                self.env, loaded.tokenizer, limits, loaded.stop_token_ids, self.data.system_prompt
            )
        self.loaded[version] = loaded
        while len(self.loaded) > self.config.cache_versions:
            old, _ = self.loaded.popitem(last=False)
            if old not in bases_of(self.weights_dir, self.loaded):  # a base stays while its adapters are loaded
                shutil.rmtree(self.weights_dir / f"v{old:06d}", ignore_errors=True)
            drop_merged(self.weights_dir, self.loaded)
            log.info("dropped version %d from the cache", old)
        log.info(
            "loaded version %d for prefill (%s on %s, %d tokens a batch)",
            version,
            self.config.dtype,
            self.device,
            prefill.batch_tokens,
        )
        return loaded

    # -- one batch ----------------------------------------------------------------------------------------

    def _task(self, task_id: int):
        """The task list's entry for `task_id`; ValueError for an id outside it (a batch's value is never an
        index unchecked)."""
        if not 0 <= task_id < len(self.tasks):
            raise ValueError(f"task id {task_id} is outside the task list (0..{len(self.tasks) - 1})")
        return self.tasks[task_id]

    def _prompt(self, loaded: _Loaded, version: int, task_id: int, target: int) -> Sequence[int]:
        key = (version, task_id, target)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) > 100_000:
                self._prompt_cache.clear()
            self._prompt_cache[key] = prompt_tokens(
                self._task(task_id), loaded.tokenizer, target, self.data.system_prompt
            )
        return self._prompt_cache[key]

    def judge(self, record: BatchRecord) -> Verdict:
        """The verdict on one announced batch. Never raises for anything the batch contains: an exception its
        content triggers is a rejection naming it. Raises ShardcastError or OSError for the validator's own
        trouble (the version's weights cannot be fetched or loaded): no verdict then."""
        where = f"batch {record.batch_id} (version {record.version})"
        expected_url = self.store.batch_url(record.version, record.batch_id)
        if record.store_path.rstrip("/") != expected_url.rstrip("/"):
            return Verdict(
                accepted=False,
                failed_checks=["store"],
                num_tokens=0,
                reason=f"{where}: announced at {record.store_path}, not in the pool's store ({expected_url})",
            )
        loaded = self._version(record.version)
        try:
            return self._judge(record, loaded, where)
        except (ShardcastError, OSError):
            raise
        except Exception as err:  # a bug the batch's content triggers: the batch is rejected, not the validator
            log.exception("%s from %s...: the checks raised on this batch; rejecting it", where, record.node_key[:16])
            return Verdict(
                accepted=False,
                failed_checks=["validator"],
                num_tokens=0,
                reason=_reason(f"{where}: the validator's checks raised on this batch: {type(err).__name__}: {err}"),
            )

    def _judge(self, record: BatchRecord, loaded: _Loaded, where: str) -> Verdict:
        declared = dataclasses.replace(self.declared, stop_token_ids=loaded.stop_token_ids)
        try:  # the claim's num_samples is the assignment's: the orchestrator refused any other at announcement
            limits = ReadLimits.for_assignment(
                record.num_samples, sample_caps(self.worker, self.data)[0], declared.max_model_len
            )
            batch = self.store.read(
                record.version,
                record.batch_id,
                vocab_size=loaded.prefill.vocab_size,
                expect_sha256=record.sha256,
                limits=limits,
            )
            samples = checks.samples_from_arrays(batch.arrays())
        except (RolloutStoreError, ValueError) as err:
            return Verdict(accepted=False, failed_checks=["store"], num_tokens=0, reason=_reason(f"{where}: {err}"))
        if batch.meta.node_key != record.node_key or int(batch.meta.version) != record.version:
            return Verdict(
                accepted=False,
                failed_checks=["store"],
                num_tokens=int(len(batch.tokens)),
                reason=f"{where}: meta.json names node {batch.meta.node_key[:16]}... version "
                f"{batch.meta.version}, the announcement another",
            )
        if self.env is None and batch.sampled is not None:  # the single-turn checks would not read the mask
            return Verdict(
                accepted=False,
                failed_checks=["store"],
                num_tokens=int(len(batch.tokens)),
                reason=f"{where}: a multi-turn batch (schema 2, a sampled mask) in a pool without data.env",
            )
        assignment = checks.AssignedWork(
            node_key=record.node_key,
            version=record.version,
            k=record.assignment_k,
            num_tasks=len(self.tasks),
            samples_per_prompt=self.data.samples_per_prompt,
            prompt_tokens_of=(  # an episode's first prompt is the episode check's (it may depend on the seed)
                None if self.env is not None else lambda tid, target: self._prompt(loaded, record.version, tid, target)
            ),
            length_targets=tuple(self.data.length_targets),
            num_samples=record.num_samples,
            salt=record.assignment_salt,
            level=record.assignment_level,
            levels=max(1, len(self.data.curriculum)),
        )
        if self.env is not None:
            from gpu_workers.envs.episode import judge
            from gpu_workers.episode_checks import validate_episode_batch

            def rerun(sample: checks.Sample):
                tokens = np.concatenate([sample.prompt_tokens, sample.completion_tokens])
                mask = np.concatenate([np.zeros(len(sample.prompt_tokens), np.uint8), _completion_mask(sample)])
                task = self._task(sample.task_id)
                return judge(loaded.protocol, task, sample.seed, tokens, mask, len(sample.prompt_tokens), sample.finish)

            result = validate_episode_batch(samples, loaded.prefill, declared, assignment, rerun)
            return self._verdict(result, record, batch, where)

        def reward(sample: checks.Sample) -> float:
            task = self._task(sample.task_id)  # check_reward turns its ValueError into a reason
            text = loaded.tokenizer.decode(sample.completion_tokens.tolist(), skip_special_tokens=True)
            return sample_reward(
                task,
                text,
                len(sample.completion_tokens),
                sample.target_len,
                self.data.length_penalty,
                self.data.length_mode,
            ).value

        result = checks.validate_batch(samples, loaded.prefill, declared, assignment, reward)
        return self._verdict(result, record, batch, where)

    def _verdict(self, result: checks.BatchVerdict, record: BatchRecord, batch, where: str) -> Verdict:
        """The verdict to post from the checks' outcome."""
        failed = result.failed_checks()
        rewards = [0.0 if r is None else float(r) for r in result.rewards()]
        summary = result.summary()
        log.info(
            "%s from %s...: %s %s worst %s (judged on %s)",
            where,
            record.node_key[:16],
            "ACCEPTED" if result.accepted else "REJECTED",
            failed or "",
            summary["worst"],
            self.device,
        )
        ledger = next((v.numbers for v in result.batch_checks if "near_tie_cost" in v.numbers), {})
        near_ties = dict(  # for the worker's near-tie ledger (`[orchestrator] near_tie_rate`)
            near_tie_cost=float(ledger.get("near_tie_cost", 0.0)), near_tie_tokens=int(ledger.get("tokens", 0))
        )
        if result.accepted:  # and the samples the learner leaves out (`[loss] near_tie_samples`)
            near_ties["near_tie_samples"] = result.near_tie_samples()
        if result.accepted:
            values = flat_logprobs(batch, result.logprobs)  # every sample of an accepted batch was prefilled
            try:
                digest = write_validator_logprobs(self.store, batch, record.sha256, values)
            except RolloutStoreError as err:  # the store's trouble, not the batch's: no verdict, the lease lapses
                raise OSError(f"{where}: cannot write the validator's logprobs: {err}") from err
            return Verdict(
                accepted=True, rewards=rewards, num_tokens=int(len(batch.tokens)), logprobs_sha256=digest, **near_ties
            )
        return Verdict(
            accepted=False,
            failed_checks=sorted(failed),
            reason=_reason("; ".join(result.reasons(8))),
            rewards=rewards,
            num_tokens=int(len(batch.tokens)),
            **near_ties,
        )

    # -- the loop -----------------------------------------------------------------------------------------

    def _join(self):
        reply = join(self.client, "validator", hardware_report())
        self.relays = list(reply.policy.relays)
        self._pin(reply.policy.manifests)
        self.interval = min(self.idle_poll_s, reply.requirements.heartbeat_interval_s)
        return reply

    def run(self) -> int:
        """Validate until stopped (0), banned or refused (raises)."""
        if patiently(self._join, self.stop, "registering", max_delay_s=10.0) is None:
            return 0
        last_beat = 0.0
        try:
            while not self.stop:
                if time.monotonic() - last_beat >= self.interval:
                    beat = patiently(
                        lambda: self.client.heartbeat([], self._metrics()), self.stop, "heartbeat", rejoin=self._join
                    )
                    if beat is None:
                        break
                    self.relays = list(beat.policy.relays)
                    self._pin(beat.policy.manifests)
                    last_beat = time.monotonic()
                    touch(self.config.health_file)
                claim = patiently(
                    lambda: self.client.claim(self.config.lease_s), self.stop, "claiming", rejoin=self._join
                )
                if claim is None:
                    break
                if claim.batch is None or self._refused_lately(claim.batch.batch_id):
                    self.stop.wait(self.interval)
                    continue
                if claim.manifest_sha256 is not None:
                    self._pin({claim.batch.version: claim.manifest_sha256})
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
            verdict = patiently(
                lambda: self.judge(record),
                self.stop,
                f"validating {record.batch_id}",
                transient=(ShardcastError, OSError),
                attempts=5,
            )
        except (ShardcastError, OSError) as err:  # not the worker's fault: no verdict; the lease runs out
            log.error("giving up on %s for now: %s", record.batch_id, err)
            return
        if verdict is None:
            return
        posted, verdict = self._post(record, verdict)
        if verdict is None:
            return
        seconds = time.perf_counter() - t0
        st = self.stats
        st["batches"] += 1
        st["accepted" if verdict.accepted else "rejected"] += 1
        st["samples"] += record.num_samples
        st["seconds"] += seconds
        if posted is not None:
            log.info(
                "verdict on %s posted in %.2f s (%.1f samples/s); %d accepted, %d rejected so far",
                record.batch_id,
                seconds,
                record.num_samples / max(seconds, 1e-9),
                st["accepted"],
                st["rejected"],
            )

    def _refused_lately(self, batch_id: str) -> bool:
        """Whether the orchestrator refused every verdict on this batch less than `UNPOSTABLE_S` ago."""
        since = self._unpostable.get(batch_id)
        if since is not None and time.monotonic() - since >= self.UNPOSTABLE_S:
            del self._unpostable[batch_id]
            return False
        return since is not None

    def _post(self, record: BatchRecord, verdict: Verdict) -> tuple[BatchRecord | None, Verdict | None]:
        """Post a verdict: (the orchestrator's record or None when stopped, the verdict posted or None).

        A refusal (4xx) is logged and never raised. 404 and 409 (judged already, or the claim went to another):
        nothing is left to post. Any other refusal, of an acceptance (e.g. 422: its rewards do not fit the
        batch) or of a rejection, is answered with a bare rejection that says so; if that is refused too, the
        batch is not judged again by this validator for `UNPOSTABLE_S` (a claim of it is skipped meanwhile)."""
        what = f"verdict on {record.batch_id}"
        try:
            return patiently(
                lambda: self.client.verdict(record.batch_id, verdict), self.stop, what, rejoin=self._join
            ), verdict
        except OrchestratorError as err:
            log.error(
                "the orchestrator refused the %s of %s: %s",
                "acceptance" if verdict.accepted else "rejection",
                record.batch_id,
                err,
            )
            if err.status in (404, 409):
                return None, None
            refusal = err
        kind = "acceptance" if verdict.accepted else "rejection"
        bare = Verdict(
            accepted=False,
            failed_checks=verdict.failed_checks or ["verdict"],
            num_tokens=verdict.num_tokens,
            reason=_reason(
                f"batch {record.batch_id}: the orchestrator refused the validator's {kind} "
                f"(HTTP {refusal.status}: {refusal.detail}); {verdict.reason}"
            ),
        )
        try:
            return patiently(
                lambda: self.client.verdict(record.batch_id, bare), self.stop, what, rejoin=self._join
            ), bare
        except OrchestratorError as err:
            log.error(
                "the orchestrator refused a bare rejection of %s too (%s); not judging it again for %.0f s",
                record.batch_id,
                err,
                self.UNPOSTABLE_S,
            )
            if len(self._unpostable) > 10_000:
                self._unpostable.clear()
            self._unpostable[record.batch_id] = time.monotonic()
            return None, None

    def _metrics(self) -> dict[str, float]:
        """The heartbeat's numbers (shown per node by the orchestrator): verdicts so far, their pace, and
        `batches_on_<device>`, the batches this validator judged on its device (e.g. batches_on_cuda:0)."""
        st = self.stats
        return {
            "batches": st["batches"],
            "accepted": st["accepted"],
            "rejected": st["rejected"],
            "samples_per_s": st["samples"] / st["seconds"] if st["seconds"] else 0.0,
            f"batches_on_{self.device}": st["batches"],
        }

    def _leave(self) -> None:
        leave(self.client)
