"""`intellect parity HF_DIR`: do the JAX model, Hugging Face transformers and vLLM agree on a checkpoint?

Each engine scores the same token sequences; the report gives, per pair of engines, the largest absolute
difference of the logits (jax vs hf) or of the sampled-token logprobs (any pair involving vllm, which
exposes logprobs only), and exits 1 when a pair is above its tolerance.

Tolerances. float32: logits 1e-4, logprobs 1e-3 (vLLM's CPU kernels sum in another order).
bfloat16 has no fixed answer, since its rounding error grows with the logits' scale and the depth, so the
command measures it: it also runs transformers in float32 and takes the bf16 noise floor
`floor = max |hf_bf16 - hf_fp32|`; two bf16 engines agree when they differ by at most
`2 * floor + 1e-3` (each carries its own rounding error of about `floor`, in independent directions).

With `--export DIR` the JAX model is also written as a Hugging Face directory and the torch engines score
that export instead of the original: the full HF -> JAX -> HF round trip in one command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ENGINES = ("jax", "hf", "vllm")
FP32_TOL = {"logits": 1e-4, "logprobs": 1e-3}


@dataclass
class PairResult:
    pair: str
    metric: str
    max_abs_diff: float
    tolerance: float
    ok: bool


@dataclass
class ParityReport:
    model_dir: str
    dtype: str
    sequences: int
    tokens: int
    pairs: list[PairResult]
    bf16_floor: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.pairs)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ok": self.ok}, indent=2)


def parity_sequences(vocab_size: int, n: int = 4, seq_len: int = 48, seed: int = 0) -> list[list[int]]:
    """`n` seeded random token sequences of different lengths (the longest is `seq_len`)."""
    rng = np.random.default_rng(seed)
    lengths = [max(2, seq_len - i * (seq_len // (2 * max(n, 1)))) for i in range(n)]
    return [rng.integers(0, vocab_size, size=length).tolist() for length in lengths]


def jax_logits(model, sequences: list[list[int]]) -> list[np.ndarray]:
    """Logits of each sequence from one batched forward (right padding cannot change earlier positions).

    The forward is one jitted program. Run op by op on a mesh of several CPU devices, its hundreds of small
    sharded programs, each with its own collectives, deadlocked XLA:CPU at the real model's shapes
    (docs/learner.md, "Multi-device CPU meshes")."""
    from flax import nnx

    longest = max(len(s) for s in sequences)
    batch = np.zeros((len(sequences), longest), np.int32)
    for i, s in enumerate(sequences):
        batch[i, : len(s)] = s
    logits = np.asarray(nnx.jit(lambda m, tokens: m(tokens))(model, batch), dtype=np.float32)
    return [logits[i, : len(s)] for i, s in enumerate(sequences)]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(max(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))) for x, y in zip(a, b)))


def check_parity(
    model_dir: str | Path,
    engines: tuple[str, ...] = ENGINES,
    dtype: str = "float32",
    n_sequences: int = 4,
    seq_len: int = 48,
    seed: int = 0,
    export_dir: str | Path | None = None,
    tol_logits: float | None = None,
    tol_logprobs: float | None = None,
) -> ParityReport:
    from gpu_workers.scoring import hf_forward, token_logprobs_from_logits
    from jax_trainer.models import ModelConfig, export_hf, load_hf

    cfg = ModelConfig.from_dir(model_dir)
    seqs = parity_sequences(cfg.vocab_size, n_sequences, seq_len, seed)
    torch_dir = Path(model_dir)
    logits: dict[str, list[np.ndarray]] = {}
    logprobs: dict[str, list[np.ndarray]] = {}
    if "jax" in engines or export_dir is not None:
        model = load_hf(model_dir, param_dtype=dtype, compute_dtype=dtype)
        if "jax" in engines:
            logits["jax"] = jax_logits(model, seqs)
        if export_dir is not None:
            export_hf(model, export_dir, version=0, source_dir=model_dir, dtype=dtype)
            torch_dir = Path(export_dir)
        del model
    if "hf" in engines:
        logits["hf"] = [o.logits for o in hf_forward(torch_dir, seqs, dtype=dtype)]
    for name, values in logits.items():
        logprobs[name] = [token_logprobs_from_logits(x, np.asarray(s)) for x, s in zip(values, seqs)]
    if "vllm" in engines:
        from gpu_workers.scoring import vllm_prompt_logprobs

        logprobs["vllm"] = vllm_prompt_logprobs(torch_dir, seqs, dtype=dtype, max_model_len=max(map(len, seqs)) + 8)

    floor = None
    if dtype == "float32":
        tl = tol_logits if tol_logits is not None else FP32_TOL["logits"]
        tp = tol_logprobs if tol_logprobs is not None else FP32_TOL["logprobs"]
    else:
        ref = [o.logits for o in hf_forward(torch_dir, seqs, dtype="float32")]
        low = logits.get("hf") or [o.logits for o in hf_forward(torch_dir, seqs, dtype=dtype)]
        ref_lp = [token_logprobs_from_logits(x, np.asarray(s)) for x, s in zip(ref, seqs)]
        low_lp = [token_logprobs_from_logits(x, np.asarray(s)) for x, s in zip(low, seqs)]
        floor = {"logits": _max_diff(low, ref), "logprobs": _max_diff(low_lp, ref_lp)}
        tl = tol_logits if tol_logits is not None else 2 * floor["logits"] + 1e-3
        tp = tol_logprobs if tol_logprobs is not None else 2 * floor["logprobs"] + 1e-3

    pairs: list[PairResult] = []
    if "jax" in logits and "hf" in logits:
        d = _max_diff(logits["jax"], logits["hf"])
        pairs.append(PairResult("jax-hf", "logits", d, tl, d <= tl))
    for a, b in (("jax", "vllm"), ("hf", "vllm")):
        if a in logprobs and b in logprobs:
            d = _max_diff(logprobs[a], logprobs[b])
            pairs.append(PairResult(f"{a}-{b}", "logprobs", d, tp, d <= tp))
    return ParityReport(str(model_dir), dtype, len(seqs), sum(map(len, seqs)), pairs, floor)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of jax,hf,vllm")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--sequences", type=int, default=4, help="number of token sequences scored")
    p.add_argument("--seq-len", type=int, default=48, help="length of the longest sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--export",
        dest="export_dir",
        default=None,
        help="also export the JAX model here and score the export with hf/vllm",
    )
    p.add_argument("--tol-logits", type=float, default=None, help="override the logits tolerance")
    p.add_argument("--tol-logprobs", type=float, default=None, help="override the logprobs tolerance")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or len(engines) < 2:
        print(f"parity: --engines needs two or more of {', '.join(ENGINES)}; got {args.engines!r}", file=sys.stderr)
        return 2
    with _stdout_to_stderr():  # engines log to stdout; keep it for the report (`--json` must parse)
        report = check_parity(
            args.model_dir,
            engines,
            args.dtype,
            args.sequences,
            args.seq_len,
            args.seed,
            args.export_dir,
            args.tol_logits,
            args.tol_logprobs,
        )
    if args.json:
        print(report.to_json())
    else:
        _print_table(report)
    return 0 if report.ok else 1


@contextlib.contextmanager
def _stdout_to_stderr():
    """Point file descriptor 1 at stderr (logging handlers keep the original stream object, so swapping
    `sys.stdout` alone would not catch them)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _print_table(report: ParityReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"parity {report.model_dir} ({report.dtype}, {report.sequences} sequences, {report.tokens} tokens)"
    )
    for col in ("pair", "compared", "max |diff|", "tolerance", "result"):
        table.add_column(col)
    for p in report.pairs:
        table.add_row(
            p.pair,
            p.metric,
            f"{p.max_abs_diff:.3g}",
            f"{p.tolerance:.3g}",
            "[green]ok[/green]" if p.ok else "[red]FAIL[/red]",
        )
    console = Console()
    console.print(table)
    if report.bf16_floor:
        console.print(
            f"bf16 noise floor (hf bf16 vs hf fp32): logits {report.bf16_floor['logits']:.3g}, "
            f"logprobs {report.bf16_floor['logprobs']:.3g}"
        )
