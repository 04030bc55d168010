"""LoRA adapter versions: a PEFT adapter directory that names the base model it belongs to.

    adapter_config.json         PEFT's LoRA config (r, lora_alpha, target_modules; plain LoRA only)
    adapter_model.safetensors   every lora_A [rank, in] / lora_B [out, rank] under PEFT's names, one file
    manifest.json               version, base_model_digest (`bridge.weights.model_digest` of the base), and the
                                size, sha256 and part sha256s of each file, as a full version's manifest
    STABLE                      written last

transformers + PEFT (`PeftModel.from_pretrained(base, dir)`) and vLLM (`LoRARequest(name, id, dir)`) load the
directory as it is. `verify_adapter(dir, base_digest)` refuses an adapter whose files do not match its manifest,
that lacks its config, or that was trained on another base (naming both digests).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bridge.safetensors_io import PlannedTensor, encode_header
from bridge.weights import (
    DTYPES,
    MANIFEST_FILE,
    STABLE_FILE,
    ExportResult,
    TensorSpec,
    WeightsError,
    resolve_dtype,
    verify_manifest,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KIND = "lora-adapter"


def write_adapter(
    specs: Sequence[TensorSpec],
    host_value: Callable[[TensorSpec], np.ndarray],
    out_dir: str | Path,
    *,
    version: int,
    config: dict,
    base_digest: str,
    dtype="float32",
    writer: bool = True,
) -> ExportResult | None:
    """Write an adapter version at `out_dir` (module docstring). `host_value(spec)` is the tensor of `spec` in
    PEFT's layout and `dtype`, called once per spec, in order, on every process; only the `writer` writes. The
    directory appears whole (written under a temporary name, then renamed) and is never overwritten."""
    from bridge.shardcast.manifest import PART_SIZE, hash_file_parts

    out_dir = Path(out_dir)
    np_dtype = resolve_dtype(dtype)
    tensors = [(spec, host_value(spec)) for spec in specs]
    if not writer:
        return None
    if (out_dir / STABLE_FILE).exists():
        raise WeightsError(f"{out_dir}: already holds a complete version (STABLE exists); refusing to overwrite")
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        planned = [PlannedTensor(spec.hf_name, np_dtype, spec.hf_shape) for spec, _ in tensors]
        with open(tmp / WEIGHTS_FILE, "wb") as f:
            f.write(encode_header(planned, {"format": "pt"}))
            for (spec, value), plan in zip(tensors, planned):
                if value.shape != plan.shape or value.dtype != np_dtype:
                    raise WeightsError(
                        f"adapter: {spec.hf_name} is {value.dtype}{list(value.shape)}, "
                        f"expected {np_dtype}{list(plan.shape)}"
                    )
                f.write(memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
            f.flush()
            os.fsync(f.fileno())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        files = []
        for p in sorted(tmp.iterdir()):
            digest, parts = hash_file_parts(p, PART_SIZE)
            files.append({"name": p.name, "size": p.stat().st_size, "sha256": digest, "parts": parts})
        manifest = {
            "version": int(version),
            "kind": KIND,
            "base_model_digest": base_digest,
            "dtype": next(k for k, v in DTYPES.items() if v == np_dtype),
            "part_size": PART_SIZE,
            "files": files,
            "total_size": sum(e["size"] for e in files),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():  # an incomplete leftover (no STABLE): replace it
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out_dir / STABLE_FILE).write_text(f"{int(version)}\n")
    return ExportResult(out_dir, sum(v.nbytes for _, v in tensors), len(files))


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / CONFIG_FILE).is_file() or (Path(directory) / WEIGHTS_FILE).is_file()


def verify_adapter(directory: str | Path, base_digest: str | None = None) -> dict:
    """The manifest of a complete, intact adapter version for the base named `base_digest` (None: any base);
    WeightsError naming what is wrong otherwise."""
    directory = Path(directory)
    for name in (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE):
        if not (directory / name).is_file():
            raise WeightsError(f"{directory}: not an adapter version: {name} is missing")
    manifest = verify_manifest(directory)
    listed = {e["name"] for e in manifest["files"]}
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if name not in listed:
            raise WeightsError(f"{directory}: {name} is not listed in the manifest")
    if manifest.get("kind") != KIND:
        raise WeightsError(f"{directory}/{MANIFEST_FILE}: kind {manifest.get('kind')!r} is not {KIND!r}")
    if base_digest is not None and manifest.get("base_model_digest") != base_digest:
        raise WeightsError(
            f"{directory}: the adapter was trained on base model {manifest.get('base_model_digest')}, "
            f"but this base is {base_digest}"
        )
    return manifest
