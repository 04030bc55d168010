"""Hugging Face safetensors directories, the weights layout of docs/design.md section 4, framework-neutral
(numpy): the learner's side in JAX is `jax_trainer.export`.

The model side describes its parameters with `TensorSpec`s (where the array sits in the parameter tree, its
HF name, and how the HF layout maps to the model's layout); this module moves bytes, one tensor at a time:

- `HFCheckpoint(model_dir)` reads a single-file or sharded safetensors checkpoint, each tensor a memory map.
- `write_version(specs, host_value, out_dir, version=..., source_dir=...)` writes the layout:
  `model-0000k-of-0000n.safetensors` up to `max_shard_bytes` each, `model.safetensors.index.json`, the
  config and tokenizer files of `source_dir`, `manifest.json` (size and sha256 of every file, and the sha256
  of each `part_size` slice of it, which SHARDCAST relays and clients check part by part) and `STABLE`
  last. Files are written into a hidden temporary directory that is renamed into place, so a reader never
  sees a half-written version; hashing overlaps with the conversion of the next tensor.
- `verify_manifest(model_dir)` checks every file against the manifest.
- `model_digest(model_dir)` names a model by its weights and config (a calibration records it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from bridge.safetensors_io import PlannedTensor, SafetensorsError, SafetensorsFile, encode_header

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "manifest.json"
STABLE_FILE = "STABLE"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".ckpt")
_NOT_COPIED = {INDEX_FILE, MANIFEST_FILE, STABLE_FILE, "pytorch_model.bin.index.json", ".gitattributes"}
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

Path_ = tuple  # a parameter's path in the model's state tree, e.g. ("layers", 0, "attn", "q_proj")


class WeightsError(ValueError):
    """A checkpoint directory or tensor is missing, mis-shaped or corrupt; the message says which."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: JAX array = HF tensor reshaped to `split_shape`, then transposed by `perm`.

    With `layer` set, the HF tensor is one slice of a stacked array: the model's array at `path` has a leading
    layer axis and this tensor is its index `layer` (the decoder's scanned layers).
    """

    path: Path_
    hf_name: str
    hf_shape: tuple[int, ...]
    split_shape: tuple[int, ...]
    perm: tuple[int, ...]
    layer: int | None = None

    @property
    def jax_shape(self) -> tuple[int, ...]:
        return tuple(self.split_shape[p] for p in self.perm)

    def to_jax(self, hf: np.ndarray) -> np.ndarray:
        """A view (no copy) of an HF tensor in the JAX layout."""
        return hf.reshape(self.split_shape).transpose(self.perm)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        return x.transpose(np.argsort(self.perm)).reshape(self.hf_shape)

    def of(self, array):
        """This tensor's part of the model's array at `path`: the array itself, or its layer of a stacked one."""
        return array if self.layer is None else array[self.layer]

    @classmethod
    def linear(cls, path: Path_, hf_name: str, hf_shape: Sequence[int], split_shape: Sequence[int], perm, layer=None):
        return cls(tuple(path), hf_name, tuple(hf_shape), tuple(split_shape), tuple(perm), layer)

    @classmethod
    def same(cls, path: Path_, hf_name: str, shape: Sequence[int], layer: int | None = None):
        return cls(tuple(path), hf_name, tuple(shape), tuple(shape), tuple(range(len(shape))), layer)


def resolve_dtype(dtype) -> np.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise WeightsError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return np.dtype(dtype)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


MODEL_DIGEST_DOMAIN = b"intellect-model/1\n"


def model_digest(model_dir: str | Path) -> str:
    """The hex sha256 that names a model: over its `config.json` and every `*.safetensors` file, in name order,

        sha256(b"intellect-model/1\n" + for each: name + b"\n" + u64le(size) + sha256(file))

    Each file's sha256 comes from `manifest.json` where the directory has one listing it at its size (an
    export, checked against it when it landed), else from the file. WeightsError when there is no config or
    no safetensors file."""
    model_dir = Path(model_dir)
    listed = {}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        listed = {
            e["name"]: (e["size"], e["sha256"]) for e in json.loads((model_dir / MANIFEST_FILE).read_text())["files"]
        }
    files = sorted(
        p for p in model_dir.glob("*") if p.is_file() and (p.suffix == ".safetensors" or p.name == "config.json")
    )
    if not any(p.name == "config.json" for p in files) or not any(p.suffix == ".safetensors" for p in files):
        raise WeightsError(f"{model_dir}: a model directory holds config.json and *.safetensors files")
    outer = hashlib.sha256(MODEL_DIGEST_DOMAIN)
    for path in files:
        size = path.stat().st_size
        known = listed.get(path.name)
        digest = known[1] if known is not None and known[0] == size else sha256_file(path)
        outer.update(path.name.encode() + b"\n" + size.to_bytes(8, "little") + bytes.fromhex(digest))
    return outer.hexdigest()


def verify_manifest(model_dir: str | Path) -> dict:
    """Check every file listed in manifest.json (size, sha256); raise WeightsError naming the first bad one."""
    model_dir = Path(model_dir)
    try:
        manifest = json.loads((model_dir / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise WeightsError(f"{model_dir / MANIFEST_FILE}: unreadable manifest ({e})") from e
    for entry in files:
        path = model_dir / entry["name"]
        if not path.is_file():
            raise WeightsError(f"{path}: listed in the manifest but missing")
        if path.stat().st_size != entry["size"]:
            raise WeightsError(f"{path}: size {path.stat().st_size} but the manifest says {entry['size']}")
        if sha256_file(path) != entry["sha256"]:
            raise WeightsError(f"{path}: sha256 does not match the manifest (corrupt file)")
    return manifest


class HFCheckpoint:
    """The tensors of a Hugging Face directory: `model.safetensors` or an index plus shards."""

    def __init__(self, model_dir: str | Path, verify: bool = True):
        self.dir = Path(model_dir)
        self._files: dict[str, SafetensorsFile] = {}
        if not self.dir.is_dir():
            raise WeightsError(f"{self.dir}: not a directory")
        if verify and (self.dir / MANIFEST_FILE).exists():
            verify_manifest(self.dir)
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise WeightsError(f"{index}: not a valid safetensors index ({e})") from e
        elif (self.dir / "model.safetensors").exists():
            weight_map = {name: "model.safetensors" for name in self._open("model.safetensors").tensors}
        else:
            found = sorted(p.name for p in self.dir.iterdir())
            raise WeightsError(
                f"{self.dir}: no model.safetensors or {INDEX_FILE} (found: {', '.join(found) or 'nothing'}); "
                "only safetensors checkpoints are supported"
            )
        self.weight_map = weight_map

    def _open(self, file: str) -> SafetensorsFile:
        if file not in self._files:
            if Path(file).name != file:
                raise WeightsError(f"{self.dir / INDEX_FILE}: shard name {file!r} is not a plain file name")
            try:
                sf = SafetensorsFile(self.dir / file)
            except FileNotFoundError as e:
                raise WeightsError(f"{self.dir / file}: listed in {INDEX_FILE} but missing") from e
            except SafetensorsError as e:
                raise WeightsError(str(e)) from e
            self._files[file] = sf
        return self._files[file]

    def names(self) -> set[str]:
        return set(self.weight_map)

    def array(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in self.weight_map:
            want = f" (expected shape {list(expected_shape)})" if expected_shape else ""
            raise WeightsError(f"{self.dir}: tensor {name!r} is missing{want}")
        file = self.weight_map[name]
        sf = self._open(file)
        if name not in sf.tensors:
            raise WeightsError(f"{self.dir / file}: tensor {name!r} is listed in the index but not in the file")
        info = sf.tensors[name]
        if expected_shape is not None and info.shape != tuple(expected_shape):
            raise WeightsError(
                f"{self.dir / file}: tensor {name!r} has shape {list(info.shape)}, expected {list(expected_shape)}"
            )
        return sf.array(name)


def _plan_shards(specs: Sequence[TensorSpec], dtype: np.dtype, max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec.hf_shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _raw_bytes(buf: np.ndarray) -> memoryview:
    return memoryview(buf.reshape(-1).view(np.uint8))  # bf16 has no buffer-protocol format: use raw bytes


def _copy_side_files(source_dir: Path | None, dest: Path, dtype_name: str, hf_config: dict | None) -> None:
    config = dict(hf_config) if hf_config is not None else None
    if source_dir is not None:
        for p in sorted(Path(source_dir).iterdir()):
            if p.is_file() and not p.name.startswith(".") and p.name not in _NOT_COPIED:
                if p.suffix in _WEIGHT_SUFFIXES or p.name.endswith(".index.json"):
                    continue
                if p.name == "config.json" and config is None:
                    config = json.loads(p.read_text())
                    continue
                shutil.copyfile(p, dest / p.name)
    if config is None:
        raise WeightsError("export needs a config: pass hf_config or a source_dir holding config.json")
    config["dtype"] = dtype_name
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype_name
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")


@dataclasses.dataclass(frozen=True)
class ExportResult:
    path: Path
    tensor_bytes: int
    files: int


def write_version(
    specs: Sequence[TensorSpec],
    host_value: Callable[[TensorSpec], np.ndarray],
    out_dir: str | Path,
    *,
    version: int,
    writer: bool = True,
    source_dir: str | Path | None = None,
    hf_config: dict | None = None,
    dtype="bfloat16",
    max_shard_bytes: int = 2 << 30,
    fsync: bool = True,
    delta_bases: Sequence[tuple[int, Path]] | None = None,
    part_size: int | None = None,
) -> ExportResult | None:
    """Write the tensors of `specs` as a complete HF directory at `out_dir` (see the module docstring); None
    where not `writer`.

    `host_value(spec)` is the tensor of `spec` in HF layout and the export dtype, whole on this host; it is
    called once per spec, in order, on every process (where it gathers collectively), writer or not.
    `source_dir` supplies config.json (its dtype updated) and the tokenizer/generation files;
    `hf_config` overrides its config.json. `out_dir` must not already hold a STABLE version.
    `delta_bases`: (version, complete directory) of older versions to write SHARDCAST delta files against
    (`bridge.shardcast.delta`), listed in the manifest's `deltas`; None: when `out_dir` is named for its version
    (`v000123`), the previous version and the newest anchor beside it (`bridge.shardcast.delta.delta_bases`).
    `part_size`: the slice size of the manifest's part hashes (None: `bridge.shardcast.manifest.PART_SIZE`).
    """
    from bridge.shardcast.manifest import PART_SIZE, PartHasher, hash_file_parts

    part_size = PART_SIZE if part_size is None else int(part_size)
    out_dir = Path(out_dir)
    np_dtype = resolve_dtype(dtype)
    dtype_name = next(k for k, v in DTYPES.items() if v == np_dtype)
    if writer and (out_dir / STABLE_FILE).exists():
        raise WeightsError(f"{out_dir}: already holds a complete version (STABLE exists); refusing to overwrite")
    shards = _plan_shards(specs, np_dtype, max_shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    if writer:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    files, weight_map, total = [], {}, 0
    try:
        # three helper threads, one writing, one hashing the file and one hashing its parts, on the same
        # buffers, while this thread prepares the next tensor; at most two tensors are in flight
        with (
            cf.ThreadPoolExecutor(1) as write_pool,
            cf.ThreadPoolExecutor(1) as hash_pool,
            cf.ThreadPoolExecutor(1) as part_pool,
        ):
            for name, shard in zip(names, shards):
                planned = [PlannedTensor(s.hf_name, np_dtype, s.hf_shape) for s in shard]
                f = open(tmp / name, "wb") if writer else None
                h = hashlib.sha256()
                ph = PartHasher(part_size, whole=False)
                pending: list[tuple[cf.Future, ...]] = []

                def submit(buf: np.ndarray) -> None:  # called within this iteration only: its f, h, ph, pending
                    while len(pending) >= 2:  # noqa: B023
                        for fut in pending.pop(0):  # noqa: B023
                            fut.result()
                    mv = _raw_bytes(buf)
                    futures = (
                        write_pool.submit(f.write, mv),  # noqa: B023
                        hash_pool.submit(h.update, mv),  # noqa: B023
                        part_pool.submit(ph.update, mv),  # noqa: B023
                    )
                    pending.append(futures)  # noqa: B023

                if writer:
                    submit(np.frombuffer(encode_header(planned, {"format": "pt"}), np.uint8))
                for spec in shard:
                    buf = host_value(spec)
                    if writer:
                        submit(buf)
                        weight_map[spec.hf_name] = name
                        total += buf.nbytes
                    del buf
                if writer:
                    for futs in pending:
                        for fut in futs:
                            fut.result()
                    if fsync:
                        f.flush()
                        os.fsync(f.fileno())
                    files.append({"name": name, "size": f.tell(), "sha256": h.hexdigest(), "parts": ph.part_digests()})
                    f.close()
        if not writer:
            return None
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _copy_side_files(Path(source_dir) if source_dir else None, tmp, dtype_name, hf_config)
        shard_names = set(names)
        for p in sorted(tmp.iterdir()):
            if p.name not in shard_names:
                digest, parts = hash_file_parts(p, part_size)
                files.append({"name": p.name, "size": p.stat().st_size, "sha256": digest, "parts": parts})
        manifest = {
            "version": int(version),
            "part_size": part_size,
            "files": sorted(files, key=lambda e: e["name"]),
            "total_size": sum(e["size"] for e in files),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        from bridge.shardcast import delta

        if delta_bases is None and out_dir.name == f"v{int(version):06d}":
            delta_bases = delta.delta_bases(out_dir.parent, int(version))
        if delta_bases:
            manifest["deltas"] = delta.write_deltas(tmp, manifest["files"], delta_bases)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():  # an incomplete leftover (no STABLE): replace it
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    (out_dir / STABLE_FILE).write_text(f"{int(version)}\n")
    if fsync:
        fd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return ExportResult(out_dir, total, len(files))
