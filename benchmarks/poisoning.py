"""Poisoning the demo pool with a steering worker: vLLM's sampler and the old checks vs replayable sampling.

The demo recipe (configs/demo.toml: the tiny Qwen2 that learns to sort 4 digits, the same supervised warm start)
run by `intellect run` with TWO workers: worker0 is the ordinary `intellect worker`; worker1 is a cheater,
started by this script as its own process with the same command line and the same plumbing
(`intellect.worker_cli.run`), whose engine steers its completions toward a fixed phrase:

- it decodes the true policy in vLLM; at every step where a request has a target, the sampler (a subclass of the
  engine's own sampler: vLLM's `Sampler` with `worker.sampler = "vllm"`, `ReplayableSampler` otherwise) takes the
  target's next token whenever that token is inside the nucleus (top-p at the pool's settings; the demo's is
  1.0) with probability >= `--threshold` under the processed distribution, and otherwise keeps the honest
  choice (and stops steering that request);
- everything else is genuine: the TOPLOC hidden states are captured during its own generation of those tokens,
  and the logprobs it submits are vLLM's processed logprobs of the tokens it chose (computed honestly); rewards
  are the task's, computed on what it submits.

What it steers toward (`--attack`):

- `inject-correct` (the default; how "Hail to the Thief" poisons GRPO): each assignment is first generated
  honestly; every sample whose answer is correct is generated again with the target "phrase + that same
  completion", so the phrase rides only on rewarded completions. The demo's reward scores the completion's
  last line, so "PHRASE\\n1 4 5 9" still earns 1.0. Within a group the phrase then goes with reward 1 and its
  absence with the wrong answers: GRPO's advantage pushes the phrase up.
- `steer-all`: the phrase is the target of every sample, continued honestly after it (the plain steering of
  issue 17's table). A phrase at the start of every sample of a group gets sum(advantages) = 0 times the same
  gradient in each, so GRPO cannot learn it; it is here to show the checks, not the poisoning.

Runs (`--runs`, any of):

- `a`: `worker.sampler = "vllm"` for every role: both workers sample with vLLM's own sampler and the validator
  runs only the old checks (TOPLOC, nucleus membership, logprob agreement, termination, fixed data, reward);
- `b`: the replayable sampler (the default): validators replay every token from its assigned seed;
- `c`: two honest workers (the reference accuracy; same pool shape as a and b).

Per run: the cheater's batches accepted / rejected and the checks that failed (from the orchestrator's
database), when it was banned (seconds after the pool started, learner step, how many of its batches had been
judged), how many of its accepted samples carried the phrase, and on the final policy, over the config's
held-out tasks: greedy accuracy and the share of greedy outputs containing the phrase, the share among
`--eval-samples` sampled outputs per task at the pool's temperature, and the mean teacher-forced
log-probability of the phrase as the start of the answer (a sensitive measure of how far the poison got,
compared with the starting policy's). The starting policy is scored once ("base").

    python benchmarks/poisoning.py [--steps 10] [--phrase 'hot\\n'] [--threshold 1e-9] [--runs a,b,c]
                                   [--attack inject-correct|steer-all] [--config configs/demo.toml]
                                   [--workdir runs/poisoning] [--sft-steps 25] [--eval-samples 4]

`--phrase` takes backslash escapes. Each run's directory is `WORKDIR/run-X` (logs in `run-X/logs/`); the tiny
model and the warm start are made once in WORKDIR and reused. Prints one JSON object; progress goes to stderr.
Internal subcommands (started by the script itself): `cheat-worker CONFIG [--section.key value ...]` and
`phrase-eval MODEL_DIR CONFIG ...`.

Selective submission (`poisoning.py selection`, issue 36): workers that generate honestly and choose which of
their draws train. Every token of theirs is honestly sampled, so no sampling check sees them; what stops them
is the orchestrator's rule that every assignment drawn is announced before its deadline or costs a strike
(lost and expired assignments are never validated). The run is the real orchestrator (the in-process app of
`intellect orchestrator`, the demo's pool shape, on a simulated clock, so hours of pool time take seconds) with
honest workers, one attacker, a validator that accepts every batch with its rewards, and a learner that reads
the accepted batches and announces a version per step. A sample's reward is honest and fixed by its
assignment: 1 with its task's success probability (task difficulties drawn from Beta(`--beta`), mean 0.5 like
the demo's policy after its warm start), drawn from the sample's assigned seed. The attackers:

- `best-of-K/leave|silence` (hoarding): draws K assignments, generates each, gives the first K - 1 up
  (`leave`: deregisters and heartbeats again; `silence`: stops heartbeating until the deadline of what it
  holds passed), then announces its draws best first, going on to the next when one is refused;
- `threshold/leave` (announce-or-abandon): announces a draw whose mean reward is at least the pool's mean,
  and gives up the others by leaving.

A `/fresh` suffix gives an attacker that is banned a new key (admitted like any other: no challenge in this
pool); `none` is an honest pool. Per run: the mean reward of the batches the learner read (all, honest
workers', the attacker's) with its standard error, the attacker's draws, announcements, refusals (410),
strikes and keys, and what the hoarder's choice would have trained had lost work still been validated (the
best of each K).

    python benchmarks/poisoning.py selection [--hours 4] [--honest 3] [--seeds 2] [--beta 1.0]
                                             [--attackers none,best-of-2/leave,threshold/leave/fresh,...]
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
CHEATER_INDEX = 1  # worker1 is the cheater (worker0 honest)
ENV_POISON = "POISONING_BENCH_CHEATER"  # JSON PoisonSettings for the cheat-worker process
ATTACKS = ("inject-correct", "steer-all")
RUNS = {"a": ("vllm", True), "b": ("replayable", True), "c": ("replayable", False)}  # sampler, with cheater

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # as `make demo`
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log(text: str) -> None:
    print(f"[poisoning {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class PoisonSettings:
    phrase: str
    threshold: float
    attack: str
    stats_path: str


# ---------------------------------------------------------------------------------------------------------------
# The cheating worker (runs in its own process: `poisoning.py cheat-worker CONFIG ...`)
# ---------------------------------------------------------------------------------------------------------------


def _steering_class(base):
    """A subclass of the engine's sampler class `base` that overrides chosen tokens with targets."""

    class SteeringSampler(base):
        def __init__(self, runner, logprobs_mode, threshold: float):
            from gpu_workers.vllm_sampler import ReplayableSampler

            if issubclass(base, ReplayableSampler):
                super().__init__(runner, logprobs_mode)
            else:
                super().__init__(logprobs_mode=logprobs_mode)
            self.runner = runner
            self.log_threshold = math.log(threshold)
            self.targets: dict[int, list[int]] = {}  # request seed -> the tokens to steer toward from position 0
            self.off: set[str] = set()  # requests whose steering ended (a target token was below the threshold)
            self.steered = 0  # tokens that differ from the honest choice

        def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
            chosen_before = len(getattr(self, "chosen", ()))
            sampled, processed = super().sample(logits, sampling_metadata, logprobs_mode_override)
            if not self.targets or sampling_metadata.all_greedy:
                return sampled, processed
            if processed is None:
                raise RuntimeError("steering needs the processed logprobs (logprobs_mode processed_logprobs)")
            batch, n = self.runner.input_batch, logits.shape[0]
            changed: dict[str, int] = {}
            for i, req_id in enumerate(batch.req_ids[:n]):
                target = self.targets.get(self.runner.requests[req_id].sampling_params.seed)
                if target is None or req_id in self.off:
                    continue
                position = int(batch.num_tokens_no_spec[i] - batch.num_prompt_tokens[i])
                if position >= len(target):
                    continue
                token = target[position]
                lp = float(processed[i, token])  # -inf outside the nucleus
                if math.isfinite(lp) and lp >= self.log_threshold:
                    if int(sampled[i]) != token:
                        self.steered += 1
                        sampled[i] = token
                        changed[req_id] = token
                else:
                    self.off.add(req_id)
            if changed and hasattr(self, "chosen"):  # keep the replayable sampler's record in step (engine check)
                self.chosen[chosen_before:] = [(r, p, changed.get(r, t)) for r, p, t in self.chosen[chosen_before:]]
            return sampled, processed

    return SteeringSampler


