"""Tiny offline HF models: they load in transformers as they are, with random (not HF-init) parameters."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from intellect.tiny_model import add_arguments, build_tokenizer, make_config, parse_rope_scaling, random_tensor, run

CASES = {
    "qwen2-tied": dict(family="qwen2"),
    "qwen3-untied": dict(family="qwen3", tie_embeddings=False),
    "llama-llama3-rope": dict(family="llama", rope_scaling="llama3:8.0"),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model):
    kwargs = CASES[request.param]
    return kwargs, tiny_model(**kwargs)


def test_directory_is_complete_hf(case, tmp_path):
    from transformers import AutoConfig

    kwargs, path = case
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    written = json.loads((path / "config.json").read_text())
    AutoConfig.from_pretrained(path).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == written  # exactly what transformers writes
    assert written["model_type"] == kwargs["family"]
    assert written["tie_word_embeddings"] == (kwargs["family"] != "llama" and kwargs.get("tie_embeddings", True))
    assert written["vocab_size"] == 512 and written["hidden_size"] == 128 and written["dtype"] == "float32"
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2] and generation["pad_token_id"] == 0


def test_llama3_rope_parameters(tiny_model):
    config = json.loads((tiny_model(**CASES["llama-llama3-rope"]) / "config.json").read_text())
    assert config["rope_parameters"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    }


def test_loads_without_missing_or_unexpected_keys(case):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs, path = case
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (kwargs["family"] != "llama" and kwargs.get("tie_embeddings", True))
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 512, (1, 48)))
    with torch.no_grad():
        logits = model(tokens).logits[0]
    assert logits.std(dim=-1).min() > 1.0, "logits too flat for tests that must be able to fail"


def test_parameters_are_random_not_hf_init(case):
    kwargs, path = case
    tensors = load_file(path / "model.safetensors")
    norms = [n for n in tensors if n.endswith("norm.weight")]
    biases = [n for n in tensors if n.endswith(".bias")]
    for name in norms:
        assert not np.allclose(tensors[name], 1.0), name
        assert abs(tensors[name].mean() - 1.0) < 0.1, name
    for name in biases:
        assert np.abs(tensors[name]).mean() > 0.01, name
    assert len(biases) == (3 * 2 if kwargs["family"] == "qwen2" else 0)  # q/k/v bias in 2 layers
    if kwargs["family"] == "qwen3":
        assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= set(norms)
    assert ("lm_head.weight" in tensors) == (not (kwargs["family"] != "llama" and kwargs.get("tie_embeddings", True)))
    assert all(t.dtype == np.float32 for t in tensors.values())


def test_tokenizer_round_trip_and_chat_template(case):
    from transformers import AutoTokenizer

    _, path = case
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 0
    for text in (
        "12+35=47",
        "Reverse the string: hello\nAnswer: olleh",
        "The answer is \\boxed{7}.",
        "naïve café ☃ 😀 tabs\tand  spaces",
    ):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    digits = tokenizer.encode("12+35=47", add_special_tokens=False)
    assert [tokenizer.decode([i]) for i in digits] == list("12+35=47")  # digits split one per token
    assert len(tokenizer.encode("the answer is", add_special_tokens=False)) < len("the answer is")  # merges
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == rendered.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 2  # special tokens are single tokens


def test_cli_bf16_padded_vocab_tied_llama_linear_rope(tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            str(tmp_path / "m"),
            "--family",
            "llama",
            "--tie",
            "--dtype",
            "bfloat16",
            "--vocab",
            "640",
            "--rope-scaling",
            "linear:2.0",
            "--layers",
            "1",
            "--seed",
            "3",
        ]
    )
    assert run(args) == 0
    assert "model.safetensors" in capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["vocab_size"] == 640 and config["tie_word_embeddings"]
    assert config["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert len(AutoTokenizer.from_pretrained(tmp_path / "m")) == 512
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "m", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16 and model.model.embed_tokens.weight.shape == (640, 128)


def test_random_tensor_rules_are_seeded_per_name():
    a = random_tensor("model.layers.0.mlp.up_proj.weight", (384, 128), seed=0, hidden=128)
    assert np.array_equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", (384, 128), seed=0, hidden=128))
    assert not np.array_equal(a, random_tensor("model.layers.0.mlp.up_proj.weight", (384, 128), seed=1, hidden=128))
    assert not np.array_equal(a, random_tensor("model.layers.1.mlp.up_proj.weight", (384, 128), seed=0, hidden=128))
    assert abs(a.std() - 1 / np.sqrt(128)) < 0.01
    with pytest.raises(ValueError, match="no init rule"):
        random_tensor("model.rotary_emb.inv_freq", (16,), seed=0, hidden=128)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
        parse_rope_scaling("yarn:4")
    with pytest.raises(ValueError, match="unknown model family"):
        make_config(
            "gpt2",
            vocab_size=512,
            hidden=128,
            layers=1,
            heads=4,
            kv_heads=2,
            intermediate=None,
            head_dim=None,
            tie_embeddings=True,
            rope_scaling=None,
            rope_theta=1e4,
            dtype="float32",
        )
    with pytest.raises(ValueError, match="qwen2 derives head_dim"):
        make_config(
            "qwen2",
            vocab_size=512,
            hidden=128,
            layers=1,
            heads=4,
            kv_heads=2,
            intermediate=None,
            head_dim=64,
            tie_embeddings=True,
            rope_scaling=None,
            rope_theta=1e4,
            dtype="float32",
        )
    with pytest.raises(ValueError, match="too small"):
        build_tokenizer(100)


def test_tokenizer_is_deterministic(tiny_model):
    path = tiny_model(**CASES["qwen2-tied"])
    rebuilt = json.loads(build_tokenizer().backend_tokenizer.to_str())
    assert rebuilt["model"] == json.loads((path / "tokenizer.json").read_text())["model"]
