"""Tokens/s of the jitted GRPO step against eager PyTorch, and its FLOP/s against the measured matmul peak.

One run starts three worker processes, so that each side's peak memory is its own:

- `jax`: `GRPOTrainer.step` (forward, chunked token logprobs, GRPO loss, backward, global-norm clip, AdamW);
  the process set up as `intellect train` sets itself up (`jax_trainer.host`: the XLA:CPU flags, and glibc
  told to keep freed memory, so that XLA's per-step buffers do not page-fault afresh every step);
- `torch`: the same step in eager PyTorch: the transformers model of the config (`AutoModelForCausalLM`) on
  the same weights, the same loss written in torch, `clip_grad_norm_`, `torch.optim.AdamW`;
- `peak`: a large float32 matmul through jax, the machine's practical FLOP/s ceiling.

The parent runs them in rounds, one after the other and in alternating order, so that load from other
processes on the machine hits all of them alike; figures are medians over rounds with min and max beside.
Both steps take pi_old from the batch's inference logprobs (`logprob_source = "inference"`), so each step is
exactly one forward, one backward and one optimizer update; the first step's loss and gradient norm of the two
sides are printed next to each other to show they compute the same thing.

Model FLOPs per token (matmuls only, a multiply-add = 2 FLOPs, backward = 2 x forward):

    6 * N + 6 * layers * heads * head_dim * (seq + 1)

N = the parameters that multiply activations (q, k, v, o, gate, up, down of every layer and the LM head; not
the embedding lookup, norms or biases); the second term is QK^T and PV of causal attention, where a query
attends (seq + 1) / 2 keys on average. `flops_per_token_full_attention` uses seq instead of (seq + 1) / 2 (the
PaLM convention) for comparison.

    python benchmarks/train_step.py [--model DIR | --shape NAME] [--layers N] [--seq 256] [--batch 8]
        [--rounds 5] [--steps 3] [--no-xla-flags] [--no-retain-memory] [--scan-layers auto|true|false]
        [--other-form]

The model: by default a Qwen2-shaped stand-in made of `--hidden`, `--heads`, ... (random weights, exported by
our bridge); `--model DIR` a Hugging Face directory (its own config: family, tied embeddings, RoPE theta, norm
eps; its weights when it has safetensors, else random weights of its config); `--shape NAME` the config in
`configs/shapes/NAME` (e.g. `smollm2-135m`, SmolLM2-135M-Instruct's) with random weights. `--layers` cuts
either to that depth, with random weights. Each side's peak resident memory (`peak_rss_mb`, its own process)
is reported beside its speed, and the JAX step's memory plan (`jax_plan_gib`: XLA's buffers per device)
beside that.

`--lora RANK` adds two more sides in the same rounds: the JAX step training LoRA adapters of that rank on every
projection (alpha = 2 x rank) on the frozen model, and eager torch with PEFT's adapters (the same adapter
file, so that their first losses and gradient norms agree): `lora` in the JSON, with each side's speed-up over
its full fine-tuning round by round, its peak memory and the trained parameters.

`--scan-layers` is the learner's `[model] scan_layers` (auto: unrolled on CPU); `--other-form` adds a second JAX
worker with the layers in the other form, timed in the same rounds (`other_form` in the JSON).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "configs" / "shapes"
LR, WEIGHT_DECAY, BETAS, EPS, GRAD_CLIP = 1e-5, 0.01, (0.9, 0.99), 1e-8, 0.1
PROMPT_LEN = 64


def hf_config(args) -> dict:
    """The benchmarked model's Hugging Face config: `--model`'s or `--shape`'s (cut to `--layers`), else the
    Qwen2 stand-in of the size arguments."""
    source = _config_source(args)
    if source is not None:
        config = json.loads((source / "config.json").read_text())
        if args.layers is not None:
            config["num_hidden_layers"] = args.layers
        return config
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers if args.layers is not None else 4,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": max(args.seq, 2048),
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    }


def _config_source(args) -> Path | None:
    """The directory whose config.json defines the model (`--model` or `--shape`), or None (the stand-in)."""
    if getattr(args, "model", None):
        return Path(args.model)
    if getattr(args, "shape", None):
        return SHAPES / args.shape
    return None


def _has_weights(directory: Path | None) -> bool:
    return directory is not None and any(directory.glob("*.safetensors"))


def make_batch(args) -> dict[str, np.ndarray]:
    """[1 micro-batch, batch rows, seq]: one sample per row (64 prompt tokens, the rest completion)."""
    from jax_trainer.packing import Sample, pack

    vocab = int(hf_config(args)["vocab_size"])
    rng = np.random.default_rng(0)
    samples = []
    for i in range(args.batch):
        tokens = rng.integers(0, vocab, args.seq).astype(np.int32)
        logprobs = np.zeros(args.seq, np.float32)
        logprobs[PROMPT_LEN:] = -np.log(vocab) + rng.normal(0, 0.1, args.seq - PROMPT_LEN)
        samples.append(Sample(tokens, PROMPT_LEN, logprobs, float(rng.normal()), 0, name=f"row{i}"))
    return pack(samples, rows=args.batch, seq_len=args.seq).arrays()


def model_shape(args) -> dict:
    """The benchmarked model's dimensions (from its config, via `ModelConfig`)."""
    from jax_trainer.models import ModelConfig

    config = hf_config(args)
    cfg = ModelConfig.from_hf(config)
    return {
        "family": config.get("model_type"),
        "hidden": cfg.hidden_size,
        "intermediate": cfg.intermediate_size,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab": cfg.vocab_size,
        "tied_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope.theta,
        "rms_norm_eps": cfg.rms_norm_eps,
    }


