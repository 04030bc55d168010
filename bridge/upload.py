"""The upload of a rollout batch through the pool (docs/design.md sections 6 and 8): the byte stream a worker
sends (`encode`) and its incremental decoder (`UploadDecoder`), which the ingest runs as the bytes arrive.

Workers hold no storage credentials: a worker sends its batch to the pool's ingest, which checks it and writes
it to the rollout store. The stream carries the batch's decoded values, laid out as the COMMIT digest hashes
them, so the arrays land in place as they arrive and nothing is decoded or re-encoded on the way; the ingest's
write hashes them (in parallel, while it writes) and commits only if they hash to the signed digest:

    u32le(len(meta)) meta.json        the exact bytes of meta.json (sorted keys, ASCII: `bridge.rollouts`)
    u8 optional fields present        bit i: the i-th field of `OPTIONAL_FIELDS` (full_logprobs) follows
    the values of each field          in digest order (`FIELDS`, then the optional fields present), little-endian,
                                      as many as meta.json's counts say (T, n, n + 1 or P)

Every byte of it is fixed by the batch's canonical sha256 (the COMMIT digest): the digest covers meta.json and
its length, each field's name, count and values, and which optional fields are present. So a stream whose
values hash to the digest the worker signed is exactly the batch it signed, and the request's signature covers
that digest in place of a hash of the raw body (`bridge.protocol.signing.signing_string`).

The decoder refuses, with `UploadError` naming the field, a stream that breaks the framing, a meta.json the
rollout reader would refuse, counts beyond the `ReadLimits` of the assignment, or a length that differs from
what meta.json implies, before it holds any array; it never holds more than the counts it accepted.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np

from bridge.protocol.upload_client import HEADER_BATCH_SHA256, UPLOAD_PREFIX
from bridge.rollouts import (
    FIELDS,
    OPTIONAL_FIELDS,
    BatchMeta,
    ReadLimits,
    RolloutBatch,
    RolloutStoreError,
    canonical_sha256,
    expected_lengths,
    meta_json,
    parse_meta,
)

MAX_META_BYTES = 1 << 16
"""A meta.json in an upload is at most this long (the rollout reader's bound is 1 MiB; this writer's are ~400)."""
_HEAD = struct.Struct("<I")
__all__ = [
    "HEADER_BATCH_SHA256",
    "MAX_META_BYTES",
    "UPLOAD_PREFIX",
    "UploadDecoder",
    "UploadError",
    "encode",
    "max_stream_length",
    "pieces_of",
    "stream_length",
    "upload_path",
]


class UploadError(ValueError):
    """An upload stream the decoder refuses; `field` names where (meta.json, a field, the stream's length)."""

    def __init__(self, field: str, reason: str, status: int = 422):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason, self.status = field, reason, status


def upload_path(assignment_id: int, batch_id: str) -> str:
    return f"{UPLOAD_PREFIX}{int(assignment_id)}/{batch_id}"


def encode(batch: RolloutBatch) -> tuple[int, list[memoryview]]:
    """(length, pieces) of the upload stream of `batch`: the pieces are views of its arrays, not copies."""
    fields = batch.fields()
    meta = meta_json(batch.meta, batch.num_samples, len(batch.tokens), len(batch.proofs))
    flags = sum(1 << i for i, (name, _, _) in enumerate(OPTIONAL_FIELDS) if getattr(batch, name) is not None)
    pieces = [memoryview(_HEAD.pack(len(meta)) + meta + bytes([flags]))]
    for name, dtype, _ in fields:
        values = np.ascontiguousarray(getattr(batch, name), dtype=np.dtype(dtype).newbyteorder("<"))
        pieces.append(memoryview(values).cast("B"))
    return sum(p.nbytes for p in pieces), pieces


def stream_length(counts: dict[str, int], meta_bytes: int, optional: tuple[str, ...] = ()) -> int:
    """The length of the upload stream of a batch with these counts (meta.json's) and optional fields."""
    lengths = expected_lengths(counts)
    fields = FIELDS + tuple(f for f in OPTIONAL_FIELDS if f[0] in optional)
    return _HEAD.size + meta_bytes + 1 + sum(lengths[name] * np.dtype(dtype).itemsize for name, dtype, _ in fields)


def max_stream_length(limits: ReadLimits, with_optional: bool = True) -> int:
    """The longest upload stream a batch within `limits` can have (every bound of `limits` must be set)."""
    n = limits.max_samples
    counts = {"num_samples": n, "num_tokens": limits.max_tokens, "num_proof_bytes": limits.max_proof_bytes}
    optional = tuple(name for name, _, _ in OPTIONAL_FIELDS) if with_optional else ()
    return stream_length(counts, MAX_META_BYTES, optional)


class UploadDecoder:
    """Feed the upload stream in pieces (`feed`); once `done`, `batch()` is the batch (and `sha256()` its canonical
    digest; the ingest's write hashes it itself, while it writes). `expect`: what the pool knows of the batch
    before it arrives (its id, node, version, assignment, exact length of the stream); `limits`: the
    assignment's `ReadLimits` (sample count exact)."""

    def __init__(
        self,
        *,
        batch_id: str,
        node_key: str,
        version: int,
        assignment_id: int,
        length: int,
        limits: ReadLimits,
    ):
        self.expect = {"batch_id": batch_id, "node_key": node_key, "version": version, "assignment_id": assignment_id}
        self.length, self.limits = length, limits
        self.received = 0
        self._head = bytearray()
        self.meta: BatchMeta | None = None
        self.meta_bytes = b""
        self.counts: dict[str, int] = {}
        self._fields: list[tuple[str, str, str]] = []
        self._arrays: dict[str, np.ndarray] = {}
        self._field = 0  # the field being filled
        self._filled = 0  # its bytes so far
        self.done = False

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self.received + view.nbytes > self.length:
            raise UploadError("stream", f"longer than the {self.length} bytes its Content-Length announced", 400)
        self.received += view.nbytes
        if self.meta is None:
            view = self._read_head(view)
            if view is None:
                return
        while view.nbytes and self._field < len(self._fields):
            name, _, _ = self._fields[self._field]
            out = self._views[self._field]
            take = min(view.nbytes, out.nbytes - self._filled)
            out[self._filled : self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == out.nbytes:
                self._field, self._filled = self._field + 1, 0
        self._finish_if_complete()

    def _read_head(self, view: memoryview) -> memoryview | None:
        """Take meta.json and the flags byte from the front of the stream; the rest of `view`, or None while the
        head is incomplete."""
        while True:
            need = _HEAD.size
            if len(self._head) >= _HEAD.size:
                (meta_len,) = _HEAD.unpack(self._head[: _HEAD.size])
                if meta_len > MAX_META_BYTES:
                    raise UploadError("meta.json", f"{meta_len} bytes, more than the {MAX_META_BYTES} accepted")
                need = _HEAD.size + meta_len + 1
            take = min(view.nbytes, need - len(self._head))
            self._head += view[:take]
            view = view[take:]
            if len(self._head) == need and need > _HEAD.size:
                self._parse_head(bytes(self._head))
                return view
            if not view.nbytes and len(self._head) < need:
                return None

    def _parse_head(self, head: bytes) -> None:
        meta_bytes, flags = head[_HEAD.size : -1], head[-1]
        where = f"v{self.expect['version']:06d}/{self.expect['batch_id']}"
        try:
            meta, counts = parse_meta(meta_bytes, where)
        except RolloutStoreError as e:
            raise UploadError(e.field, e.reason) from None
        for key, want in self.expect.items():
            if key != "node_key" and getattr(meta, key) != want:
                raise UploadError(f"meta.{key}", f"{getattr(meta, key)!r}, but the upload is for {want!r}")
        if meta.node_key.lower() != self.expect["node_key"]:
            raise UploadError("meta.node_key", "not the key that signed the upload")
        try:
            self.limits.check_counts(counts, where)
        except RolloutStoreError as e:
            raise UploadError(e.field, e.reason, 413) from None
        if flags >> len(OPTIONAL_FIELDS):
            raise UploadError("stream", f"optional-field flags {flags:#04x} name fields this pool does not know")
        optional = tuple(name for i, (name, _, _) in enumerate(OPTIONAL_FIELDS) if flags >> i & 1)
        total = stream_length(counts, len(meta_bytes), optional)
        if total != self.length:
            raise UploadError(
                "stream",
                f"meta.json's counts ({counts['num_samples']} samples, {counts['num_tokens']} tokens, "
                f"{counts['num_proof_bytes']} proof bytes) make a {total}-byte stream, "
                f"the request announced {self.length} bytes",
            )
        self.meta, self.meta_bytes, self.counts = meta, meta_bytes, counts
        self._fields = list(FIELDS + tuple(f for f in OPTIONAL_FIELDS if f[0] in optional))
        lengths = expected_lengths(counts)
        for name, dtype, _ in self._fields:  # pages are committed as bytes arrive, not here
            self._arrays[name] = np.empty(lengths[name], np.dtype(dtype).newbyteorder("<"))
        self._views = [memoryview(self._arrays[name]).cast("B") for name, _, _ in self._fields]

    def _finish_if_complete(self) -> None:
        self.done = self.meta is not None and self._field == len(self._fields) and self.received == self.length

    def sha256(self) -> str:
        """The canonical digest of the batch received (fields hashed in parallel)."""
        return canonical_sha256(self._arrays, self.meta_bytes)

    def batch(self) -> RolloutBatch:
        """The batch the stream carried (call once `done`); its values are the ones hashed."""
        if not self.done:
            raise UploadError("stream", f"ended after {self.received} of {self.length} bytes", 400)
        return RolloutBatch(
            meta=self.meta, **{name: self._arrays[name].astype(dtype, copy=False) for name, dtype, _ in self._fields}
        )


def pieces_of(chunks: list[memoryview], size: int) -> Iterator[memoryview]:
    """`chunks` cut into pieces of at most `size` bytes (a sender's writes), without copying."""
    for chunk in chunks:
        for start in range(0, chunk.nbytes, size):
            yield chunk[start : start + size]
