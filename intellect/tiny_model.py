"""Tiny, fully offline Hugging Face models for tests and demos (`intellect make-tiny-model`).

`make_tiny_model` writes a complete HF model directory (config, generation config, safetensors weights,
tokenizer with a ChatML chat template) that `transformers` and vLLM load as they are, with no model hub.

- The config is written by transformers' own config class (`Qwen2Config`, `Qwen3Config`, `LlamaConfig`) and
  the weights by `save_pretrained`, so the files are exactly what transformers writes.
- The tokenizer is a byte-level BPE trained with `tokenizers` on a small corpus generated here (English words,
  digits, arithmetic, reversed strings, chat words), so synthetic tasks tokenize sensibly. Digits are split
  one per token, as Qwen does. Special tokens: `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`.
- Every parameter is drawn from a seeded numpy generator (not HF's init, which sets norm weights to 1 and
  biases to 0 and would hide a bug that ignores them): linear weights N(0, 1/fan_in), norm weights
  1 + N(0, 0.1^2), biases N(0, 0.1^2), embeddings and LM head N(0, (3/sqrt(hidden))^2) so that the logits
  spread by about 3 units whether or not the embeddings are tied. Each tensor has its own generator seeded by
  (seed, tensor name), so a tensor's values do not depend on which other tensors exist.

Simplifications: no sliding window, no MoE, one safetensors file (the models are a few MB).
"""

from __future__ import annotations

import argparse
import json
import random
import zlib
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2", "qwen3", "llama")
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START, IM_END)  # ids 0, 1, 2
DEFAULT_VOCAB = 512
MAX_POSITION_EMBEDDINGS = 2048

# ChatML, as Qwen's instruct models use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen2's pre-tokenizer split: contractions, letters, single digits, punctuation runs, whitespace.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

WORDS = """the of and to a in is it you that he was for on are with as his they be at one have this from or
had by hot word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only round man
year came show every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near build self
earth father head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story saw far
sea draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class wind question
happen complete ship area half rock order fire south problem piece told knew pass since top whole king space
heard best hour better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow center
love person money serve appear road map rain rule govern pull cold notice voice unit power town fine certain
fly fall lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong special
mind behind clear tail produce fact street inch multiply nothing course stay wheel full force blue object
decide surface deep moon island foot system busy test record boat common gold possible plane stead dry wonder
laugh thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill east paint
language among sum add subtract divide reverse string solve compute result total equals plus minus times
""".split()
CHAT_WORDS = "system user assistant Answer: Question: Solve Reverse Compute Think step by step".split()


def _corpus(n_lines: int = 3000) -> list[str]:
    """A fixed synthetic corpus (independent of the model seed, so every tiny model shares one tokenizer)."""
    rng = random.Random(1234)
    lines = []
    for _ in range(n_lines):
        kind = rng.randrange(6)
        if kind == 0:
            words = rng.choices(WORDS, k=rng.randint(4, 14))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"{a}{op}{b}={value}" if rng.random() < 0.5 else f"{a} {op} {b} = {value}")
        elif kind == 2:
            word = "".join(rng.choices(WORDS, k=rng.randint(1, 3)))
            lines.append(f"Reverse the string: {word}\nAnswer: {word[::-1]}")
        elif kind == 3:
            role = rng.choice(("system", "user", "assistant"))
            text = " ".join(rng.choices(WORDS + CHAT_WORDS, k=rng.randint(3, 10)))
            lines.append(f"{IM_START}{role}\n{text}{IM_END}\n")
        elif kind == 4:
            answer = rng.randint(0, 9999)
            lines.append(f"<think>\nThe sum is {answer}.\n</think>\nThe answer is \\boxed{{{answer}}}.")
        else:
            lines.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(2, 8))))
    return lines


def build_tokenizer(vocab_size: int = DEFAULT_VOCAB):
    """Train the byte-level BPE on the built-in corpus; returns a transformers fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(byte_alphabet) + len(SPECIAL_TOKENS) + 1:
        raise ValueError(
            f"vocab size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{len(byte_alphabet) + len(SPECIAL_TOKENS) + 1} tokens"
        )
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=byte_alphabet,
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )


def parse_rope_scaling(spec: str | dict | None, max_position: int = MAX_POSITION_EMBEDDINGS) -> dict | None:
    """`"linear:2.0"`, `"llama3:8.0"` or a dict -> the HF rope-scaling dict (without `rope_theta`).

    llama3 defaults: low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings =
    max_position / factor (256 for factor 8), so that a tiny model's frequencies fall in all three bands.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        kind, _, factor = spec.partition(":")
        spec = {"rope_type": kind, "factor": float(factor or 2.0)}
    spec = dict(spec)
    kind = spec.pop("rope_type", None) or spec.pop("type", None)
    factor = float(spec.pop("factor", 2.0))
    if kind == "linear":
        out = {"rope_type": "linear", "factor": factor}
    elif kind == "llama3":
        out = {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": float(spec.pop("low_freq_factor", 1.0)),
            "high_freq_factor": float(spec.pop("high_freq_factor", 4.0)),
            "original_max_position_embeddings": int(
                spec.pop("original_max_position_embeddings", max(1, int(max_position / factor)))
            ),
        }
    else:
        raise ValueError(f"rope scaling type {kind!r} is not supported: use 'linear' or 'llama3'")
    if spec:
        raise ValueError(f"unknown rope scaling keys {sorted(spec)} for type {kind!r}")
    return out