def flops_per_token(shape: dict, seq: int, causal: bool = True) -> float:
    h, n, kv, m, layers = shape["hidden"], shape["heads"], shape["kv_heads"], shape["intermediate"], shape["layers"]
    d = shape["head_dim"]
    n_matmul = layers * (h * n * d + 2 * h * kv * d + n * d * h + 3 * h * m) + h * shape["vocab"]
    context = (seq + 1) / 2 if causal else seq
    return 6 * n_matmul + 12 * layers * n * d * context


# ---- workers: read "run K" lines, answer one JSON line each --------------------------------------------------
def _serve(setup, step) -> None:
    ready = setup()
    print(json.dumps({"ready": True, **ready}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            break
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(int(cmd[1])):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(json.dumps({"times": times, "page_faults_per_step": faults / len(times)}), flush=True)
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def lora_spec(args):
    from jax_trainer.models.lora import LoraSpec

    return LoraSpec(args.lora, 2.0 * args.lora, LORA_TARGETS)


def adapter_dir(args) -> Path:
    return Path(args.model_dir).parent / "adapter"


def worker_jax(args, lora: bool = False) -> None:
    from jax_trainer import host, xla_flags

    if args.xla_flags:
        xla_flags.apply("cpu")
    retained = host.retain_freed_memory() if args.retain_memory else False
    import jax

    from jax_trainer.config import LossConfig, OptimConfig
    from jax_trainer.models import load_hf
    from jax_trainer.sharding import make_mesh
    from jax_trainer.train_step import GRPOTrainer, trainable

    compile_s = []
    events = {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: compile_s.append(secs) if event in events else None
    )
    box = {}

    def setup():
        mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
        scan = {"auto": "auto", "true": True, "false": False}[args.scan_layers]
        spec = lora_spec(args) if lora else None
        model = load_hf(args.model_dir, mesh=mesh, verify=False, scan_layers=scan, lora=spec)
        optim = OptimConfig(
            lr=LR, weight_decay=WEIGHT_DECAY, b1=BETAS[0], b2=BETAS[1], eps=EPS, grad_clip=GRAD_CLIP, warmup_steps=0
        )
        trainer = GRPOTrainer(model, mesh, LossConfig(logprob_source="inference", temperature=1.0), optim)
        params = trainable(model)
        box["trainer"], box["state"] = trainer, trainer.init_state(params)
        box["batch"] = trainer.device_batch(_packed(make_batch(args)))
        compile_s.clear()
        t0 = time.perf_counter()
        box["state"], metrics = trainer.step(box["state"], box["batch"])
        jax.block_until_ready(box["state"])
        first = time.perf_counter() - t0
        return {
            "compile_s": sum(compile_s),
            "first_step_s": first,
            "loss": float(metrics["loss"]),
            "grad_norm": float(metrics["grad_norm"]),
            "xla_flags": __import__("os").environ.get("XLA_FLAGS", ""),
            "retain_freed_memory": retained,
            "scanned": bool(model.scan_layers),
            "trained_params": sum(x.size for x in jax.tree.leaves(params)),
            "plan_gib": {
                "params": round(trainer.plan.params / 2**30, 3),
                "opt_state": round(trainer.plan.opt_state / 2**30, 3),
                "temporaries": round(trainer.plan.temporaries / 2**30, 3),
                "peak": round(trainer.plan.peak / 2**30, 3),
            },
        }

    def step():
        box["state"], metrics = box["trainer"].step(box["state"], box["batch"])
        jax.block_until_ready((box["state"], metrics))

    _serve(setup, step)


def _packed(arrays):
    from jax_trainer.packing import PackedBatch

    return PackedBatch(**arrays, versions=[0] * arrays["tokens"].shape[1], num_samples=arrays["tokens"].shape[1])


def worker_torch(args, lora: bool = False) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    box = {}

    def loss_and_metrics(model, b):
        """The GRPO loss of `jax_trainer.loss` (token_mean, eps 0.2/0.2, delta 4, temperature 1) with pi_old =
        inference."""
        tokens = b["tokens"]
        logits = model(tokens).logits[:, :-1]
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, tokens[:, 1:, None])[..., 0]
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        mask, adv, old = b["loss_mask"][:, 1:], b["advantages"][:, 1:], b["inference_logprobs"][:, 1:]
        ratio = torch.exp(lp - old)
        surr1 = adv * torch.where(adv < 0, torch.clamp(ratio, max=4.0), ratio)
        surr2 = adv * torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
        loss = (-torch.minimum(surr1, surr2) * mask).sum() / mask.sum().clamp(min=1)
        return loss, (entropy * mask).sum() / mask.sum()

    def run_step():
        model, opt, b = box["model"], box["opt"], box["batch"]
        loss, _ = loss_and_metrics(model, b)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], GRAD_CLIP)
        if torch.isfinite(loss) and torch.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss), float(norm)

    def setup():
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        if lora:  # PEFT's adapters, loaded from the JAX side's fresh adapter: the same A, B = 0
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_dir(args), is_trainable=True)
        model.train()
        box["model"] = model
        trained = [p for p in model.parameters() if p.requires_grad]
        box["trained_params"] = sum(p.numel() for p in trained)
        box["opt"] = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        box["batch"] = {k: torch.from_numpy(v[0]) for k, v in make_batch(args).items()}
        box["batch"]["tokens"] = box["batch"]["tokens"].long()
        t0 = time.perf_counter()
        loss, norm = run_step()
        return {
            "first_step_s": time.perf_counter() - t0,
            "loss": loss,
            "grad_norm": norm,
            "attn_implementation": model.config._attn_implementation,
            "threads": torch.get_num_threads(),
            "trained_params": box["trained_params"],
        }

    _serve(setup, run_step)


