"""Rollout store (tensorstore zarr v3) beside pyarrow parquet, INTELLECT-2's rollout format, in one run.

10,000 samples of ~1,000 tokens (900-1,100; prompts 100-300 tokens; Zipf-distributed token ids over a 151,936
vocabulary; logprobs; TOPLOC proofs of 258 bytes per 32 completion tokens) are split into batches of
`--batch-samples` and written, then read back, once through `bridge.rollouts.RolloutStore` (file://, blosc-lz4
by default; the read verifies COMMIT's sha256 and every invariant) and once as one parquet file per batch
(one row per sample: list<int32> tokens, list<float32> logprobs, binary proof, scalar columns) with snappy
(pyarrow's default) and zstd. The parquet read converts to the same flat numpy arrays the learner needs.

Two modes: `durable` (each store batch fsyncs its files before COMMIT; each parquet file is fsynced after
writing, the same guarantee) and `page_cache` (no fsync either side). Reads come from the page cache in both
(the files were just written). MB/s counts the logical bytes of the arrays (the same for every format);
figures are medians of `--repeat` runs after an untimed warm-up of each system, interleaved so that noise from
other processes hits all of them alike; the ratios are store / parquet (>= 1: the store is at least as fast).

    python benchmarks/rollout_store.py [--samples 10000] [--batch-samples 256] [--repeat 3] [--dir /tmp/x]

Prints one JSON object (progress goes to stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.progress import Progress

from bridge.rollouts import PROOF_CHUNK_BYTES, PROOF_CHUNK_TOKENS, BatchMeta, RolloutBatch, RolloutStore

VOCAB = 151936


def make_batches(samples: int, per_batch: int, seed: int = 0) -> list[RolloutBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for k, start in enumerate(range(0, samples, per_batch)):
        n = min(per_batch, samples - start)
        lens = rng.integers(900, 1101, n)
        prompts = rng.integers(100, 301, n)
        total = int(lens.sum())
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        logprobs = (-rng.exponential(0.5, total)).astype(np.float32)
        position = np.arange(total) - np.repeat(offsets[:-1], lens)
        logprobs[position < np.repeat(prompts, lens)] = 0.0
        chunks = -(-(lens - prompts) // PROOF_CHUNK_TOKENS)
        meta = BatchMeta(
            batch_id=f"b{k:05d}",
            node_key="ab" * 32,
            version=1,
            assignment_id=k,
            sampling={"temperature": 0.6, "top_p": 1.0, "max_tokens": 1000},
        )
        out.append(
            RolloutBatch(
                meta=meta,
                tokens=np.minimum(rng.zipf(1.3, total), VOCAB - 1).astype(np.int32),
                offsets=offsets,
                prompt_lens=prompts.astype(np.int32),
                logprobs=logprobs,
                task_ids=rng.integers(0, 10**6, n),
                group_ids=(np.arange(n) // 16).astype(np.int32),
                target_lens=np.zeros(n, np.int32),
                seeds=rng.integers(0, 2**63, n).astype(np.uint64),
                finish=rng.integers(0, 2, n).astype(np.uint8),
                rewards=rng.random(n).astype(np.float32),
                proofs=rng.integers(0, 256, int(chunks.sum()) * PROOF_CHUNK_BYTES, dtype=np.uint8),
                proof_offsets=np.concatenate([[0], np.cumsum(chunks * PROOF_CHUNK_BYTES)]).astype(np.int64),
            )
        )
    return out


def to_table(b: RolloutBatch) -> pa.Table:
    n = b.num_samples
    offsets32 = pa.array(b.offsets.astype(np.int32))
    return pa.table(
        {
            "tokens": pa.ListArray.from_arrays(offsets32, pa.array(b.tokens)),
            "prompt_len": b.prompt_lens,
            "logprobs": pa.ListArray.from_arrays(offsets32, pa.array(b.logprobs)),
            "task_id": b.task_ids,
            "group_id": b.group_ids,
            "target_len": b.target_lens,
            "seed": b.seeds,
            "finish": b.finish,
            "reward": b.rewards,
            "proof": pa.BinaryArray.from_buffers(
                pa.binary(), n, [None, pa.py_buffer(b.proof_offsets.astype(np.int32)), pa.py_buffer(b.proofs)]
            ),
        }
    )


def from_table(table: pa.Table) -> dict[str, np.ndarray]:
    """The flat arrays of the store's schema from a parquet table (what the learner would build)."""
    tokens = table["tokens"].combine_chunks()
    proofs = table["proof"].combine_chunks()
    out = {
        "tokens": tokens.values.to_numpy(),
        "offsets": tokens.offsets.to_numpy().astype(np.int64),
        "logprobs": table["logprobs"].combine_chunks().values.to_numpy(),
        "proofs": np.frombuffer(proofs.buffers()[2], np.uint8),
        "proof_offsets": np.frombuffer(proofs.buffers()[1], np.int32)[: len(proofs) + 1].astype(np.int64),
    }
    for column in ("prompt_len", "task_id", "group_id", "target_len", "seed", "finish", "reward"):
        out[column] = table[column].to_numpy()
    return out


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def run_store(batches, root: Path, durable: bool, compression: str) -> tuple[float, float, int]:
    shutil.rmtree(root, ignore_errors=True)
    store = RolloutStore.open(root, sync=durable, compression=compression)
    t0 = time.perf_counter()
    for b in batches:
        store.write(b)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches:
        store.read(b.meta.version, b.meta.batch_id)
    return write_s, time.perf_counter() - t0, disk_bytes(root)