def make_config(
    family: str,
    *,
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int | None,
    head_dim: int | None,
    tie_embeddings: bool,
    rope_scaling: str | dict | None,
    rope_theta: float,
    dtype: str,
):
    """The transformers config object of a tiny model."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: use one of {', '.join(FAMILIES)}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    head_dim = head_dim or hidden // heads
    if family == "qwen2" and head_dim * heads != hidden:
        raise ValueError(
            f"qwen2 derives head_dim from hidden/heads: head_dim={head_dim} with {heads} heads "
            f"needs hidden={head_dim * heads}, not {hidden}"
        )
    rope = {"rope_type": "default", **(parse_rope_scaling(rope_scaling) or {}), "rope_theta": float(rope_theta)}
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_embeddings,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        dtype=dtype,
        architectures=[{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}[family]],
    )
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, use_sliding_window=False)
    return LlamaConfig(**common, head_dim=head_dim)


def random_tensor(name: str, shape: tuple[int, ...], seed: int, hidden: int):
    """The seeded random value of one parameter, chosen by its HF name (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if name.endswith("norm.weight"):  # input/post-attention/final RMSNorm and qwen3's q_norm/k_norm
        return 1.0 + 0.1 * rng.standard_normal(shape)
    if name.endswith(".bias"):
        return 0.1 * rng.standard_normal(shape)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 3.0 / np.sqrt(hidden) * rng.standard_normal(shape)
    if name.endswith(".weight") and len(shape) == 2:  # nn.Linear: [out, in]
        return rng.standard_normal(shape) / np.sqrt(shape[1])
    raise ValueError(f"no init rule for parameter {name} {shape}")


def make_tiny_model(
    out_dir: str | Path,
    family: str = "qwen2",
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int | None = None,
    intermediate: int | None = None,
    head_dim: int | None = None,
    tie_embeddings: bool | None = None,
    rope_scaling: str | dict | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a tiny random HF model directory to `out_dir` and return its path.

    `vocab`: the config's vocab_size; the tokenizer has min(vocab, 512) tokens (special tokens included) and a
    larger `vocab` pads the embedding, like real Qwen checkpoints. `tie_embeddings` defaults to True for
    qwen2/qwen3 and False for llama. `rope_scaling`: `"linear:F"`, `"llama3:F"` or an HF rope dict.
    `dtype`: "float32" or "bfloat16" (the stored weights and the config's dtype).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r} is not supported: use float32 or bfloat16")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(min(vocab or DEFAULT_VOCAB, DEFAULT_VOCAB))
    vocab_size = max(vocab or 0, len(tokenizer))
    if tie_embeddings is None:
        tie_embeddings = family != "llama"
    config = make_config(
        family,
        vocab_size=vocab_size,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        head_dim=head_dim,
        tie_embeddings=tie_embeddings,
        rope_scaling=rope_scaling,
        rope_theta=rope_theta,
        dtype=dtype,
    )
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            value = random_tensor(name, tuple(param.shape), seed, hidden)
            param.copy_(torch.from_numpy(value).to(torch.float32))
    model = model.to(torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=None,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `intellect make-tiny-model`."""
    parser.add_argument("out", type=Path, help="directory to write the model to")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=None, help="config vocab_size (>= tokenizer size pads)")
    parser.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 * hidden)")
    parser.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    parser.add_argument(
        "--tie",
        dest="tie_embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie the LM head to the embeddings (default: yes for qwen, no for llama)",
    )
    parser.add_argument("--rope-scaling", default=None, help="linear:FACTOR or llama3:FACTOR")
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")


def run(args: argparse.Namespace) -> int:
    """Build the model and print what was written."""
    out = make_tiny_model(
        args.out,
        family=args.family,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        head_dim=args.head_dim,
        tie_embeddings=args.tie_embeddings,
        rope_scaling=args.rope_scaling,
        rope_theta=args.rope_theta,
        seed=args.seed,
        dtype=args.dtype,
    )
    config: dict[str, Any] = json.loads((out / "config.json").read_text())
    print(
        f"wrote {config['model_type']} model to {out}: hidden {config['hidden_size']}, "
        f"layers {config['num_hidden_layers']}, vocab {config['vocab_size']}, "
        f"tied {config['tie_word_embeddings']}, dtype {config['dtype']}"
    )
    for path in sorted(out.iterdir()):
        print(f"  {path.name}  {path.stat().st_size} bytes")
    return 0
