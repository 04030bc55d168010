"""Rollout batches on tensorstore (docs/design.md §6): the schema, a writer, a validating reader, listing, pruning.

A batch is one assignment's output (G completions for each of P prompts), stored under
`<store>/v{version:06d}/{batch_id}/` on any tensorstore kvstore:

    v000003/b-17/tokens/zarr.json  tokens/0 ...     one 1-D zarr v3 array per field of `FIELDS` and per
                                                     optional field of `OPTIONAL_FIELDS` the batch holds
                                                     (compressed, `CODECS`; origin 0; `fill_value` 0; chunk
                                                     keys in the "v2" encoding, so chunk k is `tokens/k`)
    v000003/b-17/meta.json                           a JSON object, see below
    v000003/b-17/COMMIT                              64 lowercase hex digits of the digest below, then "\\n"

`meta.json` has exactly these keys: `schema` (1), `batch_id`, `node_key` (hex public key of the worker),
`version`, `assignment_id` (non-negative integer or string), `sampling` (object: temperature, top_p, ...),
`model_dtype` ("float32" | "bfloat16" | "float16"), and the counts `num_samples` (n), `num_tokens` (T) and
`num_proof_bytes` (P) that fix every array's length: T for tokens and logprobs, n + 1 for both offset
arrays, P for proofs, n for the rest. This writer emits it with sorted keys, no spaces, ASCII only.

Optional fields (`OPTIONAL_FIELDS`): `full_logprobs` (float32, T), the engine's logprob of each sampled token
on the full distribution at the sampling temperature, before top-k/top-p (0 on prompt tokens). A batch
holds it when its worker recorded it (`gpu_workers.vllm_sampler`); a reader finds it by its `zarr.json`, and
a batch without it (older writers, vLLM's own sampler) reads as before with `full_logprobs = None`.

The store is opened from a URL or a kvstore spec: a plain path or `file:///abs/dir` (default), `memory://`
(tests; writer and reader must share the `RolloutStore` or its `context`), and `gs://bucket/prefix`,
`s3://bucket/prefix` or any tensorstore kvstore JSON spec, passed through to tensorstore as they are (their
credentials come from the environment, as tensorstore documents; those drivers are not exercised here).

Canonical bytes. The sha256 in `COMMIT` is computed over the batch's decoded values, not over the stored
(compressed, chunked) files, so that any codec or chunking a writer picks gives the same digest and any
language can recompute it:

    digest = sha256(
        b"intellect-rollout-batch/1\\n"
        + for each field in the order of `FIELDS` (the order of the table in docs/design.md section 6),
          then each optional field the batch holds, in the order of `OPTIONAL_FIELDS`:
              name + b"\\n" + dtype + b"\\n" + u64le(number of elements) + sha256(values)
        + b"meta.json\\n" + u64le(len(meta)) + sha256(meta))

where `name` and `dtype` are the ASCII strings of `FIELDS` (`b"tokens"`, `b"int32"`), `u64le` is an unsigned
64-bit little-endian integer, `sha256(values)` is the 32-byte digest of the array's values laid out as
little-endian fixed-width integers or IEEE floats with no padding, and `meta` is the exact content of
`meta.json` as stored. Hashing each field first lets the fields be hashed in parallel.

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

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from bridge.protocol.messages import BATCH_ID_PATTERN

SCHEMA_VERSION = 1
PROOF_CHUNK_BYTES = 258  # one TOPLOC proof: u16 modulus + 128 u16 coefficients (docs/design.md section 7)
PROOF_CHUNK_TOKENS = 32  # decode steps covered by one proof
DIGEST_DOMAIN = b"intellect-rollout-batch/1\n"
MODEL_DTYPES = ("float32", "bfloat16", "float16")
FINISH_STOP = 0
"""`finish` of a completion that ended with a stop token (docs/design.md section 6)."""
FINISH_LENGTH = 1
"""`finish` of a completion cut at max_tokens (or at the model's context length)."""

# (name, dtype, length): length "T" = tokens, "n" = samples, "n+1" = offsets, "P" = proof bytes.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("tokens", "int32", "T"),
    ("offsets", "int64", "n+1"),
    ("prompt_lens", "int32", "n"),
    ("logprobs", "float32", "T"),
    ("task_ids", "int64", "n"),
    ("group_ids", "int32", "n"),
    ("target_lens", "int32", "n"),
    ("seeds", "uint64", "n"),
    ("finish", "uint8", "n"),
    ("rewards", "float32", "n"),
    ("proofs", "uint8", "P"),
    ("proof_offsets", "int64", "n+1"),
)
OPTIONAL_FIELDS: tuple[tuple[str, str, str], ...] = (("full_logprobs", "float32", "T"),)
"""Fields a batch may hold or not (module docstring); hashed after `FIELDS` when present."""
FIELD_NAMES = tuple(name for name, _, _ in FIELDS)
_DTYPE = {name: dtype for name, dtype, _ in FIELDS + OPTIONAL_FIELDS}
_FULL_LOGPROB_SLACK = 1e-4  # float32 rounding of processed + log(kept mass) against the processed logprob
_META_KEYS = frozenset(
    {
        "schema",
        "batch_id",
        "node_key",
        "version",
        "assignment_id",
        "sampling",
        "model_dtype",
        "num_samples",
        "num_tokens",
        "num_proof_bytes",
    }
)
_BATCH_ID = re.compile(BATCH_ID_PATTERN)  # used with fullmatch
_HEX_KEY = re.compile(r"[0-9a-fA-F]{1,256}")
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

