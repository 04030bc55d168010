"""The learner loop: take a step's rollouts, train, export the new policy, checkpoint, log.

For each step n (n = optimizer steps applied so far = the version being trained from), the source yields
rollouts of versions v with n - v <= async_level; the jitted step trains on them; every `export_interval`
steps the parameters are exported as `weights/v{version:06d}` (docs/design.md section 4) and `announce(version, dir)`
tells the pool (the orchestrator client's `POST /v1/policy` in a real run); every `checkpoint_interval` steps
an orbax checkpoint saves the state and the source's cursor. Each step appends one JSON line to
`metrics.jsonl` (loss parts, clip fractions, ratio, entropy, mismatch KL, grad norms, tokens, throughput,
wait time, staleness histogram) and updates a rich progress line on a terminal.

A learner started on a run directory that has checkpoints resumes from the newest one.

With LoRA (`GRPOTrainer.lora`), each export is also the adapter alone, as a PEFT directory
`adapters/v{version:06d}` naming the base by its digest (`bridge.adapters`); the checkpoints hold the adapters
and the base's digest, and a resume refuses another base.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jax_trainer.checkpoint import Checkpointer
from jax_trainer.config import TrainerConfig
from jax_trainer.models.hf import export_hf
from jax_trainer.source import BatchSource
from jax_trainer.train_step import GRPOTrainer, TrainState

log = logging.getLogger("jax_trainer.learner")


class Learner:
    def __init__(
        self,
        trainer: GRPOTrainer,
        source: BatchSource,
        run_dir: str | Path,
        base_model_dir: str | Path,
        config: TrainerConfig,
        checkpointer: Checkpointer | None = None,
        announce: Callable[[int, Path], None] | None = None,
        progress: bool = True,
        release_memory: Callable[[], int] | None = None,
        on_record: Callable[[dict], None] | None = None,
        ship_adapters: bool = False,
    ):
        """Of `config` the loop reads `steps`, `export_interval`, `checkpoint_interval`, `export_dtype` and
        `batch_timeout_s`; `trainer` and `source` were built from the rest of it. `release_memory` (e.g.
        `jax_trainer.host.release_freed_memory` when freed memory is not retained) runs after every step and
        export, so that what those freed is not held until the next step. `on_record` gets each step's
        metrics.jsonl record after it is written (`intellect.metrics.WandbSink.log` with W&B enabled).
        `ship_adapters` (LoRA's `ship = "adapter"`): every version after 0 is written as the adapter alone, in
        `weights/` (what SHARDCAST carries), applying to version 0."""
        self.trainer = trainer
        self.source = source
        self.run_dir = Path(run_dir)
        self.base_model_dir = Path(base_model_dir)
        self.config = config
        self.checkpointer = checkpointer or Checkpointer(self.run_dir / "checkpoints")
        self.announce = announce
        self.progress = progress
        self.release_memory = release_memory
        self.on_record = on_record
        self.weights_dir = self.run_dir / "weights"
        self.adapters_dir = self.run_dir / "adapters"
        self.base_digest = None
        self.ship_adapters = ship_adapters
        if ship_adapters and trainer.lora is None:
            raise ValueError("ship_adapters: the trainer has no LoRA adapters to ship")
        self._shipped_base_digest: str | None = None  # model_digest of weights/v000000 (`_shipped_base`)
        if trainer.lora is not None:
            from bridge.weights import model_digest

            self.base_digest = model_digest(self.base_model_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.is_writer = jax.process_index() == 0

    # ---- state -------------------------------------------------------------------------------------------
    def initial_state(self, params) -> TrainState:
        """The newest checkpoint's state if there is one (the source's cursor restored too), else fresh."""
        if self.checkpointer.latest_step() is None:
            return self.trainer.init_state(params)
        state, meta = self.checkpointer.restore(self.trainer.abstract_state())
        if meta.get("cursor") is not None:  # None: a checkpoint made by `intellect import`, before any data
            self.source.restore(meta["cursor"])
        return state

    def export(self, state: TrainState) -> Path:
        from jax_trainer.models.hf import export_adapter

        version = _scalar(state.step)
        out = self.weights_dir / f"v{version:06d}"
        model = self.trainer.model(state.params)
        dtype = self.config.export_dtype
        if self.ship_adapters and version > 0:  # the adapter alone, applying to version 0
            self._write_once(
                out,
                f"version {version} as its adapter",
                lambda: export_adapter(
                    model, out, version=version, base_digest=self._shipped_base(), dtype=dtype, base_version=0
                ),
            )
        else:
            self._write_once(
                out,
                f"version {version}",
                lambda: export_hf(model, out, version=version, source_dir=self.base_model_dir, dtype=dtype),
            )
            if self.base_digest is not None:  # LoRA: the adapter beside the merged version
                adapter = self.adapters_dir / f"v{version:06d}"
                base_model = str(self.base_model_dir.absolute())
                self._write_once(
                    adapter,
                    f"adapter {version}",
                    lambda: export_adapter(
                        model,
                        adapter,
                        version=version,
                        base_digest=self.base_digest,
                        base_model=base_model,
                        dtype=dtype,
                    ),
                )
        self._release()
        if self.announce is not None and self.is_writer:
            self.announce(version, out)
        return out

    def _write_once(self, out: Path, what: str, write: Callable[[], object]) -> None:
        """Run `write` unless `out` already holds a complete version (decided alike on every process)."""
        if _on_all_processes((out / "STABLE").exists()):
            return
        t0 = time.perf_counter()
        write()
        log.info("exported %s to %s in %.2f s", what, out, time.perf_counter() - t0)

    def _shipped_base(self) -> str:
        """The digest of version 0 (the base in the export dtype), which shipped adapters name."""
        if self._shipped_base_digest is None:
            from bridge.weights import model_digest

            base = self.weights_dir / "v000000"
            if not _on_all_processes((base / "STABLE").exists()):
                raise FileNotFoundError(f"{base}: shipped adapters apply to version 0, which this run no longer has")
            self._shipped_base_digest = model_digest(base) if self.is_writer else ""
        return self._shipped_base_digest

    def _release(self) -> None:
        if self.release_memory is not None:
            released = self.release_memory()
            if released:
                log.debug("released %.2f GiB of freed host memory", released / 2**30)

    def checkpoint(self, state: TrainState) -> None:
        step = _scalar(state.step)
        meta = checkpoint_meta(self.base_model_dir, step, self.source.cursor(), self.base_digest)
        self.checkpointer.save(step, state, meta)

    def close(self) -> None:
        """Stop the data source's background reading and finish the checkpointer's: native threads still
        running when the interpreter exits abort the process (seen once as SIGABRT after a finished run)."""
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
        self.checkpointer.close()

    # ---- loop --------------------------------------------------------------------------------------------
    def run(self, params) -> TrainState:
        s = self.config
        state = self.initial_state(params)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.export(state)  # the version workers start from (0, or the resumed one)
        with _Progress(self.progress and self.is_writer, s.steps, _scalar(state.step)) as bar:
            while _scalar(state.step) < s.steps:
                state = self._one_step(state, bar)
        if s.checkpoint_interval == 0 or _scalar(state.step) % s.checkpoint_interval:
            self.checkpoint(state)
        return state

    def _one_step(self, state: TrainState, bar: "_Progress") -> TrainState:
        s = self.config
        step = _scalar(state.step)
        t0 = time.perf_counter()
        batch = self.source.next(step, timeout=s.batch_timeout_s)
        t1 = time.perf_counter()
        state, metrics = self.trainer.step(state, self.trainer.device_batch(batch.packed))
        metrics = {k: float(_scalar(v)) for k, v in metrics.items()}
        t2 = time.perf_counter()
        self._release()
        version = _scalar(state.step)
        staleness = collections.Counter(step - v for v in batch.packed.versions)
        record = {
            "role": "learner",
            "step": version,
            "time": time.time(),
            **metrics,
            **batch.stats,
            "wait_s": t1 - t0,
            "step_s": t2 - t1,
            "tokens_per_s": float(np.sum(batch.packed.segment_ids > 0)) / max(t2 - t1, 1e-9),
            "busy_frac": (t2 - t1) / max(t2 - t0, 1e-9),
            "staleness_hist": {str(k): c for k, c in sorted(staleness.items())},
            "batch_ids": list(batch.batch_ids),
        }
        if version % s.export_interval == 0 or version >= s.steps:
            self.export(state)
        if s.checkpoint_interval and version % s.checkpoint_interval == 0:
            self.checkpoint(state)
        if self.is_writer:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.on_record is not None:
                self.on_record(record)
        bar.update(version, record)
        return state


def _scalar(x):
    """A replicated scalar as a Python number, also when the array spans several processes."""
    return np.asarray(x.addressable_data(0)).item()


def checkpoint_meta(
    base_model_dir: str | Path, version: int, cursor: dict | None, base_digest: str | None = None
) -> dict:
    """What a checkpoint needs besides arrays: the data cursor, and the base model (its config.json rebuilds the
    model for `intellect export`; its tokenizer files go into every export); with LoRA adapters, the base's
    `bridge.weights.model_digest`, which the adapters are meaningless without."""
    base = Path(base_model_dir).absolute()
    meta = {
        "cursor": cursor,
        "version": version,
        "base_model": str(base),
        "hf_config": json.loads((base / "config.json").read_text()),
    }
    if base_digest is not None:
        meta["base_model_digest"] = base_digest
    return meta


def check_checkpoint_base(meta: dict, base_dir: str | Path) -> None:
    """Refuse to resume LoRA adapters on a base other than the one they were trained on (CheckpointError)."""
    from bridge.weights import model_digest
    from jax_trainer.checkpoint import CheckpointError

    want = meta.get("base_model_digest")
    if want is None:
        raise CheckpointError(
            "the checkpoint holds no LoRA base digest: it was written by a run without [model.lora], "
            "whose checkpoints hold the whole model"
        )
    got = model_digest(base_dir)
    if got != want:
        raise CheckpointError(
            f"the checkpoint's LoRA adapters were trained on base model {want}, but {base_dir} is {got}"
        )


def _on_all_processes(flag: bool) -> bool:
    """Process 0's answer, everywhere: collective work (the export's gathers) must be entered by all or none."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


class _Progress:
    """A rich progress line on a terminal (nothing otherwise): step, loss, reward, tokens/s."""

    def __init__(self, enabled: bool, total: int, start: int):
        self.enabled, self.total, self.start = enabled, total, start

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("learner"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.description}"),
                TimeRemainingColumn(),
            )
            self.bar.__enter__()
            self.task = self.bar.add_task("", total=self.total, completed=self.start)
        return self

    def update(self, step: int, r: dict) -> None:
        if self.enabled:
            self.bar.update(
                self.task,
                completed=step,
                description=(
                    f"loss {r['loss']:+.4f} reward {r.get('reward_mean', float('nan')):.3f} "
                    f"{r['tokens_per_s']:.0f} tok/s"
                ),
            )

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
