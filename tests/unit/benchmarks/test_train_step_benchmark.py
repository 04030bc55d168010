"""benchmarks/train_step.py computes the same GRPO step on both sides: its first step's loss and gradient norm
from JAX and from eager PyTorch (Hugging Face's Qwen2 on the same weights) agree, on a tiny shape. (It once
compared a temperature-0.6 JAX loss with a temperature-1 torch one and printed both without noticing.) With
`--other-form` the JAX step also runs with its layers in the other form (scanned here, the CPU default being
unrolled), which computes the same step. `--model DIR` runs another family as itself (a tied Llama)."""

from __future__ import annotations

import json


def test_both_sides_compute_the_same_first_step(run_benchmark):
    tiny = "--hidden 64 --intermediate 128 --layers 1 --heads 2 --kv-heads 1 --vocab 128 --seq 96 --batch 2"
    args = tiny.split() + "--rounds 1 --steps 1 --peak-n 64 --peak-reps 1 --other-form".split()
    # one CPU device, as a user runs it
    done = run_benchmark("train_step.py", args, env={"XLA_FLAGS": None})
    out = json.loads(done.stdout)
    first = out["first_step"]
    assert first["agree"], first
    assert abs(first["jax_loss"] - first["torch_loss"]) <= 1e-4 * abs(first["torch_loss"]) + 1e-6, first
    other = out["other_form"]
    assert out["scan_layers"] == "auto" and out["jax_layers_scanned"] is False and other["layers_scanned"] is True
    assert abs(other["first_step_loss"] - first["jax_loss"]) <= 1e-5 * abs(first["jax_loss"]) + 1e-7, other
    assert abs(other["first_step_grad_norm"] - first["jax_grad_norm"]) <= 1e-4 * first["jax_grad_norm"], other
    assert other["tokens_per_s"]["median"] > 0 and other["default_over_other"] > 0


def test_a_llama_config_with_tied_embeddings_runs_as_itself(run_benchmark, tmp_path):
    # `--model DIR` with a config and no weights: random weights of that config on both sides, transformers'
    # own class for it (Llama here: tied head, its RoPE theta and norm eps, head_dim given apart from hidden)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 160,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = f"--model {tmp_path} --seq 96 --batch 2 --rounds 1 --steps 1 --peak-n 64 --peak-reps 1".split()
    out = json.loads(run_benchmark("train_step.py", args, env={"XLA_FLAGS": None}).stdout)
    assert out["first_step"]["agree"], out["first_step"]
    model = out["model"]
    assert (model["family"], model["tied_embeddings"], model["head_dim"], model["rope_theta"]) == (
        "llama",
        True,
        16,
        100000.0,
    )
    assert out["peak_rss_mb"]["jax"] > 0 and out["peak_rss_mb"]["torch"] > 0 and out["jax_plan_gib"]["peak"] > 0