def worker_peak(args) -> None:
    import jax
    import jax.numpy as jnp

    n = args.peak_n
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    box = {}

    def setup():
        key_a, key_b = jax.random.split(jax.random.key(0))
        box["a"] = jax.random.normal(key_a, (n, n), jnp.float32)
        box["b"] = jax.random.normal(key_b, (n, n), jnp.float32)
        matmul(box["a"], box["b"]).block_until_ready()
        return {"n": n, "flops": 2 * n**3}

    _serve(setup, lambda: matmul(box["a"], box["b"]).block_until_ready())


def prepare(args) -> None:
    """Random float32 weights of the config, written as an HF directory by our bridge (both sides load these)."""
    import jax

    from jax_trainer.models import ModelConfig, export_hf, init_random
    from jax_trainer.sharding import make_mesh

    config = hf_config(args)
    if not _has_weights(Path(args.model_dir)):
        model = init_random(ModelConfig.from_hf(config), mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]), seed=0)
        export_hf(model, args.model_dir, version=0, hf_config=config, dtype="float32", fsync=False)
    if args.lora:  # the JAX side's fresh adapter (the same draws as its worker's), for PEFT to load
        from bridge.weights import model_digest
        from jax_trainer.models import load_hf
        from jax_trainer.models.hf import export_adapter

        model = load_hf(args.model_dir, mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]), lora=lora_spec(args))
        export_adapter(model, adapter_dir(args), version=0, base_digest=model_digest(args.model_dir))


