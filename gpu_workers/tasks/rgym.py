"""reasoning-gym's procedural generators as a task source: tasks from (generator, config, seed), scored by the
generator's own `score_answer`.

`[data]` names the generator (`data.generator`, e.g. "letter_counting"), its config (`data.generator_config`,
the fields of the generator's config dataclass, e.g. {min_words = 5, max_words = 10}) and the seed
(`data.task_seed`). reasoning-gym derives entry i from the seed and i alone, so a worker, a validator and the
orchestrator that read the same `[data]` build the same task list, entry for entry.

A task keeps the entry (question, answer, metadata) in `meta["entry"]`; its reward, `reasoning_gym`, reads the
completion's answer and hands it with the entry to the generator's `score_answer`, which returns a value in
[0, 1] (1: right; some generators give partial credit, e.g. the oracle answer inside a longer one). The answer
is what the last `<answer>...</answer>` of the completion holds (reasoning-gym's own `extract_answer`, the
format its system prompts ask for); a completion without the tags is scored by its last non-empty line.

Errors name what is wrong: an unknown generator lists the names closest to it; a config key the generator does
not have lists the keys it has; a value its config rejects quotes the generator's own message.
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from typing import Any

from gpu_workers.tasks.dataset import Task, TaskDataError, TaskDataset

REWARD = "reasoning_gym"
_RESERVED = ("seed", "size")  # reasoning-gym config fields that [data] sets itself (task_seed, num_tasks)


class GeneratorError(TaskDataError):
    """An unknown reasoning-gym generator or a config it refuses; the message names the generator and field."""


def _registry() -> dict[str, tuple[type, type]]:
    try:
        import reasoning_gym  # noqa: F401  (importing registers every generator)
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise GeneratorError(
            "reasoning-gym tasks need the reasoning-gym package: pip install -e .[tasks] (or .[all])"
        ) from e
    return DATASETS


def generators() -> list[str]:
    """Names of every reasoning-gym generator."""
    return sorted(_registry())


def _config_fields(config_cls: type) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(config_cls) if f.name not in _RESERVED]


def check_generator(generator: str, config: Mapping[str, Any]) -> None:
    """Raise GeneratorError unless `generator` exists and takes every key of `config`."""
    registry = _registry()
    if generator not in registry:
        close = difflib.get_close_matches(generator, list(registry), n=5, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; {len(registry)} exist (reasoning_gym.factory)"
        raise GeneratorError(f"data.generator: unknown reasoning-gym generator {generator!r}{hint}")
    fields = _config_fields(registry[generator][1])
    reserved = sorted(set(config) & set(_RESERVED))
    if reserved:
        raise GeneratorError(
            f"data.generator_config {reserved} of generator {generator!r}: set by [data] itself "
            "(seed: data.task_seed, size: data.num_tasks / data.eval_tasks)"
        )
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise GeneratorError(
            f"data.generator_config: generator {generator!r} has no config key {', '.join(map(repr, unknown))}; "
            f"its keys: {', '.join(fields)}"
        )


def _key(config: Mapping[str, Any]) -> str:
    return json.dumps(dict(config), sort_keys=True)


@functools.lru_cache(maxsize=64)
def _dataset(generator: str, config_json: str, seed: int, size: int):
    """The reasoning-gym dataset object (its entries and its scorer) of one (generator, config, seed, size)."""
    config = json.loads(config_json)
    check_generator(generator, config)
    dataset_cls, config_cls = _registry()[generator]
    try:
        cfg = config_cls(**config, seed=seed, size=size)
        if hasattr(cfg, "validate"):
            cfg.validate()
        return dataset_cls(config=cfg)
    except (AssertionError, ValueError, TypeError) as e:
        raise GeneratorError(
            f"data.generator_config {config}: generator {generator!r} refuses it: {type(e).__name__}: {e}"
        ) from e


def reasoning_gym_tasks(generator: str, n: int, seed: int = 0, config: Mapping[str, Any] | None = None) -> TaskDataset:
    """The first `n` entries of `generator` (with `config`) from `seed`, as tasks with reward `reasoning_gym`."""
    if n <= 0:
        raise GeneratorError(f"reasoning-gym generator {generator!r}: the number of tasks ({n}) must be positive")
    config = dict(config or {})
    key = _key(config)
    dataset = _dataset(generator, key, int(seed), int(n))
    tasks = []
    for i in range(n):
        entry = dataset[i]
        tasks.append(
            Task(
                prompt=entry["question"],
                reward=REWARD,
                answer=str(entry["answer"]),
                meta={
                    "generator": generator,
                    "generator_config": key,
                    "seed": int(seed),
                    "size": int(n),
                    "entry": entry,
                },
            )
        )
    return TaskDataset(tasks, f"reasoning_gym:{generator}-seed{seed}")


def scorer(task: Task):
    """The `score_answer` of the dataset object the task came from."""
    meta = task.meta
    try:
        return _dataset(meta["generator"], meta["generator_config"], meta["seed"], meta["size"]).score_answer
    except KeyError as e:
        raise GeneratorError(f"task {task.prompt[:60]!r} is not a reasoning-gym task (meta has no {e})") from e