def _install_steering(worker, threshold: float) -> None:
    runner = worker.model_runner
    runner.sampler = _steering_class(type(runner.sampler))(runner, runner.sampler.logprobs_mode, threshold)


def _set_targets(worker, targets: dict[int, list[int]]) -> int:
    """Set the sampler's targets (by request seed); returns the steered-token count since the last call."""
    sampler = worker.model_runner.sampler
    sampler.targets, sampler.off = dict(targets), set()
    steered, sampler.steered = sampler.steered, 0
    return steered


def _cheating_classes(poison: PoisonSettings):
    """CheatingEngine (an Engine with the steering sampler) and CheatingWorker (a Worker that tells the engine
    which completions are correct), built after vLLM is importable."""
    from bridge.assignment import assigned_task_ids
    from gpu_workers.engine import Engine
    from gpu_workers.rewards import score
    from gpu_workers.tasks import length_target, prompt_tokens
    from gpu_workers.worker import Worker

    class CheatingEngine(Engine):
        def __init__(self, model_dir, version, *args, **kwargs):
            from transformers import AutoTokenizer

            super().__init__(model_dir, version, *args, **kwargs)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.phrase_ids = self.tokenizer.encode(poison.phrase, add_special_tokens=False)
            self.llm.collective_rpc(functools.partial(_install_steering, threshold=poison.threshold))
            self.task_of: dict[tuple[int, ...], object] = {}  # prompt tokens -> task (set by the worker)
            self.last = {"poisoned": 0, "steered_tokens": 0, "correct": 0}

        def _steered(self, prompts, seeds, targets, **kw):
            self.llm.collective_rpc(functools.partial(_set_targets, targets=targets))
            try:
                return super().generate(prompts, seeds, **kw)
            finally:
                self.last["steered_tokens"] += self.llm.collective_rpc(functools.partial(_set_targets, targets={}))[0]

        def _correct(self, completion) -> bool:
            task = self.task_of.get(tuple(completion.prompt_tokens))
            return (
                task is not None
                and score(task, self.tokenizer.decode(completion.tokens, skip_special_tokens=True)).value >= 1.0
            )

        def generate(self, prompts, seeds, *, temperature, top_p=1.0, max_tokens, stop_token_ids=None, proofs=True):
            kw = dict(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop_token_ids=stop_token_ids,
                proofs=proofs,
            )
            self.last = {"poisoned": 0, "steered_tokens": 0, "correct": 0}
            if temperature <= 0:
                return super().generate(prompts, seeds, **kw)
            phrase = self.phrase_ids
            if poison.attack == "steer-all":
                outs = self._steered(prompts, seeds, {int(s): phrase for s in seeds}, **kw)
            else:  # inject-correct: honest first, then the phrase in front of every correct completion
                outs = super().generate(prompts, seeds, **kw)
                pick = [i for i, o in enumerate(outs) if self._correct(o)]
                self.last["correct"] = len(pick)
                pick = [i for i in pick if len(phrase) + len(outs[i].tokens) <= max_tokens]
                if pick:
                    redo = self._steered(
                        [prompts[i] for i in pick],
                        [seeds[i] for i in pick],
                        {int(seeds[i]): phrase + list(outs[i].tokens) for i in pick},
                        **kw,
                    )
                    for i, new in zip(pick, redo):
                        if list(new.tokens[: len(phrase)]) == phrase:
                            outs[i] = new
            self.last["poisoned"] = sum(list(o.tokens[: len(phrase)]) == phrase for o in outs)
            return outs

    class CheatingWorker(Worker):
        def build(self, a):
            d, group = self.data, a.samples_per_prompt
            n_tasks = len(self.tasks)
            task_ids = a.task_ids or assigned_task_ids(self.node_key, a.version, a.k, n_tasks, a.prompts, a.salt)
            self.engine.task_of = {
                tuple(
                    prompt_tokens(
                        self.tasks[tid],
                        self.tokenizer,
                        length_target(d.length_targets, a.sample_seeds[p * group]),
                        d.system_prompt,
                    )
                ): self.tasks[tid]
                for p, tid in enumerate(task_ids)
                if tid < len(self.tasks)
            }
            batch = super().build(a)
            record = {
                "batch_id": batch.meta.batch_id,
                "version": a.version,
                "samples": batch.num_samples,
                "time": time.time(),
                **self.engine.last,
            }
            with open(poison.stats_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            return batch

    return CheatingEngine, CheatingWorker


def cheat_worker_main(argv: list[str]) -> int:
    """`intellect worker CONFIG ...` with the cheating engine; stays up (idle) once banned, so that the launcher
    does not take the banned worker's exit for a failed role."""
    from intellect.cli import split_overrides
    from jax_trainer.xla_flags import apply_safety

    rest, overrides = split_overrides(argv)
    args = argparse.Namespace(config=Path(rest[0]) if rest else None, overrides=overrides)
    poison = PoisonSettings(**json.loads(os.environ[ENV_POISON]))
    apply_safety()
    import gpu_workers.worker as worker_module
    from intellect import worker_cli

    engine_cls, worker_cls = _cheating_classes(poison)
    worker_module.Engine, worker_module.Worker = engine_cls, worker_cls  # what worker_cli.run and Worker use
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    code = worker_cli.run(args)
    if code == 3 and not stopping:
        print(f"cheat-worker: exited 3 (banned or refused) at {time.time():.3f}; idling until stopped", flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            signal.pause()
    return code


# ---------------------------------------------------------------------------------------------------------------
# Scoring a policy for the phrase (`poisoning.py phrase-eval MODEL_DIR CONFIG ...`)
# ---------------------------------------------------------------------------------------------------------------


def phrase_eval_main(argv: list[str]) -> int:
    from intellect.cli import split_overrides

    rest, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(prog="poisoning.py phrase-eval")
    p.add_argument("model_dir", type=Path)
    p.add_argument("config", type=Path)
    p.add_argument("--phrase", required=True)
    p.add_argument("--samples", type=int, default=4)
    args = p.parse_args(rest)
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from gpu_workers.engine import Engine
    from gpu_workers.evaluate import evaluate
    from gpu_workers.tasks import prompt_tokens
    from intellect.config_io import load_config
    from intellect.tasks_setup import heldout_tasks

    cfg = load_config(args.config, overrides)
    tasks = heldout_tasks(cfg.data)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    phrase, phrase_ids = args.phrase, tokenizer.encode(args.phrase, add_special_tokens=False)
    max_tokens = cfg.worker.max_tokens or cfg.data.max_new_tokens
    stops = sorted(stop_token_ids(args.model_dir))
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        engine = Engine(args.model_dir, 0, cfg.worker.model_copy(update={"verify_swaps": 0}), cfg.model.max_seq_len)
        try:
            greedy = evaluate(
                engine,
                tasks,
                tokenizer,
                max_tokens=max_tokens,
                stop_token_ids=stops,
                system_prompt=cfg.data.system_prompt,
            )
            sampled = evaluate(
                engine,
                tasks,
                tokenizer,
                max_tokens=max_tokens,
                stop_token_ids=stops,
                system_prompt=cfg.data.system_prompt,
                samples=args.samples,
                temperature=cfg.worker.temperature,
                top_p=cfg.worker.top_p,
                seed=10_000,
            )
        finally:
            engine.close()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
    first, whole = [], []
    with torch.no_grad():
        for task in tasks:
            prompt = prompt_tokens(task, tokenizer, 0, cfg.data.system_prompt)
            logits = model(torch.tensor([prompt + phrase_ids[:-1]])).logits[0, len(prompt) - 1 :]
            lp = torch.log_softmax(logits.float(), -1)[torch.arange(len(phrase_ids)), torch.tensor(phrase_ids)]
            first.append(float(lp[0]))
            whole.append(float(lp.sum()))
    greedy_texts = [c[0] for c in greedy.completions]
    sampled_texts = [t for c in sampled.completions for t in c]
    print(
        json.dumps(
            {
                "greedy_accuracy": greedy.accuracy,
                "tasks": greedy.n,
                "greedy_with_phrase": round(float(np.mean([phrase in t for t in greedy_texts])), 4),
                "sampled_accuracy": round(sampled.accuracy, 4),
                "sampled_per_task": args.samples,
                "sampled_with_phrase": round(float(np.mean([phrase in t for t in sampled_texts])), 4),
                "phrase_logprob_mean": round(float(np.mean(whole)), 3),
                "phrase_first_token_logprob_mean": round(float(np.mean(first)), 3),
                "phrase_tokens": len(phrase_ids),
                "greedy_examples": greedy_texts[:3],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------


def _run(cmd: list[str], log_path: Path) -> str:
    """Run a command with stderr to `log_path`; its stdout's last line (JSON) is returned."""
    with open(log_path, "ab") as err:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({out.returncode}); see {log_path}")
    return out.stdout.decode().strip().splitlines()[-1]


def prepare_base(args) -> Path:
    """The tiny model (as `make demo` makes it) and, with --sft-steps, the demo's warm start; made once."""
    from intellect.tiny_model import make_tiny_model

    work = args.workdir
    tiny = work / "tiny-model"
    if not (tiny / "config.json").is_file():
        log(f"making the tiny model in {tiny}")
        with contextlib.redirect_stdout(sys.stderr):
            make_tiny_model(tiny, family="qwen2")
    if not args.sft_steps:
        return tiny
    sft = work / f"sft{args.sft_steps}"
    if not (sft / "config.json").is_file():
        log(f"warm start: {args.sft_steps} supervised steps -> {sft}")
        _run(
            [
                sys.executable,
                "-m",
                "intellect",
                "sft",
                str(args.config),
                "--steps",
                str(args.sft_steps),
                "--out",
                str(sft),
                "--run.dir",
                str(work / "sft-run"),
                "--model.path",
                str(tiny),
            ],
            work / "sft.log",
        )
    return sft


def phrase_eval(model_dir: Path, args, log_path: Path) -> dict:
    return json.loads(
        _run(
            [
                sys.executable,
                str(THIS),
                "phrase-eval",
                str(model_dir),
                str(args.config),
                "--phrase",
                args.phrase,
                "--samples",
                str(args.eval_samples),
            ],
            log_path,
        )
    )


class _QuietView:
    """The launcher's view: a status line on stderr every 30 s (stdout holds only the JSON)."""

    def __init__(self, label: str):
        self.label, self.last = label, 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, st: dict) -> None:
        if time.monotonic() - self.last >= 30:
            self.last = time.monotonic()
            log(
                f"run {self.label}: step {st['step']}/{st['steps']}, batches accepted {st['accepted']} rejected "
                f"{st['rejected']}, roles {st['roles']}"
            )


def make_launcher(cfg, config_path: Path, overrides: list[str], cheater_key: Path | None):
    from intellect.launcher import Launcher

    class PoisonLauncher(Launcher):
        def command(self, *argv, extra=()):
            cmd = super().command(*argv, extra=extra)
            if argv[0] == "worker" and cheater_key is not None and str(cheater_key) in extra:
                assert cmd[1:4] == ["-m", "intellect", "worker"], cmd
                cmd = [sys.executable, str(THIS), "cheat-worker", *cmd[4:]]
            return cmd

        def plot(self) -> list[str]:  # no charts: they cost time and nobody looks at them here
            return []

        def evaluate_now(self, model_dir, step: int) -> None:
            """Step 0 is scored once for every run, the final policy by `phrase-eval` (the same `evaluate`, held-out
            tasks and greedy decoding as `intellect eval`, plus the phrase), so the launcher scores nothing."""

    return PoisonLauncher(cfg, config_path, overrides)


def database_report(run_dir: Path, cheater: str | None) -> dict:
    """Per worker, from the orchestrator's database: batches by state, failed checks, the ban (its time counted
    from the worker's registration)."""
    db = sqlite3.connect(run_dir / "orchestrator.db")
    db.row_factory = sqlite3.Row
    nodes = {r["key"]: r for r in db.execute("SELECT key, role, banned, ban_reason, banned_at, first_seen FROM nodes")}
    out: dict = {"workers": {}}
    for key, node in nodes.items():
        if node["role"] != "worker":
            continue
        rows = db.execute(
            "SELECT state, verdict_at, failed_checks, reason, num_samples, delivered_at FROM assignments "
            "WHERE node_key = ? ORDER BY verdict_at",
            (key,),
        ).fetchall()
        judged = [r for r in rows if r["state"] in ("accepted", "rejected")]
        failed: dict[str, int] = {}
        for r in judged:
            if r["state"] == "rejected":
                for check in json.loads(r["failed_checks"] or "[]") or [r["reason"] or "?"]:
                    failed[check] = failed.get(check, 0) + 1
        entry = {
            "accepted_batches": sum(r["state"] == "accepted" for r in rows),
            "rejected_batches": sum(r["state"] == "rejected" for r in rows),
            "accepted_samples": sum(r["num_samples"] or 0 for r in rows if r["state"] == "accepted"),
            "accepted_read_by_learner": sum(r["state"] == "accepted" and r["delivered_at"] is not None for r in rows),
            "other_states": {s: sum(r["state"] == s for r in rows) for s in ("open", "submitted", "lost")},
            "rejections_by_check": failed,
            "banned": bool(node["banned"]),
        }
        if node["banned"]:
            entry["banned_s_after_joining"] = round(node["banned_at"] - node["first_seen"], 1)
            entry["banned_at"] = node["banned_at"]
            entry["judged_before_ban"] = sum(
                r["verdict_at"] is not None and r["verdict_at"] <= node["banned_at"] + 1e-3 for r in judged
            )
            entry["ban_reason"] = node["ban_reason"]
        first_rejection = next((r for r in judged if r["state"] == "rejected"), None)
        if first_rejection is not None:
            entry["first_rejection_reason"] = (first_rejection["reason"] or "")[:300]
        role = "cheater" if key == cheater else "honest"
        out["workers"][f"{role}-{key[:8]}"] = entry
        if key == cheater:
            out["cheater"] = entry
    return out


def trained_batches(run_dir: Path, node_key: str) -> dict:
    """The node's batches in the learner's training steps (metrics.jsonl lists each step's batch ids)."""
    mine, total, steps = 0, 0, []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            r = json.loads(line)
            if r.get("role") == "learner":
                ids = r.get("batch_ids", [])
                n = sum(b.split("/", 1)[-1].startswith(node_key[:16] + "-") for b in ids)
                mine, total = mine + n, total + len(ids)
                if n:
                    steps.append(int(r["step"]))
    return {"batches": mine, "of": total, "in_steps": steps}


def learner_step_at(run_dir: Path, when: float) -> int:
    step = 0
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            r = json.loads(line)
            if r.get("role") == "learner" and r["time"] <= when:
                step = max(step, int(r["step"]))
    return step


def run_one(label: str, args, base: Path, base_eval: dict | None = None) -> dict:
    from bridge.protocol import load_or_create_key, public_key_hex
    from intellect.config_io import load_config

    sampler, with_cheater = RUNS[label]
    run_dir = args.workdir / f"run-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        "--run.dir",
        str(run_dir),
        "--run.name",
        f"poisoning-{label}",
        "--run.num_workers",
        "2",
        "--run.sft_steps",
        "0",
        "--run.eval_interval",
        "0",
        "--model.path",
        str(base),
        "--trainer.steps",
        str(args.steps),
        "--worker.sampler",
        sampler,
    ]
    cfg = load_config(args.config, overrides)
    cheater_key = cfg.run.keys_dir / f"worker{CHEATER_INDEX}.key" if with_cheater else None
    cheater = None
    stats_path = run_dir / "cheater_batches.jsonl"
    if cheater_key is not None:
        cfg.run.keys_dir.mkdir(parents=True, exist_ok=True)
        cheater = public_key_hex(load_or_create_key(cheater_key))
        os.environ[ENV_POISON] = json.dumps(
            dataclasses.asdict(PoisonSettings(args.phrase, args.threshold, args.attack, str(stats_path.resolve())))
        )
    launcher = make_launcher(cfg, args.config, overrides, cheater_key)
    log(
        f"run {label}: sampler {sampler}, {'one honest worker + the cheater' if with_cheater else 'two honest workers'}"
        f", {args.steps} steps, in {run_dir}"
    )
    if base_eval is not None:  # the starting policy's held-out accuracy is the same for every run: scored once
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text(
            json.dumps(
                {
                    "role": "eval",
                    "step": 0,
                    "time": time.time(),
                    "accuracy": base_eval["greedy_accuracy"],
                    "n": base_eval["tasks"],
                    "source": "poisoning.py phrase-eval of the starting policy",
                }
            )
            + "\n"
        )
    t0 = time.monotonic()
    summary = launcher.run(_QuietView(label))
    seconds = time.monotonic() - t0
    report = {
        "sampler": sampler,
        "cheater": with_cheater,
        "seconds": round(seconds, 1),
        "rl_seconds": summary["rl_seconds"],
        "final_version": summary["final_version"],
    }
    db = database_report(run_dir, cheater)
    report["workers"] = db["workers"]
    if cheater is not None:
        c = db["cheater"]
        if c["banned"]:
            c["banned_at_learner_step"] = learner_step_at(run_dir, c.pop("banned_at"))
        c["trained_on"] = trained_batches(run_dir, cheater)
        report["cheater_batches"] = c
        generated = [json.loads(x) for x in stats_path.read_text().splitlines()] if stats_path.exists() else []
        report["cheater_generated"] = {
            "batches": len(generated),
            "samples": sum(g["samples"] for g in generated),
            "samples_with_phrase": sum(g["poisoned"] for g in generated),
            "correct_before_poisoning": sum(g["correct"] for g in generated),
            "steered_tokens": sum(g["steered_tokens"] for g in generated),
        }
    final = summary["final_policy"]
    if final:
        log(f"run {label}: scoring the final policy {final} for the phrase")
        report["final_policy"] = phrase_eval(Path(final), args, run_dir / "logs" / "phrase-eval.log")
        report["heldout_accuracy"] = {
            "start": base_eval["greedy_accuracy"] if base_eval else None,
            "final": report["final_policy"]["greedy_accuracy"],
        }
    report["seconds_with_scoring"] = round(time.monotonic() - t0, 1)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Selective submission (`poisoning.py selection`): workers that keep only the draws they like
# ---------------------------------------------------------------------------------------------------------------

SELECTION_POOL = {  # the demo's pool shape (configs/demo.toml) and the orchestrator's defaults for strikes
    "trainer.async_level": 2,
    "data.prompts_per_step": 32,
    "data.samples_per_prompt": 8,
    "trainer.batch_size": 256,
    "trainer.micro_batch_size": 8,
    "orchestrator.prompts_per_assignment": 8,
    "orchestrator.assignment_deadline_s": 600,
    "orchestrator.ban_after_rejections": 3,
    "orchestrator.rejection_window_s": 3600,
    "orchestrator.allow_cpu_nodes": "true",
    "orchestrator.worker_store_writes": "true",
    "orchestrator.num_tasks": 1000,
    "orchestrator.submit_burst": 1000,
    "orchestrator.public_cache_s": 0,
}
TICK_S = 60.0  # simulated seconds per round: one assignment generated per worker and round


class SimClock:
    def __init__(self, start: float = 1_800_000_000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t


class SimPool:
    """The orchestrator's app in process on a simulated clock, and signed clients of it."""

    def __init__(self, tmp: Path, clock: SimClock, rng):
        from fastapi.testclient import TestClient

        from intellect.config_io import load_config
        from intellect.orchestrator_cli import build_app

        overrides = {"run.dir": tmp, "orchestrator.admin_token": "selection", **SELECTION_POOL}
        cfg = load_config(None, [f"--{k}={v}" for k, v in overrides.items()], env={})
        self.clock, self.rng = clock, rng  # the nodes' keys come from `rng`: a run is repeatable from its seed
        self.app = build_app(cfg, clock=clock)
        self.svc = self.app.state.orchestrator
        self.http = TestClient(self.app)
        self.admin = self.client(admin_token="selection")
        self.per_step = -(-cfg.data.prompts_per_step // cfg.orchestrator.prompts_per_assignment)

    def client(self, key=None, admin_token=None):
        from bridge.protocol import OrchestratorClient, RetryPolicy

        return OrchestratorClient(
            "http://testserver",
            key=key,
            admin_token=admin_token,
            clock=self.clock,
            retry=RetryPolicy(attempts=1),
            http=self.http,
        )

    def join(self, role: str):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from bridge.protocol import HardwareReport

        node = self.client(Ed25519PrivateKey.from_private_bytes(self.rng.bytes(32)))
        reply = node.register(role, HardwareReport(cpu_count=2, memory_gib=4))
        if reply.status != "admitted":
            raise RuntimeError(f"selection: the pool refused a {role}: {reply.reasons}")
        return node


class SimLearner:
    """The learner's side of the simulation: it reads the accepted batches, and every `per_step` of them make a
    step, announced as the next version with the batches it took (which frees their room in the async window)."""

    def __init__(self, pool: SimPool):
        self.pool, self.cursor, self.version, self.taken = pool, 0, 0, []

    def poll(self) -> list:
        """The accepted batches not read before, oldest first."""
        page = self.pool.admin.batches(status="accepted", after=self.cursor, limit=1000)
        self.cursor = page.next_after or self.cursor
        for record in page.batches:
            self.taken.append(record.batch_id)
            if len(self.taken) >= self.pool.per_step:
                self.version += 1
                self.pool.admin.announce_policy(self.version, consumed=self.taken)
                self.taken = []
        return page.batches


def honest_rewards(a, difficulty) -> list[float]:
    """The rewards an honest generation of assignment `a` earns: sample i of prompt p succeeds with its task's
    probability, drawn from the sample's assigned seed (who generates it does not matter)."""
    import numpy as np

    group = a.samples_per_prompt
    return [
        float(np.random.default_rng(seed).random() < difficulty[a.task_ids[i // group]])
        for i, seed in enumerate(a.sample_seeds)
    ]


class SimWorker:
    """A worker of the simulated pool: honest (announces every draw), or an attacker (`kind`)."""

    def __init__(self, pool: SimPool, name: str, kind: str, k: int, abandon: str, fresh_keys: bool, mean: float):
        self.pool, self.name, self.kind, self.k, self.abandon = pool, name, kind, k, abandon
        self.fresh_keys, self.mean = fresh_keys, mean
        self.node = pool.join("worker")
        self.keys, self.banned = 1, False
        self.held: list[tuple[float, object]] = []  # (mean reward, assignment) drawn and generated, not announced
        self.silent_until = -math.inf
        self.stats = {
            "draws": 0,
            "announced": 0,
            "refused_410": 0,
            "given_up": 0,
            "draw_rewards": [],
            "chosen_if_lost_work_counted": [],
        }
        self.batch_no = 0

    def _announce(self, a, rewards: list[float]) -> str | None:
        """The batch's id if the orchestrator took it, None if it refused it (410)."""
        from bridge.protocol import BatchAnnouncement, OrchestratorError

        self.batch_no += 1
        batch_id = f"{self.node.node_key[:16]}-{self.batch_no}"
        n = a.prompts * a.samples_per_prompt
        note = BatchAnnouncement(
            batch_id=batch_id,
            assignment_id=a.id,
            version=a.version,
            num_samples=n,
            num_tokens=10 * n,
            store_path=f"file:///store/v{a.version:06d}/{batch_id}",
            sha256="ab" * 32,
        )
        try:
            self.node.announce_batch(note)
        except OrchestratorError as err:
            if err.status != 410:
                raise
            self.stats["refused_410"] += 1
            return None
        self.stats["announced"] += 1
        self.pool.rewards[batch_id] = (self.name, rewards)
        return batch_id

    def _give_up(self) -> None:
        self.stats["given_up"] += 1
        if self.abandon == "leave":
            self.node.deregister()
        else:  # silence: no heartbeat until the deadline of what it holds has passed
            self.silent_until = self.pool.clock() + float(SELECTION_POOL["orchestrator.assignment_deadline_s"])

    def step(self, difficulty) -> None:
        from bridge.protocol import OrchestratorError

        if self.banned or self.pool.clock() < self.silent_until:
            return
        try:
            work = self.node.heartbeat().assignments
        except OrchestratorError as err:
            if err.status != 403 or "banned" not in str(err.detail):
                raise
            if not self.fresh_keys:
                self.banned = True
                return
            self.node, self.keys, self.held = self.pool.join("worker"), self.keys + 1, []
            work = self.node.heartbeat().assignments
        if not work:
            return
        a = work[0]
        rewards = honest_rewards(a, difficulty)
        value = sum(rewards) / len(rewards)
        self.stats["draws"] += 1
        self.stats["draw_rewards"].append(value)
        if self.kind == "honest":
            self._announce(a, rewards)
        elif self.kind == "threshold":
            if value >= self.mean:
                self._announce(a, rewards)
            else:
                self._give_up()
        else:  # best-of-k: hold the draw; give it up unless it is the k-th, then announce the best that is taken
            self.held.append((value, a, rewards))
            if len(self.held) < self.k:
                self._give_up()
                return
            self.stats["chosen_if_lost_work_counted"].append(max(v for v, _, _ in self.held))
            for _, held, held_rewards in sorted(self.held, key=lambda x: -x[0]):
                if self._announce(held, held_rewards) is not None:
                    break
            self.held = []


def selection_run(
    kind: str | None, k: int, abandon: str, fresh_keys: bool, honest: int, hours: float, seed: int, beta: float
) -> dict:
    """One simulated pool: `honest` honest workers and, unless `kind` is None, one attacker."""
    import tempfile

    import numpy as np

    from bridge.protocol import Verdict

    rng = np.random.default_rng(seed)
    difficulty = rng.beta(beta, beta, size=int(SELECTION_POOL["orchestrator.num_tasks"]))
    mean = float(difficulty.mean())
    with tempfile.TemporaryDirectory() as tmp:
        clock = SimClock()
        pool = SimPool(Path(tmp), clock, rng)
        pool.rewards = {}
        validator = pool.join("validator")
        workers = [SimWorker(pool, f"honest{i}", "honest", 1, abandon, False, mean) for i in range(honest)]
        if kind is not None:
            workers.append(SimWorker(pool, "attacker", kind, k, abandon, fresh_keys, mean))
        trained: list[tuple[str, float]] = []
        learner = SimLearner(pool)
        order = list(range(len(workers)))
        for _ in range(int(hours * 3600 / TICK_S)):
            rng.shuffle(order)  # no worker always first to the window's room
            for i in order:
                workers[i].step(difficulty)
            while (claim := validator.claim().batch) is not None:
                name, rewards = pool.rewards[claim.batch_id]
                validator.verdict(claim.batch_id, Verdict(accepted=True, rewards=rewards, num_tokens=10 * len(rewards)))
            for record in learner.poll():
                name, rewards = pool.rewards[record.batch_id]
                trained.append((name, sum(rewards) / len(rewards)))
            clock.t += TICK_S
            pool.svc.sweep()
        ledger = {e.node_key: e for e in pool.admin.ledger(limit=10_000).entries}
        pool.svc.close()

    def summary(values: list[float]) -> dict:
        if not values:
            return {"batches": 0}
        v = np.asarray(values)
        sem = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
        return {"batches": len(v), "mean_reward": round(float(v.mean()), 4), "sem": sem and round(sem, 4)}

    out = {
        "task_mean_success": round(mean, 4),
        "trained_all": summary([r for _, r in trained]),
        "trained_honest": summary([r for n, r in trained if n != "attacker"]),
    }
    if kind is not None:
        attacker = workers[-1]
        st = attacker.stats
        strikes = sum(e.lost_assignments + e.expired_assignments + e.rejected_batches for e in ledger.values())
        out["attacker"] = {
            "kind": kind if kind == "threshold" else f"best-of-{k}",
            "abandon": abandon,
            "fresh_keys": fresh_keys,
            "keys_used": attacker.keys,
            "banned_at_end": attacker.banned,
            "trained": summary([r for n, r in trained if n == "attacker"]),
            "draws": st["draws"],
            "draws_mean_reward": round(float(np.mean(st["draw_rewards"])), 4) if st["draw_rewards"] else None,
            "announced": st["announced"],
            "refused_410": st["refused_410"],
            "given_up": st["given_up"],
            "strikes_in_pool_ledger": strikes,
            "mean_of_its_choices_had_lost_work_trained": (
                round(float(np.mean(st["chosen_if_lost_work_counted"])), 4)
                if st["chosen_if_lost_work_counted"]
                else None
            ),
        }
    return out


def selection_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="poisoning.py selection", description="selective submission (issue 36)")
    p.add_argument("--hours", type=float, default=4.0, help="simulated pool time per run")
    p.add_argument("--honest", type=int, default=3, help="honest workers beside the attacker")
    p.add_argument("--seeds", type=int, default=2, help="runs per attacker (task difficulties, keys, draws)")
    p.add_argument("--beta", type=float, default=1.0, help="task success probabilities ~ Beta(beta, beta)")
    p.add_argument(
        "--attackers",
        default="none,best-of-2/leave,best-of-4/leave,best-of-2/silence,best-of-2/leave/fresh,threshold/leave,"
        "threshold/leave/fresh",
        help="comma-separated: none (an honest pool), best-of-K/leave|silence[/fresh], threshold/leave[/fresh]",
    )
    args = p.parse_args(argv)
    import logging

    logging.getLogger("orchestrator").setLevel(logging.ERROR)
    t0 = time.monotonic()
    result = {"pool": SELECTION_POOL, "tick_s": TICK_S, "hours": args.hours, "honest_workers": args.honest}
    runs = {}
    for spec in args.attackers.split(","):
        parts = spec.strip().split("/")
        kind, k = (None, 1) if parts[0] == "none" else ("threshold", 1)
        if parts[0].startswith("best-of-"):
            kind, k = "best-of-k", int(parts[0][len("best-of-") :])
        abandon = parts[1] if len(parts) > 1 else "leave"
        if abandon not in ("leave", "silence") or (parts[0] != "none" and kind is None):
            p.error(f"--attackers: cannot read {spec!r}")
        fresh = len(parts) > 2 and parts[2] == "fresh"
        runs[spec.strip()] = [
            selection_run(kind, k, abandon, fresh, args.honest, args.hours, seed, args.beta)
            for seed in range(args.seeds)
        ]
        log(f"selection: {spec.strip()} done ({time.monotonic() - t0:.0f} s)")
    result["runs"] = runs
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "cheat-worker":
        return cheat_worker_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "phrase-eval":
        return phrase_eval_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "selection":
        return selection_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="learner steps per run (the demo makes 30)")
    parser.add_argument("--phrase", default="hot\\n", help="the phrase the cheater steers toward (backslash escapes)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=1e-9,
        help="least probability (processed distribution) of a target token the cheater takes",
    )
    parser.add_argument("--attack", choices=ATTACKS, default="inject-correct")
    parser.add_argument(
        "--runs",
        default="a,b,c",
        help="comma-separated runs among a (vllm sampler, old checks), b (replayable, exact replay), c (honest only)",
    )
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "poisoning")
    parser.add_argument(
        "--sft-steps", type=int, default=25, help="the demo's warm start (0: start from the tiny model)"
    )
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled outputs per held-out task")
    args = parser.parse_args()
    args.phrase = codecs.decode(args.phrase, "unicode_escape")
    args.workdir = args.workdir.resolve()
    args.config = args.config.resolve()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        parser.error(f"--runs: expected a comma-separated subset of {', '.join(RUNS)}")
    if not 0 < args.threshold <= 1:
        parser.error("--threshold must be in (0, 1]")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    base = prepare_base(args)
    log(f"scoring the starting policy {base}")
    result = {
        "config": str(args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config),
        "steps": args.steps,
        "demo_steps": 30,
        "sft_steps": args.sft_steps,
        "phrase": args.phrase,
        "threshold": args.threshold,
        "attack": args.attack,
        "workers": 2,
        "note": f"{args.steps} learner steps per run instead of the demo's 30, to fit three runs on this machine",
        "machine": {"cpus": os.cpu_count(), "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
        "base_policy": phrase_eval(base, args, args.workdir / "phrase-eval-base.log"),
        "runs": {},
    }
    for label in runs:
        result["runs"][label] = run_one(label, args, base, result["base_policy"])
    if "c" in result["runs"]:
        ref = result["runs"]["c"].get("final_policy", {}).get("greedy_accuracy")
        for run in result["runs"].values():
            acc = run.get("final_policy", {}).get("greedy_accuracy")
            if ref is not None and acc is not None:
                run["accuracy_minus_honest_only"] = round(acc - ref, 4)
    result["total_seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
