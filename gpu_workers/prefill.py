"""Validator prefill: recompute, for prompt + completion, the hidden states and logits a worker claims to have used.

For a prompt of P tokens and a completion of n tokens, row j (j = 0..n-1) of the result is the final-norm
output at position P-1+j, the state whose logits sampled completion token j: the rows a worker's TOPLOC
capture commits to (`gpu_workers.capture`), and the logits the sampling check needs.

Runs Hugging Face transformers in the dtype the worker declared, on `device` (`resolve_device` turns the
`[validator] device` setting into one). Sequences are grouped into right-padded batches of at most
`batch_tokens` tokens (padded size), longest first, so the validator's batch composition is its own, never
the worker's; padding is masked, so it changes nothing but rounding. The LM head runs only on the completion
rows. On CPU a batch holds 8192 tokens; on a GPU `batch_tokens_for` sizes it from the memory left free after
the weights load (at most `memory_share` of the card). Results come back on the CPU, where the sampling
check reads them; the replay check moves each sample's logits back to the device
(`checks.check_replay_batch`). A vLLM prefill (`prompt_logprobs`) scored as fast as transformers on CPU
(64 x 256 tokens) but needs an engine start and a hook, so it is not offered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32")
CPU_BATCH_TOKENS = 8192
"""Padded tokens per prefill batch on a CPU."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def resolve_device(spec: str, key: str = "validator.device") -> str:
    """The torch device a device setting names: "auto" is "cuda:0" when torch sees a CUDA device, else "cpu";
    "cuda" is "cuda:0". ValueError naming `key` for a malformed setting or a GPU that is not there."""
    import torch

    if spec == "cpu":
        return "cpu"
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    match = re.fullmatch(r"cuda(?::([0-9]+))?", spec)
    if match is None:
        raise ValueError(f"{key} = {spec!r}: expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{key} = {spec!r}: torch {torch.__version__} sees no CUDA device on this machine "
            '(set it to "auto" or "cpu", or install a CUDA build of torch)'
        )
    index = int(match.group(1) or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"{key} = {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def batch_tokens_for(
    budget_bytes: int,
    *,
    hidden: int,
    intermediate: int,
    heads: int,
    vocab: int,
    max_len: int,
    dtype_bytes: int,
    reserve: float = 0.8,
) -> int:
    """Padded tokens per prefill batch that fit in `budget_bytes` of device memory (at least 1).

    What one token holds at the peak, in the model's dtype: the residual stream, the norm's output, the
    query, key, value and attention output (6 x `hidden`); the MLP's gate, up and their product
    (3 x `intermediate`); one row of attention scores per head over up to `max_len` keys (when the
    attention kernel materialises them); and its logits, in the dtype and as their float32 copy
    (`vocab` x (dtype + 4) bytes: every token may be a completion token). `reserve` of the budget is used,
    the rest left to the allocator's fragmentation."""
    if budget_bytes < 0 or min(hidden, intermediate, heads, vocab, max_len, dtype_bytes) < 1:
        raise ValueError(
            f"batch_tokens_for: budget {budget_bytes} B, hidden {hidden}, intermediate {intermediate}, heads "
            f"{heads}, vocab {vocab}, max_len {max_len}, dtype {dtype_bytes} B: expected positive sizes"
        )
    per_token = dtype_bytes * (6 * hidden + 3 * intermediate + heads * max_len) + vocab * (dtype_bytes + 4)
    return max(1, int(budget_bytes * reserve) // per_token)


@dataclass
class Prefilled:
    """The validator's recomputation for one sample's completion (n tokens)."""

    hidden: torch.Tensor
    """[n, hidden] in the prefill dtype: final-norm outputs at positions P-1 .. P+n-2."""
    logits: torch.Tensor
    """float32 [n, vocab]: logits[j] is the distribution completion token j was sampled from (before
    temperature and top-p)."""


class Prefill:
    """A loaded HF model that recomputes hidden states and logits of (prompt, completion) pairs."""

    def __init__(
        self,
        model_dir: str | Path,
        dtype: str = "bfloat16",
        device: str = "cpu",
        batch_tokens: int | None = None,
        *,
        memory_share: float = 0.2,
        max_len: int = 4096,
    ) -> None:
        """`device`: a torch device ("cpu", "cuda:0"; `resolve_device` makes one of a setting). `batch_tokens`:
        padded tokens per batch (None: `CPU_BATCH_TOKENS` on CPU; on CUDA `batch_tokens_for` the memory free
        after loading, at most `memory_share` of the device's, for sequences up to `max_len` tokens)."""
        import torch
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if batch_tokens is not None and batch_tokens < 1:
            raise ValueError(f"batch_tokens: expected a positive int, got {batch_tokens}")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.vocab_size = self.model.config.vocab_size
        self.device, self.dtype = str(device), dtype
        if batch_tokens is None:
            batch_tokens = CPU_BATCH_TOKENS
            if torch.device(device).type == "cuda":
                free, total = torch.cuda.mem_get_info(torch.device(device))
                config = self.model.config
                batch_tokens = batch_tokens_for(
                    min(free, int(memory_share * total)),
                    hidden=config.hidden_size,
                    intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
                    heads=config.num_attention_heads,
                    vocab=self.vocab_size,
                    max_len=max_len,
                    dtype_bytes=_DTYPE_BYTES[dtype],
                )
        self.batch_tokens = batch_tokens

    def run(self, samples: list[tuple[list[int], list[int]]]) -> list[Prefilled]:
        """Recompute each (prompt tokens, completion tokens) pair; results in the order given.

        Raises ValueError naming the sample for an empty prompt or completion or a token id outside the vocab.
        """
        for i, (prompt, completion) in enumerate(samples):
            if len(prompt) == 0 or len(completion) == 0:
                raise ValueError(
                    f"sample {i}: prompt ({len(prompt)} tokens) and completion ({len(completion)} "
                    "tokens) must both be non-empty"
                )
        return self.run_positions(
            [(list(p) + list(c), range(len(p), len(p) + len(c))) for p, c in samples],
        )

    def run_positions(self, samples) -> list[Prefilled]:
        """Recompute each (tokens, positions) pair, one prefill of the whole sequence: `hidden` and `logits` row j
        are the state and logits at position positions[j] - 1, the ones that sampled token positions[j] (a
        multi-turn episode's sampled tokens, across its turns). Positions must rise and lie in 1..len - 1.

        Raises ValueError naming the sample for malformed positions or a token id outside the vocab.
        """
        import numpy as np
        import torch

        rows_of = []
        for i, (tokens, positions) in enumerate(samples):
            pos = np.asarray(positions, dtype=np.int64)
            if len(pos) == 0 or pos[0] < 1 or pos[-1] >= len(tokens) or np.any(np.diff(pos) <= 0):
                raise ValueError(f"sample {i}: positions must rise within 1..{len(tokens) - 1} and not be empty")
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"sample {i}: token ids {bad[:5]} lie outside the vocab (0..{self.vocab_size - 1})")
            rows_of.append(torch.from_numpy(pos - 1))
        results: list[Prefilled | None] = [None] * len(samples)
        with torch.inference_mode():
            for batch in self._batches([len(samples[i][0]) for i in range(len(samples))]):
                width = max(len(samples[i][0]) for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    seq = list(samples[i][0])
                    ids[row, : len(seq)] = torch.tensor(seq)
                    mask[row, : len(seq)] = 1
                states = self.decoder(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                ).last_hidden_state
                hidden = [states[row].index_select(0, rows_of[i].to(states.device)) for row, i in enumerate(batch)]
                # one LM head matmul over the batch's scored rows, then split per sample
                logits = self.head(torch.cat(hidden)).float().cpu().split([len(h) for h in hidden])
                for i, h, z in zip(batch, hidden, logits):
                    results[i] = Prefilled(hidden=h.cpu(), logits=z)
        return results

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Sample indices grouped longest first, each group's padded size within `batch_tokens` (or 1 sample)."""
        batches: list[list[int]] = []
        for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= self.batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches
