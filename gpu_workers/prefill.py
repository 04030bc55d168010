"""Validator prefill: recompute, for prompt + completion, the hidden states and logits a worker claims to have used.

For a prompt of P tokens and a completion of n tokens, row j (j = 0..n-1) of the result is the final-norm
output at position P-1+j, the state whose logits sampled completion token j: the rows a worker's TOPLOC
capture commits to (`gpu_workers.capture`), and the logits the sampling check needs.

Runs Hugging Face transformers in the dtype the worker declared. Sequences are grouped into right-padded
batches of at most `batch_tokens` tokens (padded size), longest first, so the validator's batch composition
is its own, never the worker's; padding is masked, so it changes nothing but rounding. The LM head runs only
on the completion rows. A vLLM prefill (`prompt_logprobs`) scored as fast as transformers on CPU (64 x 256
tokens) but needs an engine start and a hook, so it is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("bfloat16", "float16", "float32")


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
        self, model_dir: str | Path, dtype: str = "bfloat16", device: str = "cpu", batch_tokens: int = 8192
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens: expected a positive int, got {batch_tokens}")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device)
        self.model.eval()
        self.decoder = self.model.get_decoder()
        self.head = self.model.get_output_embeddings()
        self.vocab_size = self.model.config.vocab_size
        self.device, self.dtype, self.batch_tokens = device, dtype, batch_tokens

    def run(self, samples: list[tuple[list[int], list[int]]]) -> list[Prefilled]:
        """Recompute each (prompt tokens, completion tokens) pair; results in the order given.

        Raises ValueError naming the sample for an empty prompt or completion or a token id outside the vocab.
        """
        import torch

        for i, (prompt, completion) in enumerate(samples):
            if len(prompt) == 0 or len(completion) == 0:
                raise ValueError(
                    f"sample {i}: prompt ({len(prompt)} tokens) and completion ({len(completion)} "
                    "tokens) must both be non-empty"
                )
            bad = [t for t in (*prompt, *completion) if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"sample {i}: token ids {bad[:5]} lie outside the vocab (0..{self.vocab_size - 1})")
        results: list[Prefilled | None] = [None] * len(samples)
        with torch.inference_mode():
            for batch in self._batches(samples):
                width = max(len(samples[i][0]) + len(samples[i][1]) for i in batch)
                ids = torch.zeros(len(batch), width, dtype=torch.long)
                mask = torch.zeros(len(batch), width, dtype=torch.long)
                for row, i in enumerate(batch):
                    seq = list(samples[i][0]) + list(samples[i][1])
                    ids[row, : len(seq)] = torch.tensor(seq)
                    mask[row, : len(seq)] = 1
                states = self.decoder(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                ).last_hidden_state
                hidden = [
                    states[row, len(samples[i][0]) - 1 : len(samples[i][0]) - 1 + len(samples[i][1])]
                    for row, i in enumerate(batch)
                ]
                # one LM head matmul over the batch's completion rows, then split per sample
                logits = self.head(torch.cat(hidden)).float().cpu().split([len(h) for h in hidden])
                for i, h, z in zip(batch, hidden, logits):
                    results[i] = Prefilled(hidden=h.cpu(), logits=z)
        return results

    def _batches(self, samples: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Sample indices grouped longest first, each group's padded size within `batch_tokens` (or 1 sample)."""
        lengths = [len(p) + len(c) for p, c in samples]
        batches: list[list[int]] = []
        for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
            if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= self.batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches
