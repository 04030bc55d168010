"""`intellect export CKPT_DIR OUT [--step N] [--dtype bfloat16] [--config CONFIG]`: a learner checkpoint as
a Hugging Face directory (docs/design.md section 4 layout: shards, index, manifest with sha256, STABLE last), the
same files the learner exports for workers. The model is rebuilt from the config.json recorded in the
checkpoint, and the base model's tokenizer files are copied next to the weights. A checkpoint of LoRA adapters
(a recipe with `[model.lora]`, passed with --config) is written merged into its base, which must be the one it
was trained on; `--adapter` writes the adapter alone, as a PEFT directory.
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
    p.add_argument("--adapter", action="store_true", help="LoRA checkpoints: write the adapter alone (PEFT)")


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args
    from intellect.learner_setup import (
        abstract_from_hf_config,
        init_distributed,
        load_base,
        mesh_from_config,
        trainer_for,
    )
    from jax_trainer.checkpoint import Checkpointer
    from jax_trainer.learner import check_checkpoint_base
    from jax_trainer.models import export_hf
    from jax_trainer.models.hf import export_adapter

    cfg = config_from_args(args)
    init_distributed(cfg)
    ckpt = Checkpointer(args.ckpt_dir)
    step, meta = ckpt.read_meta(args.step)
    mesh = mesh_from_config(cfg)
    if cfg.model.lora is not None:  # the adapters need their base: the one they were trained on
        check_checkpoint_base(meta, meta["base_model"])
        model = load_base(cfg, meta["base_model"], mesh, adapters=True)
    elif args.adapter:
        print("--adapter: the checkpoint's recipe has no [model.lora] (pass it with --config)")
        return 2
    else:
        model = abstract_from_hf_config(cfg, meta["hf_config"])
    trainer = trainer_for(cfg, model, mesh)
    state, _ = ckpt.restore(trainer.abstract_state(), step)
    if args.adapter:
        export_adapter(
            trainer.model(state.params),
            args.out,
            version=int(state.step),
            base_digest=meta["base_model_digest"],
            base_model=meta["base_model"],
            dtype=args.dtype,
        )
        print(f"exported the adapter of step {step} of {args.ckpt_dir} to {args.out} ({args.dtype})")
        return 0
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
