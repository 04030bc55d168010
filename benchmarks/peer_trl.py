"""Ours against Hugging Face TRL's GRPOTrainer (1.16.0, in a virtualenv of its own) on one recipe, on this machine.

    python benchmarks/peer_trl.py CONFIG [--model DIR] [--minutes 30 60 90] [--out DIR] [--trl-venv DIR]
        [--only ours|trl] [--section.key VALUE ...]

The two sides run one after the other, never at once, from the same model, with the same training tasks, prompts
(the TRL side checks each renders to our token ids), reward (`gpu_workers.rewards.sample_reward`, imported there),
group size, batch, completion cap, sampling and AdamW settings (`grpo_config_kwargs` maps them and lists what TRL
cannot match). Both train open-ended, without checkpoints or evaluations during the run, and draw prompts uniformly
from the same list with their own RNG. A mark's policy is the newest complete at that time after the start of its
side's process: ours the newest STABLE export, TRL's the weights after its last step before the mark. Every mark
and the base model are then scored by `intellect eval`. Prints one JSON object (also OUT/peer_trl.json): the eval
records at each mark and the samples each side trained per second (those of groups whose rewards differ).
`--only ours` with an override (`--data.dynamic_sampling false`, `--data.curriculum '[]'`) measures one of our own
levers at the same marks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_trl_side import task_from_json, task_to_json  # noqa: E402

OPEN_STEPS = 1_000_000  # trainer.steps of both sides: each trains until its last mark
# ours trains open-ended and is scored only here: no checkpoints, no evaluations inside the run
RUN_OVERRIDES = ("--trainer.steps", str(OPEN_STEPS), "--trainer.checkpoint_interval", "0", "--run.eval_interval", "0")
TRL_PACKAGES = ("trl==1.16.0", "reasoning-gym", "math-verify")  # versions of the others: constraints.txt
XLA_FLAGS = "--xla_force_host_platform_device_count=1"  # as the recipes run `intellect run` on one CPU
STOP_GRACE_S = 180.0  # the launcher stops its roles in three waves of up to 20 s each
LARGE_RUN_DIRS = ("weights", "rollouts", "nodes", "relays", "checkpoints")  # deleted once a side's marks are copied
_VERSION_DIR = re.compile(r"v\d{6}")


def grpo_config_kwargs(cfg) -> tuple[dict[str, Any], list[str]]:
    """TRL 1.16.0 `GRPOConfig` keyword arguments for the recipe `cfg` (an `intellect.config.Config`), and what of
    the recipe they cannot reproduce (one sentence each)."""
    from gpu_workers.config import completion_cap

    data, loss, optim, trainer, model = cfg.data, cfg.loss, cfg.optim, cfg.trainer, cfg.model
    cap = completion_cap(cfg.worker, data)
    notes: list[str] = []
    # a step's samples split into equal micro-batches of at most trainer.micro_batch_size samples (ours: packed rows
    # of model.max_seq_len tokens, about as much memory as that many padded samples)
    per_step = trainer.batch_size // trainer.steps_per_batch
    micro = max(d for d in range(1, min(trainer.micro_batch_size, per_step) + 1) if per_step % d == 0)
    accumulation = per_step // micro
    kwargs: dict[str, Any] = {
        "model_init_kwargs": {"dtype": model.param_dtype},
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": accumulation * trainer.steps_per_batch,  # one generation batch = one rollout batch
        "num_generations": data.samples_per_prompt,
        "max_completion_length": cap,
        "num_iterations": 1,
        "shuffle_dataset": True,
        "temperature": cfg.worker.temperature,
        "top_p": cfg.worker.top_p,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "beta": loss.kl_coef,
        "use_bias_correction_kl": False,  # ours: the k3 estimator, its gradient flowing, not scaled by a ratio
        "entropy_coef": loss.entropy_coef,
        "scale_rewards": "group" if loss.std_normalize else "none",
        "mask_truncated_completions": False,
        "learning_rate": optim.lr,
        "weight_decay": optim.weight_decay,
        "adam_beta1": optim.b1,
        "adam_beta2": optim.b2,
        "adam_epsilon": optim.eps,
        "optim": "adamw_torch",
        "max_grad_norm": optim.grad_clip,
        "warmup_steps": optim.warmup_steps,
        "lr_scheduler_type": {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[
            optim.schedule
        ],
        "max_steps": trainer.steps,
        "seed": trainer.seed,
        "gradient_checkpointing": model.remat != "none",
        "bf16": model.compute_dtype == "bfloat16",
        "fp16": False,
    }
    # token losses -> one number: ours' aggregation, as TRL names it
    if loss.policy_loss == "cispo":
        kwargs.update(loss_type="cispo", epsilon_high=loss.cispo_eps_high)
        if loss.aggregation != "token_mean":
            notes.append(f"TRL's cispo is a token mean; loss.aggregation is {loss.aggregation}")
    else:
        kwargs["loss_type"] = {
            "token_mean": "dapo",  # sum over the step's completion tokens / their number
            "seq_mean_token_mean": "grpo",  # mean per sample, then over samples
            "seq_mean_token_sum_norm": "dr_grpo",  # each sample's sum / max_completion_length, mean over samples
            "constant": "dr_grpo",  # the nearest: a constant normaliser, here samples x max_completion_length
        }[loss.aggregation]
        if loss.aggregation == "constant":
            notes.append(
                "loss.aggregation constant (sum / constant_normalizer) has no TRL counterpart: dr_grpo divides by "
                "samples x max_completion_length instead (the same gradient up to a constant factor)"
            )
        if loss.aggregation == "seq_mean_token_sum_norm" and loss.constant_normalizer != cap:
            notes.append(
                f"dr_grpo in TRL divides by max_completion_length ({cap}), ours by loss.constant_normalizer "
                f"({loss.constant_normalizer})"
            )
    if loss.policy_loss == "gspo":
        kwargs.update(importance_sampling_level="sequence", epsilon=loss.gspo_eps_low, epsilon_high=loss.gspo_eps_high)
    else:
        kwargs["importance_sampling_level"] = "token"
    if loss.policy_loss in ("grpo", "dr_grpo"):
        kwargs.update(epsilon=loss.eps_low, epsilon_high=loss.eps_high, delta=loss.delta)
    if trainer.async_level:
        notes.append(
            f"trainer.async_level {trainer.async_level}: ours trains on rollouts up to that many versions old "
            "(clipped ratios against the engine's logprobs); TRL is synchronous, every step on-policy (ratio 1)"
        )
    per_batch = cfg.orchestrator.prompts_per_assignment
    if data.prompts_per_step % per_batch:
        notes.append(
            f"orchestrator.prompts_per_assignment {per_batch} does not divide data.prompts_per_step "
            f"{data.prompts_per_step}: our steps take whole batches, so more than {data.prompts_per_step} prompts"
        )
    if trainer.export_interval > 1:
        notes.append(f"trainer.export_interval {trainer.export_interval}: our workers sample from older policies")
    if data.online_filter:
        notes.append(
            "data.online_filter: ours drops groups whose rewards are all equal before the loss; TRL keeps them with "
            "advantage 0, so they still count in its normaliser (tokens or samples)"
        )
    if data.dynamic_sampling:
        notes.append("data.dynamic_sampling: ours refills a step with informative groups; TRL has no such option")
    if loss.std_normalize:
        notes.append("advantages: TRL divides by the group's std + 1e-4, ours by std + 1e-6")
    if optim.warmup_steps:
        notes.append("warmup: TRL's first step has lr 0 (step / warmup_steps), ours lr / warmup_steps")
    if optim.weight_decay:
        notes.append("weight decay: TRL leaves biases and norm weights undecayed, ours (optax adamw) decays all")
    if loss.temperature != cfg.worker.temperature:
        notes.append(
            f"TRL samples and scores at one temperature ({cfg.worker.temperature}); loss.temperature is "
            f"{loss.temperature}"
        )
    if loss.tis_cap is not None or loss.mismatch != "none":
        notes.append("loss.tis_cap / loss.mismatch: TRL generates with the trained model itself, nothing to correct")
    if loss.entropy_coef:
        notes.append("entropy bonus: TRL's is the mean per-token entropy whatever loss_type; ours is aggregated")
    if model.param_dtype != model.compute_dtype:
        notes.append(f"TRL keeps {model.param_dtype} weights; bf16={kwargs['bf16']} autocasts the matmuls")
    return kwargs, notes


# -- ours: the newest complete export at each mark ------------------------------------------------------------


def newest_stable(weights_dir: Path) -> Path | None:
    """The newest version directory `v000123` under `weights_dir` that holds a STABLE file (written last, after
    the directory was renamed into place: docs/design.md section 4); None when there is none."""
    if not weights_dir.is_dir():
        return None
    done = [p for p in weights_dir.iterdir() if _VERSION_DIR.fullmatch(p.name) and (p / "STABLE").is_file()]
    return max(done, key=lambda p: int(p.name[1:]), default=None)


def snapshot(weights_dir: Path, dest: Path, base_model: Path) -> dict:
    """Copy the newest complete export under `weights_dir` to `dest` (the base model when none is complete yet);
    returns {"version", "exported"} (the export's STABLE time, None for the base)."""
    for _ in range(5):  # a version deleted while copied (the pool keeps a few): take the newest again
        src = newest_stable(weights_dir)
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(src or base_model, tmp)
        except (FileNotFoundError, shutil.Error):
            if src is None:
                raise
            continue
        tmp.rename(dest)
        if src is None:
            return {"version": 0, "exported": None}
        return {"version": int(src.name[1:]), "exported": (dest / "STABLE").stat().st_mtime}
    raise RuntimeError(f"{weights_dir}: the newest version kept vanishing while it was copied")


def read_records(path: Path, role: str = "learner") -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if record.get("role") == role:
            records.append(record)
    return records


def rates(records: Sequence[dict], t0: float, t_end: float) -> dict:
    """Throughput of one side from its per-step records ({"time", "samples", "samples_trained"}) of the steps that
    ended by `t_end`: per second of the whole span from the start `t0` (startup included), and after the first
    step (its end to the last step's end: the steady rate)."""
    done = sorted((r for r in records if r["time"] <= t_end), key=lambda r: r["time"])
    seconds = t_end - t0
    samples = sum(r["samples"] for r in done)
    trained = sum(r["samples_trained"] for r in done)
    steady = None
    if len(done) >= 2 and done[-1]["time"] > done[0]["time"]:
        steady = round(sum(r["samples_trained"] for r in done[1:]) / (done[-1]["time"] - done[0]["time"]), 4)
    return {
        "steps": len(done),
        "samples": samples,
        "samples_trained": trained,
        "samples_per_s": round(samples / seconds, 4),
        "samples_trained_per_s": round(trained / seconds, 4),
        "samples_trained_per_s_after_first_step": steady,
        "first_step_s": round(done[0]["time"] - t0, 1) if done else None,
    }


def _stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `intellect run` stops every role on SIGTERM as on Ctrl-C
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # its roles get SIGTERM from the kernel (PR_SET_PDEATHSIG)
            proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def _status(records: list[dict]) -> str:
    return f"step {records[-1]['step']}" if records else "starting"


def run_ours(cfg, config: Path, overrides: list[str], minutes: list[int], side: Path, base: dict, progress) -> dict:
    """`intellect run` until the last mark, the newest export copied to side/mark-{M}min at each mark."""
    run_dir = Path(cfg.run.dir)
    metrics = run_dir / "metrics.jsonl"
    run_dir.mkdir(parents=True)
    # the base policy is scored once, by this script: the launcher sees step 0 evaluated and goes straight to RL
    with open(metrics, "a") as f:
        f.write(json.dumps({"role": "eval", "step": 0, "time": time.time(), **base}) + "\n")
    log = side / "launcher.log"
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS}
    task = progress.add_task("ours: starting", total=minutes[-1] * 60)
    t0 = time.time()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "intellect", "run", str(config), *overrides],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    marks: dict[str, dict] = {}
    try:
        for m in minutes:
            while time.time() < t0 + m * 60 and proc.poll() is None:
                progress.update(task, completed=time.time() - t0, description=f"ours: {_status(read_records(metrics))}")
                time.sleep(1.0)
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"intellect run exited with {proc.returncode}; the end of {log}:\n{_tail(log)}")
            took = snapshot(run_dir / "weights", side / f"mark-{m}min", Path(cfg.model.path))
            exported = took.pop("exported")
            marks[str(m)] = {
                **took,
                "policy_elapsed_s": None if exported is None else round(exported - t0, 1),
                "elapsed_s": round(time.time() - t0, 1),
                "dir": str(side / f"mark-{m}min"),
            }
            progress.console.print(f"ours, mark {m} min: version {took['version']}")
    finally:
        _stop(proc)
    progress.update(task, completed=minutes[-1] * 60, description="ours: done")
    summary = {
        "t0": t0,
        "minutes": minutes,
        "marks": marks,
        **rates(read_records(metrics), t0, t0 + minutes[-1] * 60),
        "log": str(log),
    }
    for name in LARGE_RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return summary


