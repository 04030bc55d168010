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

Selective submission (workers that keep only the draws they like, issue 36) is `selective_submission.py`;
`poisoning.py selection ...` runs it too.
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


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "cheat-worker":
        return cheat_worker_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "phrase-eval":
        return phrase_eval_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "selection":
        from selective_submission import selection_main

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
