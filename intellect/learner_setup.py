"""Build the learner's pieces from the shared config: process group, mesh, model, GRPO trainer.

Used by `intellect train`, `intellect import` and `intellect export`, so that all three agree on how a
config turns into a mesh and a model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from intellect.config import Config


def init_distributed(cfg: Config) -> None:
    """`jax.distributed.initialize` for a multi-host learner (no-op for one process without a coordinator).

    On a TPU VM pod slice, leave the three fields unset: JAX reads them from the TPU environment.
    """
    import jax

    t = cfg.trainer
    if t.coordinator_address is None and t.num_processes is None:
        return
    jax.distributed.initialize(
        coordinator_address=t.coordinator_address, num_processes=t.num_processes, process_id=t.process_id
    )


def mesh_from_config(cfg: Config):
    from jax_trainer.sharding import make_mesh

    return make_mesh(cfg.trainer.data, cfg.trainer.fsdp, cfg.trainer.tensor)


def trainer_for(cfg: Config, model, mesh, reference=None):
    from jax_trainer.train_step import GRPOTrainer

    return GRPOTrainer(model, mesh, cfg.loss, cfg.optim, cfg.trainer, reference)


def lora_spec(cfg: Config):
    """The `LoraSpec` of `[model.lora]`, or None when the whole model trains."""
    from jax_trainer.models.lora import LoraSpec

    lora = cfg.model.lora
    return None if lora is None else LoraSpec(lora.rank, lora.alpha, tuple(lora.targets))


def load_base(cfg: Config, path: str | Path, mesh, adapters: bool = False):
    """The model at `path`; with `adapters`, with fresh `[model.lora]` adapters (when the config has them)."""
    from jax_trainer.models import load_hf

    m = cfg.model
    return load_hf(
        path,
        mesh=mesh,
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat=m.remat,
        scan_layers=m.scan_layers,
        scan_unroll=m.scan_unroll,
        attention=m.attention,
        lora=lora_spec(cfg) if adapters else None,
        lora_seed=m.lora.seed if m.lora is not None else 0,
    )


def abstract_from_hf_config(cfg: Config, hf_config: dict, adapters: bool = False):
    from jax_trainer.models import ModelConfig, abstract_model

    m = cfg.model
    model_cfg = dataclasses.replace(ModelConfig.from_hf(hf_config), attention=m.attention)
    lora = lora_spec(cfg) if adapters else None
    return abstract_model(model_cfg, m.param_dtype, m.compute_dtype, m.remat, m.scan_layers, m.scan_unroll, lora)
