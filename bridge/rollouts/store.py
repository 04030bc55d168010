"""The rollout store on tensorstore: a writer, a validating reader, listing and retention.

A batch lives under `<store>/v{version:06d}/{batch_id}/` on any tensorstore kvstore:

    v000003/b-17/tokens/zarr.json  tokens/0 ...     one 1-D zarr v3 array per field of its schema
                                                     (`schema_fields`) and per optional field of
                                                     `OPTIONAL_FIELDS` the batch holds
                                                     (compressed, `CODECS`; origin 0; `fill_value` 0; chunk
                                                     keys in the "v2" encoding, so chunk k is `tokens/k`)
    v000003/b-17/meta.json                           a JSON object (`bridge.rollouts.schema`)
    v000003/b-17/COMMIT                              64 lowercase hex digits of the canonical digest
                                                     (`bridge.rollouts.schema`), then "\\n"

The store is opened from a URL or a kvstore spec: a plain path or `file:///abs/dir` (default), `memory://`
(tests; writer and reader must share the `RolloutStore` or its `context`), and `gs://bucket/prefix`,
`s3://bucket/prefix` or any tensorstore kvstore JSON spec, passed through to tensorstore as they are (their
credentials come from the environment, as tensorstore documents; those drivers are not exercised here).

Writing: arrays and `meta.json` first, `COMMIT` last and only if no `COMMIT` exists yet (a conditional write),
so a batch is visible to readers only once all of it is durable; a leftover of a failed write (no `COMMIT`)
is cleared and rewritten, a committed batch is never overwritten.

Reading: `COMMIT`, then `meta.json`, then every array (declared sizes are checked before any array is read,
so a corrupt or hostile batch cannot make the reader allocate more than `max_batch_bytes`, or more than a
validator's `ReadLimits` allow: the assignment's sample count and the tokens and proof bytes it may hold;
metadata files are read with a size bound, and a chunk may not be far larger than its array nor an array
split into more than 4,096 chunks), then the digest, then every invariant of `check_batch`. Anything wrong
raises `RolloutStoreError`, whose message starts with the batch (`v000003/b-17`) and the field; a batch
either reads back exactly as written or not at all. The digest proves the batch is the one its writer
committed; `read(expect_sha256=)` also proves it is the one
the validator accepted (a worker that rewrites a batch after validation can write a matching `COMMIT`).

Retention: `prune(before_version)` deletes every batch of older versions, their `COMMIT`s first.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from bridge.rollouts.batch import RolloutBatch, check_batch
from bridge.rollouts.limits import ReadLimits
from bridge.rollouts.schema import (
    _BATCH_ID,
    _HASH_POOL,
    OPTIONAL_FIELDS,
    BatchRef,
    RolloutStoreError,
    _combine,
    _field_digest,
    _reject_constant,
    batch_path,
    expected_lengths,
    meta_json,
    parse_meta,
    schema_fields,
)

_COMMIT = re.compile(rb"([0-9a-f]{64})\n?")
_COMMIT_KEY = re.compile(r"v(\d{6,})/([^/]+)/COMMIT")
_VERSION_DIR = re.compile(r"v\d{6,}")
_CHUNK_ELEMENTS = 1 << 20  # elements per stored chunk (chunks compress and decompress in parallel)
_SPARE_CHUNK_ELEMENTS = 1 << 16  # a chunk may exceed its array by this much at most (a chunk is decoded whole:
# a 4 KB stored chunk of 2**24 zeros for a 9-element array made the reader allocate 128 MiB)
_MAX_META_BYTES = 1 << 20  # meta.json longer than this is refused unread
_MAX_ZARR_JSON_BYTES = 1 << 16  # so is an array's zarr.json (this writer's are ~350 bytes)
_MAX_CHUNKS = 4096  # stored chunks per array a reader accepts (this writer: one per 2**20 elements, <= 512)
DEFAULT_MAX_BATCH_BYTES = 4 << 30
_LOCATION_KEYS = frozenset({"driver", "bucket", "path", "endpoint", "aws_region", "host_header", "base"})

CODECS: dict[str, Any] = {
    "blosc-lz4": lambda itemsize: {
        "name": "blosc",
        "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": itemsize, "blocksize": 0},
    },
    "blosc-zstd": lambda itemsize: {
        "name": "blosc",
        "configuration": {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "typesize": itemsize, "blocksize": 0},
    },
    "zstd": lambda itemsize: {"name": "zstd", "configuration": {"level": 1, "checksum": False}},
    "none": None,
}
"""Compression of the writer's arrays (a reader reads whatever codec an array's zarr.json names)."""


def _result(future: Any, where: str, field: str, what: str) -> Any:
    try:
        return future.result()
    except Exception as e:  # tensorstore reports I/O, decoding and metadata errors as ValueError and kin
        raise RolloutStoreError(where, field, f"{what} failed: {e}") from e


def _location_spec(location: str | os.PathLike | Mapping[str, Any]) -> Any:
    if isinstance(location, Mapping):
        return dict(location)
    text = os.fspath(location)
    if text.lstrip().startswith("{"):  # a kvstore spec written as a JSON object (config strings)
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"rollout store: {text[:200]!r} is not a JSON kvstore spec: {e}") from e
        if not isinstance(spec, dict):
            raise ValueError(f"rollout store: {text[:200]!r} is not a JSON object")
        return spec
    if "://" in text:
        return text
    return "file://" + str(Path(text).expanduser().resolve())


class RolloutStore:
    """A rollout store on one tensorstore kvstore: `write`, `read`, `list`, `prune` (module docstring)."""

    def __init__(self, kvstore: ts.KvStore, context: ts.Context, *, compression: str = "blosc-lz4"):
        if compression not in CODECS:
            raise ValueError(f"rollout store: compression {compression!r} is not one of {sorted(CODECS)}")
        if kvstore.path and not kvstore.path.endswith("/"):
            kvstore.path = kvstore.path + "/"
        self.kvstore, self.context, self.compression = kvstore, context, compression

    @classmethod
    def open(
        cls,
        location: str | os.PathLike | Mapping[str, Any],
        *,
        context: ts.Context | None = None,
        sync: bool = True,
        compression: str = "blosc-lz4",
    ) -> RolloutStore:
        """Open a store at a URL (`file://`, `memory://`, `gs://`, `s3://`), a plain directory or a kvstore spec
        (a mapping, or a string holding a JSON object: `{"driver": "s3", "bucket": ..., "endpoint": ...}`).

        `sync=False` skips fsync on `file://` stores (benchmarks, scratch runs); `context` shares `memory://`
        stores and caches between `RolloutStore` objects.
        """
        context = context if context is not None else ts.Context({"file_io_sync": bool(sync)})
        spec = _location_spec(location)
        try:
            kvstore = ts.KvStore.open(spec, context=context).result()
        except Exception as e:
            raise ValueError(f"rollout store: cannot open {spec!r}: {e}") from e
        return cls(kvstore, context, compression=compression)

    @property
    def url(self) -> str:
        """The store's URL, or for a spec without one (an s3 store with an endpoint) its JSON without the
        context resources (credentials, concurrency), so that roles holding different credentials name the
        store alike."""
        try:
            return self.kvstore.url
        except Exception:  # drivers without a URL form (a composed spec) have no `url`
            spec = self.kvstore.spec().to_json()
            kept = {k: v for k, v in spec.items() if k in _LOCATION_KEYS}
            return json.dumps(kept, sort_keys=True)

    def __repr__(self) -> str:
        return f"RolloutStore({self.url!r})"

    def batch_url(self, version: int, batch_id: str) -> str:
        base = self.url
        return base + ("" if base.endswith("/") else "/") + batch_path(version, batch_id) + "/"

    # ---------------------------------------------------------------- writing

    def _metadata(self, dtype: str, length: int) -> dict[str, Any]:
        codec = CODECS[self.compression]
        codecs = [
            {"name": "bytes", "configuration": {"endian": "little"}}
            if np.dtype(dtype).itemsize > 1
            else {"name": "bytes"}
        ]
        if codec is not None:
            codecs.append(codec(np.dtype(dtype).itemsize))
        chunk = max(1, -(-length // max(1, -(-length // _CHUNK_ELEMENTS))))  # equal chunks, little padding
        return {
            "shape": [length],
            "data_type": dtype,
            "fill_value": 0,
            "codecs": codecs,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
            "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}},
        }  # name/0: no c/ dir

    def write(self, batch: RolloutBatch, *, vocab_size: int | None = None, expect_sha256: str | None = None) -> str:
        """Validate and store `batch`; returns the sha256 written to `COMMIT`. A committed batch is never replaced.

        `expect_sha256`: the digest the batch must have (an upload's announcement); if the values written hash to
        another, what was written is deleted and no `COMMIT` is made."""
        prefix = batch_path(batch.meta.version, batch.meta.batch_id) + "/"
        where = prefix[:-1]
        check_batch(batch, vocab_size)
        arrays, fields = batch.arrays(), batch.fields()
        names = tuple(name for name, _, _ in fields)
        meta = meta_json(batch.meta, batch.num_samples, len(batch.tokens), len(batch.proofs), batch.schema)
        parse_meta(meta, where)  # the reader's checks of node_key, assignment_id, model_dtype, ...
        digests = [_HASH_POOL.submit(_field_digest, arrays[name], dtype) for name, dtype, _ in fields]
        existing = _result(self.kvstore.read(prefix + "COMMIT"), where, "COMMIT", "reading")
        if existing.state != "missing":
            raise RolloutStoreError(where, "COMMIT", "the batch is already committed; batch ids are written once")
        _result(self.kvstore.delete_range(_prefix_range(prefix)), where, "batch", "clearing a partial write")
        opened = {
            name: ts.open(
                {"driver": "zarr3", "metadata": self._metadata(dtype, len(arrays[name]))},
                kvstore=self.kvstore / f"{prefix}{name}/",
                context=self.context,
                create=True,
            )
            for name, dtype, _ in fields
        }
        writes = [self.kvstore.write(prefix + "meta.json", meta)]
        for name in names:
            store = _result(opened[name], where, name, "creating the array")
            if len(arrays[name]):
                writes.append(store.write(arrays[name]))
        for name, future in zip(("meta.json",) + names, writes):
            _result(future, where, name, "writing")
        sizes = [arrays[name].size for name in names]
        digest = _combine(fields, sizes, [d.result() for d in digests], meta, batch.schema)
        if expect_sha256 is not None and digest != expect_sha256:
            _result(self.kvstore.delete_range(_prefix_range(prefix)), where, "batch", "clearing a refused write")
            raise RolloutStoreError(where, "COMMIT", f"the values hash to {digest}, not the expected {expect_sha256}")
        commit = self.kvstore.write(prefix + "COMMIT", digest.encode() + b"\n", if_equal=existing.stamp.generation)
        stamp = _result(commit, where, "COMMIT", "writing")
        if not stamp.generation:
            raise RolloutStoreError(where, "COMMIT", "another writer committed this batch id at the same time")
        return digest

    # ---------------------------------------------------------------- reading

    def commit(self, version: int, batch_id: str) -> str | None:
        """The sha256 in a batch's `COMMIT`, or None when it has none (not written, or incomplete)."""
        prefix = batch_path(version, batch_id) + "/"
        got = self._read_small(prefix + "COMMIT", 65, prefix[:-1], "COMMIT")
        if got.state == "missing":
            return None
        match = _COMMIT.fullmatch(got.value)
        if not match:
            raise RolloutStoreError(prefix[:-1], "COMMIT", f"not 64 lowercase hex digits: {got.value[:80]!r}")
        return match.group(1).decode()

    def _read_small(self, key: str, limit: int, where: str, field: str) -> Any:
        """The kvstore read of a file that must hold at most `limit` bytes; a longer one is refused unread (a
        one-byte read at offset `limit` answers OUT_OF_RANGE exactly when the file is no longer than that)."""
        try:
            probe = self.kvstore.read(key, byte_range=slice(limit, limit + 1)).result()
        except Exception as e:
            if "OUT_OF_RANGE" not in str(e):
                raise RolloutStoreError(where, field, f"reading failed: {e}") from e
        else:
            if probe.state != "missing":
                raise RolloutStoreError(where, field, f"longer than the {limit} bytes the reader accepts")
        return _result(self.kvstore.read(key), where, field, "reading")

    def _holds(self, prefix: str, name: str, where: str) -> bool:
        """Whether the batch holds the optional field `name` (its `zarr.json` exists; the digest, which
        covers exactly the fields present, proves the writer committed that choice)."""
        return self._read_small(f"{prefix}{name}/zarr.json", _MAX_ZARR_JSON_BYTES, where, name).state != "missing"

    def _open_array(self, prefix: str, name: str, where: str) -> Any:
        """Open one array from its `zarr.json`, read here with a bound, parsed, and given to tensorstore as the
        metadata to assume (so the shape and chunking checked are the ones read with)."""
        raw = self._read_small(f"{prefix}{name}/zarr.json", _MAX_ZARR_JSON_BYTES, where, name)
        if raw.state == "missing":
            raise RolloutStoreError(where, name, "zarr.json missing")
        try:
            doc = json.loads(raw.value.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise RolloutStoreError(where, name, f"zarr.json is not valid JSON ({e})") from e
        if not isinstance(doc, dict):
            raise RolloutStoreError(where, name, f"zarr.json: expected a JSON object, got {type(doc).__name__}")
        try:
            return ts.open(
                {"driver": "zarr3", "metadata": doc},
                kvstore=self.kvstore / f"{prefix}{name}/",
                context=self.context,
                open=True,
                read=True,
                assume_metadata=True,
            )
        except Exception as e:  # the spec is parsed here: a malformed zarr.json raises at once
            raise RolloutStoreError(where, name, f"opening the array failed: {e}") from e

    def read(
        self,
        version: int,
        batch_id: str,
        *,
        vocab_size: int | None = None,
        expect_sha256: str | None = None,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        limits: ReadLimits | None = None,
    ) -> RolloutBatch:
        """Read, verify and validate a committed batch (module docstring); `RolloutStoreError` otherwise.

        `expect_sha256`: the digest the validator accepted; a batch committed with any other digest is refused.
        `limits`: what the reader expects of the batch (`ReadLimits`), checked from metadata before any array
        is read, and per sample once the arrays are read.
        """
        prefix = batch_path(version, batch_id) + "/"
        where = prefix[:-1]
        digest = self.commit(version, batch_id)
        if digest is None:
            raise RolloutStoreError(where, "COMMIT", "missing: the batch was never committed (or is being written)")
        if expect_sha256 is not None and digest != expect_sha256:
            raise RolloutStoreError(where, "COMMIT", f"sha256 {digest} differs from the accepted {expect_sha256}")
        raw = self._read_small(prefix + "meta.json", _MAX_META_BYTES, where, "meta.json")
        if raw.state == "missing":
            raise RolloutStoreError(where, "meta.json", "missing")
        meta, counts = parse_meta(raw.value, where)
        if (meta.version, meta.batch_id) != (int(version), batch_id):
            raise RolloutStoreError(
                where, "meta.json", f"describes v{meta.version:06d}/{meta.batch_id}, not the batch at this path"
            )
        if limits is not None:
            limits.check_counts(counts, where)
        lengths = expected_lengths(counts)
        fields = schema_fields(counts["schema"]) + tuple(f for f in OPTIONAL_FIELDS if self._holds(prefix, f[0], where))
        declared = sum(lengths[name] * np.dtype(dtype).itemsize for name, dtype, _ in fields)
        if declared > max_batch_bytes:
            raise RolloutStoreError(
                where,
                "meta.json",
                f"declares {declared} bytes of arrays, more than the reader's limit of {max_batch_bytes}",
            )
        opened = {name: self._open_array(prefix, name, where) for name, _, _ in fields}
        reads = {}
        for name, dtype, kind in fields:  # every array's declared shape and chunking, before it is read
            store = _result(opened[name], where, name, "opening the array")
            if store.dtype.numpy_dtype != np.dtype(dtype) or store.rank != 1:
                raise RolloutStoreError(
                    where, name, f"stored as {store.dtype.numpy_dtype} rank {store.rank}, the schema says 1-D {dtype}"
                )
            bound = None if limits is None else limits.bound(kind)
            if bound is not None and store.shape[0] > bound:
                raise RolloutStoreError(
                    where, name, f"declares {store.shape[0]} elements, more than the {bound} the reader allows"
                )
            if store.domain.inclusive_min != (0,) or store.shape != (lengths[name],):
                raise RolloutStoreError(
                    where, name, f"stored with domain {store.domain}, meta.json implies length {lengths[name]}"
                )
            layout = store.chunk_layout
            chunks = [layout.read_chunk.shape, layout.write_chunk.shape]
            if any(c is None or not 0 < c[0] <= max(lengths[name], _SPARE_CHUNK_ELEMENTS) for c in chunks):
                raise RolloutStoreError(
                    where,
                    name,
                    f"chunk shape {chunks[0]} (written in {chunks[1]}) is larger "
                    f"than the reader accepts for {lengths[name]} elements",
                )
            max_chunks = _MAX_CHUNKS if limits is None else limits.max_chunks
            if -(-lengths[name] // chunks[0][0]) > max_chunks:
                raise RolloutStoreError(
                    where,
                    name,
                    f"stored in {-(-lengths[name] // chunks[0][0])} chunks of "
                    f"{chunks[0][0]} elements, more than the {max_chunks} the reader allows",
                )
            reads[name] = store.read()
        arrays, digests = {}, []
        for name, dtype, _ in fields:  # hash each field as soon as it is decoded, while the others still load
            arrays[name] = np.asarray(_result(reads[name], where, name, "reading"))
            digests.append(_HASH_POOL.submit(_field_digest, arrays[name], dtype))
        sizes = [arrays[name].size for name, _, _ in fields]
        actual = _combine(fields, sizes, [d.result() for d in digests], raw.value, counts["schema"])
        if actual != digest:
            raise RolloutStoreError(
                where,
                "COMMIT",
                f"the batch's canonical sha256 is {actual}, COMMIT says {digest} "
                "(the stored bytes were altered or are incomplete)",
            )
        batch = RolloutBatch(meta=meta, **{name: arrays[name].astype(dtype, copy=False) for name, dtype, _ in fields})
        check_batch(batch, vocab_size)
        if limits is not None:
            limits.check_samples(batch, where)
        return batch

    # ---------------------------------------------------------------- listing and retention

    def _keys(self) -> list[tuple[int, str, BatchRef | None]]:
        """(version, key, the batch if the key is its COMMIT) of every key under a `v{version:06d}/` directory."""
        out = []
        for raw in _result(self.kvstore.list(ts.KvStore.KeyRange(b"v", b"w")), self.url, "listing", "listing"):
            key = raw.decode("utf-8", "replace")
            top = key.split("/", 1)[0]
            if not _VERSION_DIR.fullmatch(top) or top != f"v{int(top[1:]):06d}":
                continue  # not a name this store writes
            match = _COMMIT_KEY.fullmatch(key)
            commit = match and _BATCH_ID.fullmatch(match.group(2))
            out.append((int(top[1:]), key, BatchRef(int(top[1:]), match.group(2)) if commit else None))
        return out

    def list(self, min_version: int = 0, max_version: int | None = None) -> list[BatchRef]:
        """Committed batches with min_version <= version <= max_version, newest version first (ids ascending).

        Committed means that `COMMIT` exists; its digest is verified by `read`, not here."""
        refs = [
            ref
            for version, _, ref in self._keys()
            if ref is not None and version >= min_version and (max_version is None or version <= max_version)
        ]
        return sorted(refs, key=lambda r: (-r.version, r.batch_id))

    def delete(self, version: int, batch_id: str) -> None:
        """Delete one batch, its `COMMIT` first (the ingest's clean-up of a batch the pool did not take)."""
        prefix = batch_path(version, batch_id) + "/"
        _result(self.kvstore.write(prefix + "COMMIT", None), prefix[:-1], "COMMIT", "deleting")
        _result(self.kvstore.delete_range(_prefix_range(prefix)), prefix[:-1], "batch", "deleting")

    def prune(self, before_version: int) -> list[BatchRef]:
        """Delete every batch (committed or partial) of a version < `before_version`; returns the committed ones.

        Each version's `COMMIT` files go first, so a reader never sees a committed batch with missing parts.
        """
        old = [(version, key, ref) for version, key, ref in self._keys() if version < before_version]
        committed = [(ref, key) for _, key, ref in old if ref is not None]
        for ref, key in committed:
            _result(self.kvstore.write(key, None), ref.path, "COMMIT", "deleting")
        for top in sorted({f"v{version:06d}" for version, _, _ in old}):
            _result(self.kvstore.delete_range(_prefix_range(top + "/")), top, "version", "deleting")
            self._remove_empty_dirs(top)
        return sorted((ref for ref, _ in committed), key=lambda r: (-r.version, r.batch_id))

    def _remove_empty_dirs(self, top: str) -> None:
        """The file driver deletes files but may leave their directories; remove those that are empty."""
        spec = self.kvstore.spec().to_json()
        if spec.get("driver") != "file":
            return
        root = Path(spec.get("path", "")) / top
        if not root.is_dir():
            return
        for dirpath, _, _ in sorted(os.walk(root), key=lambda d: -len(d[0])):
            try:
                os.rmdir(dirpath)
            except OSError:
                pass  # not empty: something this store did not write is in it


def _prefix_range(prefix: str) -> ts.KvStore.KeyRange:
    """All keys starting with `prefix` (which ends with "/": the next byte value closes the range)."""
    return ts.KvStore.KeyRange(prefix.encode(), prefix[:-1].encode() + bytes([ord(prefix[-1]) + 1]))