_HASH_POOL = cf.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="rollout-hash")


class RolloutStoreError(ValueError):
    """A rollout batch that cannot be written or read; the message names the batch and the field."""

    def __init__(self, batch: str, field: str, reason: str):
        super().__init__(f"rollout batch {batch}: {field}: {reason}")
        self.batch, self.field, self.reason = batch, field, reason


class BatchRef(NamedTuple):
    """Where a batch lives in a store."""

    version: int
    batch_id: str

    @property
    def path(self) -> str:
        return batch_path(self.version, self.batch_id)


def batch_path(version: int, batch_id: str) -> str:
    """`v{version:06d}/{batch_id}`, after refusing anything that could leave the store root."""
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise RolloutStoreError(f"v?/{batch_id!r}", "version", f"{version!r} is not a non-negative integer")
    if not isinstance(batch_id, str) or not _BATCH_ID.fullmatch(batch_id):
        raise RolloutStoreError(
            f"v{int(version):06d}/{batch_id!r}",
            "batch_id",
            "must be 1-128 characters of A-Z a-z 0-9 . _ - starting with a letter or digit",
        )
    return f"v{int(version):06d}/{batch_id}"


@dataclasses.dataclass(frozen=True)
class BatchMeta:
    """What `meta.json` says about a batch besides its arrays."""

    batch_id: str
    node_key: str  # hex ed25519 public key of the worker
    version: int  # policy version that generated the batch
    assignment_id: str | int
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # temperature, top_p, max_tokens, ...
    model_dtype: str = "bfloat16"  # dtype the inference engine ran the policy in


