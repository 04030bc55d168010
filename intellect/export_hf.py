"""`intellect export CKPT_DIR OUT [--step N] [--dtype bfloat16] [--config CONFIG]`: a learner checkpoint as
a Hugging Face directory (docs/design.md section 4 layout: shards, index, manifest with sha256, STABLE last), the
same files the learner exports for workers. The model is rebuilt from the config.json recorded in the
checkpoint, and the base model's tokenizer files are copied next to the weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("ckpt_dir", type=Path, help="orbax checkpoint directory (e.g. RUN/checkpoints)")
    p.add_argument("out", type=Path, help="directory to write (must not already hold a STABLE version)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16")
    p.add_argument("--config", type=Path, default=None, help="TOML recipe (mesh and dtypes to restore with)")


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args
    from intellect.learner_setup import abstract_from_hf_config, init_distributed, mesh_from_config, trainer_for
    from jax_trainer.checkpoint import Checkpointer
    from jax_trainer.models import export_hf

    cfg = config_from_args(args)
    init_distributed(cfg)
    ckpt = Checkpointer(args.ckpt_dir)
    step, meta = ckpt.read_meta(args.step)
    mesh = mesh_from_config(cfg)
    trainer = trainer_for(cfg, abstract_from_hf_config(cfg, meta["hf_config"]), mesh)
    state, _ = ckpt.restore(trainer.abstract_state(), step)
    export_hf(
        trainer.model(state.params),
        args.out,
        version=int(state.step),
        source_dir=meta["base_model"],
        hf_config=meta["hf_config"],
        dtype=args.dtype,
    )
    print(f"exported step {step} of {args.ckpt_dir} to {args.out} ({args.dtype})")
    return 0