# ---- parent ------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, kind: str, args, argv: list[str]):
        self.kind = kind
        self.faults: list[float] = []
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", kind, "--model-dir", args.model_dir, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.kind} worker exited with status {self.proc.wait()} (see its stderr above)")
        return json.loads(line)

    def run(self, k: int) -> list[float]:
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        answer = self._read()
        self.faults.append(answer["page_faults_per_step"])
        return answer["times"]

    def close(self) -> dict:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        out = self._read()
        self.proc.wait(timeout=60)
        return out


def _other_form(ready: dict) -> str:
    return "false" if ready["scanned"] else "true"


def _other_form_figures(tok_s: dict, ready: dict, rss: dict) -> dict:
    """`--other-form`: the JAX step with its layers in the other form (scanned <-> unrolled), timed in the
    same rounds: its tokens/s, its ratio to torch, and the default form's speed over it, round by round."""
    return {
        "layers_scanned": ready["jax_other"]["scanned"],
        "tokens_per_s": _stats(tok_s["jax_other"]),
        "ratio": round(statistics.median(o / t for o, t in zip(tok_s["jax_other"], tok_s["torch"])), 3),
        "default_over_other": round(statistics.median(d / o for d, o in zip(tok_s["jax"], tok_s["jax_other"])), 3),
        "compile_s": round(ready["jax_other"]["compile_s"], 2),
        "first_step_loss": ready["jax_other"]["loss"],
        "first_step_grad_norm": ready["jax_other"]["grad_norm"],
        "peak_rss_mb": round(rss["jax_other"]),
    }


def _lora_figures(args, tok_s: dict, ready: dict, rss: dict) -> dict:
    """`--lora`: each side's LoRA step beside its full fine-tuning step, timed in the same rounds."""
    out = {"rank": args.lora, "alpha": 2.0 * args.lora, "targets": list(LORA_TARGETS)}
    for side in ("jax", "torch"):
        lora, full = tok_s[f"{side}_lora"], tok_s[side]
        out[side] = {
            "tokens_per_s": _stats(lora),
            "speedup_over_full": round(statistics.median(a / b for a, b in zip(lora, full)), 3),
            "speedup_per_round": [round(a / b, 3) for a, b in zip(lora, full)],
            "peak_rss_mb": round(rss[f"{side}_lora"]),
            "full_peak_rss_mb": round(rss[side]),
            "trained_params": ready[f"{side}_lora"]["trained_params"],
            "first_step_loss": ready[f"{side}_lora"]["loss"],
            "first_step_grad_norm": ready[f"{side}_lora"]["grad_norm"],
        }
    out["jax"]["plan_gib"] = ready["jax_lora"]["plan_gib"]
    out["jax_over_torch"] = round(statistics.median(a / b for a, b in zip(tok_s["jax_lora"], tok_s["torch_lora"])), 3)
    out["first_step_agree"] = all(
        abs(ready["jax_lora"][k] - ready["torch_lora"][k]) <= 1e-3 * abs(ready["torch_lora"][k]) + 1e-6
        for k in ("loss", "grad_norm")
    )
    return out


