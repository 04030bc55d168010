"""The training and held-out task sets of a config (`[data]`), the same for every role that needs them.

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
from intellect.config import ConfigError, DataConfig

_HELDOUT_STREAM = 1_000_003  # added to data.task_seed for the held-out synthetic tasks


def _load(data: DataConfig, path: str) -> TaskDataset:
    return load_tasks(path, columns=data.columns, reward=data.task, format=data.format)


def _file_tasks(data: DataConfig) -> TaskDataset:
    tasks = _load(data, data.path)
    kept = tasks.filter_solve_rate(data.solve_rate_min, data.solve_rate_max)
    if not len(kept):
        raise ConfigError(
            f"data.path {data.path}: no task has a solve rate in [data.solve_rate_min, "
            f"data.solve_rate_max] = [{data.solve_rate_min}, {data.solve_rate_max}] "
            f"({len(tasks)} tasks before the filter)"
        )
    return kept


def training_tasks(data: DataConfig) -> TaskDataset:
    if data.path is None:
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
                f"data.path {data.path}: {len(tasks)} tasks cannot spare data.eval_tasks = "
                f"{data.eval_tasks} held-out rows; lower it or set data.eval_path"
            )
        return TaskDataset(tasks.tasks[: -data.eval_tasks], f"{tasks.name}[train]")
    return tasks


def heldout_tasks(data: DataConfig) -> TaskDataset:
    if data.eval_path is not None:
        return _load(data, data.eval_path)
    if data.path is not None:
        tasks = _file_tasks(data)
        return TaskDataset(tasks.tasks[len(tasks) - min(data.eval_tasks, len(tasks) - 1) :], f"{tasks.name}[held out]")
    seen = {t.prompt for t in training_tasks(data)}
    fresh: list = []
    for attempt in range(8):  # small task spaces: draw more until enough unseen prompts turn up
        pool = synthetic_tasks(
            data.task,
            4 * max(data.eval_tasks, 1) * (attempt + 1),
            data.task_seed + _HELDOUT_STREAM + attempt,
            data.digits,
        )
        for t in pool:
            if t.prompt not in seen:
                seen.add(t.prompt)
                fresh.append(t)
        if len(fresh) >= data.eval_tasks:
            break
    if len(fresh) < data.eval_tasks:
        raise ConfigError(
            f"data.eval_tasks = {data.eval_tasks}: only {len(fresh)} {data.task} prompts of "
            f"{data.digits} digits are not training prompts; lower data.num_tasks or "
            "data.eval_tasks, or raise data.digits"
        )
    return TaskDataset(fresh[: data.eval_tasks], f"{data.task}-{data.digits}d[held out]")
