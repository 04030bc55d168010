"""HF directory -> JAX -> HF directory: bytes, layout, loading in transformers, and every bad-input path."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as st_load_numpy
from safetensors.torch import load_file as st_load_torch
from transformers import AutoModelForCausalLM

from bridge.weights import STABLE_FILE, WeightsError, verify_manifest
from jax_trainer.models import export_hf, load_hf
from jax_trainer.sharding import make_mesh


def _torch_tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(st_load_torch(f))
    return out


def _hf_logits(model_dir, tokens):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("family, dtype", [("qwen2", "float32"), ("qwen3", "bfloat16"), ("llama", "float32")])
def test_import_export_is_byte_identical(tiny_model, tmp_path, family, dtype):
    src = tiny_model(family=family, dtype=dtype, tie_embeddings=family == "qwen2")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    model = load_hf(src, mesh=mesh, param_dtype=dtype)
    export_hf(model, tmp_path / "v000007", version=7, source_dir=src, dtype=dtype)
    before, after = _torch_tensors(src), _torch_tensors(tmp_path / "v000007")
    assert set(before) == set(after)
    for name, t in after.items():
        assert t.dtype == before[name].dtype and t.shape == before[name].shape, name
        assert t.view(torch.uint8).numpy().tobytes() == before[name].view(torch.uint8).numpy().tobytes(), name


def test_export_layout_manifest_and_transformers_logits(tiny_model, tmp_path):
    src = tiny_model(family="llama")
    model = load_hf(src, mesh=make_mesh(fsdp=8))
    out = tmp_path / "weights" / "v000123"
    result = export_hf(model, out, version=123, source_dir=src, dtype="float32", max_shard_bytes=600_000)
    names = sorted(p.name for p in out.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    for required in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        "manifest.json",
        STABLE_FILE,
    ):
        assert required in names
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporary directory left behind"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 123
    listed = {e["name"]: e for e in manifest["files"]}
    assert set(listed) == set(names) - {"manifest.json", STABLE_FILE}
    for name, entry in listed.items():
        data = (out / name).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert manifest["total_size"] == sum(e["size"] for e in manifest["files"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == result.tensor_bytes
    for shard in shards:  # the reference safetensors library reads our files
        assert st_load_numpy(out / shard)

    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 24))
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(_hf_logits(out, tokens) - ours).max() <= 1e-4


def test_bf16_export_from_float32_params_loads_in_transformers(tiny_model, tmp_path):
    src = tiny_model(family="qwen2")
    model = load_hf(src, mesh=make_mesh(fsdp=8))
    export_hf(model, tmp_path / "v1", version=1, source_dir=src, dtype="bfloat16")
    config = json.loads((tmp_path / "v1" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "v1")
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    expected = np.asarray(model.embed[...]).astype(jnp.bfloat16).astype(np.float32)
    assert np.array_equal(hf.model.embed_tokens.weight.detach().float().numpy(), expected)


def test_export_refuses_to_overwrite_a_stable_version_and_replaces_a_partial_one(tiny_model, tmp_path):
    src = tiny_model(family="qwen2")
    model = load_hf(src, mesh=make_mesh(fsdp=8))
    out = tmp_path / "v000002"
    out.mkdir()
    (out / "junk.safetensors").write_bytes(b"half written")  # a crashed export: no STABLE
    export_hf(model, out, version=2, source_dir=src, dtype="float32")
    assert not (out / "junk.safetensors").exists() and (out / STABLE_FILE).exists()
    with pytest.raises(WeightsError, match="already holds a complete version"):
        export_hf(model, out, version=2, source_dir=src, dtype="float32")


@pytest.fixture
def export_copy(tiny_model, tmp_path):
    src = tiny_model(family="qwen2")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _load(model_dir, **kw):
    return load_hf(model_dir, mesh=make_mesh(fsdp=8), **kw)


def _drop(name):
    def edit(tensors):
        del tensors[name]

    return edit


def _set(name, value):
    def edit(tensors):
        tensors[name] = value

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            _drop("model.layers.1.mlp.up_proj.weight"),
            r"model\.layers\.1\.mlp\.up_proj\.weight' is missing \(expected shape \[\d+, 128\]\)",
        ),
        (
            _set("model.norm.weight", np.ones(96, np.float32)),
            r"'model\.norm\.weight' has shape \[96\], expected \[128\]",
        ),
        (
            _set("model.layers.0.mlp.extra.weight", np.ones(3, np.float32)),
            r"unexpected tensors.*model\.layers\.0\.mlp\.extra\.weight",
        ),
    ],
    ids=["missing", "misshaped", "unexpected"],
)
def test_tensor_problems_are_named(export_copy, edit, message):
    from safetensors.numpy import save_file

    st = export_copy / "model.safetensors"
    tensors = st_load_numpy(st)
    edit(tensors)
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=message):
        _load(export_copy)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda b: b[: len(b) // 2], "corrupt safetensors file|truncated"),
        (lambda b: b[:4], "no header length"),
        (lambda b: struct.pack("<Q", 10**12) + b[8:], "header length"),
        (lambda b: b[:8] + b"{not json" + b[17:], "corrupt safetensors header"),
        (lambda b: b + b"\0" * 16, "tensors end at byte"),
    ],
)
def test_corrupt_safetensors_file_is_named(export_copy, corrupt, message):
    st = export_copy / "model.safetensors"
    st.write_bytes(corrupt(st.read_bytes()))
    with pytest.raises(WeightsError, match=message) as info:
        _load(export_copy)
    assert str(st) in str(info.value)


def test_flipped_bit_is_caught_by_the_manifest(tiny_model, tmp_path):
    src = tiny_model(family="qwen3")
    export_hf(_load(src), tmp_path / "v3", version=3, source_dir=src, dtype="float32")
    shard = next((tmp_path / "v3").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{shard.name}: sha256 does not match"):
        verify_manifest(tmp_path / "v3")
    with pytest.raises(WeightsError, match="sha256 does not match"):
        _load(tmp_path / "v3")


def test_directory_without_safetensors_says_what_it_found(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 8,
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
    )
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(WeightsError, match=r"found: config.json, pytorch_model.bin\); only safetensors checkpoints"):
        _load(tmp_path)


def test_import_never_places_a_whole_sharded_tensor_on_one_device(tiny_model):
    model = load_hf(tiny_model(family="llama"), mesh=make_mesh(fsdp=4, tensor=2))
    gate = model.layers.mlp.gate_proj[...]
    assert all(s.data.size == gate.size // 8 for s in gate.addressable_shards)
    assert jax.device_count() == 8
