"""LoRA adapters on the JAX decoder, against transformers + PEFT as the reference: forward, the PEFT adapter
directory, the merge, and a training step that moves the adapters alone."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bridge.adapters import verify_adapter
from bridge.weights import WeightsError, model_digest
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.models import hf, load_hf
from jax_trainer.models.hf import adapter_arrays, export_adapter, export_hf, model_arrays
from jax_trainer.models.lora import LoraError, LoraSpec, spec_from_peft_config
from jax_trainer.sharding import make_mesh
from jax_trainer.source import InMemorySource, Rollout
from jax_trainer.train_step import GRPOTrainer, trainable

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ("q", "k", "v", "o", "gate", "up", "down")
VOCAB = 96


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Llama (GQA, untied head) written by transformers: the base both sides load."""
    d = tmp_path_factory.mktemp("lora-base")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(d)
    return d


def with_random_b(model, seed: int = 1, scale: float = 0.05):
    """`model` with every adapter's B drawn at random (a fresh adapter's B is zero: it would show nothing)."""
    return hf.with_random_b(model, scale, seed)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 12)).astype(np.int32)


def test_adapter_matches_peft_forward_and_merge(base_dir, tmp_path):
    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    model = with_random_b(load_hf(base_dir, mesh=make_mesh(), scan_layers=True, lora=spec))
    ours = np.asarray(model(jnp.asarray(TOKENS)))
    digest = model_digest(base_dir)
    export_adapter(model, tmp_path / "adapter", version=3, base_digest=digest, base_model=str(base_dir))

    # the directory: PEFT's files, a manifest naming the base; another base is refused, naming both
    manifest = verify_adapter(tmp_path / "adapter", digest)
    assert manifest["version"] == 3 and manifest["base_model_digest"] == digest
    with pytest.raises(WeightsError, match=f"trained on base model {digest}.*this base is {'0' * 64}"):
        verify_adapter(tmp_path / "adapter", "0" * 64)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert spec_from_peft_config(config) == spec

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    plain = torch_logits(base, TOKENS)
    reference = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    expected = torch_logits(reference, TOKENS)
    moved = np.max(np.abs(expected - plain))
    assert moved > 1e-2  # the adapter moves the outputs far more than the tolerance below
    np.testing.assert_allclose(ours, expected, atol=2e-5, rtol=0)

    # merged: the export equals PEFT's merge_and_unload, weight for weight, and the base is untouched by it
    export_hf(model, tmp_path / "merged", version=3, source_dir=base_dir, dtype="float32")
    merged_ref = reference.merge_and_unload().state_dict()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    for name, value in merged.state_dict().items():
        np.testing.assert_allclose(value.numpy(), merged_ref[name].numpy(), atol=2e-7, rtol=1e-6, err_msg=name)
    np.testing.assert_allclose(torch_logits(merged, TOKENS), expected, atol=2e-5, rtol=0)


def test_unrolled_and_subset_targets_match_peft(base_dir, tmp_path):
    spec = LoraSpec(rank=2, alpha=3.0, targets=("v", "o", "down"))
    model = with_random_b(load_hf(base_dir, mesh=make_mesh(), scan_layers=False, lora=spec), seed=2, scale=0.2)
    export_adapter(model, tmp_path / "a", version=0, base_digest=model_digest(base_dir))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    expected = torch_logits(peft.PeftModel.from_pretrained(base, tmp_path / "a"), TOKENS)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(TOKENS))), expected, atol=2e-5, rtol=0)
    assert sorted(json.loads((tmp_path / "a" / "adapter_config.json").read_text())["target_modules"]) == [
        "down_proj",
        "o_proj",
        "v_proj",
    ]


def test_fresh_adapter_leaves_the_base_unchanged(base_dir):
    plain = load_hf(base_dir, mesh=make_mesh())
    adapted = load_hf(base_dir, mesh=make_mesh(), lora=LoraSpec(8, 16.0, ALL))
    np.testing.assert_array_equal(np.asarray(plain(jnp.asarray(TOKENS))), np.asarray(adapted(jnp.asarray(TOKENS))))
    assert set(model_arrays(adapted)) == set(model_arrays(plain))  # the base, without the adapters
    a = adapter_arrays(adapted)[("layers", "attn", "q_lora_a")]
    assert a.shape == (2, 64, 4, 16)[:2] + (8,) and float(jnp.std(a)) > 0