def run_parquet(batches, root: Path, durable: bool, codec: str) -> tuple[float, float, int]:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    for b in batches:
        path = root / f"{b.meta.batch_id}.parquet"
        pq.write_table(to_table(b), path, compression=codec)
        if durable:
            fsync_file(path)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for b in batches:
        from_table(pq.read_table(root / f"{b.meta.batch_id}.parquet"))
    return write_s, time.perf_counter() - t0, disk_bytes(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--batch-samples", type=int, default=256, help="samples per batch (one assignment)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compression", default="blosc-lz4", help="the store's codec (bridge.rollouts.CODECS)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = ap.parse_args()

    batches = make_batches(args.samples, args.batch_samples)
    # a parquet round trip must give back exactly the store's arrays, or the comparison would be unfair
    check = from_table(to_table(batches[0]))
    for name, column in [
        ("tokens", "tokens"),
        ("offsets", "offsets"),
        ("logprobs", "logprobs"),
        ("proofs", "proofs"),
        ("proof_offsets", "proof_offsets"),
        ("prompt_lens", "prompt_len"),
    ]:
        assert np.array_equal(check[column], getattr(batches[0], name)), name
    logical = sum(a.nbytes for b in batches for a in b.arrays().values())
    tokens = sum(len(b.tokens) for b in batches)
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    systems = {
        "store": lambda bs, d, durable: run_store(bs, d, durable, args.compression),
        "parquet_snappy": lambda bs, d, durable: run_parquet(bs, d, durable, "snappy"),
        "parquet_zstd": lambda bs, d, durable: run_parquet(bs, d, durable, "zstd"),
    }
    results: dict[str, dict[str, dict]] = {}
    console = Console(stderr=True)
    try:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("write + read", total=2 * len(systems) * args.repeat)
            for name, run in systems.items():  # warm-up, untimed: thread pools, codecs, first-touch allocations
                run(batches[:2], scratch / f"warmup-{name}", False)
            for mode, durable in (("durable", True), ("page_cache", False)):
                runs: dict[str, list] = {name: [] for name in systems}
                for _ in range(args.repeat):
                    for name, run in systems.items():
                        runs[name].append(run(batches, scratch / name, durable))
                        progress.advance(task)
                results[mode] = {}
                for name, figures in runs.items():
                    write_s = statistics.median(f[0] for f in figures)
                    read_s = statistics.median(f[1] for f in figures)
                    results[mode][name] = {
                        "write_samples_per_s": round(args.samples / write_s),
                        "write_MB_per_s": round(logical / write_s / 1e6, 1),
                        "read_samples_per_s": round(args.samples / read_s),
                        "read_MB_per_s": round(logical / read_s / 1e6, 1),
                        "disk_MB": round(figures[0][2] / 1e6, 2),
                    }
                for name in ("parquet_snappy", "parquet_zstd"):
                    ours, theirs = results[mode]["store"], results[mode][name]
                    results[mode][f"ratio_vs_{name}"] = {
                        "write": round(ours["write_MB_per_s"] / theirs["write_MB_per_s"], 2),
                        "read": round(ours["read_MB_per_s"] / theirs["read_MB_per_s"], 2),
                        "disk": round(ours["disk_MB"] / theirs["disk_MB"], 2),
                    }
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(
        json.dumps(
            {
                "samples": args.samples,
                "batches": len(batches),
                "tokens": tokens,
                "logical_MB": round(logical / 1e6, 1),
                "store_compression": args.compression,
                "pyarrow": pa.__version__,
                "repeat": args.repeat,
                **results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