@dataclasses.dataclass(frozen=True)
class ReadLimits:
    """What a reader holds a batch to before it reads any array (`RolloutStore.read(limits=)`).

    A validator knows the assignment a batch answers and the pool's settings, so it derives these with
    `for_assignment`: the sample count is exact, and tokens and proof bytes are bounded by it. `meta.json`'s
    counts and each array's declared shape and chunking are compared with them from metadata alone; a batch
    that breaks one is refused (`RolloutStoreError` naming the batch and the field) before anything is
    allocated for its arrays. None: no bound (besides the reader's `max_batch_bytes`).
    """

    min_samples: int = 1
    max_samples: int | None = None
    max_tokens: int | None = None
    """All samples' tokens together (prompts and completions)."""
    max_proof_bytes: int | None = None
    """All samples' TOPLOC proof bytes together."""
    max_sample_tokens: int | None = None
    """One sample's prompt and completion (checked once the offsets are read; the totals bound the read)."""
    max_chunks: int = 4096  # _MAX_CHUNKS
    """Stored chunks per array (each costs a read and some bookkeeping: an array declared in chunks of 8
    elements cost the reader ~2 KiB and 20 us per chunk; this writer makes one chunk per 2**20 elements)."""

    @classmethod
    def for_assignment(cls, num_samples: int, max_tokens: int, max_model_len: int | None = None) -> ReadLimits:
        """Exactly `num_samples` samples, each of at most `max_model_len` tokens (prompt + completion; None: the
        total tokens are not bounded) with at most `max_tokens` completion tokens (which bound its proofs)."""
        if num_samples < 1 or max_tokens < 1:
            raise ValueError(f"read limits: num_samples ({num_samples}) and max_tokens ({max_tokens}) must be >= 1")
        proof_bytes = -(-max_tokens // PROOF_CHUNK_TOKENS) * PROOF_CHUNK_BYTES
        return cls(
            min_samples=num_samples,
            max_samples=num_samples,
            max_tokens=None if max_model_len is None else num_samples * max_model_len,
            max_proof_bytes=num_samples * proof_bytes,
            max_sample_tokens=max_model_len,
        )

    def bound(self, length: str) -> int | None:
        """The most elements an array of `FIELDS` length kind `length` ("T", "n", "n+1", "P") may declare."""
        return {
            "T": self.max_tokens,
            "n": self.max_samples,
            "n+1": None if self.max_samples is None else self.max_samples + 1,
            "P": self.max_proof_bytes,
        }[length]

    def check_counts(self, counts: Mapping[str, int], where: str) -> None:
        """`meta.json`'s counts against the limits."""
        n = counts["num_samples"]
        if n < self.min_samples or (self.max_samples is not None and n > self.max_samples):
            wanted = (
                f"exactly {self.min_samples}"
                if self.min_samples == self.max_samples
                else f"{self.min_samples} to {self.max_samples}"
            )
            raise RolloutStoreError(where, "meta.num_samples", f"{n} samples; the reader expects {wanted}")
        for key, limit, what in (
            ("num_tokens", self.max_tokens, "tokens"),
            ("num_proof_bytes", self.max_proof_bytes, "proof bytes"),
        ):
            if limit is not None and counts[key] > limit:
                raise RolloutStoreError(
                    where,
                    f"meta.{key}",
                    f"declares {counts[key]} {what}, more than the {limit} that {n} samples may hold",
                )

    def check_samples(self, batch: RolloutBatch, where: str) -> None:
        """Per-sample lengths of a batch read whole (its totals were bounded before it was read)."""
        if self.max_sample_tokens is None:
            return
        long = np.flatnonzero(batch.lengths > self.max_sample_tokens)
        if len(long):
            i = int(long[0])
            raise RolloutStoreError(
                where,
                "offsets",
                f"sample {i} has {int(batch.lengths[i])} tokens, more than "
                f"the {self.max_sample_tokens} a sample may hold ({len(long)} such samples)",
            )


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch:
    """One batch: `meta` and the arrays of `FIELDS` (flat, with offsets; see docs/design.md section 6)."""

    meta: BatchMeta
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    logprobs: np.ndarray
    task_ids: np.ndarray
    group_ids: np.ndarray
    target_lens: np.ndarray
    seeds: np.ndarray
    finish: np.ndarray
    rewards: np.ndarray
    proofs: np.ndarray
    proof_offsets: np.ndarray
    full_logprobs: np.ndarray | None = None
    """Optional (`OPTIONAL_FIELDS`): each token's engine logprob on the full distribution, before top-k/top-p."""

    @classmethod
    def from_samples(
        cls,
        meta: BatchMeta,
        *,
        tokens: Sequence[Any],
        prompt_lens: Sequence[int],
        logprobs: Sequence[Any],
        task_ids: Sequence[int],
        group_ids: Sequence[int],
        seeds: Sequence[int],
        finish: Sequence[int],
        rewards: Sequence[float],
        proofs: Sequence[bytes],
        target_lens: Sequence[int] | None = None,
        full_logprobs: Sequence[Any] | None = None,
    ) -> RolloutBatch:
        """Concatenate per-sample sequences (tokens, logprobs, proof bytes) into the flat layout;
        `full_logprobs` (per sample, like `logprobs`; None: the batch does not hold the optional field)."""
        where = _where(meta.version, meta.batch_id)
        n = len(tokens)
        lists = {
            "prompt_lens": prompt_lens,
            "logprobs": logprobs,
            "task_ids": task_ids,
            "group_ids": group_ids,
            "seeds": seeds,
            "finish": finish,
            "rewards": rewards,
            "proofs": proofs,
        }
        for name, values in lists.items():
            if len(values) != n:
                raise RolloutStoreError(where, name, f"{len(values)} entries for {n} samples")
        tok = [_cast(t, "int32", where, "tokens") for t in tokens]
        lens = np.array([len(t) for t in tok], np.int64)
        proof_lens = np.array([len(p) for p in proofs], np.int64)
        arrays = {
            "tokens": np.concatenate(tok) if n else np.zeros(0, np.int32),
            "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            "logprobs": (
                np.concatenate([_cast(x, "float32", where, "logprobs") for x in logprobs])
                if n
                else np.zeros(0, np.float32)
            ),
            "proofs": np.frombuffer(b"".join(bytes(p) for p in proofs), np.uint8).copy(),
            "proof_offsets": np.concatenate([[0], np.cumsum(proof_lens)]).astype(np.int64),
            "target_lens": _cast(
                np.zeros(n, np.int32) if target_lens is None else target_lens, "int32", where, "target_lens"
            ),
        }
        for name in ("prompt_lens", "task_ids", "group_ids", "seeds", "finish", "rewards"):
            arrays[name] = _cast(lists[name], _DTYPE[name], where, name)
        if full_logprobs is not None:
            if len(full_logprobs) != n:
                raise RolloutStoreError(where, "full_logprobs", f"{len(full_logprobs)} entries for {n} samples")
            arrays["full_logprobs"] = (
                np.concatenate([_cast(x, "float32", where, "full_logprobs") for x in full_logprobs])
                if n
                else np.zeros(0, np.float32)
            )
        return cls(meta=meta, **arrays)

    def fields(self) -> tuple[tuple[str, str, str], ...]:
        """(name, dtype, length) of every array this batch holds: `FIELDS`, then its optional fields."""
        return FIELDS + tuple(f for f in OPTIONAL_FIELDS if getattr(self, f[0]) is not None)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _, _ in self.fields()}

    @property
    def ref(self) -> BatchRef:
        return BatchRef(int(self.meta.version), self.meta.batch_id)

    @property
    def num_samples(self) -> int:
        return len(self.prompt_lens)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def completion_lens(self) -> np.ndarray:
        return self.lengths - self.prompt_lens

    def sample_tokens(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def sample_logprobs(self, i: int) -> np.ndarray:
        return self.logprobs[self.offsets[i] : self.offsets[i + 1]]

    def sample_ratio_logprobs(self, i: int) -> np.ndarray:
        """The engine's logprobs an importance ratio against the learner needs: `full_logprobs` where the batch
        holds them (the learner's logprobs are on the full distribution too), else the processed `logprobs`."""
        source = self.logprobs if self.full_logprobs is None else self.full_logprobs
        return source[self.offsets[i] : self.offsets[i + 1]]

    def sample_proof(self, i: int) -> bytes:
        return self.proofs[self.proof_offsets[i] : self.proof_offsets[i + 1]].tobytes()


def _where(version: Any, batch_id: Any) -> str:
    try:
        return f"v{int(version):06d}/{batch_id}"
    except (TypeError, ValueError):
        return f"v{version!r}/{batch_id}"


def _cast(values: Any, dtype: str, where: str, field: str) -> np.ndarray:
    """`values` as a 1-D array of `dtype`, refusing casts that would change a value (overflow, fractions)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise RolloutStoreError(where, field, f"expected a 1-D sequence, got shape {arr.shape}")
    out = arr.astype(dtype)
    if len(arr) and np.dtype(dtype).kind in "iu" and not np.array_equal(out.astype(arr.dtype), arr):
        raise RolloutStoreError(where, field, f"values do not fit {dtype}")
    return out


def meta_json(meta: BatchMeta, num_samples: int, num_tokens: int, num_proof_bytes: int) -> bytes:
    """The bytes of `meta.json`: sorted keys, no spaces, ASCII (readers hash these bytes as they are stored)."""
    doc = {
        "schema": SCHEMA_VERSION,
        "batch_id": meta.batch_id,
        "node_key": meta.node_key,
        "version": int(meta.version),
        "assignment_id": meta.assignment_id,
        "sampling": dict(meta.sampling),
        "model_dtype": meta.model_dtype,
        "num_samples": int(num_samples),
        "num_tokens": int(num_tokens),
        "num_proof_bytes": int(num_proof_bytes),
    }
    try:
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise RolloutStoreError(
            _where(meta.version, meta.batch_id), "meta.json", f"meta is not JSON with finite numbers ({e})"
        ) from e


def _reject_constant(name: str) -> None:
    raise ValueError(f"non-finite number {name}")


def parse_meta(raw: bytes, where: str) -> tuple[BatchMeta, dict[str, int]]:
    """`meta.json` bytes -> (`BatchMeta`, counts {num_samples, num_tokens, num_proof_bytes}); strict."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RolloutStoreError(where, "meta.json", f"not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise RolloutStoreError(where, "meta.json", f"expected a JSON object, got {type(doc).__name__}")
    if set(doc) != _META_KEYS:
        missing, extra = sorted(_META_KEYS - set(doc)), sorted(set(doc) - _META_KEYS)
        raise RolloutStoreError(where, "meta.json", f"missing keys {missing}, unknown keys {extra}")

    def integer(key: str) -> int:
        value = doc[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RolloutStoreError(where, f"meta.{key}", f"{value!r} is not a non-negative integer")
        return value

    if doc["schema"] != SCHEMA_VERSION or isinstance(doc["schema"], bool):
        raise RolloutStoreError(where, "meta.schema", f"{doc['schema']!r}: this reader knows schema {SCHEMA_VERSION}")
    if not isinstance(doc["batch_id"], str) or not _BATCH_ID.fullmatch(doc["batch_id"]):
        raise RolloutStoreError(where, "meta.batch_id", f"{doc['batch_id']!r} is not a valid batch id")
    if not isinstance(doc["node_key"], str) or not _HEX_KEY.fullmatch(doc["node_key"]):
        raise RolloutStoreError(where, "meta.node_key", f"{doc['node_key']!r} is not a hex public key")
    assignment = doc["assignment_id"]
    if isinstance(assignment, bool) or not (
        isinstance(assignment, int) and assignment >= 0 or isinstance(assignment, str) and 0 < len(assignment) <= 256
    ):
        raise RolloutStoreError(
            where, "meta.assignment_id", f"{assignment!r} is not a non-negative integer or a string of 1-256 characters"
        )
    if not isinstance(doc["sampling"], dict):
        raise RolloutStoreError(where, "meta.sampling", f"expected a JSON object, got {doc['sampling']!r}")
    if doc["model_dtype"] not in MODEL_DTYPES:
        raise RolloutStoreError(where, "meta.model_dtype", f"{doc['model_dtype']!r} is not one of {MODEL_DTYPES}")
    meta = BatchMeta(
        batch_id=doc["batch_id"],
        node_key=doc["node_key"],
        version=integer("version"),
        assignment_id=assignment,
        sampling=doc["sampling"],
        model_dtype=doc["model_dtype"],
    )
    counts = {k: integer(k) for k in ("num_samples", "num_tokens", "num_proof_bytes")}
    return meta, counts


def expected_lengths(counts: Mapping[str, int]) -> dict[str, int]:
    n, t, p = counts["num_samples"], counts["num_tokens"], counts["num_proof_bytes"]
    sizes = {"T": t, "n": n, "n+1": n + 1, "P": p}
    return {name: sizes[length] for name, _, length in FIELDS + OPTIONAL_FIELDS}


def _field_digest(arr: np.ndarray, dtype: str) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))).digest()


