"""The JAX decoder against Hugging Face transformers (torch) on the same random tiny weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

from jax_trainer.models import ModelConfig, UnsupportedModelError, load_hf
from jax_trainer.models.decoder import checkpoint_policy, has_pinned_host
from jax_trainer.sharding import describe_shardings, make_mesh

VARIANTS = {
    "qwen2-tied": dict(family="qwen2", tie_embeddings=True),
    "qwen2-untied-mha": dict(family="qwen2", tie_embeddings=False, kv_heads=4),
    "qwen3-untied": dict(family="qwen3", tie_embeddings=False),
    "qwen3-tied-headdim64": dict(family="qwen3", tie_embeddings=True, head_dim=64),
    "llama-untied": dict(family="llama"),
    "llama-tied-linear": dict(family="llama", tie_embeddings=True, rope_scaling="linear:4.0"),
    "llama-llama3": dict(family="llama", rope_scaling="llama3:8.0", kv_heads=1),
}


def _tokens(vocab: int, batch: int = 2, length: int = 40, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length))


def _one_device():
    return make_mesh(fsdp=1, devices=jax.devices()[:1])


def _hf(model_dir, tokens, dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    return out.logits.float().numpy(), out.hidden_states[-1].float().numpy()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tiny_model):
    # a long RoPE base period makes the llama3 bands matter for short sequences too
    kwargs = dict(VARIANTS[request.param])
    if kwargs.get("rope_scaling", "").startswith("llama3"):
        kwargs["rope_theta"] = 500000.0
    return request.param, tiny_model(**kwargs)


def test_float32_logits_and_hidden_match_hf(variant):
    name, model_dir = variant
    cfg = ModelConfig.from_dir(model_dir)
    tokens = _tokens(cfg.vocab_size)
    ref_logits, ref_hidden = _hf(model_dir, tokens, "float32")
    assert ref_logits.std() > 0.5, "weights too small for the comparison to mean anything"
    model = load_hf(model_dir, mesh=_one_device())
    logits, hidden = model(jnp.asarray(tokens), return_hidden=True)
    assert np.abs(np.asarray(logits) - ref_logits).max() <= 1e-4, name
    assert np.abs(np.asarray(hidden) - ref_hidden).max() <= 1e-4, name


def test_bfloat16_is_as_accurate_as_torch_bfloat16(variant):
    """bf16 tolerance, measured rather than guessed: against the float32 reference, the JAX bf16 model may
    be off by at most 1.5x what HF's own bf16 model is off (plus 1e-3), and the two bf16 models differ by
    at most 2x that noise floor (each rounds independently)."""
    name, model_dir = variant
    cfg = ModelConfig.from_dir(model_dir)
    tokens = _tokens(cfg.vocab_size)
    ref, _ = _hf(model_dir, tokens, "float32")
    hf_bf16, _ = _hf(model_dir, tokens, "bfloat16")
    model = load_hf(model_dir, mesh=_one_device(), param_dtype="bfloat16", compute_dtype="bfloat16")
    ours = np.asarray(model(jnp.asarray(tokens)))
    floor = np.abs(hf_bf16 - ref).max()
    assert floor > 0, "bf16 should differ from float32 at all"
    assert np.abs(ours - ref).max() <= 1.5 * floor + 1e-3, name
    assert np.abs(ours - hf_bf16).max() <= 2 * floor + 1e-3, name


def test_packed_sequences_equal_separate_forwards(tiny_model):
    model_dir = tiny_model(family="qwen3")
    model = load_hf(model_dir, mesh=_one_device())
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(3)
    a, b, c = (rng.integers(0, vocab, n) for n in (13, 9, 10))
    packed = np.concatenate([a, b, c])[None]
    segments = np.concatenate([np.full(13, 1), np.full(9, 2), np.full(10, 3)])[None]
    positions = np.concatenate([np.arange(13), np.arange(9), np.arange(10)])[None]
    out = np.asarray(model(jnp.asarray(packed), positions=jnp.asarray(positions), segment_ids=jnp.asarray(segments)))
    separate = np.concatenate([np.asarray(model(jnp.asarray(s[None])))[0] for s in (a, b, c)])
    assert np.abs(out[0] - separate).max() <= 1e-5
    # and without segment ids the later sequences do see the earlier ones (the test can fail)
    leaky = np.asarray(model(jnp.asarray(packed), positions=jnp.asarray(positions)))
    assert np.abs(leaky[0, 13:] - separate[13:]).max() > 1e-2


def test_fsdp4_tensor2_equals_unsharded(tiny_model):
    assert jax.device_count() == 8, "tests expect XLA_FLAGS=--xla_force_host_platform_device_count=8"
    model_dir = tiny_model(family="qwen2", tie_embeddings=False)
    tokens = jnp.asarray(_tokens(512, batch=4))
    ref = np.asarray(load_hf(model_dir, mesh=_one_device())(tokens))
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    model = load_hf(model_dir, mesh=mesh)
    specs = describe_shardings(nnx.state(model))
    assert specs["layers/attn/q_proj"] == "P(None, 'fsdp', 'tensor', None)"  # the layer axis is never split
    assert specs["layers/mlp/down_proj"] == "P(None, 'tensor', 'fsdp')"
    assert specs["embed"] == "P('tensor', 'fsdp')"
    # every device holds only its slice (of every layer)
    q = model.layers.attn.q_proj[...]
    assert {s.data.shape for s in q.addressable_shards} == {(q.shape[0], q.shape[1] // 4, q.shape[2] // 2, q.shape[3])}
    with jax.set_mesh(mesh):
        out = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert len(out.sharding.device_set) == 8
    # only the summation order differs between the layouts
    assert np.abs(np.asarray(out) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max() / 10)


def test_scanned_layers_and_every_remat_policy_give_the_unrolled_gradients(tiny_model):
    """Scan and remat change what runs and what is kept, never the gradients: each variant against the
    unrolled layers without remat."""
    model_dir = tiny_model(family="llama")
    tokens = jnp.asarray(_tokens(512))

    def grads(**kwargs):
        model = load_hf(model_dir, mesh=_one_device(), **kwargs)
        return nnx.state(nnx.grad(lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[..., 0]))(model), nnx.Param)

    reference = grads(scan_layers=False, remat="none")
    scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(reference))
    variants = [(True, "none"), (True, "full"), (True, "save_dots"), (False, "full")]
    if has_pinned_host():
        variants.append((True, "offload"))
    else:  # here "offload" runs as "full", compared above
        assert checkpoint_policy("offload") is jax.checkpoint_policies.nothing_saveable
    for scan_layers, remat in variants:
        diffs = jax.tree.map(
            lambda a, b: float(jnp.abs(a - b).max()), reference, grads(scan_layers=scan_layers, remat=remat)
        )
        assert max(jax.tree.leaves(diffs)) <= 1e-6 * max(scale, 1.0), (scan_layers, remat)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "supported: qwen2, qwen3, llama"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "supported: default, linear, llama3",
        ),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_unsupported_configs_are_refused_with_the_supported_list(change, message):
    hf = {
        "model_type": "qwen2",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf({**hf, **change})


def test_reads_both_old_and_new_rope_formats():
    base = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert old.rope == new.rope
    assert (old.rope.type, old.rope.factor, old.rope.theta) == ("linear", 2.0, 5e5)


def test_tiny_llama3_variant_exercises_all_three_rope_bands(tiny_model):
    """Otherwise the llama3 parity above could pass with the scaling ignored."""
    from jax_trainer.models.layers import rope_inv_freq

    cfg = ModelConfig.from_dir(tiny_model(family="llama", rope_scaling="llama3:8.0", kv_heads=1, rope_theta=500000.0))
    assert cfg.rope.type == "llama3"
    plain = np.asarray(rope_inv_freq(dataclasses.replace(cfg.rope, type="default"), cfg.head_dim))
    scaled = np.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
    kept = np.isclose(scaled, plain)
    divided = np.isclose(scaled, plain / cfg.rope.factor)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_init_random_draws_each_kind_of_parameter_like_transformers():
    """The std of each kind of parameter of a fresh model equals that of transformers' `_init_weights` for the
    same config (a non-default initializer_range): embedding and projections normal(0, range), norms ones,
    biases zeros. Values need not match (different generators), distributions must."""
    from transformers import AutoConfig

    from jax_trainer.models import init_random

    hf_config = {
        "model_type": "qwen2",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        "initializer_range": 0.05,
    }
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config))
    kinds = {
        "embed": "embed_tokens.weight",
        "head": "lm_head.weight",
        "mlp": "mlp.",
        "attention": "proj.weight",
        "norm": "norm.weight",
        "bias": ".bias",
    }

    def kind(name):
        return next(k for k, marker in kinds.items() if marker in name)

    def stats(named):
        groups = {}
        for name, value in named:
            groups.setdefault(kind(name), []).append(np.asarray(value, np.float64).ravel())
        return {k: (float(np.concatenate(v).mean()), float(np.concatenate(v).std())) for k, v in groups.items()}

    theirs = stats((n, p.detach().numpy()) for n, p in hf.named_parameters())
    model = init_random(ModelConfig.from_hf(hf_config), mesh=_one_device(), seed=5)
    names = {"q_proj": "attn.q_proj.weight", "k_proj": "attn.k_proj.weight", "v_proj": "attn.v_proj.weight"}
    names |= {"o_proj": "attn.o_proj.weight", "embed": "embed_tokens.weight", "lm_head": "lm_head.weight"}
    ours = stats(
        (names.get(str(path[-1]), ".".join(map(str, path)).replace("_bias", ".bias")), var.get_value())
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )
    assert set(ours) == set(theirs) == set(kinds)
    assert theirs["norm"] == (1.0, 0.0) and theirs["bias"] == (0.0, 0.0)
    for k, (mean, std) in theirs.items():
        assert abs(ours[k][0] - mean) <= 0.01 * max(std, 1e-3), (k, ours[k], (mean, std))
        assert abs(ours[k][1] - std) <= 0.02 * std, (k, ours[k], (mean, std))
