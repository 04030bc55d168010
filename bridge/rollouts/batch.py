"""A rollout batch in memory (`RolloutBatch`: the flat arrays of docs/design.md section 6 and their
`meta`) and every invariant of the schema (`check_batch`), which the writer and the reader both enforce."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge.rollouts.schema import (
    _DTYPE,
    _FULL_LOGPROB_SLACK,
    FINISH_LENGTH,
    FINISH_STOP,
    OPTIONAL_FIELDS,
    PROOF_CHUNK_BYTES,
    PROOF_CHUNK_TOKENS,
    BatchMeta,
    BatchRef,
    RolloutStoreError,
    _where,
    expected_lengths,
    schema_fields,
)


@dataclasses.dataclass(frozen=True, eq=False)
class RolloutBatch:
    """One batch: `meta` and the arrays of `FIELDS` (flat, with offsets; see docs/design.md section 6); `sampled`
    makes it a schema-2 batch."""

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
    sampled: np.ndarray | None = None
    """Schema 2 (`SAMPLED_FIELD`): uint8 [T], 1 where the model sampled the token. None: a schema-1 batch, whose
    completion tokens were all sampled (`token_mask`, `sample_mask` give that mask)."""

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
        sampled: Sequence[Any] | None = None,
    ) -> RolloutBatch:
        """Concatenate per-sample sequences (tokens, logprobs, proof bytes) into the flat layout;
        `full_logprobs` (per sample, like `logprobs`; None: the batch does not hold the optional field);
        `sampled` (per sample, 0/1 per token; None: a schema-1 batch)."""
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
        if sampled is not None:
            if len(sampled) != n:
                raise RolloutStoreError(where, "sampled", f"{len(sampled)} entries for {n} samples")
            arrays["sampled"] = (
                np.concatenate([_cast(x, "uint8", where, "sampled") for x in sampled]) if n else np.zeros(0, np.uint8)
            )
        return cls(meta=meta, **arrays)

    @property
    def schema(self) -> int:
        """2 when the batch holds `sampled`, else 1 (the schema its meta.json states)."""
        return 1 if self.sampled is None else 2

    def fields(self) -> tuple[tuple[str, str, str], ...]:
        """(name, dtype, length) of every array this batch holds: its schema's fields, then its optional fields."""
        return schema_fields(self.schema) + tuple(f for f in OPTIONAL_FIELDS if getattr(self, f[0]) is not None)

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

    def token_mask(self) -> np.ndarray:
        """uint8 [T]: 1 on every token the model sampled (`sampled`; of a schema-1 batch, every completion token)."""
        if self.sampled is not None:
            return self.sampled
        lengths = self.lengths
        runs = np.stack([self.prompt_lens, lengths - self.prompt_lens], axis=1).reshape(-1)
        return np.repeat(np.tile(np.array([0, 1], np.uint8), len(lengths)), runs)

    def sample_mask(self, i: int) -> np.ndarray:
        """uint8 [sample i's length]: 1 on the tokens the model sampled (see `token_mask`)."""
        if self.sampled is not None:
            return self.sampled[self.offsets[i] : self.offsets[i + 1]]
        mask = np.ones(int(self.offsets[i + 1] - self.offsets[i]), np.uint8)
        mask[: int(self.prompt_lens[i])] = 0
        return mask

    def sample_proof(self, i: int) -> bytes:
        return self.proofs[self.proof_offsets[i] : self.proof_offsets[i + 1]].tobytes()


def _cast(values: Any, dtype: str, where: str, field: str) -> np.ndarray:
    """`values` as a 1-D array of `dtype`, refusing casts that would change a value (overflow, fractions)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise RolloutStoreError(where, field, f"expected a 1-D sequence, got shape {arr.shape}")
    out = arr.astype(dtype)
    if len(arr) and np.dtype(dtype).kind in "iu" and not np.array_equal(out.astype(arr.dtype), arr):
        raise RolloutStoreError(where, field, f"values do not fit {dtype}")
    return out


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
    if batch.sampled is not None:
        _check_sampled(batch, fail)
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
    if batch.sampled is None:
        chunks = -(-(lengths - batch.prompt_lens) // PROOF_CHUNK_TOKENS)
        fail(
            "proof_offsets",
            np.diff(proof_offsets) != chunks * PROOF_CHUNK_BYTES,
            f"proof bytes differ from {PROOF_CHUNK_BYTES} x ceil(completion length / {PROOF_CHUNK_TOKENS})",
        )
    else:
        chunks = -(-np.add.reduceat(batch.sampled, offsets[:-1], dtype=np.int64) // PROOF_CHUNK_TOKENS)
        fail(
            "proof_offsets",
            np.diff(proof_offsets) != chunks * PROOF_CHUNK_BYTES,
            f"proof bytes differ from {PROOF_CHUNK_BYTES} x ceil(sampled tokens / {PROOF_CHUNK_TOKENS})",
        )


def _check_sampled(batch: RolloutBatch, fail) -> None:
    """Schema 2's `sampled` (its length and dtype are checked already): 0 or 1; 0 on every prompt; 1 on each
    sample's first token after its prompt and on its last token; logprobs 0 wherever it is 0."""
    sampled, offsets = batch.sampled, batch.offsets
    fail("sampled", sampled > 1, "not 0 or 1")
    starts = offsets[:-1]
    bounds = np.stack([starts, starts + batch.prompt_lens]).T.reshape(-1)
    on_prompt = np.add.reduceat(sampled, bounds, dtype=np.int64)[0::2]
    fail("sampled", on_prompt > 0, "1 on a prompt token of the sample")
    fail(
        "sampled",
        sampled[starts + batch.prompt_lens] != 1,
        "0 on the sample's first token after its prompt (prompt_lens marks where the model starts)",
    )
    fail("sampled", sampled[offsets[1:] - 1] != 1, "0 on the sample's last token (an episode ends with a model turn)")
    unsampled = sampled == 0
    fail("logprobs", (batch.logprobs != 0) & unsampled, "non-zero logprob on a token the model did not sample")
    if batch.full_logprobs is not None:
        fail(
            "full_logprobs",
            (batch.full_logprobs != 0) & unsampled,
            "non-zero logprob on a token the model did not sample",
        )
