"""Scanned layers and the named remat policies, by the structure of what JAX and XLA build (no timings)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jax_trainer.config import LossConfig, OptimConfig
from jax_trainer.models import ModelConfig, abstract_model, init_random
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
)


def _step_dots(num_layers: int, scan_layers: bool = True) -> int:
    """Dot operations in the lowered program (StableHLO) of the GRPO step of a `num_layers`-deep model."""
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = abstract_model(dataclasses.replace(CFG, num_layers=num_layers), remat="full", scan_layers=scan_layers)
    trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-3, warmup_steps=0))
    state, batch = trainer.abstract_state(), trainer.abstract_batch(1, 2, 32)
    return trainer.jitted_step(state, batch).lower(state, batch, None).as_text().count("stablehlo.dot_general")


def test_the_compiled_step_holds_one_layer_whatever_the_depth():
    """2 and 24 scanned layers compile to the same program but for the stacked shapes: the same dots.
    (Unrolled, the 24-layer step has 12x the 2-layer step's per-layer dots.)"""
    shallow, deep = _step_dots(2), _step_dots(24)
    assert shallow > 10  # the layer's projections, forward and backward, and the LM head are in it
    assert deep == shallow


def _grad_jaxpr_dots(remat: str) -> int:
    model = abstract_model(CFG, remat=remat, scan_layers=True)
    tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    graphdef, params = nnx.split(model)

    def loss(params):
        return nnx.merge(graphdef, params)(tokens).mean()

    return str(jax.make_jaxpr(jax.grad(loss))(params)).count("dot_general")


def test_save_dots_keeps_the_projections_full_recomputes_them():
    """`full` runs the layer's whole forward again in the backward pass (projections and attention);
    `save_dots` keeps the projections' outputs and recomputes the rest (attention's own dots among it); `none`
    recomputes nothing. So the gradient programs hold strictly more dots in that order."""
    none, save_dots, full = (_grad_jaxpr_dots(r) for r in ("none", "save_dots", "full"))
    assert none < save_dots < full


def test_auto_scans_on_accelerators_and_unrolls_on_cpu():
    """`[model] scan_layers = "auto"` (the default): scanned on GPU and TPU, unrolled on the CPU backend (where
    XLA:CPU runs the scanned step slower); booleans are kept; anything else is refused by name."""
    from jax_trainer.config import LearnerModelConfig
    from jax_trainer.models.decoder import resolve_scan_layers

    assert [resolve_scan_layers("auto", b) for b in ("cpu", "gpu", "tpu")] == [False, True, True]
    assert resolve_scan_layers(True, "cpu") is True and resolve_scan_layers(False, "tpu") is False
    with pytest.raises(ValueError, match="scan_layers 'yes' must be true, false or 'auto'"):
        resolve_scan_layers("yes")
    assert LearnerModelConfig().scan_layers == "auto"
    assert jax.default_backend() == "cpu"
    assert abstract_model(CFG).scan_layers is False and abstract_model(CFG, scan_layers="auto").scan_layers is False
    assert abstract_model(CFG, scan_layers=True).scan_layers is True
    # the two forms run the same stacked parameters: the unrolled default loads a scanned model's state as is
    scanned, unrolled = abstract_model(CFG, scan_layers=True), abstract_model(CFG)
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m, nnx.Param))  # noqa: E731
    assert shapes(scanned) == shapes(unrolled)


def test_a_checkpoint_saved_layer_by_layer_restores_into_the_stacked_layers(tmp_path):
    """A checkpoint of the unstacked decoder (one array per layer: `.params['layers'][1]['attn']['q_proj']`,
    the same for the Adam moments) is stacked into today's state; a layer missing from it is refused by name."""
    import numpy as np
    import orbax.checkpoint as ocp

    from jax_trainer.checkpoint import Checkpointer, CheckpointError

    mesh = make_mesh(fsdp=4, tensor=2)
    model = init_random(CFG, mesh=mesh, seed=3)
    trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-3))
    state = trainer.init_state(nnx.split(model)[1])
    state = state.replace(opt_state=jax.tree.map(lambda x: x + 1 if x.ndim else x, state.opt_state))
    flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    old = {}
    for key, value in flat.items():
        if "['layers']" in key:
            for i in range(CFG.num_layers):
                old[key.replace("['layers']", f"['layers'][{i}]", 1)] = value[i]
        else:
            old[key] = value
    assert sum("['layers'][1]" in k for k in old) >= 3 * 11  # params, mu and nu of each layer parameter
    ckpt = Checkpointer(tmp_path / "ckpt")
    save = ocp.args.Composite(state=ocp.args.StandardSave(old), meta=ocp.args.JsonSave({"v": 1}))
    ckpt.manager.save(7, args=save)
    old.pop(next(k for k in old if "['layers'][1]" in k))
    save = ocp.args.Composite(state=ocp.args.StandardSave(old), meta=ocp.args.JsonSave({"v": 1}))
    ckpt.manager.save(8, args=save)
    ckpt.manager.wait_until_finished()

    restored, meta = ckpt.restore(trainer.abstract_state(), step=7)
    assert meta == {"v": 1}
    got = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    assert set(got) == set(flat)
    for key, value in flat.items():
        np.testing.assert_array_equal(np.asarray(got[key]), value, err_msg=key)
    assert got[".params['layers']['mlp']['up_proj'].value"].sharding == model.layers.mlp.up_proj[...].sharding
    with pytest.raises(CheckpointError, match=r"the checkpoint has layers \[0\], the model 2 layers"):
        ckpt.restore(trainer.abstract_state(), step=8)
    ckpt.close()
