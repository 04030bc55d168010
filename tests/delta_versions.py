"""Versions for the SHARDCAST delta tests (unit and end to end): bf16 weights as safetensors bytes, a training
step that moves a fraction of the values by one unit in the last place, and a publisher that does what the
learner's export does (files, deltas against `delta_bases`, manifest, STABLE)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from bridge.shardcast import delta

N = 300_000  # bf16 values per tensor


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    header, pos, body = {}, 0, []
    for name, arr in tensors.items():
        kind = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32"}[arr.dtype]
        header[name] = {"dtype": kind, "shape": list(arr.shape), "data_offsets": [pos, pos + arr.nbytes]}
        pos += arr.nbytes
        body.append(arr.tobytes())
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"".join(body)


def step(weights: dict[str, np.ndarray], seed: int, frac: float = 0.01) -> dict[str, np.ndarray]:
    """A copy with `frac` of the values moved by one ulp (bf16 bit patterns as uint16)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, arr in weights.items():
        arr = arr.copy()
        idx = rng.choice(arr.size, int(arr.size * frac), replace=False)
        arr[idx] = (arr[idx].astype(np.int64) + rng.choice([1, -1], idx.size)).astype(arr.dtype)
        out[name] = arr
    return out


def publish(root: Path, version: int, files: dict[str, bytes], every: int = delta.ANCHOR_EVERY) -> dict:
    """What the learner's export does: files, deltas against `delta_bases`, manifest, then STABLE."""
    vdir = root / f"v{version:06d}"
    staging = root / f".staging-{version}"
    staging.mkdir(parents=True)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    entries = [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())]
    doc = {
        "version": version,
        "files": entries,
        "total_size": sum(len(d) for d in files.values()),
        "deltas": delta.write_deltas(staging, entries, delta.delta_bases(root, version, every)),
    }
    (staging / "manifest.json").write_text(json.dumps(doc))
    os.rename(staging, vdir)
    (vdir / "STABLE").write_text(f"{version}\n")
    return doc


def initial(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.integers(0x3C00, 0x3D00, N, dtype=np.uint16),
        "b.weight": rng.integers(0xBC00, 0xBD00, N // 3, dtype=np.uint16),
    }
