"""TOPLOC speed: proof build and verify per chunk beside the reference `toploc` 0.1.6, and what capture costs vLLM.

Codec: random bf16 hidden states of one sample ([rows, hidden], standard normal; like real final-norm
outputs, most chunks tie at the k-th |value|). Build is timed on the states, verify on states scaled by 1.01
against those proofs; each figure is the median over `--repeat` runs of the whole sample divided by its
chunks, with torch limited to 1 and then 2 threads. The reference is timed on the same data in the same run
and its outputs are checked equal to ours; the four timings run interleaved, round after round, and each
speedup is the median of the per-round ratios (robust to a machine shared with other work). The reference
must not live in the project's venv: it is imported from `--reference-path`, and installed there first if
missing (`pip install --no-build-isolation --no-deps --no-binary toploc --target DIR toploc==0.1.6`, which
compiles its C++ extension against the installed torch).

vLLM: an in-process vllm engine (bf16, eager) generates `--requests` completions of `--max-tokens` tokens
with fixed seeds, plain (`LLM.generate`, no hook) and through `ProofCapture.generate` (hook, per-request
assembly, proof building), in `--gen-repeat` rounds of both, in alternating order; tokens/s are medians.
On a shared machine two wall-clock runs differ by more than the few percent at stake, so the capture's own
work is also timed directly: the seconds spent in the hook plus everything `ProofCapture.generate` does
around `LLM.generate`, as a share of a plain generation (`capture_cost_pct`), with proof building on top
(`capture_and_proofs_cost_pct`; a GPU worker can overlap it with the next batch).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DEFAULT_REFERENCE = Path.home() / ".cache" / "intellect" / "toploc-0.1.6"


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _reference(path: Path, install: bool):
    """The reference `toploc` module imported from `path` (installed there first if allowed), or why not."""
    if install and not (path / "toploc").is_dir():
        print(f"installing toploc 0.1.6 into {path} ...", file=sys.stderr)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--no-build-isolation",
                "--no-deps",
                "--no-binary",
                "toploc",
                "--target",
                str(path),
                "toploc==0.1.6",
            ],
            stdout=sys.stderr,
            stderr=sys.stderr,
        )
        if done.returncode != 0:
            return None, f"pip install failed with status {done.returncode}"
    sys.path.insert(0, str(path))
    try:
        import toploc
    except ImportError as err:
        return None, f"{type(err).__name__}: {err}"
    return toploc, None


def codec(args) -> dict:
    import torch

    from gpu_workers.toploc import Thresholds, build_proofs, verify_proofs

    rng = np.random.default_rng(0)
    states = torch.from_numpy(rng.standard_normal((args.rows, args.hidden), dtype=np.float32)).to(torch.bfloat16)
    perturbed = (states.float() * 1.01).to(torch.bfloat16)
    bits = states.view(torch.int16).numpy().view(np.uint16)
    bits_perturbed = perturbed.view(torch.int16).numpy().view(np.uint16)
    n_chunks = -(-args.rows // args.chunk)
    build_proofs(bits[:1], args.chunk, args.topk)  # the first call builds the inverse table
    proofs = build_proofs(bits, args.chunk, args.topk)
    checks = verify_proofs(bits_perturbed, proofs, args.chunk, args.topk)
    result = {
        "hidden": args.hidden,
        "rows": args.rows,
        "chunk": args.chunk,
        "topk": args.topk,
        "chunks": n_chunks,
        "accepts_perturbed": Thresholds().accepts(checks),
    }
    toploc, why = _reference(Path(args.reference_path), not args.no_install)
    if toploc is None:
        result["reference"] = f"not measured ({why})"
    else:
        ref_proofs = toploc.build_proofs_bytes(states, args.chunk, args.topk, skip_prefill=True)
        ref_checks = toploc.verify_proofs_bytes(perturbed, ref_proofs, args.chunk, args.topk, skip_prefill=True)
        result["reference"] = {
            "version": toploc.__version__,
            "same_proof_bytes": ref_proofs == proofs,
            "same_checks": [(c.exp_mismatches, c.mant_err_mean, c.mant_err_median) for c in ref_checks]
            == [(c.exp_mismatches, c.mant_err_mean, c.mant_err_median) for c in checks],
        }
    per_chunk = 1e3 / n_chunks
    cases = {
        "ours_build": lambda: build_proofs(bits, args.chunk, args.topk),
        "ours_verify": lambda: verify_proofs(bits_perturbed, proofs, args.chunk, args.topk),
    }
    if toploc is not None:
        cases["reference_build"] = lambda: toploc.build_proofs_bytes(states, args.chunk, args.topk, skip_prefill=True)
        cases["reference_verify"] = lambda: toploc.verify_proofs_bytes(
            perturbed, ref_proofs, args.chunk, args.topk, skip_prefill=True
        )
    for threads in (1, 2):
        torch.set_num_threads(threads)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeat):  # interleaved rounds, so that a busy moment hits every figure alike
            for name, fn in cases.items():
                times[name].append(_seconds(fn))
        row = {f"{name}_ms_per_chunk": per_chunk * statistics.median(t) for name, t in times.items()}
        if toploc is not None:
            for step in ("build", "verify"):
                ratios = [r / o for r, o in zip(times[f"reference_{step}"], times[f"ours_{step}"])]
                row[f"{step}_speedup_median_of_rounds"] = statistics.median(ratios)
        result[f"threads_{threads}"] = row
    return result


class _Timed:
    """Wraps a callable and adds the seconds spent in it to `seconds`."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


