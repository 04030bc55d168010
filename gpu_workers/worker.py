"""The rollout worker (`intellect worker`): join the pool, take assignments, generate, upload.

One loop, driven by heartbeats:

1. heartbeat with the versions whose weights are on disk; the answer carries the policy (version, relays) and
   the node's open assignments (oldest first);
2. a newer policy version starts downloading in a background thread (SHARDCAST); the orchestrator assigns work
   at the newest version announced, whatever the worker holds (docs/design.md section 3), and an assignment at
   a version not held yet waits for its download;
3. the oldest open assignment is generated at its version (swapping the engine's weights in place when the
   version changes), scored, and uploaded to the pool (`bridge.upload`): the pool's ingest checks it, writes
   it to the rollout store and announces it. The worker holds no storage credentials; its batch waits in its
   own local outbox (a `bridge.rollouts` store on its disk, COMMIT last) until the pool has taken it.

Everything a validator will check follows from the assignment: task ids and seeds (`bridge.assignment`), the
length target of each group (drawn from its first sample's seed), the prompt (the chat template of the
version's tokenizer), the sampling parameters (stated in the batch's meta.json). An assignment already in the
outbox from an earlier run of this worker (it died before the upload was taken) is uploaded from there, not
generated twice.

Failures: the orchestrator or the ingest unreachable or restarting, a relay down: retried with backoff
(`gpu_workers.node.patiently`); a ban or a refused admission ends the worker with the reason. SIGTERM: the
batch in hand is finished and announced, then the worker deregisters (its other open assignments go back).
"""

from __future__ import annotations

import logging
import random
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bridge.assignment import assigned_task_ids
from bridge.protocol import Assignment, OrchestratorError, PolicyInfo
from bridge.protocol.upload_client import upload_batch
from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from bridge.shardcast import ShardcastClient, ShardcastError
from bridge.shardcast.config import ShardcastConfig
from bridge.shardcast.delta import retained
from bridge.shardcast.disk import held_manifest_sha256
from bridge.upload import encode
from gpu_workers.adapters import bases_of, drop_merged, servable
from gpu_workers.config import DataConfig, WorkerConfig, completion_cap, episode_limits, sample_caps
from gpu_workers.engine import Engine
from gpu_workers.node import NodeBanned, Stop, connect, hardware_report, join, leave, patiently, touch
from gpu_workers.rewards import sample_reward
from gpu_workers.tasks import TaskDataset, length_target, prompt_tokens

log = logging.getLogger("worker")