# -- TRL ------------------------------------------------------------------------------------------------------


def default_trl_venv() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "intellect" / "peer-trl-venv"


def trl_install_commands(venv: Path) -> list[list[str]]:
    """The commands that make TRL's virtualenv: torch first (the CPU wheel pinned in constraints.txt, so nothing
    later pulls a CUDA build), then TRL and what the rewards import, all under the project's constraints."""
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    constraints = ["-c", str(ROOT / "constraints.txt")]
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [*pip, "--upgrade", "pip>=24"],
        [*pip, "torch", *constraints],
        [*pip, *TRL_PACKAGES, *constraints],
    ]


def ensure_trl_venv(venv: Path, console) -> Path:
    """TRL's virtualenv at `venv`, made if missing (`trl_install_commands`); its python."""
    stamp = venv / ".peer-trl-installed"
    wanted = json.dumps([TRL_PACKAGES, (ROOT / "constraints.txt").read_text()])
    if stamp.is_file() and stamp.read_text() == wanted:
        return venv / "bin" / "python"
    commands = trl_install_commands(venv)
    if (venv / "bin" / "python").exists():
        commands = commands[1:]
    for argv in commands:
        console.print(f"TRL virtualenv: {' '.join(argv)}")
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    stamp.write_text(wanted)
    return venv / "bin" / "python"


