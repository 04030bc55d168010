"""Torch-side reference scoring: HF forward outputs checked against numpy, vLLM prompt logprobs against HF."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from gpu_workers.scoring import hf_forward, token_logprobs_from_logits, vllm_prompt_logprobs

QWEN2_TIED = dict(family="qwen2")
QWEN3_UNTIED = dict(family="qwen3", tie_embeddings=False)
LLAMA3_ROPE = dict(family="llama", rope_scaling="llama3:8.0")


def random_sequences(lengths=(5, 33, 70), vocab=512, seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def test_token_logprobs_from_logits_matches_torch():
    import torch

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((9, 50)) * 5 + 1e4).astype(np.float32)  # large offset: must stay stable
    tokens = rng.integers(0, 50, 9)
    expected = torch.log_softmax(torch.from_numpy(logits).double(), -1)[torch.arange(8), tokens[1:]].numpy()
    got = token_logprobs_from_logits(logits, tokens)
    assert got.shape == (8,) and got.dtype == np.float64
    np.testing.assert_allclose(got, expected, atol=1e-9)
    np.testing.assert_allclose(token_logprobs_from_logits(np.zeros((3, 7)), [0, 1, 2]), -np.log(7) * np.ones(2))


@pytest.mark.parametrize("kwargs", [QWEN2_TIED, QWEN3_UNTIED, LLAMA3_ROPE], ids=["qwen2", "qwen3", "llama"])
def test_hf_forward_hidden_is_final_norm_and_logits_its_projection(tiny_model, kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    path = tiny_model(**kwargs)
    sequences = random_sequences()
    outputs = hf_forward(path, sequences)

    tensors = load_file(path / "model.safetensors")
    head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied: no lm_head in the file
    eps = json.loads((path / "config.json").read_text())["rms_norm_eps"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    captured = []
    model.model.norm.register_forward_hook(lambda module, args, out: captured.append(args[0][0].numpy()))
    for tokens, out in zip(sequences, outputs):
        assert out.logits.shape == (len(tokens), 512) and out.hidden.shape == (len(tokens), 128)
        assert out.logits.dtype == np.float32 and out.hidden.dtype == np.float32
        with torch.no_grad():
            model(torch.tensor([tokens]))
        x = captured.pop().astype(np.float64)  # the final norm's input, normalised here in numpy
        normed = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * tensors["model.norm.weight"]
        np.testing.assert_allclose(out.hidden, normed, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(out.logits, out.hidden @ head.T, atol=1e-4, rtol=1e-5)


def test_hf_forward_honours_dtype(tiny_model):
    path = tiny_model(**QWEN2_TIED)
    tokens = random_sequences((40,))
    fp32 = token_logprobs_from_logits(hf_forward(path, tokens)[0].logits, tokens[0])
    bf16 = token_logprobs_from_logits(hf_forward(path, tokens, dtype="bfloat16")[0].logits, tokens[0])
    assert 1e-4 < np.abs(bf16 - fp32).max() < 0.5


@pytest.mark.vllm
def test_vllm_prompt_logprobs_match_hf_twice_in_one_process(tiny_model):
    from transformers import AutoTokenizer

    for kwargs in (QWEN2_TIED, LLAMA3_ROPE):  # two engines, one after the other, in this process
        path = tiny_model(**kwargs)
        chat = AutoTokenizer.from_pretrained(path).apply_chat_template(
            [{"role": "user", "content": "Compute 12+35."}], add_generation_prompt=True
        )["input_ids"]
        sequences = random_sequences() + [list(chat)]
        got = vllm_prompt_logprobs(path, sequences)
        for tokens, logprobs, hf in zip(sequences, got, hf_forward(path, sequences)):
            assert logprobs.shape == (len(tokens) - 1,) and logprobs.dtype == np.float32
            np.testing.assert_allclose(logprobs, token_logprobs_from_logits(hf.logits, tokens), atol=1e-3, rtol=0)
