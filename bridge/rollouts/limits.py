"""What a reader holds a rollout batch to before it reads any array (`RolloutStore.read(limits=)`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from bridge.rollouts.schema import PROOF_CHUNK_BYTES, PROOF_CHUNK_TOKENS, RolloutStoreError

if TYPE_CHECKING:
    from bridge.rollouts.batch import RolloutBatch


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
