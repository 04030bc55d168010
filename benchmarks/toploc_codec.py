"""Build and verify time per TOPLOC chunk of `gpu_workers.toploc`, beside the reference `toploc` when importable.

Random bf16 hidden states of one sample ([rows, hidden], standard normal: like real final-norm outputs, most
chunks tie at the k-th |value|, which sends our top-k to its exact replay of torch's tie-break). Build is
timed on the states, verify on states perturbed by 1% against those proofs. Each figure is the median over
`--repeat` runs of the whole sample, divided by its number of chunks. The reference (PyPI `toploc` 0.1.6, a
torch C++ extension) is timed on the same data in the same run, with the same outputs checked equal; it must
not live in the project's venv, so point `--reference-path` at a separate install, e.g.

    pip install --no-build-isolation --no-deps --no-binary toploc --target /tmp/toploc_ref toploc==0.1.6
    python benchmarks/toploc_codec.py --reference-path /tmp/toploc_ref

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _import_reference(path: str | None):
    if path:
        sys.path.insert(0, path)
    try:
        import toploc
    except ImportError as err:
        return None, f"{type(err).__name__}: {err}"
    return toploc, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    parser.add_argument("--rows", type=int, default=256, help="decode steps in the sample")
    parser.add_argument("--chunk", type=int, default=32, help="rows per proof")
    parser.add_argument("--topk", type=int, default=128, help="entries committed per chunk")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per figure (median reported)")
    parser.add_argument("--reference-path", default=None, help="directory holding a `toploc` 0.1.6 install")
    args = parser.parse_args()

    import torch

    from gpu_workers.toploc import Thresholds, _topk_indices, build_proofs, verify_proofs

    rng = np.random.default_rng(0)
    states = torch.from_numpy(rng.standard_normal((args.rows, args.hidden), dtype=np.float32)).to(torch.bfloat16)
    perturbed = (states.float() * 1.01).to(torch.bfloat16)
    bits = states.view(torch.int16).numpy().view(np.uint16)
    bits_perturbed = perturbed.view(torch.int16).numpy().view(np.uint16)
    n_chunks = -(-args.rows // args.chunk)

    def tied(flat: np.ndarray) -> bool:
        keys = np.sort(np.minimum(flat & 0x7FFF, 0x7F81))
        return keys.size > args.topk and keys[-args.topk] == keys[-args.topk - 1]

    build_proofs(bits[:1], args.chunk, args.topk)  # first call builds the inverse table
    proofs = build_proofs(bits, args.chunk, args.topk)
    checks = verify_proofs(bits_perturbed, proofs, args.chunk, args.topk)
    ours = {
        "build_ms_per_chunk": 1e3 * _median_seconds(lambda: build_proofs(bits, args.chunk, args.topk),
                                                    args.repeat) / n_chunks,
        "verify_ms_per_chunk": 1e3 * _median_seconds(lambda: verify_proofs(bits_perturbed, proofs, args.chunk,
                                                                           args.topk), args.repeat) / n_chunks,
        "topk_ms_per_chunk": 1e3 * _median_seconds(
            lambda: [_topk_indices(bits[r:r + args.chunk].reshape(-1), args.topk)
                     for r in range(0, args.rows, args.chunk)], args.repeat) / n_chunks,
        "accepts_perturbed": Thresholds().accepts(checks),
    }
    result = {
        "hidden": args.hidden, "rows": args.rows, "chunk": args.chunk, "topk": args.topk, "chunks": n_chunks,
        "chunks_tied_at_kth": sum(bool(tied(bits[r:r + args.chunk].reshape(-1)))
                                  for r in range(0, args.rows, args.chunk)),
        "torch_threads": torch.get_num_threads(), "ours": ours,
    }

    toploc, why = _import_reference(args.reference_path)
    if toploc is None:
        result["reference"] = f"not measured ({why})"
    else:
        ref_proofs = toploc.build_proofs_bytes(states, args.chunk, args.topk, skip_prefill=True)
        ref_checks = toploc.verify_proofs_bytes(perturbed, ref_proofs, args.chunk, args.topk, skip_prefill=True)
        result["reference"] = {
            "version": toploc.__version__,
            "build_ms_per_chunk": 1e3 * _median_seconds(
                lambda: toploc.build_proofs_bytes(states, args.chunk, args.topk, skip_prefill=True),
                args.repeat) / n_chunks,
            "verify_ms_per_chunk": 1e3 * _median_seconds(
                lambda: toploc.verify_proofs_bytes(perturbed, ref_proofs, args.chunk, args.topk, skip_prefill=True),
                args.repeat) / n_chunks,
            "same_proof_bytes": ref_proofs == proofs,
            "same_checks": [(c.exp_mismatches, c.mant_err_mean, c.mant_err_median) for c in ref_checks]
            == [(c.exp_mismatches, c.mant_err_mean, c.mant_err_median) for c in checks],
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
