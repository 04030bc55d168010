"""Task datasets: problems with what their verifier needs, from JSONL or parquet files or a generator.

A `Task` is one problem: the prompt text, the reference answer or tests, an optional solve rate, and the name
of the reward that verifies it (`gpu_workers.rewards`). Files are mapped column by column, so any dataset
works without renaming: `ColumnMap(prompt="problem", answer="solution")`. INTELLECT-2 filtered its data
offline by the base model's solve rate, keeping [0.1, 0.8]: `filter_solve_rate` does that, and tasks without a
solve rate are kept (there is nothing to filter them on).

Task ids are positions in the (filtered) dataset: the deterministic assignment draws ids in [0, len), and a
worker and a validator that load the same file with the same filter see the same ids.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class TaskDataError(ValueError):
    """A dataset file or row is unusable; the message names the file, the row and the field."""


@dataclasses.dataclass(frozen=True)
class Task:
    prompt: str
    reward: str  # name of the reward function in gpu_workers.rewards
    answer: str | None = None
    tests: list[dict[str, Any]] | None = None  # code tasks: [{"input": stdin, "output": expected stdout}]
    solve_rate: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ColumnMap:
    """Which column of the file holds each field (None: the file has no such column)."""

    prompt: str = "prompt"
    answer: str | None = "answer"
    tests: str | None = "tests"
    solve_rate: str | None = "solve_rate"
    reward: str | None = "reward"  # per-row reward name; else the dataset's default


class TaskDataset(Sequence[Task]):
    def __init__(self, tasks: Iterable[Task], name: str = "tasks"):
        self.tasks = list(tasks)
        self.name = name

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i):
        return self.tasks[i]

    def filter_solve_rate(self, low: float, high: float) -> "TaskDataset":
        """Keep tasks with low <= solve_rate <= high (and those without a solve rate)."""
        kept = [t for t in self.tasks if t.solve_rate is None or low <= t.solve_rate <= high]
        return TaskDataset(kept, f"{self.name}[solve_rate {low}..{high}]")


def _row_to_task(row: dict[str, Any], columns: ColumnMap, default_reward: str, where: str) -> Task:
    if columns.prompt not in row or not isinstance(row[columns.prompt], str) or not row[columns.prompt]:
        raise TaskDataError(f"{where}: column {columns.prompt!r} (the prompt) is missing or not a non-empty string")

    def get(column):
        return row.get(column) if column is not None else None

    tests = get(columns.tests)
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise TaskDataError(f"{where}: column {columns.tests!r} is not JSON ({e})") from e
    if tests is not None and not (isinstance(tests, list) and all(isinstance(t, dict) for t in tests)):
        raise TaskDataError(f"{where}: column {columns.tests!r} must be a list of {{input, output}} objects")
    rate = get(columns.solve_rate)
    if rate is not None:
        try:
            rate = float(rate)
        except (TypeError, ValueError) as e:
            raise TaskDataError(f"{where}: column {columns.solve_rate!r} is not a number ({rate!r})") from e
    answer = get(columns.answer)
    used = {c for c in dataclasses.astuple(columns) if c}
    return Task(
        prompt=row[columns.prompt],
        reward=get(columns.reward) or default_reward,
        answer=None if answer is None else str(answer),
        tests=tests,
        solve_rate=rate,
        meta={k: v for k, v in row.items() if k not in used},
    )


def load_jsonl(path: str | Path, columns: ColumnMap = ColumnMap(), reward: str = "math") -> TaskDataset:
    path = Path(path)
    tasks = []
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise TaskDataError(f"{path}:{n}: a row must be a JSON object")
            tasks.append(_row_to_task(row, columns, reward, f"{path}:{n}"))
    return TaskDataset(tasks, path.name)


def load_parquet(path: str | Path, columns: ColumnMap = ColumnMap(), reward: str = "math") -> TaskDataset:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise TaskDataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from e
    rows = pq.read_table(path).to_pylist()
    return TaskDataset(
        [_row_to_task(r, columns, reward, f"{path}: row {i}") for i, r in enumerate(rows)], Path(path).name
    )


def load_tasks(path: str | Path, columns: ColumnMap = ColumnMap(), reward: str = "math") -> TaskDataset:
    """JSONL (`.jsonl`, `.json`) or parquet (`.parquet`), by extension."""
    suffix = Path(path).suffix
    if suffix in (".jsonl", ".json"):
        return load_jsonl(path, columns, reward)
    if suffix == ".parquet":
        return load_parquet(path, columns, reward)
    raise TaskDataError(f"{path}: unknown task file type {suffix!r}; use .jsonl or .parquet")
