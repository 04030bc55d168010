"""The jitted GRPO step, checkpoints and the learner loop on tiny random models."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_trainer.checkpoint import Checkpointer
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.learner import Learner
from jax_trainer.models import ModelConfig, init_random, load_hf
from jax_trainer.packing import Sample, pack
from jax_trainer.sharding import make_mesh
from jax_trainer.source import InMemorySource, Rollout, build_step_batch
from jax_trainer.train_step import GRPOTrainer

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    tie_embeddings=False,
)


def rollouts(position: int, n: int = 8, group: int = 4, vocab: int = 96, version: int = 0) -> list[Rollout]:
    rng = np.random.default_rng(position)
    out = []
    for i in range(n):
        length, prompt = int(rng.integers(10, 24)), int(rng.integers(3, 6))
        lp = np.r_[np.zeros(prompt), -rng.random(length - prompt) * 3].astype(np.float32)
        out.append(
            Rollout(
                rng.integers(0, vocab, length).astype(np.int32),
                prompt,
                lp,
                float(rng.random()),
                i // group,
                version,
                name=f"pos{position}/{i}",
            )
        )
    return out


def make_trainer(mesh, loss=LossConfig(tis_cap=2.0), optim=None, config=TrainerConfig(), seed=0):
    model = init_random(CFG, mesh=mesh, seed=seed)
    optim = optim or OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)
    trainer = GRPOTrainer(model, mesh, loss, optim, config)
    return trainer, trainer.init_state(nnx.split(model)[1])


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state.params)]


def test_sharded_step_equals_unsharded_step():
    source = InMemorySource(rollouts, rows=4, seq_len=64, async_level=10)
    batch = source.next(0).packed
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0, eps=1e-3)  # eps keeps Adam away from sign()
    results = []
    for mesh in (make_mesh(fsdp=1, devices=jax.devices()[:1]), make_mesh(data=1, fsdp=4, tensor=2)):
        trainer, state = make_trainer(mesh, optim=optim)
        for _ in range(2):
            state, metrics = trainer.step(state, trainer.device_batch(batch))
        results.append((leaves(state), {k: float(v) for k, v in metrics.items()}))
    (p1, m1), (p2, m2) = results
    assert np.isclose(m1["loss"], m2["loss"], rtol=1e-4, atol=1e-6) and m1["tokens"] == m2["tokens"]
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)


def test_non_finite_loss_skips_the_update_and_is_counted():
    mesh = make_mesh(fsdp=-1)
    trainer, state = make_trainer(mesh)
    packed = pack([Sample(np.arange(12, dtype=np.int32), 4, np.zeros(12, np.float32), float("nan"), 0)], 2, 32)
    before = leaves(state)
    state, metrics = trainer.step(state, trainer.device_batch(packed))
    assert int(metrics["skipped"]) == 1 and int(state.skipped) == 1
    assert all(np.array_equal(a, b) for a, b in zip(before, leaves(state)))
    assert int(state.step) == 1  # the version still advances: the batch was consumed
    good = InMemorySource(rollouts, rows=4, seq_len=64, async_level=10).next(1).packed
    state, metrics = trainer.step(state, trainer.device_batch(good))
    assert int(metrics["skipped"]) == 0 and not all(np.array_equal(a, b) for a, b in zip(before, leaves(state)))


def test_several_optimizer_steps_per_batch_move_the_ratio():
    mesh = make_mesh(fsdp=-1)
    trainer, state = make_trainer(mesh, config=TrainerConfig(steps_per_batch=2))
    batch = InMemorySource(rollouts, rows=2, seq_len=64, multiple_of=2, async_level=10).next(0).packed
    assert batch.shape[0] % 2 == 0
    state, metrics = trainer.step(state, trainer.device_batch(batch))
    assert int(state.step) == 2
    # pi_old is fixed at the start of the step: the second optimizer step sees ratios != 1
    assert float(metrics["ratio_max"]) > 1.0 + 1e-4


def _numpy_logprobs(model, packed, temperature):
    """log pi(token t | tokens < t) of every packed row, in numpy from the model's hidden states and head."""
    out = np.zeros(packed.tokens.shape, np.float32)
    head = np.asarray(model.head(), np.float64)
    for i in range(packed.tokens.shape[0]):
        hidden = np.asarray(model.hidden_states(packed.tokens[i], packed.positions[i], packed.segment_ids[i]))
        z = hidden[:, :-1].astype(np.float64) @ head / temperature
        z -= z.max(-1, keepdims=True)
        lse = np.log(np.exp(z).sum(-1))
        out[i, :, 1:] = np.take_along_axis(z, packed.tokens[i][:, 1:, None], -1)[..., 0] - lse
    return out


