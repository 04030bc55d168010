"""Every stage of the pipeline on one model directory: wall-clock and peak resident memory, printed as JSON.

Each stage runs as its own process (the way a user runs it), so its peak resident set is its own (`wait4`'s
ru_maxrss, which covers the process and the children it waited for):

- `matmul`: this machine's float32 matmul peak under JAX on the same devices (the learner's physical limit);
- `import`: `intellect import MODEL_DIR` (Hugging Face safetensors -> the learner's orbax checkpoint);
- `train`: `intellect train` for `--steps` steps on stored batches of `--samples` samples of up to `--seq`
  tokens (`--micro-batches` accumulation steps, remat on, float32 master weights), on `--devices` fake CPU
  devices; reports the step time from metrics.jsonl, tokens/s, the FLOP rate against `matmul`, and the
  learner's own memory plan (the `plan:` lines it logs from the compiled step; on CPU devices its total for
  the host, against which the steps' peak resident set is set) and the seconds of its own exports (in the
  process, from the parameters it holds: what a run pays per version);
- `export`: `intellect export` of the trained checkpoint as bf16 safetensors (a new policy version), a process
  of its own that restores the checkpoint first;
- `shardcast`: an origin and a relay (`intellect shardcast origin|relay`) and a client
  (`intellect shardcast fetch`) that waits for the version: from the start of the fetch to the verified copy;
- `engine`: vLLM on MODEL_DIR (start), a hot swap to the exported version (load), and `--gen-samples`
  generations of `--max-tokens` tokens with TOPLOC proofs, beside which the swap's check against a fresh
  engine runs (how long the generation then waited for it is reported);
- `validator`: the validator's prefill and every check of that batch (`gpu_workers.checks.validate_batch`).

    python benchmarks/scale.py MODEL_DIR [--workdir runs/scale] [--stages all] [--devices 2]

MODEL_DIR is any Hugging Face directory the project loads (e.g. `intellect make-tiny-model DIR --hidden 896
--layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936` for the Qwen2.5-0.5B shape).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from intellect.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("matmul", "import", "train", "export", "shardcast", "engine", "validator")


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "PYTHONPATH": str(ROOT),
    }


def _rss(pid: int) -> int:
    """Resident bytes of `pid` now (0 once it has gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


TIMELINE_S = 10


def run_stage(cmd: list[str], env: dict, log: Path, timeout: float, until=None) -> dict:
    """Run `cmd` to completion; its wall-clock seconds and peak RSS (GiB) from wait4, and the sampled resident
    set's peak per `TIMELINE_S` seconds (to see which phase holds the peak). With `until` (a callable polled every
    50 ms), also the peak of the resident set sampled before `until()` first held."""
    start = time.perf_counter()
    sampled, before, timeline = 0, None, []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            rss = _rss(proc.pid)
            sampled = max(sampled, rss)
            slot = int((time.perf_counter() - start) // TIMELINE_S)
            timeline += [0] * (slot + 1 - len(timeline))
            timeline[slot] = max(timeline[slot], rss)
            if until is not None and before is None and until():
                before = sampled
            time.sleep(0.05)
    code = os.waitstatus_to_exitcode(status)
    result = {
        "seconds": round(time.perf_counter() - start, 2),
        "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
        "exit": code,
        "log": str(log),
        f"rss_gib_per_{TIMELINE_S}s": [round(x / 2**30, 2) for x in timeline],
    }
    if until is not None:
        result["peak_rss_gib_until"] = round(before / 2**30, 2) if before is not None else None
    if code != 0:
        result["error"] = log.read_text()[-1500:]
    return result


def _child_json(log: Path) -> dict:
    """The last line of a stage's log that is a JSON object (what a child stage of this script prints)."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


# ---- child stages (run as `python benchmarks/scale.py --child NAME ...`) ----


def child_matmul(args) -> None:
    import jax
    import jax.numpy as jnp

    n = 2048
    devices = jax.devices()
    a = [jax.device_put(jnp.ones((n, n), jnp.float32), d) for d in devices]
    f = jax.jit(lambda x: x @ x)
    for x in a:
        f(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        outs = [f(x) for x in a]  # every device at once, as the learner's mesh uses them
        for o in outs:
            o.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    print(json.dumps({"gflops": round(2 * n**3 * len(devices) / best / 1e9, 1), "devices": len(devices)}))


def child_engine(args) -> None:
    import numpy as np

    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine

    rng = np.random.default_rng(0)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = [rng.integers(3, min(vocab, 30000), 32).tolist() for _ in range(args.gen_samples)]
    t0 = time.perf_counter()
    engine = Engine(args.model, 0, WorkerConfig(dtype=args.worker_dtype), max_model_len=64 + args.max_tokens)
    started = time.perf_counter() - t0
    t0 = time.perf_counter()
    # the post-swap check (a fresh engine on the new files) starts here and runs beside the generation
    engine.swap(args.version_dir, int(Path(args.version_dir).name[1:]))
    swapped = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(prompts, list(range(len(prompts))), temperature=1.0, max_tokens=args.max_tokens)
    generated = time.perf_counter() - t0
    check = engine.last_check or {}
    tokens = sum(len(c.tokens) for c in out)
    np.savez(
        args.batch,
        **{
            f"{k}{i}": np.asarray(v)
            for i, c in enumerate(out)
            for k, v in (
                ("p", c.prompt_tokens),
                ("t", c.tokens),
                ("l", c.logprobs),
                ("f", c.finish),
                ("x", np.frombuffer(b"".join(c.proofs), np.uint8)),
            )
        },
    )
    engine.close()
    print(
        json.dumps(
            {
                "start_s": round(started, 2),
                "swap_s": round(swapped, 2),
                "generate_s": round(generated, 2),  # the check's wait included
                "swap_check_waited_s": round(check.get("waited_s", float("nan")), 2),
                "swap_check_max_diff": check.get("max_diff"),
                "samples": len(out),
                "tokens": tokens,
                "tokens_per_s": round(tokens / generated, 1),
            }
        )
    )


def child_validator(args) -> None:
    import numpy as np

    from gpu_workers.checks import Declared, Sample, stop_token_ids, validate_batch
    from gpu_workers.prefill import Prefill

    data = np.load(args.batch)
    n = len([k for k in data.files if k.startswith("t")])
    samples = [
        Sample(
            prompt_tokens=data[f"p{i}"],
            completion_tokens=data[f"t{i}"],
            logprobs=data[f"l{i}"],
            finish=int(data[f"f{i}"]),
            proofs=data[f"x{i}"].tobytes(),
            seed=i,
        )
        for i in range(n)
    ]
    t0 = time.perf_counter()
    prefill = Prefill(args.version_dir, dtype=args.worker_dtype)
    loaded = time.perf_counter() - t0
    declared = Declared(
        temperature=1.0,
        top_p=1.0,
        max_tokens=args.max_tokens,
        stop_token_ids=stop_token_ids(Path(args.version_dir)),
        max_model_len=64 + args.max_tokens,
        dtype=args.worker_dtype,
    )
    t0 = time.perf_counter()
    verdict = validate_batch(samples, prefill, declared)
    checked = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "load_s": round(loaded, 2),
                "prefill_and_checks_s": round(checked, 2),
                "samples": n,
                "samples_per_s": round(n / checked, 3),
                "accepted": bool(verdict.accepted),
                "failed": sorted({c for s in verdict.samples for c in s.failed}),
            }
        )
    )


# ---- the driver ----


def write_batches(store_dir: Path, count: int, samples: int, seq: int, vocab: int) -> None:
    import numpy as np

    from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore

    store = RolloutStore.open(str(store_dir))
    rng = np.random.default_rng(0)
    for b in range(count):
        prompt = seq // 4
        tokens = [rng.integers(3, min(vocab, 30000), seq) for _ in range(samples)]
        logprobs = [np.r_[np.zeros(prompt), -rng.random(seq - prompt) * 2] for _ in range(samples)]
        meta = BatchMeta(
            f"b{b}", "ab" * 32, version=0, assignment_id=b, sampling={"temperature": 1.0}, model_dtype="float32"
        )
        store.write(
            RolloutBatch.from_samples(
                meta,
                tokens=tokens,
                prompt_lens=[prompt] * samples,
                logprobs=logprobs,
                task_ids=list(range(samples)),
                group_ids=[i // 4 for i in range(samples)],
                seeds=list(range(samples)),
                finish=[1] * samples,
                rewards=rng.random(samples).tolist(),
                proofs=[bytes(258 * -(-(seq - prompt) // 32))] * samples,
            )
        )


def train_flags(args, work: Path) -> list[str]:
    flags = {
        "run.dir": work / "run",
        "model.path": args.model,
        "model.max_seq_len": args.seq,
        "model.remat": True,
        "model.param_dtype": "float32",
        "model.compute_dtype": args.compute_dtype,
        "data.max_prompt_len": args.seq // 4,
        "data.max_new_tokens": args.seq - args.seq // 4,
        "trainer.data": 1,
        "trainer.fsdp": -1,
        "trainer.tensor": 1,
        "trainer.batch_size": args.samples,
        "data.prompts_per_step": args.samples // 4,
        "data.samples_per_prompt": 4,
        "trainer.micro_batch_size": args.samples // args.micro_batches,
        "trainer.micro_batches": args.micro_batches,
        "trainer.steps": args.steps,
        "trainer.export_interval": 10**6,
        "trainer.checkpoint_interval": args.steps,
        "trainer.accepted_from": "store",
        "trainer.rollout_store": work / "rollouts",
        "trainer.async_level": 1,
        "trainer.batch_timeout_s": 600,
        "trainer.coordinator_address": "none",
        "trainer.num_processes": "none",
        "trainer.process_id": "none",
        "data.online_filter": False,
        "data.length_targets": "[]",
        "loss.logprob_source": "recompute",
    }
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def flops_per_token(model_dir: Path, seq: int, executed: bool = False, pi_old: bool = False) -> float:
    """The model's FLOPs per trained token: 6 x parameters touched (forward + backward) plus causal attention, as
    in the PaLM appendix. `executed=True` counts what the step runs besides: each layer's forward again in the
    backward pass (remat) and, with `pi_old`, a forward pass for pi_old (`loss.logprob_source = "recompute"` with
    more than one optimizer step per batch; with one, the step's own forward gives pi_old)."""
    c = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    hd = c.get("head_dim") or h // heads
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter
    head = h * vocab  # the LM head (tied or not, it is a matmul per token)
    attention = 2 * layers * heads * hd * seq  # QK^T and AV, causal (half of 2 x 2 x seq), forward only
    model = 6 * (layers * per_layer + head) + 3 * attention
    if not executed:
        return model
    remat = 2 * layers * per_layer + attention
    return model + remat + (2 * (layers * per_layer + head) + attention if pi_old else 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "scale")
    parser.add_argument("--stages", default="all", help=f"comma-separated of {', '.join(STAGES)}")
    parser.add_argument("--devices", type=int, default=2, help="fake CPU devices of the learner's mesh")
    parser.add_argument("--samples", type=int, default=16, help="samples per learner batch")
    parser.add_argument("--seq", type=int, default=160, help="tokens per sample (prompt = a quarter)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="learner steps (the first compiles)")
    parser.add_argument("--compute-dtype", default="float32")
    parser.add_argument("--worker-dtype", default="bfloat16")
    parser.add_argument("--gen-samples", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per stage")
    parser.add_argument("--child", choices=("matmul", "engine", "validator"), help=argparse.SUPPRESS)
    parser.add_argument("--version-dir", help=argparse.SUPPRESS)
    parser.add_argument("--batch", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        {"matmul": child_matmul, "engine": child_engine, "validator": child_validator}[args.child](args)
        return 0
    if args.model is None:
        parser.error("MODEL_DIR is required")
    args.model = args.model.resolve()
    stages = STAGES if args.stages == "all" else tuple(args.stages.split(","))
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env, me = _env(args.devices), [sys.executable, str(Path(__file__).resolve())]
    intellect = [sys.executable, "-m", "intellect"]
    config = json.loads((args.model / "config.json").read_text())
    params = sum(p.stat().st_size for p in args.model.glob("*.safetensors"))
    report: dict = {
        "model": {
            "dir": str(args.model),
            "hidden": config["hidden_size"],
            "layers": config["num_hidden_layers"],
            "vocab": config["vocab_size"],
            "safetensors_gib": round(params / 2**30, 3),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        },
        "stages": {},
    }
    out = report["stages"]
    version = work / "weights" / f"v{args.steps:06d}"  # the export of the last step's checkpoint

    def stage(name: str, cmd: list[str], extra: dict | None = None, until=None) -> dict:
        print(f"[scale] {name} ...", file=sys.stderr, flush=True)
        result = run_stage(cmd, env, work / f"{name}.log", args.timeout, until)
        result.update(extra or {})
        out[name] = result
        print(
            f"[scale] {name}: {result['seconds']} s, peak {result['peak_rss_gib']} GiB, exit {result['exit']}",
            file=sys.stderr,
            flush=True,
        )
        return result

    if "matmul" in stages:
        r = stage("matmul", me + ["--child", "matmul"])
        r.update(_child_json(work / "matmul.log"))
    if "import" in stages:
        shutil.rmtree(work / "import", ignore_errors=True)
        stage("import", intellect + ["import", str(args.model), str(work / "import")])
    if "train" in stages:
        shutil.rmtree(work / "run", ignore_errors=True)
        shutil.rmtree(work / "rollouts", ignore_errors=True)
        write_batches(work / "rollouts", args.steps + 1, args.samples, args.seq, config["vocab_size"])
        metrics = work / "run" / "metrics.jsonl"

        def trained() -> list[dict]:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return [x for x in (json.loads(line) for line in lines if line.startswith("{")) if "loss" in x]

        # the steps' peak: sampled until the last step's metrics are written (before its checkpoint is saved)
        r = stage(
            "train",
            intellect + ["train", str(ROOT / "configs" / "qwen2_5_0_5b_cpu.toml")] + train_flags(args, work),
            until=lambda: len(trained()) >= args.steps,
        )
        steps = trained()
        plan = {}
        for line in (work / "train.log").read_text().splitlines():
            if "memory plan per device" in line:
                plan = {"mesh": line.split("memory plan per device", 1)[1].strip(" :")}
            elif plan and (m := re.search(r"train_step INFO {3}(\S.*?) {2,}([\d.]+ [KMG]iB)", line)):
                plan[m.group(1)] = m.group(2)
        r["plan_per_device"] = plan
        if "this host" in plan:  # CPU devices: the plan's total for the process, against what it reached
            host_gib = float(plan["this host"].split()[0]) * (1 if plan["this host"].endswith("GiB") else 2**-10)
            r["plan_host_gib"] = host_gib
            if r.get("peak_rss_gib_until"):
                r["steps_peak_over_plan"] = round(r["peak_rss_gib_until"] / host_gib, 3)
        exports = re.findall(r"exported version \d+ to \S+ in ([\d.]+) s", (work / "train.log").read_text())
        if exports:  # the learner's own export of a version (in the process, from the parameters it holds)
            r["export_in_learner_s"] = [float(x) for x in exports]
        if steps:
            key = next((k for k in ("step_s", "step_time_s", "time_s") if k in steps[-1]), None)
            r["steps"] = [{k: x[k] for k in ("step", "loss", key, "tokens") if k and k in x} for x in steps]
            if key:
                step_s = steps[-1][key]
                tokens = args.samples * args.seq
                r["step_s"] = step_s
                r["tokens_per_s"] = round(tokens / step_s, 1)
                r["gflops"] = round(tokens * flops_per_token(args.model, args.seq) / step_s / 1e9, 1)
                r["executed_gflops"] = round(tokens * flops_per_token(args.model, args.seq, True) / step_s / 1e9, 1)
                if "gflops" in out.get("matmul", {}):
                    r["of_matmul_peak"] = round(r["gflops"] / out["matmul"]["gflops"], 3)
                    r["executed_of_matmul_peak"] = round(r["executed_gflops"] / out["matmul"]["gflops"], 3)
    if "export" in stages:
        shutil.rmtree(work / "weights", ignore_errors=True)
        (work / "weights").mkdir(parents=True)
        stage("export", intellect + ["export", str(work / "run" / "checkpoints"), str(version), "--dtype", "bfloat16"])
    if "shardcast" in stages:
        port, relay_port = free_port(), free_port()
        procs = []
        fetched = Path(tempfile.mkdtemp(dir=work, prefix="fetched-"))
        try:
            procs.append(
                subprocess.Popen(
                    intellect
                    + [
                        "shardcast",
                        "origin",
                        "--dir",
                        str(work / "weights"),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=open(work / "origin.log", "w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            procs.append(
                subprocess.Popen(
                    intellect
                    + [
                        "shardcast",
                        "relay",
                        "--upstream",
                        f"http://127.0.0.1:{port}",
                        "--dir",
                        str(work / "relay"),
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(relay_port),
                        "--shardcast.pin_manifests",
                        "false",
                    ],  # no orchestrator
                    env=env,
                    cwd=ROOT,
                    stdout=open(work / "relay.log", "w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            stage(
                "shardcast",
                intellect
                + [
                    "shardcast",
                    "fetch",
                    "--servers",
                    f"http://127.0.0.1:{relay_port}",
                    "--version",
                    str(args.steps),
                    "--wait",
                    "120",
                    "--out",
                    str(fetched),
                    "--json",
                ],
                {"bytes": sum(p.stat().st_size for p in version.glob("*") if p.is_file())},
            )
            out["shardcast"]["fetch"] = _child_json(work / "shardcast.log")  # its own figures
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)
            shutil.rmtree(fetched, ignore_errors=True)
    if "engine" in stages:
        r = stage(
            "engine",
            me
            + [
                "--child",
                "engine",
                str(args.model),
                "--version-dir",
                str(version),
                "--batch",
                str(work / "batch.npz"),
                "--worker-dtype",
                args.worker_dtype,
                "--gen-samples",
                str(args.gen_samples),
                "--max-tokens",
                str(args.max_tokens),
            ],
        )
        r.update(_child_json(work / "engine.log"))
    if "validator" in stages:
        r = stage(
            "validator",
            me
            + [
                "--child",
                "validator",
                str(args.model),
                "--version-dir",
                str(version),
                "--batch",
                str(work / "batch.npz"),
                "--worker-dtype",
                args.worker_dtype,
                "--max-tokens",
                str(args.max_tokens),
            ],
        )
        r.update(_child_json(work / "validator.log"))
    print(json.dumps(report, indent=1))
    return 0 if all(s["exit"] == 0 for s in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
