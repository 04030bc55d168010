"""A cheating worker for test_lora_pool.py: `intellect worker` that, for a version shipped as a LoRA adapter, serves
weights other than the contract merge of that adapter into its base while it claims the adapter's version. FORGE
(a key of FORGES) says what it serves instead. Each forge is built from the public pieces (`bridge.adapters`,
safetensors, `gpu_workers.adapters`) and put in place of `gpu_workers.adapters.servable` where the worker calls it.

    python adapter_cheat_worker.py --forge FORGE CONFIG [--section.key value ...]
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file

import gpu_workers.worker
from bridge.adapters import merge_weight, read_adapter
from bridge.weights import MANIFEST_FILE, STABLE_FILE
from gpu_workers.adapters import adapter_manifest, servable
from intellect.cli import main

FORGED = "forged"  # weights_dir/forged/{forge}-v000123: what the forge serves for version 123
Fetch = Callable[[int], Path]
Rule = Callable[[str, np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]


def write_forged(out: Path, source: Path, adapter_dir: Path, rule: Rule) -> Path:
    """`source` (a model directory) with every weight the adapter at `adapter_dir` adapts replaced by
    `rule(name, W, A, B, scaling)` (float32 arrays, PEFT's layout), written once at `out` as a model directory."""
    if (out / STABLE_FILE).exists():
        return out
    _, scaling, pairs = read_adapter(adapter_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp, ignore=shutil.ignore_patterns("*.safetensors", STABLE_FILE, MANIFEST_FILE))
    for f in sorted(source.glob("*.safetensors")):
        tensors = load_file(f)
        for name, w in tensors.items():
            if name in pairs:
                tensors[name] = rule(name, w.astype(np.float32), *pairs[name], scaling).astype(w.dtype)
        save_file(tensors, tmp / f.name, metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    (out / STABLE_FILE).write_text("forged\n")
    return out


def merged_by(forge: str, rule: Rule):
    """A forge that merges each adapter into its base by `rule` in place of the merge contract."""

    def serve(version_dir: Path, weights_dir: Path, fetch: Fetch) -> Path:
        manifest = adapter_manifest(Path(version_dir))
        if manifest is None:
            return Path(version_dir)
        out = Path(weights_dir) / FORGED / f"{forge}-v{manifest['version']:06d}"
        return write_forged(out, fetch(manifest["base_version"]), Path(version_dir), rule)

    return serve


def base_only(version_dir: Path, weights_dir: Path, fetch: Fetch) -> Path:
    """The base alone: no merge at all."""
    manifest = adapter_manifest(Path(version_dir))
    return Path(version_dir) if manifest is None else fetch(manifest["base_version"])


def older(version_dir: Path, weights_dir: Path, fetch: Fetch) -> Path:
    """The version before (its honest merge; the base for the first adapter version): a stale worker."""
    manifest = adapter_manifest(Path(version_dir))
    if manifest is None:
        return Path(version_dir)
    previous = manifest["version"] - 1
    return servable(fetch(previous), weights_dir, fetch)


def stacked(version_dir: Path, weights_dir: Path, fetch: Fetch) -> Path:
    """Each new adapter merged into the weights served for the version before, as if adapters were updates:
    base + delta_1 + ... + delta_N where the contract serves base + delta_N (identical at the first version)."""
    manifest = adapter_manifest(Path(version_dir))
    if manifest is None:
        return Path(version_dir)
    previous = manifest["version"] - 1
    below = fetch(previous) if previous == manifest["base_version"] else stacked(fetch(previous), weights_dir, fetch)
    out = Path(weights_dir) / FORGED / f"stacked-v{manifest['version']:06d}"
    return write_forged(out, below, Path(version_dir), lambda _, w, a, b, s: merge_weight(w, a, b, s))


def half_rank(name, w, a, b, s):
    """Only the first half of the rank's components (A's first r/2 rows, B's first r/2 columns), same scaling."""
    r = a.shape[0] // 2
    return merge_weight(w, a[:r], b[:, :r], s)


def alpha_as_scaling(name, w, a, b, s):
    """Scaled by lora_alpha instead of lora_alpha / r (r times the contract's delta)."""
    return merge_weight(w, a, b, s * a.shape[0])


def attention_only(name, w, a, b, s):
    """The adapter applied to the attention projections only; the MLP's adapted weights left as the base's."""
    return merge_weight(w, a, b, s) if ".self_attn." in name else w


def bfloat16_merge(name, w, a, b, s):
    """Merged in bfloat16 (W cast to bfloat16, plus s * B @ A computed in bfloat16), served as float32."""
    bf16 = torch.bfloat16
    merged = torch.from_numpy(w).to(bf16) + s * (torch.from_numpy(b).to(bf16) @ torch.from_numpy(a).to(bf16))
    return merged.float().numpy()


FORGES = {
    "base-only": base_only,
    "older": older,
    "stacked": stacked,
    "half-rank": merged_by("half-rank", half_rank),
    "alpha-as-scaling": merged_by("alpha-as-scaling", alpha_as_scaling),
    "attention-only": merged_by("attention-only", attention_only),
    "bfloat16-merge": merged_by("bfloat16-merge", bfloat16_merge),
}


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--forge" or sys.argv[2] not in FORGES:
        sys.exit(f"usage: {Path(__file__).name} --forge {{{','.join(FORGES)}}} CONFIG [--section.key value ...]")
    gpu_workers.worker.servable = FORGES[sys.argv[2]]  # what the worker calls to turn a held version into weights
    sys.exit(main(["worker", *sys.argv[3:]]))
