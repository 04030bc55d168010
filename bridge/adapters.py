"""LoRA adapter versions: a PEFT adapter directory that names the base model it belongs to.

    adapter_config.json         PEFT's LoRA config (r, lora_alpha, target_modules; plain LoRA only)
    adapter_model.safetensors   every lora_A [rank, in] / lora_B [out, rank] under PEFT's names, one file
    manifest.json               version, base_model_digest (`bridge.weights.model_digest` of the base), optional
                                base_version (the full version it applies to, when it is shipped by SHARDCAST
                                in its place), and the size, sha256 and part sha256s of each file; when
                                shipped so, `deltas` as a full version's (`bridge.shardcast.delta`: against
                                older adapter versions of the same dtype, where they save half the bytes)
    *.xzst                      those delta files of adapter_model.safetensors
    STABLE                      written last

transformers + PEFT (`PeftModel.from_pretrained(base, dir)`) and vLLM (`LoRARequest(name, id, dir)`) load the
directory as it is. `verify_adapter(dir, base_digest)` refuses an adapter whose files do not match its manifest,
that lacks its config, or that was trained on another base (naming both digests).

The merge (`merge_weight`) is one function for every role that merges, so that all compute the same bytes on any
machine: with W [out, in], A [r, in], B [out, r] in float32 and s = lora_alpha / r,

    W' = float32(float64(W) + s * sum over k = 0..r-1, in that order, of float64(B[:, k]) * float64(A[k, :]))

then rounded once from float32 to the export dtype. Every float64 product of two float32 values is exact and the
sum's order is fixed, so no BLAS, thread count or device changes a bit. `merge_adapter` writes a base plus an
adapter as a complete merged version (what a worker or validator serves); the learner's merged export uses the
same function.
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

from bridge.safetensors_io import PlannedTensor, SafetensorsError, SafetensorsFile, encode_header
from bridge.weights import (
    DTYPES,
    MANIFEST_FILE,
    STABLE_FILE,
    ExportResult,
    HFCheckpoint,
    TensorSpec,
    WeightsError,
    resolve_dtype,
    verify_manifest,
    write_version,
)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
KIND = "lora-adapter"
PEFT_PREFIX = "base_model.model."  # PEFT's key prefix in front of the transformers module path
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"
PLAIN = {"use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False}


def lora_scaling(config: dict, where: str = CONFIG_FILE) -> float:
    """lora_alpha / r of a PEFT `adapter_config.json`, refusing what plain LoRA does not compute (WeightsError)."""
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise WeightsError(
            f"{where}: peft_type {config.get('peft_type') if isinstance(config, dict) else None!r} is not LORA"
        )
    for key, plain in PLAIN.items():
        if config.get(key, plain) != plain:
            raise WeightsError(
                f"{where}: {key} = {config[key]!r} is not supported (only plain LoRA: {key} = {plain!r})"
            )
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise WeightsError(f"{where}: {key} {config[key]!r} is not supported (one rank and alpha for all)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise WeightsError(f"{where}: r ({r!r}) must be an integer >= 1 and lora_alpha ({alpha!r}) a number > 0")
    return float(alpha) / r


_MERGE_BLOCK = 1 << 16  # float64 entries per block of merge_weight's rows (512 KiB)


def merge_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
    """W + s * (B @ A) in float32 by the merge contract (module docstring): W [out, in], A [r, in], B [out, r]."""
    if a.ndim != 2 or b.ndim != 2 or w.shape != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
        raise WeightsError(f"merge: W {list(w.shape)}, A {list(a.shape)} and B {list(b.shape)} do not fit W + B @ A")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    out = np.empty(w.shape, np.float32)
    rows = max(1, _MERGE_BLOCK // w.shape[1])  # a block of rows at a time: the float64 sums stay in cache
    product = np.empty((rows, w.shape[1]), np.float64)
    for i in range(0, w.shape[0], rows):
        j = min(i + rows, w.shape[0])
        delta, p = np.zeros((j - i, w.shape[1]), np.float64), product[: j - i]
        for k in range(a.shape[0]):
            np.multiply(b64[i:j, k, None], a64[k][None, :], out=p)
            delta += p
        delta *= np.float64(scaling)
        delta += w[i:j]
        out[i:j] = delta
    return out


def adapter_pairs(names, where: str = WEIGHTS_FILE) -> dict[str, tuple[str, str]]:
    """{base tensor name: (its lora_A name, its lora_B name)} of an adapter's tensor names; WeightsError on a
    name that is neither, or an A without its B."""
    pairs: dict[str, list[str | None]] = {}
    for name in names:
        for i, suffix in enumerate((A_SUFFIX, B_SUFFIX)):
            if name.startswith(PEFT_PREFIX) and name.endswith(suffix):
                module = name[len(PEFT_PREFIX) : -len(suffix)]
                pairs.setdefault(module + ".weight", [None, None])[i] = name
                break
        else:
            raise WeightsError(f"{where}: tensor {name!r} is not a LoRA A or B of plain LoRA")
    incomplete = sorted(k for k, v in pairs.items() if None in v)
    if incomplete:
        raise WeightsError(f"{where}: {incomplete[0]} has an A without a B or a B without an A")
    return {k: (v[0], v[1]) for k, v in pairs.items()}


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
    base_version: int | None = None,
    delta_bases: Sequence[tuple[int, Path]] | None = None,
) -> ExportResult | None:
    """Write an adapter version at `out_dir` (module docstring). `host_value(spec)` is the tensor of `spec` in
    PEFT's layout and `dtype`, called once per spec, in order, on every process; only the `writer` writes. The
    directory appears whole (written under a temporary name, then renamed) and is never overwritten.
    `base_version`: the full version of the same SHARDCAST directory the adapter applies to (its manifest's
    `base_version`, which relays and workers keep beside it). `delta_bases`: as `bridge.weights.write_version`'s
    (None: for an adapter shipped in a full version's place, `base_version` given, in a directory named for its
    version, the previous version and the newest anchor beside it; else none); only an older adapter's
    `adapter_model.safetensors` of the same dtype and shapes is a base for a delta."""
    from bridge.shardcast import delta
    from bridge.shardcast.manifest import PART_SIZE, hash_file_parts
    from bridge.shardcast.names import version_dirname

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
            **({"base_version": int(base_version)} if base_version is not None else {}),
            "dtype": next(k for k, v in DTYPES.items() if v == np_dtype),
            "part_size": PART_SIZE,
            "files": files,
            "total_size": sum(e["size"] for e in files),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if delta_bases is None and base_version is not None and out_dir.name == version_dirname(version):
            delta_bases = delta.delta_bases(out_dir.parent, int(version))
        if delta_bases:
            manifest["deltas"] = delta.write_deltas(tmp, manifest["files"], delta_bases)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():  # an incomplete leftover (no STABLE): replace it
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out_dir / STABLE_FILE).write_text(f"{int(version)}\n")
    return ExportResult(out_dir, sum(v.nbytes for _, v in tensors), len(files))


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


def read_adapter(directory: str | Path, base_digest: str | None = None):
    """(manifest, scaling, {base tensor name: (A, B)} as float32 arrays) of a verified adapter version."""
    directory = Path(directory)
    manifest = verify_adapter(directory, base_digest)
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"{directory / CONFIG_FILE}: unreadable ({e})") from e
    scaling = lora_scaling(config, str(directory / CONFIG_FILE))
    try:
        weights = SafetensorsFile(directory / WEIGHTS_FILE)
        pairs = adapter_pairs(weights.tensors, str(directory / WEIGHTS_FILE))
        tensors = {
            base: (np.asarray(weights.array(a), np.float32), np.asarray(weights.array(b), np.float32))
            for base, (a, b) in pairs.items()
        }
    except SafetensorsError as e:
        raise WeightsError(str(e)) from e
    rank = config["r"]
    for base, (a, b) in tensors.items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise WeightsError(f"{directory}: {base}'s A {list(a.shape)} / B {list(b.shape)} are not of rank {rank}")
    return manifest, scaling, tensors


def merge_adapter(
    base_dir: str | Path,
    adapter_dir: str | Path,
    out_dir: str | Path,
    *,
    version: int,
    dtype="bfloat16",
    base_digest: str | None = None,
) -> ExportResult:
    """Write base + adapter as a complete merged version at `out_dir` (`bridge.weights.write_version`), by the
    merge contract; `base_digest` (the base's `model_digest`) is checked against the adapter's first."""
    base = HFCheckpoint(base_dir)
    _, scaling, tensors = read_adapter(adapter_dir, base_digest)
    missing = sorted(set(tensors) - base.names())
    if missing:
        raise WeightsError(f"{adapter_dir}: adapts {missing[0]}, which the base {base_dir} does not have")
    np_dtype = resolve_dtype(dtype)
    specs = []
    for name in sorted(base.names()):
        shape = base._open(base.weight_map[name]).tensors[name].shape
        specs.append(TensorSpec.same((name,), name, shape))

    def host_value(spec: TensorSpec) -> np.ndarray:
        w = base.array(spec.hf_name)
        if spec.hf_name in tensors:
            a, b = tensors[spec.hf_name]
            return merge_weight(np.asarray(w, np.float32), a, b, scaling).astype(np_dtype)
        return np.asarray(w).astype(np_dtype)

    return write_version(specs, host_value, out_dir, version=version, source_dir=base_dir, dtype=dtype)