@contextlib.contextmanager
def _stdout_to_stderr():
    """Point file descriptor 1 at stderr while vLLM runs (it logs to stdout; the JSON must stay parseable)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def generation(args) -> dict:
    """Tokens/s with and without capture, and the capture's own work measured directly (hook calls, and
    everything `ProofCapture.generate` does around `LLM.generate`), which a busy machine does not blur."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from gpu_workers import capture as capture_module
    from gpu_workers.toploc import build_proofs_batch
    from intellect.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(
            Path(tmp) / "model",
            hidden=args.gen_hidden,
            layers=args.gen_layers,
            heads=args.gen_hidden // 64,
            kv_heads=args.gen_hidden // 128,
        )
        llm = LLM(
            model=str(model_dir),
            dtype="bfloat16",
            enforce_eager=True,
            seed=0,
            enable_chunked_prefill=False,
            max_model_len=64 + args.max_tokens,
            logprobs_mode="processed_logprobs",
        )
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, 500, int(rng.integers(8, 64))).tolist() for _ in range(args.requests)]
        params = [
            SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=i, logprobs=0)
            for i in range(args.requests)
        ]
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(token_prompts[:4], params[:4], use_tqdm=False)  # warm-up
        hook = _Timed(capture_module._Recorder.__call__)
        capture_module._Recorder.__call__ = lambda self, *a: hook(self, *a)
        rounds = []
        for round_ in range(args.gen_repeat):  # the order alternates, so that drift hits both alike
            row = {}
            for mode in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                if mode == "off":
                    start = time.perf_counter()
                    plain = llm.generate(token_prompts, params, use_tqdm=False)
                    row["off"] = time.perf_counter() - start
                    continue
                with capture_module.ProofCapture(llm) as capture:
                    inner, hook.seconds = _Timed(llm.generate), 0.0
                    llm.generate = inner
                    start = time.perf_counter()
                    completions = capture.generate(prompts, params)
                    row["on"] = time.perf_counter() - start
                    del llm.generate
                start = time.perf_counter()
                build_proofs_batch([c.hidden.to(torch.bfloat16) for c in completions])
                row["proofs"] = time.perf_counter() - start
                row["capture"] = hook.seconds + row["on"] - inner.seconds - row["proofs"]  # hook + drain + assembly
            rounds.append(row)
        tokens = sum(len(o.outputs[0].token_ids) for o in plain)
        same = [c.tokens for c in completions] == [list(o.outputs[0].token_ids) for o in plain]
        llm.llm_engine.engine_core.shutdown()

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    return {
        "model": {"hidden": args.gen_hidden, "layers": args.gen_layers, "dtype": "bfloat16"},
        "requests": args.requests,
        "tokens": tokens,
        "same_tokens_with_capture": same,
        "tokens_per_s_off": tokens / median("off"),
        "tokens_per_s_capture_and_proofs": tokens / median("on"),
        "capture_cost_pct": 100 * statistics.median(r["capture"] / r["off"] for r in rounds),
        "capture_and_proofs_cost_pct": 100 * statistics.median((r["capture"] + r["proofs"]) / r["off"] for r in rounds),
        "wall_overhead_pct_median_of_rounds": 100 * (statistics.median(r["on"] / r["off"] for r in rounds) - 1),
        "capture_s_per_run": median("capture"),
        "proof_build_s_per_run": median("proofs"),
        "generate_s_per_run": median("off"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096, help="codec: hidden size H")
    parser.add_argument("--rows", type=int, default=256, help="codec: decode steps in the sample")
    parser.add_argument("--chunk", type=int, default=32, help="codec: rows per proof")
    parser.add_argument("--topk", type=int, default=128, help="codec: entries committed per chunk")
    parser.add_argument("--repeat", type=int, default=21, help="codec: interleaved timed rounds (medians reported)")
    parser.add_argument(
        "--reference-path",
        default=str(DEFAULT_REFERENCE),
        help="directory holding (or to receive) a `toploc` 0.1.6 install",
    )
    parser.add_argument("--no-install", action="store_true", help="do not pip-install a missing reference")
    parser.add_argument("--skip-vllm", action="store_true", help="codec figures only")
    parser.add_argument("--requests", type=int, default=64, help="vLLM: concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=128, help="vLLM: tokens per completion")
    parser.add_argument("--gen-hidden", type=int, default=512, help="vLLM: hidden size of the generated model")
    parser.add_argument("--gen-layers", type=int, default=4, help="vLLM: layers of the generated model")
    parser.add_argument("--gen-repeat", type=int, default=6, help="vLLM: timed rounds (medians reported)")
    args = parser.parse_args()
    result = {"codec": codec(args)}  # before vLLM, which takes over torch's thread settings
    if not args.skip_vllm:
        with _stdout_to_stderr():
            result["vllm"] = generation(args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
