"""Orbax checkpoints of the learner: parameters, optimizer state, step counters and the data cursor.

`Checkpointer(dir, keep=n)` wraps an orbax `CheckpointManager`. A checkpoint holds two items:

- `state`: every array of the `TrainState`, stored by its key path (`.params['layers'][0]...`), restored
  straight into the shardings of a freshly built state (each host reads only its own shards);
- `meta`: JSON: the data source's cursor (which accepted batches were consumed), the policy version, and
  whatever the caller adds (config digest, wall time).

The step is deterministic given its inputs, so parameters + optimizer state + step + data cursor are the whole
state: N steps, save, restore, N more steps gives bitwise the parameters of 2N straight steps (tested).
Saving is synchronous by default: a checkpoint that `save` returned from is complete on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A checkpoint does not match the model or optimizer it is restored into; the message names the entries."""


def _named_leaves(tree) -> dict[str, Any]:
    return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


class Checkpointer:
    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, meta: dict[str, Any]) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(_named_leaves(state)), meta=ocp.args.JsonSave(meta)),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore(self, template, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore into the structure and shardings of `template` (a freshly initialised state)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.directory}: no checkpoint to restore")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
        abstract = {
            jax.tree_util.keystr(p): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for p, x in leaves
        }
        stored = self.manager.item_metadata(step)["state"]
        if stored is not None and set(stored) != set(abstract):
            missing = sorted(set(abstract) - set(stored))[:5]
            extra = sorted(set(stored) - set(abstract))[:5]
            raise CheckpointError(
                f"{self.directory}/{step}: checkpoint does not match the model/optimizer "
                f"(missing {missing}, unexpected {extra})"
            )
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        values = [restored["state"][jax.tree_util.keystr(p)] for p, _ in leaves]
        for (p, want), got in zip(leaves, values):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise CheckpointError(
                    f"{self.directory}/{step}: {jax.tree_util.keystr(p)} is {got.dtype}{list(got.shape)}"
                    f", expected {want.dtype}{list(want.shape)}"
                )
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), values), dict(restored["meta"])

    def read_meta(self, step: int | None = None) -> tuple[int, dict[str, Any]]:
        """(step, meta) of a checkpoint without touching its arrays."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{self.directory}: no checkpoint to read")
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return step, dict(restored["meta"])

    def close(self) -> None:
        self.manager.close()
