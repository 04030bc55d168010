"""The rollout batch's schema (docs/design.md section 6): its fields, `meta.json`, and the canonical digest.

A batch is one assignment's output (G completions for each of P prompts): one 1-D array per field of `FIELDS`
and per optional field of `OPTIONAL_FIELDS` it holds, and `meta.json`.

`meta.json` has exactly these keys: `schema` (1 or 2), `batch_id`, `node_key` (hex public key of the worker),
`version`, `assignment_id` (non-negative integer or string), `sampling` (object: temperature, top_p, ...),
`model_dtype` ("float32" | "bfloat16" | "float16"), and the counts `num_samples` (n), `num_tokens` (T) and
`num_proof_bytes` (P) that fix every array's length: T for tokens and logprobs, n + 1 for both offset
arrays, P for proofs, n for the rest. This writer emits it with sorted keys, no spaces, ASCII only.

Schema 2 adds one required field after `FIELDS`, `sampled` (uint8, T): 1 where the model sampled the token, 0
where the prompt or the environment of a multi-turn episode wrote it (tool outputs, user turns, the chat
template's wrapper). Each sample's first `prompt_lens` tokens are unsampled, the token right after them and its
last token are sampled; `logprobs` (and `full_logprobs`) are 0 on every unsampled token, and the TOPLOC proofs
commit to the hidden states behind the sampled tokens only (258 bytes per 32 of them). A writer emits schema 2
exactly when the batch holds `sampled`; a schema-1 batch (no `sampled`, every older writer's) reads as before,
as one whose completion tokens were all sampled.

Optional fields (`OPTIONAL_FIELDS`): `full_logprobs` (float32, T), the engine's logprob of each sampled token
on the full distribution at the sampling temperature, before top-k/top-p (0 on prompt tokens). A batch
holds it when its worker recorded it (`gpu_workers.vllm_sampler`); a reader finds it by its `zarr.json`, and
a batch without it (older writers, vLLM's own sampler) reads as before with `full_logprobs = None`.

Canonical bytes. The sha256 in `COMMIT` is computed over the batch's decoded values, not over the stored
(compressed, chunked) files, so that any codec or chunking a writer picks gives the same digest and any
language can recompute it:

    digest = sha256(
        b"intellect-rollout-batch/1\\n"   (schema 2: b"intellect-rollout-batch/2\\n")
        + for each field in the order of `FIELDS` (the order of the table in docs/design.md section 6),
          then (schema 2) `sampled`, then each optional field the batch holds, in the order of `OPTIONAL_FIELDS`:
              name + b"\\n" + dtype + b"\\n" + u64le(number of elements) + sha256(values)
        + b"meta.json\\n" + u64le(len(meta)) + sha256(meta))

where `name` and `dtype` are the ASCII strings of `FIELDS` (`b"tokens"`, `b"int32"`), `u64le` is an unsigned
64-bit little-endian integer, `sha256(values)` is the 32-byte digest of the array's values laid out as
little-endian fixed-width integers or IEEE floats with no padding, and `meta` is the exact content of
`meta.json` as stored. Hashing each field first lets the fields be hashed in parallel.
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
from typing import Any, NamedTuple

import numpy as np

from bridge.protocol.messages import BATCH_ID_PATTERN

SCHEMA_VERSION = 2
"""The newest schema: 2 adds `sampled` (`SAMPLED_FIELD`), which a writer emits for a batch that holds it; a batch
without it is written and read as schema 1, byte for byte as before (module docstring)."""
SCHEMAS = (1, 2)
PROOF_CHUNK_BYTES = 258  # one TOPLOC proof: u16 modulus + 128 u16 coefficients (docs/design.md section 7)
PROOF_CHUNK_TOKENS = 32  # decode steps covered by one proof
DIGEST_DOMAIN = b"intellect-rollout-batch/1\n"
DIGEST_DOMAINS = {1: DIGEST_DOMAIN, 2: b"intellect-rollout-batch/2\n"}
"""The first bytes of the canonical digest of a batch of each schema."""
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
SAMPLED_FIELD = ("sampled", "uint8", "T")
"""Schema 2: 1 where the model sampled the token, 0 where the prompt or the environment wrote it (module docstring)."""
OPTIONAL_FIELDS: tuple[tuple[str, str, str], ...] = (("full_logprobs", "float32", "T"),)
"""Fields a batch may hold or not (module docstring); hashed after `FIELDS` when present."""
FIELD_NAMES = tuple(name for name, _, _ in FIELDS)
_DTYPE = {name: dtype for name, dtype, _ in FIELDS + (SAMPLED_FIELD,) + OPTIONAL_FIELDS}
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


def _where(version: Any, batch_id: Any) -> str:
    try:
        return f"v{int(version):06d}/{batch_id}"
    except (TypeError, ValueError):
        return f"v{version!r}/{batch_id}"


def meta_json(meta: BatchMeta, num_samples: int, num_tokens: int, num_proof_bytes: int, schema: int = 1) -> bytes:
    """The bytes of `meta.json`: sorted keys, no spaces, ASCII (readers hash these bytes as they are stored).
    `schema`: 2 for a batch holding `sampled`, else 1 (`RolloutBatch.schema`)."""
    if schema not in SCHEMAS:
        raise ValueError(f"rollout schema {schema!r} is not one of {SCHEMAS}")
    doc = {
        "schema": schema,
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
    """`meta.json` bytes -> (`BatchMeta`, counts {schema, num_samples, num_tokens, num_proof_bytes}); strict."""
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

    if isinstance(doc["schema"], bool) or doc["schema"] not in SCHEMAS:
        raise RolloutStoreError(
            where,
            "meta.schema",
            f"{doc['schema']!r}: this reader knows schemas {', '.join(map(str, SCHEMAS))} (a newer writer's batch "
            "needs a newer reader)",
        )
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
    return meta, {"schema": doc["schema"], **counts}


def schema_fields(schema: int) -> tuple[tuple[str, str, str], ...]:
    """The required fields of a batch of `schema`, in digest order: `FIELDS`, then (schema 2) `SAMPLED_FIELD`."""
    if schema not in SCHEMAS:
        raise ValueError(f"rollout schema {schema!r} is not one of {SCHEMAS}")
    return FIELDS if schema == 1 else FIELDS + (SAMPLED_FIELD,)


def expected_lengths(counts: Mapping[str, int]) -> dict[str, int]:
    n, t, p = counts["num_samples"], counts["num_tokens"], counts["num_proof_bytes"]
    sizes = {"T": t, "n": n, "n+1": n + 1, "P": p}
    return {name: sizes[length] for name, _, length in FIELDS + (SAMPLED_FIELD,) + OPTIONAL_FIELDS}


def _field_digest(arr: np.ndarray, dtype: str) -> bytes:
    return hashlib.sha256(np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))).digest()


def _combine(
    fields: Sequence[tuple[str, str, str]],
    sizes: Sequence[int],
    digests: Sequence[bytes],
    meta_bytes: bytes,
    schema: int = 1,
) -> str:
    outer = hashlib.sha256(DIGEST_DOMAINS[schema])
    for (name, dtype, _), size, digest in zip(fields, sizes, digests, strict=True):
        outer.update(name.encode() + b"\n" + dtype.encode() + b"\n" + struct.pack("<Q", size) + digest)
    outer.update(b"meta.json\n" + struct.pack("<Q", len(meta_bytes)) + hashlib.sha256(meta_bytes).digest())
    return outer.hexdigest()


def canonical_sha256(arrays: Mapping[str, np.ndarray], meta_bytes: bytes) -> str:
    """Hex sha256 of the batch's canonical bytes (module docstring); fields are hashed in parallel. `arrays`
    holds every field of `FIELDS`, `sampled` for a schema-2 batch, and the optional fields the batch holds."""
    schema = 2 if SAMPLED_FIELD[0] in arrays else 1
    fields = schema_fields(schema) + tuple(f for f in OPTIONAL_FIELDS if f[0] in arrays)
    digests = [_HASH_POOL.submit(_field_digest, arrays[name], dtype) for name, dtype, _ in fields]
    sizes = [arrays[name].size for name, _, _ in fields]
    return _combine(fields, sizes, [d.result() for d in digests], meta_bytes, schema)
