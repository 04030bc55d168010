"""The training step's float32 matmuls through JAX (XLA:CPU) and through torch, side by side, on all cores and
on one.

`benchmarks/train_step.py` compares whole steps; this script asks what the step's matmuls alone run at in
each framework, and how each framework's matmuls scale from one core to all of them. Shapes, for `tokens`
rows (`batch x seq` of train_step.py's defaults) and its model (hidden h, SwiGLU width m, vocabulary V):

- `proj`: [tokens, h] @ [h, h] (the q and o projections)
- `up`: [tokens, h] @ [h, m] (gate and up)
- `down`: [tokens, m] @ [m, h]
- `down_dx`: [tokens, h] @ [m, h]^T (the backward pass's gradient of the down projection's input)
- `up_dw`: [tokens, h]^T @ [tokens, m] (a weight gradient: contracts the tokens)
- `head`: [tokens, h] @ [h, V]
- `square`: [n, n] @ [n, n] (train_step.py's peak)

Each round starts one process per side and thread setting (the one-core runs pin the process to the first
core of its affinity before the framework starts, so that XLA's and torch's thread pools size themselves to
it), in alternating order; a figure is the median over rounds of each round's median repetition. Both sides
multiply the same seeded inputs, and `agree` says whether their products match (relative to the product's
scale), so that both measure the same contraction. The JAX side sets the XLA flags the learner sets.

    python benchmarks/matmul.py [--rounds 3] [--reps 5] [--threads all,1] [--tokens 4096] [--hidden 512]
        [--intermediate 1408] [--vocab 2048] [--square 2048]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def shapes(args) -> dict[str, tuple[tuple[int, int], tuple[int, int], int, int]]:
    """name -> (lhs shape, rhs shape, lhs contracting dim, rhs contracting dim)."""
    t, h, m, v, n = args.tokens, args.hidden, args.intermediate, args.vocab, args.square
    return {
        "proj": ((t, h), (h, h), 1, 0),
        "up": ((t, h), (h, m), 1, 0),
        "down": ((t, m), (m, h), 1, 0),
        "down_dx": ((t, h), (m, h), 1, 1),
        "up_dw": ((t, h), (t, m), 0, 0),
        "head": ((t, h), (h, v), 1, 0),
        "square": ((n, n), (n, n), 1, 0),
    }


def flops(lhs, rhs, lc, rc) -> int:
    return 2 * lhs[lc] * lhs[1 - lc] * rhs[1 - rc]


def inputs(name: str, lhs, rhs) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(sum(map(ord, name)))
    return rng.standard_normal(lhs, np.float32), rng.standard_normal(rhs, np.float32)


# ---- worker: one side, one thread setting, every shape; prints one JSON line -----------------------------------
def worker(args) -> None:
    if args.threads_now == "1":
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    cores = len(os.sched_getaffinity(0))
    out = {}
    if args.side == "jax":
        from jax_trainer import xla_flags

        xla_flags.apply("cpu")
        import jax

        def prepare(a, b, lc, rc):
            f = jax.jit(lambda x, y: jax.lax.dot_general(x, y, (((lc,), (rc,)), ((), ()))))
            x, y = jax.device_put(a), jax.device_put(b)
            return lambda: f(x, y).block_until_ready()

        to_numpy = np.asarray
    else:
        import torch

        torch.set_num_threads(cores)

        def prepare(a, b, lc, rc):
            x, y = torch.from_numpy(a), torch.from_numpy(b)
            x, y = (x if lc == 1 else x.t()), (y if rc == 0 else y.t())
            return lambda: x @ y

        def to_numpy(r):
            return r.numpy()

    for name, (lhs, rhs, lc, rc) in shapes(args).items():
        run = prepare(*inputs(name, lhs, rhs), lc, rc)
        product = to_numpy(run())
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out[name] = {"seconds": statistics.median(times), **fingerprint(product)}
    print(json.dumps({"cores": cores, "shapes": out}), flush=True)


def run_worker(side: str, threads: str, argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--side", side, "--threads-now", threads, *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{side} worker ({threads} thread setting) exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _sig(x: float) -> float:
    """Three significant digits (a tiny shape's figures are well under 1 GFLOP/s)."""
    return float(f"{x:.3g}")


def _stats(values: list[float]) -> dict:
    return {"median": _sig(statistics.median(values)), "min": _sig(min(values)), "max": _sig(max(values))}


def fingerprint(product: np.ndarray) -> dict:
    """What the parent compares across sides: the first 64 row sums and column sums of the product, each divided
    by the square root of its count (so that all are on the scale of one entry), and that scale (the RMS)."""
    p = product.astype(np.float64)
    return {
        "rows": (p.sum(axis=1)[:64] / np.sqrt(p.shape[1])).tolist(),
        "cols": (p.sum(axis=0)[:64] / np.sqrt(p.shape[0])).tolist(),
        "scale": float(np.sqrt(np.mean(p**2))),
    }


def agree(a: dict, b: dict, rtol: float = 1e-4) -> bool:
    """Two fingerprints of the same product, up to float32 accumulation order: every normalised sum within
    `rtol` of the entries' scale."""
    tol = rtol * max(a["scale"], b["scale"])
    return all(len(a[k]) == len(b[k]) and np.max(np.abs(np.subtract(a[k], b[k]))) <= tol for k in ("rows", "cols"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per shape per process (after one)")
    ap.add_argument("--threads", default="all,1", help="thread settings: all (the process's cores) and/or 1")
    ap.add_argument("--tokens", type=int, default=4096, help="rows: train_step.py's batch x seq")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--square", type=int, default=2048)
    ap.add_argument("--side", choices=("jax", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--threads-now", choices=("all", "1"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        worker(args)
        return

    settings = [s for s in args.threads.split(",") if s]
    if not settings or any(s not in ("all", "1") for s in settings):
        ap.error(f"--threads: a comma-separated list of 'all' and '1', not {args.threads!r}")
    shape_argv = [f"--{k}={getattr(args, k)}" for k in ("reps", "tokens", "hidden", "intermediate", "vocab", "square")]
    runs = [(side, s) for s in settings for side in ("jax", "torch")]
    gflops = {run: {name: [] for name in shapes(args)} for run in runs}
    same, cores = True, {}
    for r in range(args.rounds):
        results = {}
        for run in runs if r % 2 == 0 else runs[::-1]:
            results[run] = run_worker(*run, shape_argv)
            cores[run[1]] = results[run]["cores"]
        for run, res in results.items():
            for name, (lhs, rhs, lc, rc) in shapes(args).items():
                gflops[run][name].append(flops(lhs, rhs, lc, rc) / res["shapes"][name]["seconds"] / 1e9)
        for s in settings:
            same &= all(
                agree(results[("jax", s)]["shapes"][n], results[("torch", s)]["shapes"][n]) for n in shapes(args)
            )

    per_setting = {}
    for s in settings:
        per_setting[s] = {"cores": cores[s]}
        for name in shapes(args):
            j, t = gflops[("jax", s)][name], gflops[("torch", s)][name]
            per_setting[s][name] = {
                "jax_gflops": _stats(j),
                "torch_gflops": _stats(t),
                "jax_over_torch": _sig(statistics.median(a / b for a, b in zip(j, t))),
            }
    out = {
        "benchmark": "matmul",
        "dtype": "float32",
        "shapes": {
            name: f"{list(lhs)} x {list(rhs)}, contracting dim {lc} with {rc}"
            for name, (lhs, rhs, lc, rc) in shapes(args).items()
        },
        "rounds": args.rounds,
        "threads": per_setting,
        "agree": bool(same),
        "xla_flags": "the learner's (jax_trainer.xla_flags)",
    }
    if "all" in settings and "1" in settings:
        # how each framework's matmuls scale from one core to all of the process's cores
        out["scaling"] = {
            name: {
                side: _sig(
                    statistics.median(gflops[(side, "all")][name]) / statistics.median(gflops[(side, "1")][name])
                )
                for side in ("jax", "torch")
            }
            for name in shapes(args)
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
