"""Pack variable-length samples into the learner's fixed [micro_batches, rows, seq_len] arrays.

A `Sample` is one completion with its prompt: tokens, the inference engine's logprobs, its advantage and the
policy version that generated it. `pack` places samples into rows of `seq_len` tokens (first-fit decreasing,
several samples per row, never splitting one), groups rows into micro-batches of `rows` rows, and returns
a `PackedBatch` of numpy arrays, all aligned with `tokens`:

| field | dtype | meaning |
| --- | --- | --- |
| `tokens` | int32 | token ids; 0 on padding |
| `positions` | int32 | position inside its own sample (RoPE restarts at every sample) |
| `segment_ids` | int32 | 1, 2, ... per sample inside a row; 0 = padding (attention never crosses segments) |
| `loss_mask` | float32 | 1 on the tokens trained on, the sampled ones: a completion; an episode's model turns |
| `advantages` | float32 | the sample's advantage on each of its sampled tokens |
| `inference_logprobs` | float32 | the worker's logprob of each sampled token (0 elsewhere) |
| `completion_lens` | float32 | the number of sampled tokens of the token's sample (for per-sequence means) |

Token t's logprob comes from the logits at t-1, so the loss reads `loss_mask[:, 1:]` against `logits[:, :-1]`;
a sample's first token is a prompt token, so no completion token is ever predicted across a boundary.

The number of micro-batches is rounded up to a multiple of `multiple_of` (the optimizer steps per batch)
with empty rows; empty rows have no loss tokens and cost only compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


class PackingError(ValueError):
    """A sample cannot be packed (too long, empty completion, inconsistent arrays); the message names it."""


@dataclasses.dataclass(frozen=True)
class Sample:
    tokens: np.ndarray  # int32 [n]: prompt then completion
    prompt_len: int
    logprobs: np.ndarray  # float32 [n]: inference logprob of each completion token, 0 on prompt tokens
    advantage: float
    version: int  # policy version that generated it
    reward: float = 0.0
    name: str = ""  # where it came from (batch id and index), for error messages
    sampled: np.ndarray | None = None  # uint8 [n]: 1 on the tokens the model sampled (None: every completion token)

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    def loss_mask(self) -> np.ndarray:
        """float32 [n]: 1 on the tokens trained on (`sampled`; else every token after the prompt)."""
        if self.sampled is not None:
            return np.asarray(self.sampled, np.float32)
        mask = np.zeros(len(self.tokens), np.float32)
        mask[self.prompt_len :] = 1.0
        return mask


@dataclasses.dataclass
class PackedBatch:
    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    completion_lens: np.ndarray
    versions: list[int]  # one per packed sample, for the staleness histogram
    num_samples: int

    ARRAYS = ("tokens", "positions", "segment_ids", "loss_mask", "advantages", "inference_logprobs", "completion_lens")

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in self.ARRAYS}

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.tokens.shape

    @property
    def completion_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _check(sample: Sample, i: int, seq_len: int, truncate: bool) -> Sample:
    where = sample.name or f"sample {i}"
    n = len(sample.tokens)
    if len(sample.logprobs) != n:
        raise PackingError(f"{where}: {n} tokens but {len(sample.logprobs)} logprobs")
    if not 1 <= sample.prompt_len < n:
        raise PackingError(f"{where}: prompt_len {sample.prompt_len} must be in [1, {n}) (a completion is required)")
    if sample.sampled is not None:
        mask = np.asarray(sample.sampled)
        if len(mask) != n or np.any(mask[: sample.prompt_len] != 0) or not np.any(mask):
            raise PackingError(f"{where}: the sampled mask must hold {n} values, 0 on the prompt, and a 1")
    if n > seq_len:
        if not truncate or sample.prompt_len >= seq_len:
            raise PackingError(
                f"{where}: {n} tokens ({sample.prompt_len} prompt) do not fit in seq_len {seq_len}"
                + ("" if truncate else "; raise trainer.seq_len or enable truncation")
            )
        sample = dataclasses.replace(
            sample,
            tokens=sample.tokens[:seq_len],
            logprobs=sample.logprobs[:seq_len],
            sampled=None if sample.sampled is None else np.asarray(sample.sampled)[:seq_len],
        )
    return sample


def pack(
    samples: Sequence[Sample],
    rows: int,
    seq_len: int,
    multiple_of: int = 1,
    truncate: bool = False,
    micro_batches: int | None = None,
) -> PackedBatch:
    """Pack `samples` into [m, rows, seq_len] arrays, m a multiple of `multiple_of` (see the module docstring).

    `micro_batches` fixes m (padding with empty rows), so that every step has the same shapes and the train
    step compiles once; more samples than fit are an error.
    """
    if not samples:
        raise PackingError("nothing to pack: no samples")
    samples = [_check(s, i, seq_len, truncate) for i, s in enumerate(samples)]
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].tokens))
    free: list[int] = []  # tokens left per row
    placement: list[list[int]] = []
    for i in order:
        n = len(samples[i].tokens)
        row = next((r for r, left in enumerate(free) if left >= n), None)
        if row is None:
            free.append(seq_len)
            placement.append([])
            row = len(free) - 1
        free[row] -= n
        placement[row].append(i)
    micro = math.ceil(len(placement) / rows)
    if micro_batches is not None:
        if micro > micro_batches:
            raise PackingError(
                f"{len(samples)} samples need {micro} micro-batches of {rows} x {seq_len} tokens, "
                f"more than the {micro_batches} configured"
            )
        micro = micro_batches
    micro = math.ceil(micro / multiple_of) * multiple_of
    shape = (micro * rows, seq_len)
    out = {
        "tokens": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "advantages": np.zeros(shape, np.float32),
        "inference_logprobs": np.zeros(shape, np.float32),
        "completion_lens": np.zeros(shape, np.float32),
    }
    for r, members in enumerate(placement):
        pos = 0
        for seg, i in enumerate(members, start=1):
            s = samples[i]
            n = len(s.tokens)
            sl = slice(pos, pos + n)
            out["tokens"][r, sl] = s.tokens
            out["positions"][r, sl] = np.arange(n)
            out["segment_ids"][r, sl] = seg
            mask = s.loss_mask()
            out["loss_mask"][r, sl] = mask
            out["advantages"][r, sl] = s.advantage * mask
            out["inference_logprobs"][r, sl] = np.where(mask > 0, s.logprobs, 0.0)
            out["completion_lens"][r, sl] = mask.sum()
            pos += n
    arrays = {k: v.reshape(micro, rows, seq_len) for k, v in out.items()}
    return PackedBatch(**arrays, versions=[s.version for s in samples], num_samples=len(samples))