def pinned_manifest(policy: PolicyInfo | None, version: int) -> str | None:
    """The manifest sha256 the orchestrator announced for `version` (None: the learner pinned none, the pool
    then trusts its relays). A version missing while others are pinned is refused: it left the window, or the
    policy is older than the version asked for."""
    if policy is None or not policy.manifests:
        return None
    if version not in policy.manifests:
        raise ShardcastError(
            f"version {version} has no announced manifest sha256 (the policy pins "
            f"{sorted(policy.manifests)}); not fetching it unpinned"
        )
    return policy.manifests[version]


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        data: DataConfig,
        shardcast: ShardcastConfig,
        tasks: TaskDataset,
        *,
        key_path: Path,
        weights_dir: Path,
        outbox: str | Path,
        servers: Sequence[str] = (),
        stop: Stop | None = None,
        idle_poll_s: float = 1.0,
    ):
        """`config`: this worker's section; `data`: the pool's group lengths, length rewards and system prompt;
        `shardcast`: how weights are fetched (`timeout_s`, `patience_s`, `direct_io`, `buffer_mib`). Resolved
        locations: the key file, where fetched versions land (v000123/), the local outbox (a directory of
        batches not yet taken by the pool), and the SHARDCAST servers used when the policy names no relays.
        `idle_poll_s`: the heartbeat period while there is no assignment (the pool's interval caps it)."""
        if not len(tasks):
            raise ValueError("worker: the task set is empty")
        self.config, self.data, self.shardcast = config, data, shardcast
        self.max_tokens = completion_cap(config, data)
        self.weights_dir, self.servers, self.idle_poll_s = Path(weights_dir), tuple(servers), idle_poll_s
        self.tasks = tasks
        self.env = self.protocol = None
        if data.env is not None:  # a multi-turn pool: every task is played as an episode of its environment
            from gpu_workers.envs.loading import load_environment

            self.env = load_environment(data.env, data.env_config)
        self.stop = stop or Stop()
        self.node_key, self.client = connect(key_path, config.orchestrator_url)
        self.outbox = RolloutStore.open(outbox)
        self.engine: Engine | None = None
        self.tokenizer = None
        self.policy: PolicyInfo | None = None
        self.interval = idle_poll_s
        self._fetching: threading.Thread | None = None
        self._shardcast: ShardcastClient | None = None  # kept while the servers stay the same (speeds, buffers)
        self.stats = {"batches": 0, "samples": 0, "tokens": 0, "generate_s": 0.0, "reward_sum": 0.0}

    # -- weights ------------------------------------------------------------------------------------------

    def held_versions(self) -> list[int]:
        """Versions complete on disk (their STABLE marker written), newest first."""
        held = []
        for d in self.weights_dir.glob("v[0-9][0-9][0-9][0-9][0-9][0-9]"):
            if (d / "STABLE").exists():
                held.append(int(d.name[1:]))
        return sorted(held, reverse=True)

    def _servers(self) -> list[str]:
        servers = list(self.policy.relays if self.policy and self.policy.relays else self.servers)
        if not servers:
            raise RuntimeError(
                "no SHARDCAST server: the policy names no relays and worker servers are not set (shardcast.servers)"
            )
        return servers

    def _fetch(self, version: int) -> Path:
        servers = self._servers()
        client = self._shardcast
        if client is None or not client.same_servers(servers):
            client = self._shardcast = ShardcastClient(
                servers,
                timeout=self.shardcast.timeout_s,
                patience=self.shardcast.patience_s,
                direct_io=self.shardcast.direct_io,
                buffer_bytes=self.shardcast.buffer_mib << 20,
            )
        result = client.fetch(
            version,
            self.weights_dir,
            wait=self.shardcast.timeout_s,
            manifest_sha256=pinned_manifest(self.policy, version),
        )
        if not result.already_present:
            log.info("fetched version %d: %.1f MiB in %.2f s", version, result.received_bytes / 2**20, result.seconds)
        return result.path

    def _prefetch(self, version: int) -> None:
        """Download `version` in the background unless it is held or already coming."""
        if version in self.held_versions() or (self._fetching is not None and self._fetching.is_alive()):
            return

        def run() -> None:
            try:
                self._fetch(version)
            except Exception as err:  # logged; the next heartbeat that still sees the version missing retries
                log.warning("background fetch of version %d failed: %s: %s", version, type(err).__name__, err)

        self._fetching = threading.Thread(target=run, name=f"fetch-v{version}", daemon=True)
        self._fetching.start()

    def _load(self, version: int) -> None:
        """Make the engine run `version` (fetching it first when it is not held)."""
        if self.engine is not None and self.engine.version == version:
            return
        path = self.weights_dir / f"v{version:06d}"
        if not (path / "STABLE").exists() and self._fetching is not None:
            self._fetching.join()  # a background download may be landing it (two would race for the directory)
        pin = pinned_manifest(self.policy, version)
        if (path / "STABLE").exists() and pin is not None and held_manifest_sha256(path) != pin:
            log.warning(
                "version %d is held under another manifest than the announced %s: fetching it again", version, pin[:12]
            )
            path = self._fetch(version)  # replaces it
        elif not (path / "STABLE").exists():
            log.info("version %d is not held yet: fetching it now", version)
            path = self._fetch(version)
        path = servable(path, self.weights_dir, self._held_or_fetched)  # an adapter: merged into its base
        if self.engine is None:
            from transformers import AutoTokenizer

            self.engine = Engine(path, version, self.config, sample_caps(self.config, self.data)[1])
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            if self.env is not None:
                from gpu_workers.checks import stop_token_ids
                from gpu_workers.envs.episode import Protocol

                self.protocol = Protocol.for_tokenizer(
                    self.env,
                    self.tokenizer,
                    episode_limits(self.config, self.data),
                    stop_token_ids(path),
                    self.data.system_prompt,
                )
        else:
            self.engine.swap(path, version)
        self._retire()

    def _held_or_fetched(self, version: int) -> Path:
        path = self.weights_dir / f"v{version:06d}"
        return path if (path / "STABLE").exists() else self._fetch(version)

    def _retire(self) -> None:
        """Delete held versions that are out of the async window, keeping the newest keep_versions and (with
        shardcast.keep_anchor) the newest anchor version, the base the next versions' deltas are rebuilt from."""
        floor = self.policy.min_version if self.policy else 0
        running = self.engine.version if self.engine else None
        held = self.held_versions()
        anchor = retained(held, 1, self.shardcast.keep_anchor) - {held[0]} if held else set()
        anchor |= bases_of(self.weights_dir, held)  # the base versions of held adapter versions
        for i, v in enumerate(held):
            if v != running and v not in anchor and (i >= self.config.keep_versions or v < floor):
                shutil.rmtree(self.weights_dir / f"v{v:06d}", ignore_errors=True)
                log.info("removed version %d (out of the async window or beyond keep_versions)", v)
        drop_merged(self.weights_dir, self.held_versions())

    # -- one assignment -----------------------------------------------------------------------------------

    def batch_id(self, a: Assignment) -> str:
        return f"{self.node_key[:16]}-a{a.id}"

    def build(self, a: Assignment) -> RolloutBatch:
        """Generate and score the assignment's samples at its version (the engine must run it)."""
        cfg, data = self.config, self.data
        group = a.samples_per_prompt
        levels = max(1, len(data.curriculum))
        if a.level >= levels:
            raise RuntimeError(
                f"assignment {a.id} is at curriculum level {a.level} but this worker's [data] has {levels} "
                "level(s): the orchestrator's data.curriculum and the worker's disagree"
            )
        task_ids = a.task_ids or assigned_task_ids(
            self.node_key, a.version, a.k, len(self.tasks), a.prompts, a.salt, a.level, levels
        )
        if max(task_ids) >= len(self.tasks):
            raise RuntimeError(
                f"assignment {a.id} names task {max(task_ids)} but this worker has {len(self.tasks)} "
                "tasks: the orchestrator's num_tasks and the worker's [data] disagree"
            )
        if self.protocol is not None:
            return self._build_episodes(a, task_ids)
        prompts, targets, tids, gids = [], [], [], []
        for p, tid in enumerate(task_ids):
            target = length_target(data.length_targets, a.sample_seeds[p * group])
            tokens = prompt_tokens(self.tasks[tid], self.tokenizer, target, data.system_prompt)
            for _ in range(group):
                prompts.append(tokens)
                targets.append(target)
                tids.append(tid)
                gids.append(p)
        t0 = time.perf_counter()
        outs = self.engine.generate(
            prompts, list(a.sample_seeds), temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=self.max_tokens
        )
        seconds = time.perf_counter() - t0
        rewards = []
        for out, tid, target in zip(outs, tids, targets):
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            result = sample_reward(
                self.tasks[tid], text, len(out.tokens), target, data.length_penalty, data.length_mode
            )
            if result.reason:
                log.info("task %d: reward %.3f (%s)", tid, result.value, result.reason)
            rewards.append(result.value)
        meta = self._meta(a)
        batch = RolloutBatch.from_samples(
            meta,
            tokens=[o.prompt_tokens + o.tokens for o in outs],
            prompt_lens=[len(o.prompt_tokens) for o in outs],
            logprobs=[np.concatenate([np.zeros(len(o.prompt_tokens), np.float32), o.logprobs]) for o in outs],
            task_ids=tids,
            group_ids=gids,
            seeds=list(a.sample_seeds),
            finish=[o.finish for o in outs],
            rewards=rewards,
            proofs=[b"".join(o.proofs) for o in outs],
            target_lens=targets,
            full_logprobs=(  # recorded by the replayable sampler: the learner's ratios need them under top-p
                [np.concatenate([np.zeros(len(o.prompt_tokens), np.float32), o.full_logprobs]) for o in outs]
                if all(o.full_logprobs is not None for o in outs)
                else None
            ),
        )
        self._count(a, len(outs), int(sum(len(o.tokens) for o in outs)), seconds, rewards)
        return batch

    def _meta(self, a: Assignment) -> BatchMeta:
        cfg, data = self.config, self.data
        sampling = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "max_tokens": self.max_tokens,
            "length_penalty": data.length_penalty,
            "length_mode": data.length_mode,
        }
        if self.protocol is not None:
            limits = self.protocol.limits
            sampling.update(env=data.env, max_turns=limits.max_turns, max_episode_tokens=limits.max_total_tokens)
        return BatchMeta(
            batch_id=self.batch_id(a),
            node_key=self.node_key,
            version=a.version,
            assignment_id=a.id,
            sampling=sampling,
            model_dtype=cfg.dtype,
        )

    def _count(self, a: Assignment, samples: int, new_tokens: int, seconds: float, rewards) -> None:
        st = self.stats
        st["batches"] += 1
        st["samples"] += samples
        st["tokens"] += new_tokens
        st["generate_s"] += seconds
        st["reward_sum"] += float(sum(rewards))
        log.info(
            "assignment %d (version %d): %d samples, %d sampled tokens in %.2f s (%.0f tok/s), mean reward %.3f",
            a.id,
            a.version,
            samples,
            new_tokens,
            seconds,
            new_tokens / max(seconds, 1e-9),
            float(np.mean(rewards)),
        )

    def _build_episodes(self, a: Assignment, task_ids: Sequence[int]) -> RolloutBatch:
        """The assignment's samples as episodes of the pool's environment (`play_episodes`)."""
        cfg, group = self.config, a.samples_per_prompt
        tids = [tid for tid in task_ids for _ in range(group)]
        gids = [p for p in range(len(task_ids)) for _ in range(group)]
        t0 = time.perf_counter()
        episodes, proofs = play_episodes(
            self.engine, self.protocol, [self.tasks[t] for t in tids], list(a.sample_seeds), cfg.temperature, cfg.top_p
        )
        seconds = time.perf_counter() - t0
        for e, tid in zip(episodes, tids):
            if e.reason:
                log.info("task %d: episode reward %.3f after %d turns (%s)", tid, e.reward, e.turns, e.reason)
        batch = RolloutBatch.from_samples(
            self._meta(a),
            tokens=[e.tokens for e in episodes],
            prompt_lens=[e.prompt_len for e in episodes],
            logprobs=[np.asarray(e.logprobs, np.float32) for e in episodes],
            task_ids=tids,
            group_ids=gids,
            seeds=list(a.sample_seeds),
            finish=[e.finish for e in episodes],
            rewards=[e.reward for e in episodes],
            proofs=proofs,
            full_logprobs=(
                [np.asarray(e.full_logprobs, np.float32) for e in episodes]
                if all(e.full_logprobs is not None for e in episodes)
                else None
            ),
            sampled=[e.sampled for e in episodes],
        )
        self._count(a, len(episodes), int(sum(sum(e.sampled) for e in episodes)), seconds, [e.reward for e in episodes])
        return batch

    def submit(self, a: Assignment) -> bool:
        """Generate (unless already in the outbox), upload and so announce assignment `a`: True once it is done
        with (taken, or refused as lost, past its deadline or taken already: 410, 409), False if stopped."""
        batch_id = self.batch_id(a)
        digest = self.outbox.commit(a.version, batch_id)
        if digest is None:
            if (
                patiently(
                    lambda: self._load(a.version) or True,
                    self.stop,
                    f"loading version {a.version}",
                    transient=(ShardcastError, OSError),
                )
                is None
            ):
                return False
            batch = self.build(a)
            digest = self.outbox.write(batch)
        else:
            log.info("assignment %d is in the outbox already (%s...): uploading it", a.id, digest[:12])
            batch = self.outbox.read(a.version, batch_id, expect_sha256=digest)
        length, pieces = encode(batch)

        def upload():
            return upload_batch(
                self._upload_url(), self.client.key, a.id, batch_id, digest, length, pieces, timeout_s=300.0
            )

        try:
            record = patiently(upload, self.stop, f"uploading batch {batch_id}", rejoin=self._join)
        except OrchestratorError as err:
            if err.status not in (409, 410):
                raise
            log.warning("batch %s was not taken: %s", batch_id, err.detail)  # past its deadline, or taken already
            record = None
        else:
            if record is None:
                return False
            log.info(
                "uploaded batch %s (%d samples, %.1f MB, version %d)",
                batch_id,
                batch.num_samples,
                length / 1e6,
                a.version,
            )
        self.outbox.delete(a.version, batch_id)
        return True

    def _upload_url(self) -> str:
        """Where to upload: worker.upload_url, else one of the pool's upload URLs at random, else the
        orchestrator."""
        if self.config.upload_url:
            return self.config.upload_url
        urls = self.policy.uploads if self.policy is not None else []
        return random.choice(urls) if urls else self.config.orchestrator_url

    # -- the loop -----------------------------------------------------------------------------------------

    def _join(self):
        reply = join(self.client, "worker", hardware_report())
        self.policy = reply.policy
        self.interval = min(self.idle_poll_s, reply.requirements.heartbeat_interval_s)
        return reply

    def _metrics(self) -> dict[str, float]:
        st = self.stats
        return {
            "batches": st["batches"],
            "samples": st["samples"],
            "tokens": st["tokens"],
            "tokens_per_s": st["tokens"] / st["generate_s"] if st["generate_s"] else 0.0,
            "mean_reward": st["reward_sum"] / st["samples"] if st["samples"] else 0.0,
            "version": float(self.engine.version if self.engine else -1),
        }

    def run(self) -> int:
        """Work until stopped (0), banned or refused (raises)."""
        if patiently(self._join, self.stop, "registering", max_delay_s=10.0) is None:
            return 0
        done: set[int] = set()
        try:
            while not self.stop:
                reply = patiently(
                    lambda: self.client.heartbeat(self.held_versions(), self._metrics()),
                    self.stop,
                    "heartbeat",
                    rejoin=self._join,
                )
                if reply is None:
                    break
                touch(self.config.health_file)
                self.policy = reply.policy
                self.interval = min(self.idle_poll_s, reply.heartbeat_interval_s)
                self.outbox.prune(self.policy.min_version)  # batches of versions out of the window stay untaken
                if self.policy.version not in self.held_versions():
                    self._prefetch(self.policy.version)
                todo = [a for a in reply.assignments if a.id not in done]
                if not todo:
                    self.stop.wait(self.interval)
                    continue
                a = todo[0]
                if self.submit(a):
                    done.add(a.id)
        except NodeBanned as err:
            log.error("%s", err)
            raise
        finally:
            self._leave()
        return 0

    def _leave(self) -> None:
        st = self.stats
        log.info("worker stopping: %d batches, %d samples, %d tokens", st["batches"], st["samples"], st["tokens"])
        leave(self.client)
        if self.engine is not None:
            self.engine.close()


def play_episodes(engine, protocol, tasks: Sequence, seeds: Sequence[int], temperature: float, top_p: float):
    """(rollouts, proofs) of one episode per (task, seed) (`gpu_workers.envs.episode.play`): every model turn is
    generated by `engine` on the exact previous sequence as token ids, at its turn's seed, stopping on the
    protocol's stop tokens; each episode's TOPLOC proofs cover the hidden states behind its sampled tokens, across
    turns (docs/design.md section 7), as one byte string."""
    import torch

    from gpu_workers.envs.episode import engine_turns, play
    from gpu_workers.toploc import build_proofs_batch

    episodes = play(protocol, tasks, seeds, engine_turns(engine, protocol, temperature, top_p, hidden_only=True))
    proofs = build_proofs_batch([torch.cat(e.hidden).to(torch.bfloat16) for e in episodes])
    return episodes, [b"".join(p) for p in proofs]
