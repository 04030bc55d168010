"""The validator's logprobs of an accepted batch: stored beside it, bound to it by a digest (docs/design.md section 6).

A worker reports each completion token's logprob, and the validator bounds the difference to its own
recomputation only by the engines' rounding (0.75 nats per token in bfloat16). Wherever the learner divides by
an engine logprob (pi_old with `loss.logprob_source = "inference"`, the TIS weights and mismatch masks under
"recompute") a worker could move that ratio within the bound. The validator, trusted, recomputed every one of
those logprobs in its prefill: it writes them here and puts their digest in its verdict; the orchestrator keeps
the digest with the batch and the learner reads them under it (`logprob_source = "validator"`).

    <store>/v000003/b-17/validator_logprobs/zarr.json  0 ...     one 1-D zarr v3 float32 array of T entries (the
                                                                  batch's `tokens`): each completion token's
                                                                  logprob on the full distribution at the pool's
                                                                  temperature from the validator's prefill logits
                                                                  (what `full_logprobs` is for the worker), 0 on
                                                                  prompt tokens

It lives in the batch's directory (retention deletes it with the batch) but is not part of the batch's digest
(the batch was committed before it was judged); it has its own:

    sha256(b"intellect-validator-logprobs/1\\n" + batch sha256 (64 hex, ASCII) + b"\\n" + u64le(T)
           + sha256(the T values as little-endian float32))

so a file is valid for one batch only, and one that anyone with write access to the store rewrote (a worker
where workers share the store) is refused by the learner: the batch then counts as invalid and is not trained
on, the same as a batch whose bytes were altered. The validator writes it unconditionally (a worker may have put
a file there first). Reading checks the declared shape and chunking before any value is read.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from bridge.rollouts import RolloutBatch, RolloutStore, RolloutStoreError, batch_path

FIELD = "validator_logprobs"
DIGEST_DOMAIN = b"intellect-validator-logprobs/1\n"
_MAX_CHUNKS = 4096
_SPARE_CHUNK_ELEMENTS = 1 << 16
_LOGPROB_SLACK = 1e-4  # float32 rounding of a log-softmax at its top


def logprobs_digest(batch_sha256: str, values: np.ndarray) -> str:
    """The hex digest of the validator's logprobs `values` (float32 [T]) of the batch committed as `batch_sha256`."""
    flat = np.ascontiguousarray(values, dtype=np.dtype("float32").newbyteorder("<"))
    outer = hashlib.sha256(DIGEST_DOMAIN + batch_sha256.encode("ascii") + b"\n" + struct.pack("<Q", flat.size))
    outer.update(hashlib.sha256(flat).digest())
    return outer.hexdigest()


def flat_logprobs(batch: RolloutBatch, per_sample: Sequence[np.ndarray | None]) -> np.ndarray:
    """The batch's layout of per-sample completion logprobs: float32 [T], 0 on every prompt token; ValueError when
    a sample has none (its prefill did not run) or another length than its completion."""
    if len(per_sample) != batch.num_samples:
        raise ValueError(f"validator logprobs: {len(per_sample)} samples for a batch of {batch.num_samples}")
    out = np.zeros(len(batch.tokens), np.float32)
    for i, values in enumerate(per_sample):
        start, end = int(batch.offsets[i]) + int(batch.prompt_lens[i]), int(batch.offsets[i + 1])
        if values is None or len(values) != end - start:
            got = "none" if values is None else len(values)
            raise ValueError(f"validator logprobs: sample {i} has {got} for {end - start} completion tokens")
        out[start:end] = values
    return out


def _where(batch: RolloutBatch) -> str:
    return batch_path(batch.meta.version, batch.meta.batch_id)


def write_validator_logprobs(store: RolloutStore, batch: RolloutBatch, batch_sha256: str, values: np.ndarray) -> str:
    """Write (replacing whatever is there) the validator's logprobs of `batch`; returns their digest."""
    where = _where(batch)
    values = np.asarray(values, np.float32)
    if values.shape != (len(batch.tokens),):
        raise RolloutStoreError(where, FIELD, f"{values.shape} values for {len(batch.tokens)} tokens")
    try:
        array = ts.open(
            {"driver": "zarr3", "metadata": store._metadata("float32", len(values))},
            kvstore=store.kvstore / f"{where}/{FIELD}/",
            context=store.context,
            create=True,
            delete_existing=True,
        ).result()
        if len(values):
            array.write(values).result()
    except Exception as e:  # tensorstore reports I/O and metadata errors as ValueError and kin
        raise RolloutStoreError(where, FIELD, f"writing failed: {e}") from e
    return logprobs_digest(batch_sha256, values)


def read_validator_logprobs(
    store: RolloutStore, batch: RolloutBatch, batch_sha256: str, expect_sha256: str | None
) -> np.ndarray:
    """The validator's logprobs of `batch` (read and verified: `RolloutStoreError` naming the batch and the field
    otherwise): float32 [T], checked against `expect_sha256` (the digest of the verdict; None: the validator wrote
    none, which is an error here), finite, at most 0 and 0 on every prompt token."""
    where = _where(batch)
    if expect_sha256 is None:
        raise RolloutStoreError(where, FIELD, "the verdict names no validator logprobs (judged by an older validator?)")
    prefix = where + "/"
    if not store._holds(prefix, FIELD, where):
        raise RolloutStoreError(where, FIELD, "missing: the validator's logprobs are not beside the batch")
    opened = store._open_array(prefix, FIELD, where)
    try:
        array = opened.result()
    except Exception as e:
        raise RolloutStoreError(where, FIELD, f"opening the array failed: {e}") from e
    length = len(batch.tokens)
    if array.dtype.numpy_dtype != np.dtype("float32") or array.rank != 1 or array.shape != (length,):
        raise RolloutStoreError(
            where, FIELD, f"stored as {array.dtype.numpy_dtype}{list(array.shape)}, the batch has {length} tokens"
        )
    if array.domain.inclusive_min != (0,):
        raise RolloutStoreError(where, FIELD, f"stored with domain {array.domain}")
    chunk = array.chunk_layout.read_chunk.shape
    if chunk is None or not 0 < chunk[0] <= max(length, _SPARE_CHUNK_ELEMENTS) or -(-length // chunk[0]) > _MAX_CHUNKS:
        raise RolloutStoreError(where, FIELD, f"chunk shape {chunk} is not one the reader accepts for {length} values")
    try:
        values = np.asarray(array.read().result(), np.float32)
    except Exception as e:
        raise RolloutStoreError(where, FIELD, f"reading failed: {e}") from e
    actual = logprobs_digest(batch_sha256, values)
    if actual != expect_sha256:
        raise RolloutStoreError(
            where, FIELD, f"digest {actual} differs from the validator's {expect_sha256} (rewritten after the verdict?)"
        )
    if not np.all(np.isfinite(values)) or np.any(values > _LOGPROB_SLACK):
        raise RolloutStoreError(where, FIELD, "values must be finite logprobs (<= 0)")
    starts = batch.offsets[:-1]
    on_prompts = np.add.reduceat(
        (values != 0).view(np.uint8), np.stack([starts, starts + batch.prompt_lens]).T.reshape(-1), dtype=np.int64
    )[0::2]
    if np.any(on_prompts):
        raise RolloutStoreError(where, FIELD, "non-zero logprob on a prompt token")
    return values