def _stats(values: list[float], digits: int = 1) -> dict:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408, help="SwiGLU width (8/3 x hidden, rounded up)")
    ap.add_argument("--model", help="a Hugging Face model directory: its config, and its weights if it has safetensors")
    ap.add_argument(
        "--shape",
        choices=sorted(d.name for d in SHAPES.iterdir() if (d / "config.json").is_file()),
        help="a config of configs/shapes, with random weights",
    )
    ap.add_argument("--layers", type=int, default=None, help="depth (default: the config's; the stand-in's 4)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="rounds of jax, torch and peak, order alternating")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per side per round (after one warm step)")
    ap.add_argument("--peak-n", type=int, default=2048, help="the peak matmul is [n, n] @ [n, n] float32")
    ap.add_argument("--peak-reps", type=int, default=10, help="peak matmuls per round")
    ap.add_argument(
        "--no-xla-flags",
        dest="xla_flags",
        action="store_false",
        help="do not apply jax_trainer.xla_flags (to measure what they bring)",
    )
    ap.add_argument(
        "--no-retain-memory",
        dest="retain_memory",
        action="store_false",
        help="leave glibc's malloc as it is (jax_trainer.host.retain_freed_memory is what "
        "`intellect train` does by default, trainer.retain_host_memory)",
    )
    ap.add_argument(
        "--scan-layers",
        choices=("auto", "true", "false"),
        default="auto",
        help="the JAX side's `[model] scan_layers` (auto: the learner's default, unrolled on CPU): A/B the forms",
    )
    ap.add_argument("--no-scan-layers", dest="scan_layers", action="store_const", const="false", help="= false")
    ap.add_argument(
        "--other-form",
        action="store_true",
        help="also time the JAX step with its layers in the other form (scanned <-> unrolled) in the same rounds",
    )
    ap.add_argument("--lora", type=int, default=0, help="also time LoRA of this rank (JAX, and torch with PEFT)")
    ap.add_argument(
        "--worker", choices=("jax", "torch", "peak", "prepare", "jax_lora", "torch_lora"), help=argparse.SUPPRESS
    )
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        workers = {"jax": worker_jax, "torch": worker_torch, "peak": worker_peak, "prepare": prepare}
        if args.worker.endswith("_lora"):
            workers[args.worker.removesuffix("_lora")](args, lora=True)
        else:
            workers[args.worker](args)
        return

    if args.model and args.shape:
        ap.error("--model and --shape are alternatives")
    if args.model and not (Path(args.model) / "config.json").is_file():
        ap.error(f"--model {args.model}: no config.json there")
    argv = [a for a in sys.argv[1:]]
    shape = model_shape(args)
    with tempfile.TemporaryDirectory(prefix="train-step-bench-") as tmp:
        source = _config_source(args)
        if _has_weights(source) and args.layers is None and not args.lora:
            args.model_dir = str(source)  # the checkpoint itself, as both frameworks load it
        else:
            args.model_dir = str(Path(tmp) / "model")
            if _has_weights(source) and args.layers is None:  # the checkpoint, beside the adapter prepared below
                Path(args.model_dir).symlink_to(source.absolute(), target_is_directory=True)
            subprocess.run(
                [sys.executable, __file__, "--worker", "prepare", "--model-dir", args.model_dir, *argv], check=True
            )
        kinds = ("jax", "torch", "peak") + (("jax_lora", "torch_lora") if args.lora else ())
        workers = {k: Worker(k, args, argv) for k in kinds}
        if args.other_form:  # the JAX step with the layers in the other form, in the same rounds
            workers["jax_other"] = Worker("jax", args, argv + ["--scan-layers", _other_form(workers["jax"].ready)])
        times = {k: [] for k in workers}
        for r in range(args.rounds):
            order = tuple(workers) if r % 2 == 0 else tuple(reversed(workers))
            for k in order:
                n = args.peak_reps if k == "peak" else args.steps
                workers[k].run(1)  # the first call after the other sides ran: let caches warm again
                times[k].append(workers[k].run(n))
        ready = {k: w.ready for k, w in workers.items()}
        rss = {k: w.close()["peak_rss_mb"] for k, w in workers.items()}
        faults = {k: round(statistics.median(w.faults)) for k, w in workers.items() if k != "peak"}

    tokens = args.batch * args.seq
    tok_s = {k: [tokens / statistics.median(ts) for ts in times[k]] for k in times if k != "peak"}
    other = _other_form_figures(tok_s, ready, rss) if args.other_form else None
    lora = _lora_figures(args, tok_s, ready, rss) if args.lora else None
    peak = [ready["peak"]["flops"] / statistics.median(ts) / 1e9 for ts in times["peak"]]
    fpt = flops_per_token(shape, args.seq)
    jax_gflops = [t * fpt / 1e9 for t in tok_s["jax"]]
    torch_gflops = [t * fpt / 1e9 for t in tok_s["torch"]]
    ratio = [j / t for j, t in zip(tok_s["jax"], tok_s["torch"])]
    util = [g / p for g, p in zip(jax_gflops, peak)]
    print(
        json.dumps(
            {
                "benchmark": "train_step",
                "model": {
                    **shape,
                    "source": args.model or args.shape or "qwen2 stand-in",
                    "weights": "checkpoint" if _has_weights(_config_source(args)) else "random",
                },
                "seq": args.seq,
                "batch": args.batch,
                "dtype": "float32",
                "scan_layers": args.scan_layers,
                "jax_layers_scanned": ready["jax"]["scanned"],
                **({"other_form": other} if other else {}),
                **({"lora": lora} if lora else {}),
                "tokens_per_step": tokens,
                "rounds": args.rounds,
                "steps_per_round": args.steps,
                "jax_tokens_per_s": _stats(tok_s["jax"]),
                "torch_tokens_per_s": _stats(tok_s["torch"]),
                "ratio": round(statistics.median(ratio), 3),
                "ratio_per_round": [round(x, 3) for x in ratio],
                "flops_per_token": fpt,
                "flops_per_token_full_attention": flops_per_token(shape, args.seq, causal=False),
                "jax_gflops": _stats(jax_gflops),
                "torch_gflops": _stats(torch_gflops),
                "peak_matmul_gflops": _stats(peak),
                "utilisation": round(statistics.median(util), 3),
                "utilisation_per_round": [round(x, 3) for x in util],
                "torch_utilisation": round(statistics.median(torch_gflops) / statistics.median(peak), 3),
                "jax_compile_s": round(ready["jax"]["compile_s"], 2),
                "jax_first_step_s": round(ready["jax"]["first_step_s"], 2),
                "torch_first_step_s": round(ready["torch"]["first_step_s"], 2),
                "peak_rss_mb": {k: round(rss[k]) for k in ("jax", "torch", "peak")},
                "jax_over_torch_peak_rss": round(rss["jax"] / rss["torch"], 3),
                "jax_plan_gib": ready["jax"]["plan_gib"],
                "page_faults_per_step": faults,
                "jax_retains_freed_memory": ready["jax"]["retain_freed_memory"],
                "first_step": {
                    "jax_loss": ready["jax"]["loss"],
                    "torch_loss": ready["torch"]["loss"],
                    "jax_grad_norm": ready["jax"]["grad_norm"],
                    "torch_grad_norm": ready["torch"]["grad_norm"],
                    # the same loss on the same weights and batch: a difference is a bug, not noise
                    "agree": all(
                        abs(ready["jax"][k] - ready["torch"][k]) <= 1e-3 * abs(ready["torch"][k]) + 1e-6
                        for k in ("loss", "grad_norm")
                    ),
                },
                "xla_flags": ready["jax"]["xla_flags"],
                "torch_threads": ready["torch"]["threads"],
                "torch_attn_implementation": ready["torch"]["attn_implementation"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
