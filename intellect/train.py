"""`intellect train CONFIG [--section.key value ...]`: the JAX learner.

Starts (or joins, multi-host) the process group, builds the mesh, and either resumes from the newest
checkpoint in `run.dir/checkpoints` or loads the base model `model.path`; then trains on the accepted rollouts
of the rollout store (`RolloutPipeline`), exporting `run.dir/weights/v{n:06d}` and announcing each version.

Where accepted batches come from (`trainer.accepted_from`):
- `orchestrator`: `GET /v1/batches?status=accepted` of `worker.orchestrator_url` with the operator token
  (`orchestrator.admin_token`), with the validators' rewards; new versions are announced with `POST /v1/policy`,
  each with its manifest's sha256 (workers, validators and relays accept no other manifest for that version).
- `store`: every committed batch of the store, with the workers' own rewards: a trusted single box only.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")


def build_learner(cfg, release_memory=None, on_record=None):
    """(learner, initial params or None when resuming) for a resolved config; `release_memory` and `on_record`
    (each step's metrics record, for W&B) go to the `Learner`."""
    from bridge.rollouts import RolloutStore
    from intellect.config import rollout_store
    from intellect.learner_setup import (
        abstract_from_hf_config,
        init_distributed,
        load_base,
        mesh_from_config,
        trainer_for,
    )
    from jax_trainer.checkpoint import Checkpointer
    from jax_trainer.data import RolloutPipeline, StoreListing
    from jax_trainer.learner import Learner, check_checkpoint_base
    from jax_trainer.train_step import trainable

    init_distributed(cfg)
    run_dir = Path(cfg.run.dir)
    mesh = mesh_from_config(cfg)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints)
    params = None
    lora = cfg.model.lora is not None
    if ckpt.latest_step() is not None:
        _, meta = ckpt.read_meta()
        base_dir = Path(meta["base_model"])
        if lora:  # the checkpoint holds the adapters; the frozen base is read again, and must be the same
            check_checkpoint_base(meta, base_dir)
            model = load_base(cfg, base_dir, mesh, adapters=True)
        else:
            model = abstract_from_hf_config(cfg, meta["hf_config"])
    else:
        base_dir = Path(cfg.model.path)
        model = load_base(cfg, base_dir, mesh, adapters=True)
        params = trainable(model)
    reference = load_base(cfg, base_dir, mesh) if cfg.loss.kl_coef and not lora else None
    trainer = trainer_for(cfg, model, mesh, reference)

    store = RolloutStore.open(rollout_store(cfg, "learner"))
    announce = None
    if cfg.trainer.accepted_from == "orchestrator":
        from bridge.protocol import OrchestratorClient
        from jax_trainer.data import OrchestratorListing

        client = OrchestratorClient(cfg.worker.orchestrator_url, admin_token=cfg.orchestrator.admin_token)
        accepted = OrchestratorListing(client)

        announced: list[tuple[int, str]] = []  # the newest (version, manifest sha256) announced

        def report(version: int, manifest_sha256: str) -> None:
            # with the version, the batches the steps since the last report took: their room in the async window
            # goes to new assignments (design section 3)
            consumed = source.take_consumed()[-4096:]  # PolicyAnnouncement's limit (older ones left the window)
            try:
                client.announce_policy(
                    version, learner_step=version, manifest_sha256=manifest_sha256, consumed=consumed
                )
            except BaseException:
                source.give_back_consumed(consumed)
                raise

        def announce(version: int, path: Path) -> None:
            # the manifest's sha256 travels with the version: SHARDCAST clients accept no other manifest for it
            manifest_sha256 = hashlib.sha256((path / "manifest.json").read_bytes()).hexdigest()
            report(version, manifest_sha256)
            announced[:] = [(version, manifest_sha256)]

        def release() -> None:
            # a step still gathering (data.dynamic_sampling) reports what it took by announcing the current version
            # again, so that workers make the batches it waits for; a failed report goes with the next announcement
            if announced:
                try:
                    report(*announced[0])
                except Exception as e:
                    logging.getLogger("intellect.train").warning("could not report taken batches: %s", e)
    else:
        accepted = StoreListing(store, trust_worker_rewards=True)
    t = cfg.trainer
    if t.accepted_from == "orchestrator" and cfg.loss.logprob_source == "inference":
        logging.getLogger("intellect.train").warning(
            'loss.logprob_source = "inference": pi_old is each worker\'s own claim, which a worker may move within '
            "the validator's logprob bound (0.75 nats a token in bfloat16); \"validator\" takes the validators' "
            "recomputation instead (docs/learner.md)"
        )
    samples = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    source = RolloutPipeline(
        store,
        accepted,
        samples_per_step=samples,
        rows=t.micro_batch_size,
        seq_len=cfg.model.max_seq_len,
        multiple_of=t.steps_per_batch,
        micro_batches=t.micro_batches,
        truncate=t.truncate,
        advantage_mode="std" if cfg.loss.std_normalize else "mean",
        drop_zero_groups=cfg.data.online_filter,
        async_level=t.async_level,
        keep_versions=t.rollout_keep_versions,
        engine_logprobs=engine_logprobs_source(cfg),
        near_tie_samples=cfg.loss.near_tie_samples,
        dynamic_sampling=cfg.data.dynamic_sampling,
        max_gather=cfg.data.dynamic_sampling_max,
    )
    if announce is not None:
        source.release = release
    learner = Learner(
        trainer,
        source,
        run_dir,
        base_dir,
        t,
        ckpt,
        announce=announce,
        release_memory=release_memory,
        on_record=on_record,
        ship_adapters=lora and cfg.model.lora.ship == "adapter",
    )
    return learner, params


def engine_logprobs_source(cfg) -> str:
    """Whose logprobs the learner's ratios divide by: in a pool the validator's (`bridge.validator_logprobs`),
    unless `loss.logprob_source = "inference"` trusts the workers' claims; without validators (`trainer.
    accepted_from = "store"`, one trusted box) the workers'."""
    pool = cfg.trainer.accepted_from == "orchestrator"
    return "validator" if pool and cfg.loss.logprob_source != "inference" else "worker"


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the accepted-batch polls would drown the log
    from jax_trainer import host

    done = host.prepare(cfg.trainer.retain_host_memory, cfg.model.path)  # before jax starts a backend
    # retained memory is meant to be kept; otherwise what each step frees goes back to the system at once
    from intellect.metrics import wandb_sink

    sink = wandb_sink(cfg, "learner")
    learner, params = build_learner(
        cfg,
        None if done["retain_freed_memory"] else host.release_freed_memory,
        on_record=None if sink is None else sink.log,
    )
    try:
        state = learner.run(params)
    finally:
        learner.close()
        if sink is not None:
            sink.close()
    print(f"intellect train: finished at version {int(state.step)}; weights in {learner.weights_dir}")
    return 0
