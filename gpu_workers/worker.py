"""The rollout worker (`intellect worker`): join the pool, take assignments, generate, store, announce.

One loop, driven by heartbeats:

1. heartbeat with the versions whose weights are on disk; the answer carries the policy (version, relays) and
   the node's open assignments (oldest first);
2. a newer policy version starts downloading in a background thread (SHARDCAST), while generation carries on
   with a version already held: the orchestrator assigns work at the newest version in the async window that
   the worker says it holds (docs/design.md section 3);
3. the oldest open assignment is generated at its version (swapping the engine's weights in place when the
   version changes), scored, written to the rollout store (`bridge.rollouts`, COMMIT last) and announced.

Everything a validator will check follows from the assignment: task ids and seeds (`bridge.assignment`), the
length target of each group (drawn from its first sample's seed), the prompt (the chat template of the
version's tokenizer), the sampling parameters (stated in the batch's meta.json). An assignment already
written by an earlier run of this worker (it died between COMMIT and the announcement) is announced again,
not generated twice.

Failures: the orchestrator unreachable or restarting, a relay down, the store failing: retried with backoff
(`gpu_workers.node.patiently`); a ban or a refused admission ends the worker with the reason. SIGTERM: the
batch in hand is finished and announced, then the worker deregisters (its other open assignments go back).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from bridge.assignment import assigned_task_ids
from bridge.protocol import Assignment, BatchAnnouncement, PolicyInfo
from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore, RolloutStoreError
from bridge.shardcast import ShardcastClient, ShardcastError
from bridge.shardcast.disk import held_manifest_sha256
from gpu_workers.engine import Engine, EngineSettings
from gpu_workers.node import NodeBanned, Stop, connect, hardware_report, join, leave, patiently, touch
from gpu_workers.rewards import sample_reward
from gpu_workers.tasks import TaskDataset, length_target, prompt_tokens

log = logging.getLogger("worker")

TAMPER_ENV = "TEST_ONLY_TAMPER_WEIGHTS"
"""Test-only: a float; the worker adds Gaussian noise of that relative size to every weight it loads, i.e. runs
a model other than the policy (the integration test's cheating worker). Never set it in a real pool."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    length_targets: tuple[int, ...] = ()
    length_penalty: float = 0.0
    length_mode: str = "exact"
    system_prompt: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    orchestrator_url: str
    key_path: Path
    weights_dir: Path  # versions fetched through SHARDCAST land here (v000123/)
    store: str  # rollout store location (a path or tensorstore URL)
    sampling: Sampling
    engine: EngineSettings
    servers: tuple[str, ...] = ()  # SHARDCAST servers used when the policy names no relays
    keep_versions: int = 3
    health_file: Path | None = None
    idle_poll_s: float = 1.0  # heartbeat period while there is no assignment (the pool's interval caps it)
    fetch_timeout_s: float = 30.0
    fetch_patience_s: float = 300.0
    fetch_direct_io: bool = True  # land weights with O_DIRECT (see bridge.shardcast.direct)
    fetch_buffer_mib: int = 32


def pinned_manifest(policy: PolicyInfo | None, version: int) -> str | None:
    """The manifest sha256 the orchestrator announced for `version` (None: the learner pinned none, the pool
    then trusts its relays). A version missing while others are pinned is refused: it left the window, or the
    policy is older than the version asked for."""
    if policy is None or not policy.manifests:
        return None
    if version not in policy.manifests:
        raise ShardcastError(f"version {version} has no announced manifest sha256 (the policy pins "
                             f"{sorted(policy.manifests)}); not fetching it unpinned")
    return policy.manifests[version]


class Worker:
    def __init__(self, settings: WorkerSettings, tasks: TaskDataset, stop: Stop | None = None):
        if not len(tasks):
            raise ValueError("worker: the task set is empty")
        self.s = settings
        self.tasks = tasks
        self.stop = stop or Stop()
        self.node_key, self.client = connect(settings.key_path, settings.orchestrator_url)
        self.store = RolloutStore.open(settings.store)
        self.engine: Engine | None = None
        self.tokenizer = None
        self.policy: PolicyInfo | None = None
        self.interval = settings.idle_poll_s
        self._fetching: threading.Thread | None = None
        self._shardcast: ShardcastClient | None = None  # kept while the servers stay the same (speeds, buffers)
        self.tamper = float(os.environ.get(TAMPER_ENV, "0") or 0)
        self.stats = {"batches": 0, "samples": 0, "tokens": 0, "generate_s": 0.0, "reward_sum": 0.0}

    # -- weights ------------------------------------------------------------------------------------------

    def held_versions(self) -> list[int]:
        """Versions complete on disk (their STABLE marker written), newest first."""
        held = []
        for d in self.s.weights_dir.glob("v[0-9][0-9][0-9][0-9][0-9][0-9]"):
            if (d / "STABLE").exists():
                held.append(int(d.name[1:]))
        return sorted(held, reverse=True)

    def _servers(self) -> list[str]:
        servers = list(self.policy.relays if self.policy and self.policy.relays else self.s.servers)
        if not servers:
            raise RuntimeError("no SHARDCAST server: the policy names no relays and worker servers are not set "
                               "(shardcast.servers)")
        return servers

    def _fetch(self, version: int) -> Path:
        servers = self._servers()
        client = self._shardcast
        if client is None or not client.same_servers(servers):
            client = self._shardcast = ShardcastClient(
                servers, timeout=self.s.fetch_timeout_s, patience=self.s.fetch_patience_s,
                direct_io=self.s.fetch_direct_io, buffer_bytes=self.s.fetch_buffer_mib << 20)
        result = client.fetch(version, self.s.weights_dir, wait=self.s.fetch_timeout_s,
                              manifest_sha256=pinned_manifest(self.policy, version))
        if not result.already_present:
            log.info("fetched version %d: %.1f MiB in %.2f s", version, result.received_bytes / 2**20,
                     result.seconds)
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

    def _tampered(self, src: Path, version: int) -> Path:
        """Test-only (TAMPER_ENV): a copy of version `version` with noise added to every floating weight."""
        import torch
        from safetensors.torch import load_file, save_file

        out = self.s.weights_dir / f"tampered-v{version:06d}"
        if out.exists():
            return out
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", "STABLE"))
        gen = torch.Generator().manual_seed(version)
        for f in sorted(src.glob("*.safetensors")):
            tensors = load_file(f)
            for name, t in tensors.items():
                if t.is_floating_point():
                    noise = torch.randn(t.shape, generator=gen) * self.tamper * t.float().std().clamp_min(1e-3)
                    tensors[name] = (t.float() + noise).to(t.dtype)
            save_file(tensors, tmp / f.name, metadata={"format": "pt"})
        tmp.rename(out)
        log.warning("TEST-ONLY: running version %d with weights tampered by %g", version, self.tamper)
        return out

    def _load(self, version: int) -> None:
        """Make the engine run `version` (fetching it first when it is not held)."""
        if self.engine is not None and self.engine.version == version:
            return
        path = self.s.weights_dir / f"v{version:06d}"
        if not (path / "STABLE").exists() and self._fetching is not None:
            self._fetching.join()  # a background download may be landing it (two would race for the directory)
        pin = pinned_manifest(self.policy, version)
        if (path / "STABLE").exists() and pin is not None and held_manifest_sha256(path) != pin:
            log.warning("version %d is held under another manifest than the announced %s: fetching it again",
                        version, pin[:12])
            path = self._fetch(version)  # replaces it
        elif not (path / "STABLE").exists():
            log.info("version %d is not held yet: fetching it now", version)
            path = self._fetch(version)
        model_dir = self._tampered(path, version) if self.tamper else path
        if self.engine is None:
            from transformers import AutoTokenizer

            self.engine = Engine(model_dir, version, self.s.engine)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        else:
            self.engine.swap(model_dir, version)
        self._retire()

    def _retire(self) -> None:
        """Delete held versions that are out of the async window, keeping the newest keep_versions."""
        floor = self.policy.min_version if self.policy else 0
        running = self.engine.version if self.engine else None
        for i, v in enumerate(self.held_versions()):
            if v != running and (i >= self.s.keep_versions or v < floor):
                for name in (f"v{v:06d}", f"tampered-v{v:06d}"):
                    shutil.rmtree(self.s.weights_dir / name, ignore_errors=True)
                log.info("removed version %d (out of the async window or beyond keep_versions)", v)

    # -- one assignment -----------------------------------------------------------------------------------

    def batch_id(self, a: Assignment) -> str:
        return f"{self.node_key[:16]}-a{a.id}"

    def build(self, a: Assignment) -> RolloutBatch:
        """Generate and score the assignment's samples at its version (the engine must run it)."""
        sp = self.s.sampling
        group = a.samples_per_prompt
        task_ids = a.task_ids or assigned_task_ids(self.node_key, a.version, a.k, len(self.tasks), a.prompts)
        if max(task_ids) >= len(self.tasks):
            raise RuntimeError(f"assignment {a.id} names task {max(task_ids)} but this worker has {len(self.tasks)} "
                               "tasks: the orchestrator's num_tasks and the worker's [data] disagree")
        prompts, targets, tids, gids = [], [], [], []
        for p, tid in enumerate(task_ids):
            target = length_target(sp.length_targets, a.sample_seeds[p * group])
            tokens = prompt_tokens(self.tasks[tid], self.tokenizer, target, sp.system_prompt)
            for _ in range(group):
                prompts.append(tokens)
                targets.append(target)
                tids.append(tid)
                gids.append(p)
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, list(a.sample_seeds), temperature=sp.temperature, top_p=sp.top_p,
                                    max_tokens=sp.max_tokens)
        seconds = time.perf_counter() - t0
        rewards = []
        for out, tid, target in zip(outs, tids, targets):
            text = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
            result = sample_reward(self.tasks[tid], text, len(out.tokens), target, sp.length_penalty, sp.length_mode)
            if result.reason:
                log.info("task %d: reward %.3f (%s)", tid, result.value, result.reason)
            rewards.append(result.value)
        meta = BatchMeta(batch_id=self.batch_id(a), node_key=self.node_key, version=a.version, assignment_id=a.id,
                         sampling={"temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": sp.max_tokens,
                                   "length_penalty": sp.length_penalty, "length_mode": sp.length_mode},
                         model_dtype=self.s.engine.dtype)
        batch = RolloutBatch.from_samples(
            meta, tokens=[o.prompt_tokens + o.tokens for o in outs], prompt_lens=[len(o.prompt_tokens) for o in outs],
            logprobs=[np.concatenate([np.zeros(len(o.prompt_tokens), np.float32), o.logprobs]) for o in outs],
            task_ids=tids, group_ids=gids, seeds=list(a.sample_seeds), finish=[o.finish for o in outs],
            rewards=rewards, proofs=[b"".join(o.proofs) for o in outs], target_lens=targets)
        new_tokens = int(sum(len(o.tokens) for o in outs))
        st = self.stats
        st["batches"] += 1
        st["samples"] += len(outs)
        st["tokens"] += new_tokens
        st["generate_s"] += seconds
        st["reward_sum"] += float(sum(rewards))
        log.info("assignment %d (version %d): %d samples, %d tokens in %.2f s (%.0f tok/s), mean reward %.3f",
                 a.id, a.version, len(outs), new_tokens, seconds, new_tokens / max(seconds, 1e-9),
                 float(np.mean(rewards)))
        return batch

    def submit(self, a: Assignment) -> bool:
        """Generate (unless already committed), store and announce assignment `a`; False if stopped."""
        batch_id = self.batch_id(a)
        committed = patiently(lambda: [self.store.commit(a.version, batch_id)], self.stop,
                              "reading the rollout store", transient=(RolloutStoreError,))
        if committed is None:
            return False
        digest = committed[0]
        if digest is None:
            if patiently(lambda: self._load(a.version) or True, self.stop, f"loading version {a.version}",
                         transient=(ShardcastError, OSError)) is None:
                return False
            batch = self.build(a)
            digest = patiently(lambda: self.store.write(batch), self.stop, f"writing batch {batch_id}",
                               transient=(RolloutStoreError, OSError))
            if digest is None:
                return False
            num_samples, num_tokens = batch.num_samples, int(len(batch.tokens))
        else:
            log.info("assignment %d was already written (%s...): announcing it", a.id, digest[:12])
            batch = self.store.read(a.version, batch_id, expect_sha256=digest)
            num_samples, num_tokens = batch.num_samples, int(len(batch.tokens))
        note = BatchAnnouncement(batch_id=batch_id, assignment_id=a.id, version=a.version,
                                 store_path=self.store.batch_url(a.version, batch_id), sha256=digest,
                                 num_samples=num_samples, num_tokens=num_tokens)
        record = patiently(lambda: self.client.announce_batch(note), self.stop, f"announcing batch {batch_id}",
                           rejoin=self._join)
        if record is not None:
            log.info("announced batch %s (%d samples, version %d)", batch_id, num_samples, a.version)
        return record is not None

    # -- the loop -----------------------------------------------------------------------------------------

    def _join(self):
        reply = join(self.client, "worker", hardware_report())
        self.policy = reply.policy
        self.interval = min(self.s.idle_poll_s, reply.requirements.heartbeat_interval_s)
        return reply

    def _metrics(self) -> dict[str, float]:
        st = self.stats
        return {"batches": st["batches"], "samples": st["samples"], "tokens": st["tokens"],
                "tokens_per_s": st["tokens"] / st["generate_s"] if st["generate_s"] else 0.0,
                "mean_reward": st["reward_sum"] / st["samples"] if st["samples"] else 0.0,
                "version": float(self.engine.version if self.engine else -1)}

    def run(self) -> int:
        """Work until stopped (0), banned or refused (raises)."""
        if patiently(self._join, self.stop, "registering", max_delay_s=10.0) is None:
            return 0
        done: set[int] = set()
        try:
            while not self.stop:
                reply = patiently(lambda: self.client.heartbeat(self.held_versions(), self._metrics()), self.stop,
                                  "heartbeat", rejoin=self._join)
                if reply is None:
                    break
                touch(self.s.health_file)
                self.policy = reply.policy
                self.interval = min(self.s.idle_poll_s, reply.heartbeat_interval_s)
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