def test_one_optimizer_step_per_batch_takes_pi_old_from_its_own_forward():
    """With one optimizer step per batch, pi_old is the policy being differentiated: a `recompute` step gets it
    from each micro-batch's own forward (no second forward pass), and its update equals that of a step told
    pi_old through `inference_logprobs`, computed here in numpy."""
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    # two micro-batches: with one, XLA merges the two identical forwards itself
    packed = InMemorySource(rollouts, rows=2, seq_len=64, multiple_of=2, async_level=10).next(0).packed
    assert packed.shape[0] == 2
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0, eps=1e-3)
    model = init_random(CFG, mesh=mesh, seed=0)
    told = dataclasses.replace(packed, inference_logprobs=_numpy_logprobs(model, packed, LossConfig().temperature))
    results, flops = [], {}
    for source, batch in (("recompute", packed), ("inference", told)):
        trainer, state = make_trainer(mesh, loss=LossConfig(logprob_source=source), optim=optim)
        device_batch = trainer.device_batch(batch)
        compiled = trainer.jitted_step(state, device_batch).lower(state, device_batch, None).compile()
        flops[source] = compiled.cost_analysis()["flops"]
        state, metrics = compiled(state, device_batch, None)  # the executable `trainer.step` would compile
        results.append((leaves(state), float(metrics["loss"]), float(metrics["ratio_max"])))
    (p1, l1, r1), (p2, l2, r2) = results
    assert r1 == 1.0 and abs(r2 - 1.0) < 1e-4  # pi / pi_old: exactly 1 from the same forward, ~1 from numpy's
    assert np.isclose(l1, l2, rtol=1e-4, atol=1e-6)
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=1e-4)
    assert flops["recompute"] < 1.01 * flops["inference"]  # no forward pass for pi_old
    # with two optimizer steps per batch pi_old is the batch's starting policy: one forward more, kept
    trainer, state = make_trainer(
        mesh, loss=LossConfig(logprob_source="recompute"), config=TrainerConfig(steps_per_batch=2)
    )
    two = InMemorySource(rollouts, rows=2, seq_len=64, multiple_of=2, async_level=10).next(0).packed
    device_batch = trainer.device_batch(two)
    compiled = trainer.jitted_step(state, device_batch).lower(state, device_batch, None).compile()
    trainer_inf, state_inf = make_trainer(
        mesh, loss=LossConfig(logprob_source="inference"), config=TrainerConfig(steps_per_batch=2)
    )
    compiled_inf = trainer_inf.jitted_step(state_inf, device_batch).lower(state_inf, device_batch, None).compile()
    assert compiled.cost_analysis()["flops"] > 1.2 * compiled_inf.cost_analysis()["flops"]


def test_a_sequence_mask_in_the_step_drops_the_mismatched_sample_and_reports_it():
    """`loss.mismatch = "seq_mask"` with pi_old recomputed: the engine's logprobs equal the learner's (numpy)
    except one sample's, 0.1 lower per token; the step drops exactly that sample and its metrics say so."""
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    packed = InMemorySource(rollouts, rows=2, seq_len=64, multiple_of=2, async_level=10).next(0).packed
    model = init_random(CFG, mesh=mesh, seed=0)
    engine = _numpy_logprobs(model, packed, LossConfig().temperature) * packed.loss_mask
    target = (packed.segment_ids == 1) & (packed.loss_mask > 0)
    target[1:], target[0, 1:] = False, False  # only the first sample of the first row of the first micro-batch
    engine[target] -= 0.1  # its sequence ratio pi_old / pi_engine is exp(0.1 n) > 1.5 for n >= 5 tokens
    assert target.sum() >= 5
    loss = LossConfig(logprob_source="recompute", mismatch="seq_mask", mismatch_low=0.67, mismatch_high=1.5)
    trainer, state = make_trainer(mesh, loss=loss)
    batch = dataclasses.replace(packed, inference_logprobs=engine.astype(np.float32))
    _, metrics = trainer.step(state, trainer.device_batch(batch))
    assert float(metrics["mismatch_masked_frac"]) == pytest.approx(target.sum() / packed.loss_mask.sum(), rel=1e-6)
    assert float(metrics["mismatch_masked_sample_frac"]) == pytest.approx(1 / packed.num_samples, rel=1e-6)


def test_save_restore_continue_is_bitwise_equal_to_straight_training(tmp_path):
    mesh = make_mesh(fsdp=4, tensor=2)

    def run(trainer, state, source, n):
        for _ in range(n):
            state, _ = trainer.step(state, trainer.device_batch(source.next(int(state.step)).packed))
        return state

    trainer, state = make_trainer(mesh)
    straight = leaves(run(trainer, state, InMemorySource(rollouts, rows=4, seq_len=64, async_level=99), 4))

    trainer, state = make_trainer(mesh)
    source = InMemorySource(rollouts, rows=4, seq_len=64, async_level=99)
    state = run(trainer, state, source, 2)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(2, state, {"cursor": source.cursor()})

    trainer2, _ = make_trainer(mesh, seed=123)  # different init: everything must come from the checkpoint
    restored, meta = ckpt.restore(trainer2.abstract_state())
    source2 = InMemorySource(rollouts, rows=4, seq_len=64, async_level=99)
    source2.restore(meta["cursor"])
    assert int(restored.step) == 2
    resumed = leaves(run(trainer2, restored, source2, 2))
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed))


