"""A LoRA adapter version that moves a model's outputs as a trained one does, and how far it moves them.

The adapter (rank `--rank`, alpha `--alpha`, all seven projections) is the learner's: `load_hf` with fresh
adapters, B drawn from normal(0, `--std`) (`jax_trainer.models.hf.with_random_b`), written by `export_adapter` in
float32 against the base's `model_digest`. Then the base and the adapter merged into it (`bridge.adapters.
merge_adapter`) are loaded in transformers (float32): the merged model samples `--tokens` tokens at temperature 1
for `--prompts` arithmetic questions in the chat template, and both models score those tokens. Printed as JSON:
the |merged - base| logprob of the sampled tokens (mean, median, p90, max, share over 0.1 and 1 nat) and each
model's greedy answer to the first questions, to see that the adapted model still writes sense.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 JAX_PLATFORMS=cpu \
        python benchmarks/random_adapter.py --model models/smollm2-135m --std 0.002 --out ADAPTER
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write(model_dir: Path, out: Path, rank: int, alpha: float, std: float, seed: int) -> None:
    import jax

    from bridge.weights import model_digest
    from jax_trainer.models import load_hf
    from jax_trainer.models.hf import export_adapter, with_random_b
    from jax_trainer.models.lora import TARGETS, LoraSpec
    from jax_trainer.sharding import make_mesh

    spec = LoraSpec(rank, alpha, tuple(TARGETS))
    model = load_hf(model_dir, mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]), lora=spec)
    model = with_random_b(model, std, seed)
    export_adapter(model, out, version=1, base_digest=model_digest(model_dir), base_model=str(model_dir))


def questions(count: int) -> list[str]:
    rng = np.random.default_rng(0)
    ops = ("plus", "minus", "times")
    return [f"What is {rng.integers(2, 999)} {ops[rng.integers(3)]} {rng.integers(2, 999)}?" for _ in range(count)]


def shift(model_dir: Path, adapter: Path, prompts: int, tokens: int, greedy: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bridge.adapters import merge_adapter

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with tempfile.TemporaryDirectory(prefix="random-adapter-") as tmp:
        merge_adapter(model_dir, adapter, Path(tmp) / "merged", version=1, dtype="float32")
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        merged = AutoModelForCausalLM.from_pretrained(str(Path(tmp) / "merged"), dtype=torch.float32).eval()
    torch.manual_seed(0)
    diffs, answers = [], []
    for i, question in enumerate(questions(prompts)):
        chat = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        prompt = ids["input_ids"]
        with torch.no_grad():
            out = merged.generate(prompt, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens)
            completion = out[0, prompt.shape[1] :]
            lp = [torch.log_softmax(m(out).logits[0, prompt.shape[1] - 1 : -1].float(), -1) for m in (merged, base)]
            picked = [x.gather(-1, completion[:, None])[:, 0] for x in lp]
            diffs.append((picked[0] - picked[1]).abs().numpy())
            if i < greedy:
                answers.append(
                    {
                        "question": question,
                        **{
                            name: tokenizer.decode(
                                m.generate(prompt, do_sample=False, max_new_tokens=tokens)[0, prompt.shape[1] :],
                                skip_special_tokens=True,
                            )
                            for name, m in (("base", base), ("adapted", merged))
                        },
                    }
                )
    d = np.concatenate(diffs)
    return {
        "sampled_tokens": int(d.size),
        "abs_logprob_shift": {
            "mean": round(float(d.mean()), 4),
            "median": round(float(np.median(d)), 4),
            "p90": round(float(np.quantile(d, 0.9)), 4),
            "max": round(float(d.max()), 4),
            "share_over_0.1": round(float((d > 0.1).mean()), 4),
            "share_over_1": round(float((d > 1.0).mean()), 4),
        },
        "greedy": answers,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the base: a Hugging Face directory")
    parser.add_argument("--out", type=Path, required=True, help="the adapter version to write (must not exist)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--std", type=float, required=True, help="B's standard deviation (A is PEFT's init)")
    parser.add_argument("--seed", type=int, default=1, help="B's draws")
    parser.add_argument("--prompts", type=int, default=16, help="questions the shift is measured on")
    parser.add_argument("--tokens", type=int, default=48, help="tokens sampled per question")
    parser.add_argument("--greedy", type=int, default=3, help="questions whose greedy answers are printed")
    args = parser.parse_args()
    write(args.model, args.out, args.rank, args.alpha, args.std, args.seed)
    report = {"adapter": str(args.out), "std": args.std, "rank": args.rank, "alpha": args.alpha}
    report |= shift(args.model, args.out, args.prompts, args.tokens, args.greedy)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