def _combine(
    fields: Sequence[tuple[str, str, str]], sizes: Sequence[int], digests: Sequence[bytes], meta_bytes: bytes
) -> str:
    outer = hashlib.sha256(DIGEST_DOMAIN)
    for (name, dtype, _), size, digest in zip(fields, sizes, digests, strict=True):
        outer.update(name.encode() + b"\n" + dtype.encode() + b"\n" + struct.pack("<Q", size) + digest)
    outer.update(b"meta.json\n" + struct.pack("<Q", len(meta_bytes)) + hashlib.sha256(meta_bytes).digest())
    return outer.hexdigest()


def canonical_sha256(arrays: Mapping[str, np.ndarray], meta_bytes: bytes) -> str:
    """Hex sha256 of the batch's canonical bytes (module docstring); fields are hashed in parallel. `arrays`
    holds every field of `FIELDS` and the optional fields the batch holds."""
    fields = FIELDS + tuple(f for f in OPTIONAL_FIELDS if f[0] in arrays)
    digests = [_HASH_POOL.submit(_field_digest, arrays[name], dtype) for name, dtype, _ in fields]
    return _combine(fields, [arrays[name].size for name, _, _ in fields], [d.result() for d in digests], meta_bytes)


def check_batch(batch: RolloutBatch, vocab_size: int | None = None) -> None:
    """Every invariant of the schema; raises `RolloutStoreError` naming the first field that breaks one."""
    where = _where(batch.meta.version, batch.meta.batch_id)
    arrays = batch.arrays()
    n = len(batch.prompt_lens)
    counts = {"num_samples": n, "num_tokens": len(batch.tokens), "num_proof_bytes": len(batch.proofs)}
    want = expected_lengths(counts)
    for name, dtype, _ in batch.fields():
        arr = arrays[name]
        if not isinstance(arr, np.ndarray) or arr.dtype != np.dtype(dtype) or arr.ndim != 1:
            got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise RolloutStoreError(where, name, f"expected a 1-D {dtype} array, got {got}")
        if len(arr) != want[name]:
            raise RolloutStoreError(
                where,
                name,
                f"length {len(arr)}, expected {want[name]} for {n} samples, "
                f"{counts['num_tokens']} tokens, {counts['num_proof_bytes']} proof bytes",
            )
    if n == 0:
        raise RolloutStoreError(where, "num_samples", "a batch holds at least one sample")

    def fail(field: str, bad: np.ndarray, reason: str) -> None:
        idx = np.flatnonzero(bad)
        if len(idx):
            raise RolloutStoreError(where, field, f"{reason} at index {int(idx[0])} ({len(idx)} in all)")

    offsets, proof_offsets = batch.offsets, batch.proof_offsets
    if offsets[0] != 0 or offsets[-1] != len(batch.tokens):
        raise RolloutStoreError(
            where,
            "offsets",
            f"must run from 0 to {len(batch.tokens)} (the token count), got {int(offsets[0])} .. {int(offsets[-1])}",
        )
    lengths = np.diff(offsets)
    fail("offsets", lengths <= 0, "not strictly increasing")
    fail("prompt_lens", batch.prompt_lens < 1, "prompt length < 1")
    fail("prompt_lens", batch.prompt_lens >= lengths, "prompt length not below the sample length")
    fail("tokens", batch.tokens < 0, "negative token id")
    if vocab_size is not None:
        fail("tokens", batch.tokens >= vocab_size, f"token id >= vocabulary size {vocab_size}")
    fail("logprobs", ~np.isfinite(batch.logprobs), "non-finite logprob")
    # non-zero logprobs per prompt span [offsets[i], offsets[i] + prompt_lens[i]) (even entries of the reduceat)
    bounds = np.stack([offsets[:-1], offsets[:-1] + batch.prompt_lens]).T.reshape(-1)
    nonzero = np.add.reduceat((batch.logprobs != 0).view(np.uint8), bounds, dtype=np.int64)[0::2]
    fail("logprobs", nonzero > 0, "non-zero logprob on a prompt token of the sample")
    if batch.full_logprobs is not None:
        full = batch.full_logprobs
        fail("full_logprobs", ~np.isfinite(full), "non-finite logprob")
        nonzero = np.add.reduceat((full != 0).view(np.uint8), bounds, dtype=np.int64)[0::2]
        fail("full_logprobs", nonzero > 0, "non-zero logprob on a prompt token of the sample")
        fail(
            "full_logprobs",
            full > batch.logprobs + _FULL_LOGPROB_SLACK,
            "full-distribution logprob above the processed one (the kept top-p mass cannot exceed 1)",
        )
    fail("rewards", ~np.isfinite(batch.rewards), "non-finite reward")
    fail("finish", batch.finish > FINISH_LENGTH, f"finish must be {FINISH_STOP} (stop) or {FINISH_LENGTH} (length)")
    fail("task_ids", batch.task_ids < 0, "negative task id")
    fail("group_ids", batch.group_ids < 0, "negative group id")
    fail("target_lens", batch.target_lens < 0, "negative target length")
    if len(batch.proofs) % PROOF_CHUNK_BYTES:
        raise RolloutStoreError(where, "proofs", f"{len(batch.proofs)} bytes is not a multiple of {PROOF_CHUNK_BYTES}")
    if proof_offsets[0] != 0 or proof_offsets[-1] != len(batch.proofs):
        raise RolloutStoreError(
            where,
            "proof_offsets",
            f"must run from 0 to {len(batch.proofs)} (the proof bytes), "
            f"got {int(proof_offsets[0])} .. {int(proof_offsets[-1])}",
        )
    chunks = -(-(lengths - batch.prompt_lens) // PROOF_CHUNK_TOKENS)
    fail(
        "proof_offsets",
        np.diff(proof_offsets) != chunks * PROOF_CHUNK_BYTES,
        f"proof bytes differ from {PROOF_CHUNK_BYTES} x ceil(completion length / {PROOF_CHUNK_TOKENS})",
    )


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
        meta = meta_json(batch.meta, batch.num_samples, len(batch.tokens), len(batch.proofs))
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
        digest = _combine(fields, [arrays[name].size for name in names], [d.result() for d in digests], meta)
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
        fields = FIELDS + tuple(f for f in OPTIONAL_FIELDS if self._holds(prefix, f[0], where))
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
        actual = _combine(fields, sizes, [d.result() for d in digests], raw.value)
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