def test_grpo_learns_to_emit_the_rewarded_token():
    """One prompt, reward 1 for emitting token 7: its probability goes from chance to > 0.9."""
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    mesh = make_mesh(fsdp=-1)
    model = init_random(cfg, mesh=mesh, seed=1)
    trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=3e-3, warmup_steps=0, grad_clip=1.0))
    state = trainer.init_state(nnx.split(model)[1])
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    rng = np.random.default_rng(0)

    @jax.jit
    def next_token_probs(params):
        return jax.nn.softmax(trainer.model(params)(jnp.asarray(prompt[None]))[0, -1])

    def prob(state):
        return np.asarray(next_token_probs(state.params), np.float64)

    start = prob(state)[7]
    assert start < 0.2
    for step in range(40):
        p = prob(state)
        tokens = rng.choice(16, size=64, p=p / p.sum())
        samples = [
            Rollout(
                np.r_[prompt, t].astype(np.int32),
                len(prompt),
                np.r_[np.zeros(len(prompt)), np.log(p[t])].astype(np.float32),
                float(t == 7),
                g // 16,
                step,
            )
            for g, t in enumerate(tokens)
        ]
        batch = build_step_batch(samples, step, rows=8, seq_len=18, micro_batches=4)  # fixed shapes
        if batch is not None:
            state, _ = trainer.step(state, trainer.device_batch(batch.packed))
        if prob(state)[7] > 0.95:
            break
    assert prob(state)[7] > 0.9, (start, prob(state)[7])


def test_learner_loop_exports_checkpoints_logs_and_resumes(tiny_model, tmp_path):
    base = tiny_model(family="qwen2")
    mesh = make_mesh(fsdp=-1)
    settings = TrainerConfig(steps=3, export_interval=1, checkpoint_interval=2, export_dtype="float32")
    announced, released, handed = [], [], []

    def learner():
        model = load_hf(base, mesh=mesh)
        trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-3, warmup_steps=0))
        source = InMemorySource(
            lambda pos: rollouts(pos, vocab=512, version=max(pos - 1, 0)), rows=4, seq_len=64, async_level=2
        )
        return Learner(
            trainer,
            source,
            tmp_path,
            base,
            settings,
            announce=lambda v, d: announced.append(v),
            progress=False,
            release_memory=lambda: released.append(len(announced)) or 0,
            on_record=handed.append,  # the W&B sink's hook: each record as written
        ), nnx.split(model)[1]

    first, params = learner()
    state = first.run(params)
    assert int(state.step) == 3 and announced == [0, 1, 2, 3]
    # freed host memory is handed back after every export (before its announcement) and every step
    assert released == [0, 1, 1, 2, 2, 3, 3]
    versions = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert versions == ["v000000", "v000001", "v000002", "v000003"]
    assert all((tmp_path / "weights" / v / "STABLE").exists() for v in versions)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and handed == lines
    for key in (
        "loss",
        "grad_norm",
        "clip_high_frac",
        "ratio_mean",
        "entropy",
        "mismatch_kl",
        "tokens",
        "staleness_hist",
        "tokens_per_s",
        "reward_mean",
    ):
        assert key in lines[-1], key
    assert first.checkpointer.all_steps() == [2, 3]

    resumed, params = learner()  # a new process would do this: it picks up step 3 and the source cursor
    settings2 = TrainerConfig(steps=4, export_interval=1, checkpoint_interval=2, export_dtype="float32")
    resumed.config = settings2
    state = resumed.run(params)
    assert int(state.step) == 4 and resumed.source.cursor() == {"position": 4}
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_packing_errors_name_the_sample():
    from jax_trainer.packing import PackingError

    long = Sample(np.zeros(40, np.int32), 4, np.zeros(40, np.float32), 1.0, 0, name="batch-17/3")
    with pytest.raises(PackingError, match="batch-17/3: 40 tokens .* do not fit in seq_len 32"):
        pack([long], 2, 32)
    packed = pack([long], 2, 32, truncate=True)
    assert packed.loss_mask.sum() == 28
    with pytest.raises(PackingError, match="a completion is required"):
        pack([Sample(np.zeros(5, np.int32), 5, np.zeros(5, np.float32), 1.0, 0)], 2, 32)


def test_remat_step_equals_the_plain_step():
    """Gradient checkpointing changes memory, not numbers, with pi_old recomputed inside the step's map too."""
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    batch = InMemorySource(rollouts, rows=4, seq_len=64, async_level=10).next(0).packed
    optim = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0, eps=1e-3)
    results = []
    for remat in (False, True):
        model = init_random(CFG, mesh=mesh, seed=0, remat=remat)
        trainer = GRPOTrainer(model, mesh, LossConfig(tis_cap=2.0, logprob_source="recompute"), optim)
        state = trainer.init_state(nnx.split(model)[1])
        state, metrics = trainer.step(state, trainer.device_batch(batch))
        results.append((leaves(state), float(metrics["loss"])))
    (p1, l1), (p2, l2) = results
    assert np.isclose(l1, l2, rtol=1e-5, atol=1e-7)
    for a, b in zip(p1, p2):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
