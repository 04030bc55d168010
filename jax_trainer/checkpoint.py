"""Orbax checkpoints of the learner: parameters, optimizer state, step counters and the data cursor.

`Checkpointer(dir, keep=n)` wraps an orbax `CheckpointManager`. A checkpoint holds two items:

- `state`: every array of the `TrainState`, stored by its key path (`.params['layers']['attn']...`), restored
  straight into the shardings of a freshly built state (each host reads only its own shards);
- `meta`: JSON: the data source's cursor (which accepted batches were consumed), the policy version, and
  whatever the caller adds (config digest, wall time).

The step is deterministic given its inputs, so parameters + optimizer state + step + data cursor are the whole
state: N steps, save, restore, N more steps gives bitwise the parameters of 2N straight steps (tested).
Saving is synchronous by default: a checkpoint that `save` returned from is complete on disk.

Checkpoints written before the decoder's layers were stacked (`.params['layers'][3]['attn']['q_proj']`, one
array per layer) restore into today's stacked state (`.params['layers']['attn']['q_proj']`, a leading layer
axis): each layer's array is read in its slice of the stacked sharding and the layers are stacked on the devices;
the parameters and the optimizer moments alike.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

log = logging.getLogger("jax_trainer.checkpoint")


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
        per_layer = _per_layer_keys(stored, abstract) if stored is not None else {}
        if per_layer:  # written before the layers were stacked: read each layer, stack them below
            log.info("%s/%d: stacking %d arrays saved layer by layer", self.directory, step, len(per_layer))
            abstract = _unstacked_abstract(abstract, per_layer)
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
        arrays = dict(restored["state"])
        for key, layer_keys in per_layer.items():
            want = leaves[[jax.tree_util.keystr(p) for p, _ in leaves].index(key)][1]
            arrays[key] = _stack(want.sharding)(*(arrays.pop(k) for k in layer_keys))
        values = [arrays[jax.tree_util.keystr(p)] for p, _ in leaves]
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


_LAYER_INDEX = re.compile(r"\['layers'\]\[(\d+)\]")


def _per_layer_keys(stored, abstract: dict[str, jax.ShapeDtypeStruct]) -> dict[str, list[str]]:
    """{stacked key of `abstract`: the stored keys of its layers 0..n-1} for a checkpoint written before the
    decoder's layers were stacked (`['layers'][3]['attn']...` for layer 3 of `['layers']['attn']...`); empty
    when `stored` has no such keys. Layers that do not run 0..n-1 for the n of the stacked array are an error."""
    groups: dict[str, dict[int, str]] = {}
    for key in stored:
        match = _LAYER_INDEX.search(key)
        if match and _LAYER_INDEX.sub("['layers']", key, count=1) in abstract:
            groups.setdefault(_LAYER_INDEX.sub("['layers']", key, count=1), {})[int(match.group(1))] = key
    out = {}
    for key, layers in groups.items():
        n = abstract[key].shape[0]
        if sorted(layers) != list(range(n)):
            raise CheckpointError(f"{key}: the checkpoint has layers {sorted(layers)}, the model {n} layers")
        out[key] = [layers[i] for i in range(n)]
    return out


def _unstacked_abstract(abstract: dict, per_layer: dict[str, list[str]]) -> dict:
    """`abstract` with each stacked array replaced by its layers' arrays (the stacked sharding less the layer axis)."""
    out = {k: v for k, v in abstract.items() if k not in per_layer}
    for key, layer_keys in per_layer.items():
        want = abstract[key]
        spec = tuple(want.sharding.spec) + (None,) * (len(want.shape) - len(want.sharding.spec))
        sharding = NamedSharding(want.sharding.mesh, PartitionSpec(*spec[1:]))
        for k in layer_keys:
            out[k] = jax.ShapeDtypeStruct(want.shape[1:], want.dtype, sharding=sharding)
    return out


@functools.lru_cache(maxsize=None)
def _stack(sharding):
    return jax.jit(lambda *layers: jnp.stack(layers), out_shardings=sharding)
