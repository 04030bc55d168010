"""Reference scoring with the torch stacks (HF transformers and vLLM), used to check the JAX models.

- `hf_forward`: logits and final hidden states (the output of the last norm, the LM head's input) of each
  sequence, from `transformers`, one sequence at a time (no padding, no attention mask subtleties).
- `vllm_prompt_logprobs`: the logprob of every prompt token given the tokens before it, from an in-process
  vLLM engine that is shut down before returning (so that a process can call it again).
- `token_logprobs_from_logits`: the same quantity computed from logits in float64 numpy, to compare the two.

Both loaders score in the dtype asked for (float32 or bfloat16) and return float32 numpy arrays.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class HFOutput:
    """One sequence scored by transformers."""

    logits: np.ndarray  # float32 [len, vocab]: logits[t] predicts token t+1
    hidden: np.ndarray  # float32 [len, hidden]: final-norm output, HF `hidden_states[-1]`


def hf_forward(
    model_dir: str | Path, sequences: list[list[int]], dtype: str = "float32", adapter: str | Path | None = None
) -> list[HFOutput]:
    """Run the HF model in `model_dir` on each sequence and return its logits and final hidden states (float32;
    float64 when `dtype` is "float64"); with `adapter`, a PEFT adapter directory applied on it (PEFT's layers,
    not merged)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).to(getattr(torch, dtype))
    model.eval()
    keep = torch.float64 if dtype == "float64" else torch.float32  # a float64 reference stays float64
    outputs = []
    with torch.no_grad():
        for tokens in sequences:
            out = model(torch.tensor([tokens], dtype=torch.long), output_hidden_states=True, use_cache=False)
            outputs.append(
                HFOutput(logits=out.logits[0].to(keep).numpy(), hidden=out.hidden_states[-1][0].to(keep).numpy())
            )
    return outputs


def token_logprobs_from_logits(logits: np.ndarray, tokens: list[int] | np.ndarray) -> np.ndarray:
    """Logprob of tokens[t] under logits[t-1] for t = 1..len-1, by a float64 log-softmax.

    `logits`: [len, vocab] of the sequence `tokens` (length len); returns float64 [len-1].
    """
    logits = np.asarray(logits, dtype=np.float64)[:-1]
    targets = np.asarray(tokens)[1:]
    top = logits.max(axis=-1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    return logits[np.arange(len(targets)), targets] - log_z


def vllm_prompt_logprobs(
    model_dir: str | Path,
    sequences: list[list[int]],
    dtype: str = "float32",
    max_model_len: int | None = None,
    seed: int = 0,
    enforce_eager: bool = True,
    adapter: str | Path | None = None,
    **engine_args,
) -> list[np.ndarray]:
    """Score each sequence as a vLLM prompt: float32 [len-1], the logprob of token t given tokens < t; with
    `adapter`, through vLLM's LoRA layers (`enable_lora`, one `LoRARequest` for the PEFT directory).

    Starts an in-process engine (eager unless `enforce_eager=False`; `engine_args` go to `vllm.LLM`; set
    `VLLM_ENABLE_V1_MULTIPROCESSING=0` and a small `VLLM_CPU_KVCACHE_SPACE` on CPU) and shuts it down before
    returning. `max_model_len` defaults to the longest sequence plus the one token that vLLM must generate.
    `prompt_logprobs` are the raw model's (log_softmax of the logits, no temperature), and prefix caching is
    off so every prompt is recomputed.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if any(len(tokens) < 2 for tokens in sequences):
        raise ValueError("every sequence needs at least 2 tokens to have a prompt logprob")
    lora_request = None
    if adapter is not None:
        import json

        from vllm.lora.request import LoRARequest

        rank = json.loads((Path(adapter) / "adapter_config.json").read_text())["r"]
        engine_args = {"enable_lora": True, "max_lora_rank": max(8, rank), "max_loras": 1, **engine_args}
        lora_request = LoRARequest("adapter", 1, str(adapter))
    llm = LLM(
        model=str(model_dir),
        dtype=dtype,
        enforce_eager=enforce_eager,
        seed=seed,
        max_model_len=max_model_len or max(len(tokens) for tokens in sequences) + 1,
        enable_prefix_caching=False,
        **engine_args,
    )
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        results = llm.generate(
            [TokensPrompt(prompt_token_ids=list(tokens)) for tokens in sequences],
            params,
            use_tqdm=False,
            lora_request=lora_request,
        )
        # prompt_logprobs[0] is None (no context); entry t maps token ids to Logprob and holds tokens[t].
        return [
            np.array(
                [entry[token].logprob for entry, token in zip(result.prompt_logprobs[1:], tokens[1:])], dtype=np.float32
            )
            for result, tokens in zip(results, sequences)
        ]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