def rollouts(position: int, n: int = 8, group: int = 4) -> list[Rollout]:
    rng = np.random.default_rng(position)
    out = []
    for i in range(n):
        length, prompt = int(rng.integers(10, 24)), int(rng.integers(3, 6))
        lp = np.r_[np.zeros(prompt), -rng.random(length - prompt) * 3].astype(np.float32)
        tokens = rng.integers(0, VOCAB, length).astype(np.int32)
        out.append(Rollout(tokens, prompt, lp, float(rng.random()), i // group, 0, name=f"p{position}/{i}"))
    return out


@pytest.mark.parametrize("scan", [True, False])
def test_step_trains_adapters_alone(base_dir, scan):
    """The optimizer holds the adapters alone and the base never moves; B moves at the first step, A only once
    B is nonzero (its gradient is scaling * dL/dW B^T)."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    batch = InMemorySource(rollouts, rows=2, seq_len=64, multiple_of=2, async_level=10).next(0).packed
    model = load_hf(base_dir, mesh=mesh, scan_layers=scan, lora=spec)
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1e9)
    trainer = GRPOTrainer(model, mesh, LossConfig(tis_cap=2.0), optim, TrainerConfig(steps_per_batch=2))
    state = trainer.init_state(trainable(model))
    base_before = {k: np.asarray(v) for k, v in model_arrays(model).items()}
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    assert n_adapter == 2 * (4 * (64 + 64) + 2 * 4 * (64 + 32) + 4 * (64 + 64) + 3 * 4 * (64 + 96))
    assert sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim) == 2 * n_adapter  # Adam's moments

    before = {k: np.asarray(v) for k, v in adapter_arrays(model).items()}
    state, metrics = trainer.step(state, trainer.device_batch(batch))  # two optimizer steps
    assert float(metrics["skipped"]) == 0 and int(state.step) == 2
    after = trainer.model(state.params)
    for k, v in model_arrays(after).items():
        np.testing.assert_array_equal(np.asarray(v), base_before[k], err_msg=str(k))
    for k, v in adapter_arrays(after).items():
        assert np.max(np.abs(np.asarray(v) - before[k])) > 1e-5, k


def test_adapter_gradient_is_the_chain_rule_of_the_full_gradient(base_dir):
    """With B = 0: dL/dB = scaling * A^T dL/dW and dL/dA = 0, dL/dW from the full model's backward pass."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    mesh = make_mesh()
    batch = InMemorySource(rollouts, rows=4, seq_len=64, async_level=10).next(0).packed
    loss, optim = LossConfig(), OptimConfig()
    lora_model = load_hf(base_dir, mesh=mesh, lora=spec)
    lora_trainer = GRPOTrainer(lora_model, mesh, loss, optim)
    full_model = load_hf(base_dir, mesh=mesh)
    full_trainer = GRPOTrainer(full_model, mesh, loss, optim)
    mb = {k: v[0] for k, v in lora_trainer.device_batch(batch).items()}
    weights = jnp.asarray(np.random.default_rng(3).normal(size=mb["tokens"][:, 1:].shape), jnp.float32)

    def objective(trainer, frozen=None):
        return lambda p: jnp.sum(trainer._logprobs(p, mb, frozen)[0] * weights)

    g_lora = jax.grad(objective(lora_trainer, lora_trainer.frozen))(trainable(lora_model))
    g_full = jax.grad(objective(full_trainer))(nnx.split(full_model)[1])
    a_all = adapter_arrays(lora_model)
    targets = {"q": ("attn", "q_proj"), "o": ("attn", "o_proj"), "down": ("mlp", "down_proj")}
    for t, (module, kernel) in targets.items():
        a = np.asarray(a_all[("layers", module, f"{t}_lora_a")], np.float64)
        dw = np.asarray(g_full["layers"][module][kernel][...], np.float64)
        db = np.asarray(g_lora["layers"][module][f"{t}_lora_b"][...], np.float64)
        da = np.asarray(g_lora["layers"][module][f"{t}_lora_a"][...])
        layers, rank = a.shape[0], a.shape[-1]
        a2 = a.reshape(layers, -1, rank)
        dw2 = dw.reshape(layers, a2.shape[1], -1)
        expected = spec.scaling * np.einsum("lir,lio->lro", a2, dw2).reshape(db.shape)
        np.testing.assert_allclose(db, expected, rtol=2e-4, atol=2e-4 * np.max(np.abs(expected)), err_msg=t)
        assert np.max(np.abs(expected)) > 1e-3 and not np.any(da)


def test_bad_settings_name_the_field(base_dir):
    with pytest.raises(LoraError, match="model.lora.targets.*'qq'.*q, k, v, o, gate, up, down"):
        LoraSpec(4, 8.0, ("q", "qq"))
    with pytest.raises(LoraError, match="rank 40 is larger than the k projection's 64 x 32"):
        load_hf(base_dir, mesh=make_mesh(), lora=LoraSpec(40, 8.0, ("k",)))
    with pytest.raises(LoraError, match="use_dora"):
        spec_from_peft_config(
            {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "use_dora": True}
        )


def test_learner_exports_adapters_and_resumes_only_on_its_base(base_dir, tmp_path):
    """Each version is written merged (what the pool fetches) and as a PEFT adapter naming the base; the
    checkpoint holds the adapters; a resume on the same base continues, on another base is refused."""
    import shutil

    from jax_trainer.checkpoint import CheckpointError
    from jax_trainer.learner import Learner, check_checkpoint_base

    spec = LoraSpec(rank=4, alpha=8.0, targets=("q", "v", "up"))
    mesh = make_mesh()

    def learner(steps: int):
        model = load_hf(base_dir, mesh=mesh, lora=spec)
        trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-2, warmup_steps=0), TrainerConfig())
        source = InMemorySource(rollouts, rows=4, seq_len=64, async_level=10)
        settings = TrainerConfig(steps=steps, export_interval=1, checkpoint_interval=2, export_dtype="float32")
        return Learner(trainer, source, tmp_path / "run", base_dir, settings, progress=False), trainable(model)

    first, params = learner(2)
    first.run(params)
    first.close()
    digest = model_digest(base_dir)
    for v in (0, 1, 2):
        manifest = verify_adapter(tmp_path / "run" / "adapters" / f"v{v:06d}", digest)
        assert manifest["version"] == v
    # the merged export of version 2 is the base + its adapter, as PEFT merges it
    plain_base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapters" / "v000002")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "weights" / "v000002")
    np.testing.assert_allclose(torch_logits(merged, TOKENS), torch_logits(with_adapter, TOKENS), atol=2e-5, rtol=0)
    assert np.max(np.abs(torch_logits(merged, TOKENS) - torch_logits(plain_base, TOKENS))) > 1e-3
    adapter_bytes = (tmp_path / "run" / "adapters" / "v000002" / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < sum(
        p.stat().st_size for p in (tmp_path / "run" / "weights" / "v000002").glob("*.safetensors")
    )

    second, _ = learner(4)  # resumes from the checkpoint at step 2
    resumed = second.run(None)
    second.close()
    assert int(resumed.step) == 4
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # continued from the checkpoint of step 2
    restored = second.initial_state(None).params["layers"]["attn"]["q_lora_b"][...]
    np.testing.assert_array_equal(np.asarray(restored), np.asarray(resumed.params["layers"]["attn"]["q_lora_b"][...]))
    assert np.any(np.asarray(restored))  # trained adapters (a fresh B is zero)
    _, meta = second.checkpointer.read_meta()
    check_checkpoint_base(meta, base_dir)
    other = tmp_path / "other-base"
    shutil.copytree(base_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    with pytest.raises(CheckpointError, match=f"trained on base model {digest}, but .*other-base is [0-9a-f]{{64}}"):
        check_checkpoint_base(meta, other)


def test_compiled_step_drops_the_frozen_weight_gradients():
    """XLA's own FLOP count: the LoRA step computes no weight gradient for the frozen matrices (each is
    2 x its size x tokens of the full step), the untied LM head's included."""
    from jax_trainer.models import ModelConfig, init_random

    cfg = ModelConfig("llama", 512, 128, 256, 2, 4, 2, 32)
    n_matmul = cfg.num_layers * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256) + 128 * 512
    rows, seq = 8, 128
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    flops = {}
    for lora in (None, LoraSpec(4, 8.0, ALL)):
        model = init_random(cfg, mesh=mesh, lora=lora)
        trainer = GRPOTrainer(model, mesh, LossConfig(logprob_source="inference"), OptimConfig())
        compiled = trainer.lower(trainer.init_state(trainable(model)), trainer.abstract_batch(1, rows, seq)).compile()
        cost = compiled.cost_analysis()
        flops[lora is not None] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    weight_gradients = 2 * n_matmul * rows * seq
    assert flops[False] - flops[True] >= 0.9 * weight_gradients, (flops, weight_gradients)


def test_a_worker_merges_the_bytes_the_learner_merged(base_dir, tmp_path):
    """`bridge.adapters.merge_adapter` (a worker's or validator's merge of base + adapter file) writes the very
    tensors of the learner's merged export, in float32 and bfloat16; a wrong base or a malformed adapter is
    refused by name."""
    from bridge.adapters import merge_adapter
    from bridge.weights import HFCheckpoint

    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    model = with_random_b(load_hf(base_dir, mesh=make_mesh(), lora=spec), seed=4)
    digest = model_digest(base_dir)
    export_adapter(model, tmp_path / "adapter", version=1, base_digest=digest)
    for dtype in ("float32", "bfloat16"):
        export_hf(model, tmp_path / f"learner-{dtype}", version=1, source_dir=base_dir, dtype=dtype)
        merge_adapter(base_dir, tmp_path / "adapter", tmp_path / f"worker-{dtype}", version=1, dtype=dtype)
        ours, theirs = HFCheckpoint(tmp_path / f"learner-{dtype}"), HFCheckpoint(tmp_path / f"worker-{dtype}")
        assert ours.names() == theirs.names()
        for name in ours.names():
            a, b = ours.array(name), theirs.array(name)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (dtype, name)
    with pytest.raises(WeightsError, match=f"trained on base model {digest}, but this base is {'1' * 64}"):
        merge_adapter(base_dir, tmp_path / "adapter", tmp_path / "x", version=1, base_digest="1" * 64)
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(WeightsError, match="adapter_config.json: size .* manifest says"):  # it guards each file
        merge_adapter(base_dir, tmp_path / "adapter", tmp_path / "y", version=1)


def test_the_kl_reference_of_adapters_is_their_base(base_dir):
    """kl_coef > 0 with LoRA: the reference is the base (the adapters at zero), not the policy of the batch's start:
    0 at the first step (B = 0: the policy is the base), above 0 at the second."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=ALL)
    mesh = make_mesh()
    model = load_hf(base_dir, mesh=mesh, lora=spec)
    loss = LossConfig(tis_cap=2.0, kl_coef=0.1)
    trainer = GRPOTrainer(model, mesh, loss, OptimConfig(lr=1e-2, warmup_steps=0), TrainerConfig())
    state = trainer.init_state(trainable(model))
    batch = trainer.device_batch(InMemorySource(rollouts, rows=4, seq_len=64, async_level=10).next(0).packed)
    state, first = trainer.step(state, batch)
    state, second = trainer.step(state, batch)
    assert abs(float(first["kl_ref"])) < 1e-7 < 1e-5 < float(second["kl_ref"])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("contract", [1, 2])
def test_lora_kernel_matches_the_formula_and_its_autodiff(dtype, contract):
    """`kernels.lora_dense` (merged for the contraction in float32, factored below) against jax's own gradient
    of x W + s (x A) B written with einsum in float32; the kernel's gradient included (a full-model step uses it)."""
    from jax_trainer.kernels import lora_dense

    ins, outs = ((24,), (3, 8)) if contract == 1 else ((3, 8), (24,))
    rank, scale = 4, 2.5
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (2, 5, *ins))
    w = jax.random.normal(keys[1], (*ins, *outs)) * 0.2
    a = jax.random.normal(keys[2], (*ins, rank)) * 0.2
    b = jax.random.normal(keys[3], (rank, *outs)) * 0.2
    g = jax.random.normal(keys[4], (2, 5, *outs))

    def formula(x, w, a, b):
        xf, wf, af = x.reshape(10, -1), w.reshape(-1, int(np.prod(outs))), a.reshape(-1, rank)
        y = xf @ wf + scale * (xf @ af) @ b.reshape(rank, -1)
        return y.reshape(2, 5, *outs)

    def ours(x, w, a, b):
        return lora_dense(x, w, a, b, contract, dtype, scale).astype(jnp.float32)

    want_y, want_vjp = jax.vjp(formula, x, w, a, b)
    got_y, got_vjp = jax.vjp(ours, x, w, a, b)
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(got_y, want_y, rtol=tol, atol=tol * float(jnp.abs(want_y).max()))
    for got, want in zip(got_vjp(g), want_vjp(g)):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * float(jnp.abs(want).max()))
