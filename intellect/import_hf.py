"""`intellect import HF_DIR CKPT_DIR [--config CONFIG]`: start a learner checkpoint from a Hugging Face model.

The checkpoint (step 0) holds the model's parameters in `model.param_dtype`, a fresh optimizer state and the
base model's path and config; `intellect train` with `run.dir` pointing at its parent continues from it. With
`[model.lora]` in the config it holds fresh adapters and the base's digest instead (the base stays at HF_DIR).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", type=Path, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("ckpt_dir", type=Path, help="orbax checkpoint directory to create (e.g. RUN/checkpoints)")
    p.add_argument("--config", type=Path, default=None, help="TOML recipe (mesh, dtypes, optimizer)")


def run(args: argparse.Namespace) -> int:
    from bridge.weights import model_digest
    from intellect.cli import config_from_args
    from intellect.learner_setup import init_distributed, load_base, mesh_from_config, trainer_for
    from jax_trainer.checkpoint import Checkpointer
    from jax_trainer.learner import checkpoint_meta
    from jax_trainer.train_step import trainable

    cfg = config_from_args(args)
    init_distributed(cfg)
    mesh = mesh_from_config(cfg)
    model = load_base(cfg, args.hf_dir, mesh, adapters=True)
    trainer = trainer_for(cfg, model, mesh)
    state = trainer.init_state(trainable(model))
    ckpt = Checkpointer(args.ckpt_dir, keep=cfg.trainer.keep_checkpoints)
    if ckpt.latest_step() is not None:
        print(f"intellect import: {args.ckpt_dir} already holds checkpoints {ckpt.all_steps()}; refusing to mix runs")
        return 1
    digest = model_digest(args.hf_dir) if cfg.model.lora is not None else None
    ckpt.save(0, state, checkpoint_meta(args.hf_dir, 0, None, digest))
    ckpt.close()
    print(f"imported {args.hf_dir} as step 0 of {args.ckpt_dir}")
    return 0