def write_prompts(tasks, tokenizer, system: str | None, targets: Sequence[int], path: Path) -> int:
    """One JSON line per training task and length target (each target once: ours draws one uniformly per prompt):
    {"prompt": the chat messages, "prompt_ids": what `prompt_tokens` makes of them, "task": `task_to_json`,
    "target": the length target or 0}. Returns the number of lines; ValueError names a task JSON cannot carry."""
    from gpu_workers.tasks import prompt_text, prompt_tokens

    rows = 0
    with open(path, "w") as f:
        for i, task in enumerate(tasks):
            try:
                text = task_to_json(task)
                same = task_from_json(text) == task
            except (TypeError, ValueError) as e:
                raise ValueError(f"training task {i}: not JSON ({e}); the TRL side reads tasks as JSON") from e
            if not same:
                raise ValueError(f"training task {i} does not survive JSON unchanged; the TRL side reads tasks as JSON")
            for target in targets or (0,):
                messages = [{"role": "system", "content": system}] if system else []
                messages.append({"role": "user", "content": prompt_text(task, target)})
                ids = prompt_tokens(task, tokenizer, target, system)
                f.write(json.dumps({"prompt": messages, "prompt_ids": ids, "task": text, "target": target}) + "\n")
                rows += 1
    return rows


def run_trl(cfg, minutes: list[int], side: Path, venv: Path, progress) -> dict:
    """TRL's GRPOTrainer (benchmarks/peer_trl_side.py in TRL's virtualenv) until the last mark."""
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from intellect.tasks_setup import training_tasks

    python = ensure_trl_venv(venv, progress.console)
    model = Path(cfg.model.path).resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = side / "prompts.jsonl"
    rows = write_prompts(training_tasks(cfg.data), tokenizer, cfg.data.system_prompt, cfg.data.length_targets, prompts)
    kwargs, _ = grpo_config_kwargs(cfg)
    settings = {
        "minutes": minutes,
        "model": str(model),
        "prompts": str(prompts),
        "out": str(side.resolve()),
        "grpo": kwargs,
        "length_penalty": cfg.data.length_penalty,
        "length_mode": cfg.data.length_mode,
    }
    log = side / "trl.log"
    metrics = side / "metrics.jsonl"
    task = progress.add_task("trl: starting", total=minutes[-1] * 60)
    progress.console.print(f"TRL: {rows} prompts in {prompts}")
    t0 = settings["t0"] = time.time()
    (side / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(python), str(ROOT / "benchmarks" / "peer_trl_side.py"), str(side / "settings.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    try:
        deadline = t0 + minutes[-1] * 60 + 3600  # the last step may end long after the last mark, not this long
        while proc.poll() is None and time.time() < deadline:
            elapsed = min(time.time() - t0, minutes[-1] * 60)
            progress.update(task, completed=elapsed, description=f"trl: {_status(read_records(metrics))}")
            time.sleep(1.0)
    finally:
        _stop(proc, 30.0)
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL side exited with {proc.returncode}; the end of {log}:\n{_tail(log)}")
    progress.update(task, completed=minutes[-1] * 60, description="trl: done")
    summary = json.loads((side / "summary.json").read_text())
    ours_stop = sorted(stop_token_ids(model))
    summary["stop_token_ids_ours"] = ours_stop
    if summary["stop_token_ids"] != ours_stop:
        progress.console.print(f"[yellow]TRL stops on {summary['stop_token_ids']}, our engine on {ours_stop}[/]")
    summary.update(rates(read_records(metrics), t0, t0 + minutes[-1] * 60), log=str(log))
    return summary


# -- evaluation and the report ---------------------------------------------------------------------------------


def evaluate(model_dir: Path, config: Path, overrides: list[str], cache: Path) -> dict:
    """`intellect eval MODEL_DIR CONFIG --json` (its record kept in `cache`, reused when present)."""
    if cache.is_file():
        return json.loads(cache.read_text())
    done = subprocess.run(
        [sys.executable, "-m", "intellect", "eval", str(model_dir), str(config), "--json", *overrides],
        capture_output=True,
        text=True,
    )
    cache.with_suffix(".log").write_text(done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"intellect eval {model_dir} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    cache.write_text(json.dumps(record) + "\n")
    return record


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count()}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    from intellect.cli import split_overrides

    rest, overrides = split_overrides(list(argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, help="TOML recipe (e.g. configs/smollm2_135m_syllogism.toml)")
    p.add_argument("--model", type=Path, default=None, help="starting policy (default: the recipe's model.path)")
    p.add_argument("--minutes", type=int, nargs="+", default=[30, 60, 90], help="wall-clock marks from each start")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/peer-trl"),
        help="results: base-eval.json, ours/ and trl/ (marks, logs, metrics; a side's run is replaced when rerun; "
        "ours' run directory keeps metrics and logs, its weights and rollouts are deleted), peer_trl.json",
    )
    p.add_argument("--trl-venv", type=Path, default=None, help=f"TRL's virtualenv (default {default_trl_venv()})")
    p.add_argument("--only", choices=("ours", "trl"), default=None, help="run one side (the other's results stay)")
    args = p.parse_args(rest)
    args.overrides = overrides
    if sorted(set(args.minutes)) != args.minutes or args.minutes[0] <= 0:
        p.error(f"--minutes: positive and increasing, got {args.minutes}")
    return args


def _run_and_score(args, cfg, overrides: list[str], out: Path, sides: list[str], progress) -> tuple[dict, dict]:
    """The base model's eval record, then each side of `sides` run, then every side's marks scored (a side left
    by an earlier invocation with the same marks included): (base record, {side: its results or None})."""
    model = Path(cfg.model.path).resolve()
    progress.console.print(f"scoring the base model {model} ...")
    base = evaluate(model, args.config, overrides, out / "base-eval.json")
    if base.get("model") != str(model):  # a cached record of another model
        (out / "base-eval.json").unlink()
        base = evaluate(model, args.config, overrides, out / "base-eval.json")
    for name in sides:
        side = out / name
        shutil.rmtree(side, ignore_errors=True)
        side.mkdir(parents=True)
        if name == "ours":
            summary = run_ours(cfg, args.config, overrides, args.minutes, side, base, progress)
        else:
            summary = run_trl(cfg, args.minutes, side, args.trl_venv or default_trl_venv(), progress)
        (side / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    results: dict[str, Any] = {}
    for name in ("ours", "trl"):
        path = out / name / "summary.json"
        summary = json.loads(path.read_text()) if path.is_file() else None
        if summary is None or summary["minutes"] != args.minutes:
            results[name] = None
            continue
        marks = {}
        for m, policy in summary.pop("marks").items():
            progress.console.print(f"scoring {name} at {m} min ...")
            record = evaluate(Path(policy["dir"]), args.config, overrides, out / name / f"eval-{m}min.json")
            marks[m] = {**record, "policy": policy}
        results[name] = {"marks": marks, **summary}
    return base, results


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from intellect.config import ConfigError
    from intellect.config_io import load_config

    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = Console(stderr=True)
    out = args.out.resolve()
    overrides = [*RUN_OVERRIDES, *args.overrides]
    if args.model is not None:
        overrides += ["--model.path", str(args.model.resolve())]
    overrides += ["--run.dir", str(out / "ours" / "run")]
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        console.print(f"[red]peer_trl: {e}[/]")
        return 2
    if args.only != "ours" and (cfg.data.env is not None or cfg.run.sft_steps or cfg.data.curriculum):
        console.print(
            "[red]peer_trl: multi-turn pools (data.env), warm starts (run.sft_steps) and curricula (data.curriculum) "
            "have no TRL side here; for a warm start pass its model with --model DIR --run.sft_steps 0, for a "
            "curriculum compare on the held-out difficulty with --data.curriculum '[]'[/]"
        )
        return 2
    kwargs, unmatched = grpo_config_kwargs(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(cfg.model.path).resolve()
    sides = [s for s in ("ours", "trl") if args.only in (None, s)]
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:.0f}/{task.total:.0f} s"))
    try:
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            base, results = _run_and_score(args, cfg, overrides, out, sides, progress)
    except RuntimeError as e:
        console.print(f"[red]peer_trl: {e}[/]")
        return 1
    report = {
        "config": str(args.config),
        "model": str(model),
        "minutes": args.minutes,
        "ours": results["ours"],
        "trl": results["trl"],
        "base": base,
        "grpo_config": kwargs,
        "unmatched": unmatched,
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (out / "peer_trl.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
