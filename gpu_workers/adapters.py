"""Versions shipped as LoRA adapters (`[model.lora] ship = "adapter"`): what a worker or validator serves.

A SHARDCAST version is either a full model or an adapter (`bridge.adapters`: its manifest's `kind` is
"lora-adapter" and `base_version` names the full version it applies to). `servable` turns a held version into
the directory an engine loads: the version itself, or the adapter merged into its base by the merge contract
(`bridge.adapters.merge_adapter`), written once under `weights_dir/merged/` and kept while the version is held.
An adapter whose base digest differs from the base held is refused, naming both.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from bridge.adapters import KIND, merge_adapter
from bridge.weights import MANIFEST_FILE, STABLE_FILE, WeightsError, model_digest

log = logging.getLogger("gpu_workers.adapters")
MERGED = "merged"  # weights_dir/merged/v000123: an adapter version merged into its base
SOURCE = "adapter-manifest.sha256"  # beside a merged directory: the adapter manifest it was merged from


def adapter_manifest(version_dir: Path) -> dict | None:
    """The manifest of an adapter version, None for a full one (a model directory without a manifest too)."""
    path = Path(version_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = json.loads(path.read_text())
    return manifest if isinstance(manifest, dict) and manifest.get("kind") == KIND else None


def servable(version_dir: Path, weights_dir: Path, fetch_base: Callable[[int], Path]) -> Path:
    """The directory an engine loads for the held version `version_dir`: itself when it is a full model; for an
    adapter, its merge into the base version (`fetch_base(base_version)` returns that version's directory,
    fetching it when it is not held)."""
    version_dir, weights_dir = Path(version_dir), Path(weights_dir)
    manifest = adapter_manifest(version_dir)
    if manifest is None:
        return version_dir
    base_version = manifest.get("base_version")
    if not isinstance(base_version, int):
        raise WeightsError(f"{version_dir}/{MANIFEST_FILE}: an adapter version without its base_version")
    source = hashlib.sha256((version_dir / MANIFEST_FILE).read_bytes()).hexdigest()
    out = weights_dir / MERGED / version_dir.name
    marker = out.parent / f"{out.name}.{SOURCE}"
    if (out / STABLE_FILE).exists() and marker.is_file() and marker.read_text().strip() == source:
        return out
    shutil.rmtree(out, ignore_errors=True)
    base = fetch_base(base_version)
    t0 = time.perf_counter()
    merge_adapter(
        base,
        version_dir,
        out,
        version=manifest["version"],
        dtype=manifest.get("dtype", "float32"),
        base_digest=model_digest(base),
    )
    marker.write_text(source + "\n")
    log.info(
        "merged adapter version %d into version %d in %.1f s",
        manifest["version"],
        base_version,
        time.perf_counter() - t0,
    )
    return out


def bases_of(weights_dir: Path, versions: Iterable[int]) -> set[int]:
    """The base versions the held adapter versions among `versions` apply to (to be kept beside them)."""
    bases = set()
    for v in versions:
        try:
            manifest = adapter_manifest(Path(weights_dir) / f"v{v:06d}")
        except (OSError, ValueError):
            continue
        if manifest is not None and isinstance(manifest.get("base_version"), int):
            bases.add(manifest["base_version"])
    return bases


def drop_merged(weights_dir: Path, keep: Iterable[int]) -> None:
    """Delete the merged directories of versions not in `keep`."""
    root = Path(weights_dir) / MERGED
    if not root.is_dir():
        return
    keep_names = {f"v{v:06d}" for v in keep}
    for entry in root.iterdir():
        name = entry.name.split(".")[0]
        if name not in keep_names:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
