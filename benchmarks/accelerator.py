"""The learner on an accelerator, in one JSON: matmul peak, our GRPO step against eager PyTorch, init and load
times, attention kernels, and JAX against transformers logits (issue 33).

Every stage runs in its own child process with its own time limit (`STAGE_LIMITS`, clipped to what is left of
`--budget`): a stage that fails reports its error, one that hangs is killed and reported, and the others still
run. A JSON line per stage is appended to `--out` as soon as it finishes, so a run killed from outside keeps
what finished; stdout gets one JSON object at the end, with a summary (tokens/s, MFU) computed across stages.

Stages (full size on one GPU; `--small` runs the same code at a tiny shape on the CPU in a few minutes):

- `matmul_jax`, `matmul_torch`: bf16 [n, n] @ [n, n] (n = 8192), TFLOP/s: the measured peak.
- `attention`: each attention implementation of `jax_trainer.attention` this backend has (xla everywhere,
  cudnn on GPU, splash on TPU) on packed bf16 rows of the 0.5B model's heads at 16 x 2048: the error against a
  float32 reference on two rows, and the forward + backward time; on GPU also cuDNN with `is_causal` alone
  (no segment mask), whose time against the masked call is the cost of keeping packed samples apart.
- `grpo_jax_0.5b`, `grpo_jax_0.5b_4layers`, `grpo_jax_1.5b`: `init_random` (timed), `export_hf` to a temp
  directory, `load_hf` from it (timed, page cache warm), then `GRPOTrainer.step` (float32 parameters, bfloat16
  compute (float32 in small mode), no remat, pi_old from the batch's inference logprobs so a step is one
  forward, one backward, one AdamW update, as in `benchmarks/train_step.py`): first step (compile) time,
  steady-state step time, tokens/s, model TFLOP/s (`train_step.flops_per_token`), MFU against the nominal peak
  (`NOMINAL_TFLOPS`, keyed by device name), peak device memory. Qwen2.5-0.5B shape at 16 x 2048 (the 4-layer
  variant: the same at 4 layers, for the compile time against depth), Qwen2.5-1.5B at 8 x 2048.
- `grpo_torch_0.5b`, `grpo_torch_1.5b`: the same step in eager PyTorch: HF Qwen2 (sdpa), bf16 autocast (none
  in small mode), float32 parameters, chunked LM head (no [batch, seq, vocab] logits held), fused AdamW on CUDA.
- `grpo_jax_0.5b_lora`: the 0.5B step training rank-16 LoRA adapters on all seven projections (frozen base),
  beside the full step above.
- `logits`: JAX (`load_hf`) against transformers on the same random 0.5B-shaped checkpoint, 2 x 512 tokens on
  the device: float32 error relative to the logit scale, and the bfloat16 error beside the measured floor
  (transformers bf16 against transformers float32).
- the workers' stages, `benchmarks/accelerator_workers.py`'s `STAGES`, when that file exists.

The summary divides each GRPO stage's model TFLOP/s by the measured peak (`matmul_jax`) as well as the nominal.

    python benchmarks/accelerator.py [--small] [--out FILE.jsonl] [--budget SECONDS] [--stages a,b,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKERS = HERE / "accelerator_workers.py"

# bf16 dense peak TFLOP/s per chip, by a substring of the device name (first match wins)
NOMINAL_TFLOPS = (
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("TPU v5p", 459.0),
    ("TPU v5 lite", 197.0),
    ("TPU v6", 918.0),
    ("TPU v4", 275.0),
)
QWEN_0_5B = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, batch=16, seq=2048)
QWEN_1_5B = dict(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936, batch=8, seq=2048)
SMALL = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512, batch=2, seq=128)
SHAPES = {"0.5b": QWEN_0_5B, "0.5b_4layers": {**QWEN_0_5B, "layers": 4}, "1.5b": QWEN_1_5B}
STAGE_LIMITS = {  # seconds (full size, small)
    "matmul_jax": (60, 120),
    "matmul_torch": (60, 120),
    "attention": (90, 240),
    "grpo_jax_0.5b": (150, 300),
    "grpo_torch_0.5b": (90, 240),
    "logits": (120, 240),
    "grpo_jax_0.5b_lora": (150, 300),
    "grpo_jax_0.5b_4layers": (90, 300),
    "grpo_jax_1.5b": (150, 300),
    "grpo_torch_1.5b": (90, 240),
}
WORKER_LIMIT = (120, 300)
MIN_STAGE_S = 10  # a stage with less than this left of the budget is skipped, not started


# ---- the harness ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Stage:
    name: str
    module: Path  # the file whose `STAGES[name]` the child runs
    limit_s: float


def run_stages(stages: list[Stage], out: Path | None, small: bool, budget_s: float, env: dict | None = None) -> dict:
    """Run each stage in its own child process; returns {name: record} and appends each record to `out`."""
    records = {}
    deadline = time.monotonic() + budget_s
    for stage in stages:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            record = {"stage": stage.name, "ok": False, "error": f"skipped: {left:.0f} s of the budget left"}
        else:
            record = _run_child(stage, small, min(stage.limit_s, left), env)
        records[stage.name] = record
        print(f"[accelerator] {stage.name}: {'ok' if record['ok'] else record['error']}", file=sys.stderr, flush=True)
        if out is not None:
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
    return records


def _run_child(stage: Stage, small: bool, limit_s: float, env: dict | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="accelerator-stage-") as tmp:
        result_path = Path(tmp) / "result.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(stage.module), stage.name]
        argv += ["--result", str(result_path)] + (["--small"] if small else [])
        child_env = {**os.environ, **(env or {})}
        child_env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), child_env.get("PYTHONPATH", "")])
        child_env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # jax and torch share the device
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env, start_new_session=True
        )
        try:
            log, _ = proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the stage's own children (compilers, workers) too
            log, _ = proc.communicate()
            return {
                "stage": stage.name,
                "ok": False,
                "error": f"timed out after {limit_s:.0f} s",
                "seconds": round(time.monotonic() - t0, 1),
                "log_tail": log[-2000:],
            }
        seconds = round(time.monotonic() - t0, 1)
        if proc.returncode != 0 or not result_path.exists():
            lines = [line for line in log.strip().splitlines() if line.strip()]
            return {
                "stage": stage.name,
                "ok": False,
                "error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}",
                "seconds": seconds,
                "log_tail": log[-2000:],
            }
        return {"stage": stage.name, "ok": True, "seconds": seconds, "result": json.loads(result_path.read_text())}


def _load(path: Path):
    """The module at `path` (registered in sys.modules first: its dataclasses look themselves up there)."""
    spec = importlib.util.spec_from_file_location(f"accelerator_stage_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _child(module_path: str, name: str, small: bool, result: str) -> int:
    module = _load(Path(module_path))
    try:
        value = module.STAGES[name](small)
    except Exception:
        traceback.print_exc()
        return 1
    Path(result).write_text(json.dumps(value))
    return 0


# ---- helpers of the stages -----------------------------------------------------------------------------------
def nominal_tflops(device_name: str) -> float | None:
    return next((tf for key, tf in NOMINAL_TFLOPS if key.lower() in device_name.lower()), None)


def _shape(name: str, small: bool) -> argparse.Namespace:
    return argparse.Namespace(**(SMALL if small else SHAPES[name]))


def _hf_config(s: argparse.Namespace) -> dict:
    """A Qwen2.5-shaped HF config (tied embeddings, as the 0.5B and 1.5B checkpoints)."""
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": s.vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max(s.seq, 2048),
        "rope_theta": 1000000.0,
        "torch_dtype": "float32",
    }


def _jax_device() -> tuple[str, str]:
    import jax

    device = jax.devices()[0]
    return device.platform, device.device_kind


def _jax_peak_memory_gib() -> float:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return round(stats["peak_bytes_in_use"] / 2**30, 2)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # CPU: the process's peak RSS


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- stages ----------------------------------------------------------------------------------------------------
def matmul_jax(small: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n, reps = (256, 3) if small else (8192, 20)
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.dot)
    matmul(a, b).block_until_ready()
    seconds = _median_time(lambda: matmul(a, b).block_until_ready(), reps)
    platform, kind = _jax_device()
    return {"device": kind, "platform": platform, "n": n, "dtype": "bfloat16", "tflops": 2 * n**3 / seconds / 1e12}


def matmul_torch(small: bool) -> dict:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    n, reps = (256, 3) if small else (8192, 20)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=g)

    def run():
        torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()

    run()
    seconds = _median_time(run, reps)
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    return {"device": name, "n": n, "dtype": "bfloat16", "tflops": 2 * n**3 / seconds / 1e12}


def attention_stage(small: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_trainer import attention

    s = _shape("0.5b", small)
    b, t, n, kv, d = s.batch, s.seq, s.heads, s.kv_heads, s.hidden // s.heads
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16) for h in (n, kv, kv))
    # four samples of uneven length per row, then padding
    bounds = np.cumsum([0, t * 3 // 10, t * 2 // 10, t * 3 // 10, t * 1 // 10])
    row = np.zeros(t, np.int32)
    for i in range(4):
        row[bounds[i] : bounds[i + 1]] = i + 1
    segments = jnp.asarray(np.broadcast_to(row, (b, t)))

    def reference(q, k, v, seg):
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :])
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(d)
        p = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("bnqk,bknd->bqnd", p, v)

    rows = slice(0, 2)
    want = jax.jit(reference)(q[rows], k[rows], v[rows], segments[rows])
    platform, kind = _jax_device()
    kernels: dict[str, Callable] = {"xla": lambda q, k, v, seg: attention.attention(q, k, v, seg, "xla")}
    if platform == "gpu":
        kernels["cudnn"] = lambda q, k, v, seg: attention.attention(q, k, v, seg, "cudnn")
        kernels["cudnn_causal_only"] = lambda q, k, v, seg: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        )
    if platform == "tpu":
        kernels["splash"] = lambda q, k, v, seg: attention.attention(q, k, v, seg, "splash")
    out = {"device": kind, "shape": {"batch": b, "seq": t, "heads": n, "kv_heads": kv, "head_dim": d}}

    def fwd_bwd_ms(fn) -> float:
        grad = jax.jit(jax.value_and_grad(lambda q, k, v: fn(q, k, v, segments).astype(jnp.float32).sum(), (0, 1, 2)))
        jax.block_until_ready(grad(q, k, v))
        return 1e3 * _median_time(lambda: jax.block_until_ready(grad(q, k, v)), 5)

    for name, fn in kernels.items():
        try:
            got = jax.jit(fn)(q[rows], k[rows], v[rows], segments[rows]).astype(jnp.float32)
            entry = {"fwd_bwd_ms": fwd_bwd_ms(fn)}
            if name != "cudnn_causal_only":  # that one ignores the segments on purpose
                entry["max_error_rel"] = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        except Exception as exc:  # a kernel this device cannot run is reported beside the others
            entry = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        out[name] = entry
    if "fwd_bwd_ms" in out.get("cudnn", {}) and "fwd_bwd_ms" in out.get("cudnn_causal_only", {}):
        out["segment_mask_cost"] = out["cudnn"]["fwd_bwd_ms"] / out["cudnn_causal_only"]["fwd_bwd_ms"]
    return out


def _compute_dtype(small: bool) -> str:
    """bfloat16 on the accelerator; float32 in small mode, as the CPU recipes (XLA:CPU emulates bf16 and cannot
    run every bf16 x bf16 -> f32 dot of the step)."""
    return "float32" if small else "bfloat16"


def _grpo_jax(shape: str, small: bool, lora_rank: int = 0) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_trainer import attention
    from jax_trainer.models import ModelConfig, export_hf, init_random, load_hf
    from jax_trainer.sharding import make_mesh

    s = _shape(shape, small)
    hf = _hf_config(s)
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    compute = _compute_dtype(small)
    out = {"shape": vars(s), "compute_dtype": compute, "attention": attention.resolve("auto", jnp.dtype(compute))}
    t0 = time.perf_counter()
    model = init_random(ModelConfig.from_hf(hf), mesh=mesh, param_dtype="float32", compute_dtype=compute)
    jax.block_until_ready(nnx.state(model))
    out["init_random_s"] = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="accelerator-model-") as tmp:
        export_hf(model, tmp, version=0, hf_config=hf, dtype="float32", fsync=False)
        del model
        t0 = time.perf_counter()
        lora = _lora(lora_rank)
        model = load_hf(tmp, mesh=mesh, param_dtype="float32", compute_dtype=compute, verify=False, lora=lora)
        jax.block_until_ready(nnx.state(model))
        out["load_hf_s"] = time.perf_counter() - t0
        if lora is not None:
            out["lora"] = {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets)}
        try:
            out.update(_jax_steps(model, mesh, s, small))
        except Exception as exc:  # a kernel the device refuses: measure the step on the xla kernel, say why
            if out["attention"] == "xla":
                raise
            out["attention_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out["attention"] = "xla"
            model = load_hf(
                tmp, mesh=mesh, param_dtype="float32", compute_dtype=compute, verify=False, attention="xla", lora=lora
            )
            out.update(_jax_steps(model, mesh, s, small))
    return _throughput(out, s, _jax_device()[1], _jax_peak_memory_gib())


def _lora(rank: int):
    from jax_trainer.models.lora import TARGETS, LoraSpec

    return LoraSpec(rank, 2.0 * rank, tuple(TARGETS)) if rank else None


def _jax_steps(model, mesh, s: argparse.Namespace, small: bool) -> dict:
    """`GRPOTrainer.step` on `model`: the first step (compile included), its loss, the steady-state step time."""
    import jax
    import train_step

    from jax_trainer.config import LossConfig, OptimConfig
    from jax_trainer.train_step import GRPOTrainer, trainable

    optim = OptimConfig(lr=train_step.LR, weight_decay=train_step.WEIGHT_DECAY, grad_clip=train_step.GRAD_CLIP)
    trainer = GRPOTrainer(model, mesh, LossConfig(logprob_source="inference", temperature=1.0), optim)
    box = {"state": trainer.init_state(trainable(model))}  # the adapters alone under LoRA
    batch = trainer.device_batch(train_step._packed(train_step.make_batch(s)))

    def step():
        box["state"], metrics = trainer.step(box["state"], batch)
        jax.block_until_ready((box["state"], metrics))
        return metrics

    t0 = time.perf_counter()
    metrics = step()
    out = {"first_step_s": time.perf_counter() - t0, "loss": float(metrics["loss"])}
    out["step_s"] = _median_time(step, 2 if small else 5)
    return out


def _throughput(out: dict, s: argparse.Namespace, device: str, peak_gib: float) -> dict:
    import train_step

    tokens = s.batch * s.seq
    out["device"] = device
    out["tokens_per_s"] = tokens / out["step_s"]
    out["flops_per_token"] = train_step.flops_per_token(s)
    out["model_tflops"] = out["tokens_per_s"] * out["flops_per_token"] / 1e12
    nominal = nominal_tflops(device)
    out["nominal_tflops"] = nominal
    out["mfu_nominal"] = out["model_tflops"] / nominal if nominal else None
    out["peak_memory_gib"] = peak_gib
    return out


def _grpo_torch(shape: str, small: bool) -> dict:
    import torch
    import train_step
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = _shape(shape, small)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = {k: v for k, v in _hf_config(s).items() if k not in ("model_type", "architectures", "torch_dtype")}
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**hf, attn_implementation="sdpa"))
    out = {
        "shape": vars(s),
        "init_s": time.perf_counter() - t0,
        "attn_implementation": model.config._attn_implementation,
        "compute_dtype": _compute_dtype(small),
    }
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=train_step.LR,
        betas=train_step.BETAS,
        eps=train_step.EPS,
        weight_decay=train_step.WEIGHT_DECAY,
        fused=device == "cuda",
    )
    batch = {k: torch.from_numpy(v[0]).to(device) for k, v in train_step.make_batch(s).items()}
    tokens = batch["tokens"].long()
    chunk = 512

    def chunk_logprobs(h, weight, targets):
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=not small):
            logits = (h @ weight.t()).float()
        return logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]

    def run_step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=not small):
            hidden = model.model(input_ids=tokens).last_hidden_state[:, :-1]
        targets = tokens[:, 1:]
        # the LM head chunk by chunk, recomputed in the backward pass: no [batch, seq, vocab] logits held
        lp = torch.cat(
            [
                torch.utils.checkpoint.checkpoint(
                    chunk_logprobs,
                    hidden[:, c : c + chunk],
                    model.lm_head.weight,
                    targets[:, c : c + chunk],
                    use_reentrant=False,
                )
                for c in range(0, targets.shape[1], chunk)
            ],
            dim=1,
        )
        mask, adv, old = batch["loss_mask"][:, 1:], batch["advantages"][:, 1:], batch["inference_logprobs"][:, 1:]
        ratio = torch.exp(lp - old)
        surr1 = adv * torch.where(adv < 0, torch.clamp(ratio, max=4.0), ratio)
        surr2 = adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
        loss = (-torch.minimum(surr1, surr2) * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_step.GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return float(loss.detach())

    t0 = time.perf_counter()
    out["loss"] = run_step()
    out["first_step_s"] = time.perf_counter() - t0
    out["step_s"] = _median_time(run_step, 2 if small else 5)
    if device == "cuda":
        name, peak = torch.cuda.get_device_name(0), round(torch.cuda.max_memory_allocated() / 2**30, 2)
    else:
        name, peak = "cpu", round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    return _throughput(out, s, name, peak)


def logits_stage(small: bool) -> dict:
    import numpy as np
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    s = _shape("0.5b", small)
    batch, seq = (2, 64) if small else (2, 512)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = {k: v for k, v in _hf_config(s).items() if k not in ("model_type", "architectures", "torch_dtype")}
    tokens = np.random.default_rng(0).integers(0, s.vocab, (batch, seq)).astype(np.int32)
    out = {"tokens": [batch, seq]}
    with tempfile.TemporaryDirectory(prefix="accelerator-logits-") as tmp:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**hf, attn_implementation="sdpa")).float().eval()
        model.save_pretrained(tmp)
        model.to(device)
        ids = torch.from_numpy(tokens).long().to(device)
        with torch.no_grad():
            hf32 = model(ids).logits.float().cpu().numpy()
            model.to(torch.bfloat16)
            hf16 = model(ids).logits.float().cpu().numpy()
        del model
        if device == "cuda":
            torch.cuda.empty_cache()

        import jax
        from flax import nnx

        from jax_trainer.models import load_hf

        forward = nnx.jit(lambda m, t: m(t))
        t0 = time.perf_counter()
        jax32 = np.asarray(forward(load_hf(tmp, param_dtype="float32", compute_dtype="float32"), tokens))
        out["jax_load_and_forward_s"] = time.perf_counter() - t0
        jax16 = np.asarray(forward(load_hf(tmp, param_dtype="float32", compute_dtype="bfloat16"), tokens))
    scale = float(np.abs(hf32).max())
    out["device"] = jax.devices()[0].device_kind
    out["logit_scale"] = scale
    out["float32_error_rel"] = float(np.abs(jax32 - hf32).max()) / scale
    out["bfloat16_error_rel"] = float(np.abs(jax16 - hf32).max()) / scale
    out["bfloat16_floor_rel"] = float(np.abs(hf16 - hf32).max()) / scale  # transformers bf16 against its fp32
    out["float32_ok"] = out["float32_error_rel"] <= 1e-4
    out["bfloat16_within_floor"] = out["bfloat16_error_rel"] <= out["bfloat16_floor_rel"]
    return out


STAGES: dict[str, Callable[[bool], dict]] = {
    "matmul_jax": matmul_jax,
    "matmul_torch": matmul_torch,
    "attention": attention_stage,
    "grpo_jax_0.5b": lambda small: _grpo_jax("0.5b", small),
    "grpo_torch_0.5b": lambda small: _grpo_torch("0.5b", small),
    "logits": logits_stage,
    "grpo_jax_0.5b_lora": lambda small: _grpo_jax("0.5b", small, lora_rank=16),
    "grpo_jax_0.5b_4layers": lambda small: _grpo_jax("0.5b_4layers", small),
    "grpo_jax_1.5b": lambda small: _grpo_jax("1.5b", small),
    "grpo_torch_1.5b": lambda small: _grpo_torch("1.5b", small),
}


# ---- the parent ------------------------------------------------------------------------------------------------
def all_stages(small: bool, workers: Path = WORKERS) -> list[Stage]:
    """Ours (`STAGES`), then the workers' (`workers`' STAGES, when the file exists), each with its limit."""
    pick = 1 if small else 0
    stages = [Stage(name, Path(__file__).resolve(), STAGE_LIMITS[name][pick]) for name in STAGES]
    if workers.exists():
        stages += [Stage(name, workers, WORKER_LIMIT[pick]) for name in _load(workers).STAGES]
    return stages


def summary(records: dict) -> dict:
    """Across stages: tokens/s of both sides and their ratio, MFU against the measured and the nominal peak."""

    def result(name):
        record = records.get(name, {})
        return record.get("result") if record.get("ok") else None

    peak = (result("matmul_jax") or {}).get("tflops")
    out = {"measured_peak_tflops": peak}
    for shape in ("0.5b", "1.5b", "0.5b_4layers"):
        ours, theirs = result(f"grpo_jax_{shape}"), result(f"grpo_torch_{shape}")
        if ours is None:
            continue
        entry = {
            "jax_tokens_per_s": ours["tokens_per_s"],
            "mfu_nominal": ours["mfu_nominal"],
            "mfu_measured_peak": ours["model_tflops"] / peak if peak else None,
            "first_step_s": ours["first_step_s"],
            "init_random_s": ours["init_random_s"],
            "load_hf_s": ours["load_hf_s"],
        }
        if theirs is not None:
            entry["torch_tokens_per_s"] = theirs["tokens_per_s"]
            entry["ratio_vs_torch"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        out[shape] = entry
    four, full = result("grpo_jax_0.5b_4layers"), result("grpo_jax_0.5b")
    if four and full:
        out["first_step_24_over_4_layers"] = full["first_step_s"] / four["first_step_s"]
    lora = result("grpo_jax_0.5b_lora")
    if lora and full:  # its model TFLOP/s count the full step's 6N per token: compare times, not MFU
        out["lora_0.5b"] = {
            "jax_tokens_per_s": lora["tokens_per_s"],
            "speedup_over_full": full["step_s"] / lora["step_s"],
            "peak_memory_gib": lora["peak_memory_gib"],
            "full_peak_memory_gib": full["peak_memory_gib"],
            "first_step_s": lora["first_step_s"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on the CPU (the same stages)")
    ap.add_argument("--out", type=Path, help="append one JSON line per stage here as each finishes")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all stages (default 450, small 1500)")
    ap.add_argument("--stages", help="comma-separated stage names to run (default: all)")
    ap.add_argument("--child", nargs=2, metavar=("MODULE", "STAGE"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child, args.small, args.result)

    stages = all_stages(args.small)
    if args.stages:
        wanted = args.stages.split(",")
        unknown = sorted(set(wanted) - {s.name for s in stages})
        if unknown:
            ap.error(f"unknown stage(s) {', '.join(unknown)}; stages: {', '.join(s.name for s in stages)}")
        stages = [s for s in stages if s.name in wanted]
    budget = args.budget if args.budget is not None else (1500 if args.small else 450)
    t0 = time.time()
    records = run_stages(stages, args.out, args.small, budget)
    report = {
        "benchmark": "accelerator",
        "small": args.small,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "seconds": round(time.time() - t0, 1),
        "summary": summary(records),
        "stages": records,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
