"""Task datasets: problems with what their verifier needs, from files in one of a few row formats.

A `Task` is one problem: the prompt text, the reference answer or tests, an optional solve rate, and the name
of the reward that verifies it (`gpu_workers.rewards`). Rows come in one of these formats (`data.format`),
each with default column names that `data.columns` overrides field by field:

- `plain`: prompt, answer, tests (stdin/stdout pairs), solve_rate, reward: the row as it is; its reward, else the
  dataset's default.
- `gsm8k`: prompt (column `question`), answer (`answer`, a worked solution ending in a `#### N` line),
  solve_rate: reward `math` against N.
- `math`: prompt (`problem`), solution (`solution`, with a `\\boxed{...}` answer), solve_rate: reward `math`
  against the last boxed expression; `level`, `type` and the other columns are kept as meta.
- `humaneval`: task_id, prompt (code: a signature and docstring), entry_point, test (code defining
  `check(candidate)`), canonical_solution (optional), solve_rate: reward `code` on the program made of the
  prompt, the completion's code, the test code and `check(entry_point)`.

Files (`load_tasks`): JSONL (`.jsonl`, `.json`, gzipped `.jsonl.gz`), parquet, Arrow (`.arrow`), or a directory:
one written by Hugging Face `datasets`' `Dataset.save_to_disk` (Arrow stream files listed in its `state.json`;
read with pyarrow, the `datasets` package is not needed) or a directory of parquet files (one split, read in name
order). A `DatasetDict` saved to disk is refused with its split directories named: point at one of them. A row
that does not fit its format raises `TaskDataError` naming the file, the row and the field.

INTELLECT-2 filtered its data offline by the base model's solve rate, keeping [0.1, 0.8]: `filter_solve_rate`
does that, and tasks without a solve rate are kept (there is nothing to filter them on).

Task ids are positions in the (filtered) dataset: the deterministic assignment draws ids in [0, len), and a
worker and a validator that load the same file with the same filter see the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


class TaskDataError(ValueError):
    """A dataset file or row is unusable; the message names the file, the row and the field."""


@dataclasses.dataclass(frozen=True)
class CodeCheck:
    """A HumanEval-style test: the program is `prefix` + the completion's code + `test` + `check(entry_point)`,
    and passes when it exits cleanly (a failing assert, an exception or a timeout fails it)."""

    prefix: str
    test: str
    entry_point: str


@dataclasses.dataclass(frozen=True)
class Task:
    prompt: str
    reward: str  # name of the reward function in gpu_workers.rewards
    answer: str | None = None
    tests: list[dict[str, Any]] | None = None  # code tasks: [{"input": stdin, "output": expected stdout}]
    solve_rate: float | None = None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    check: CodeCheck | None = None  # code tasks in HumanEval format


@dataclasses.dataclass(frozen=True)
class ColumnMap:
    """Which column of a `plain` file holds each field (None: the file has no such column)."""

    prompt: str = "prompt"
    answer: str | None = "answer"
    tests: str | None = "tests"
    solve_rate: str | None = "solve_rate"
    reward: str | None = "reward"  # per-row reward name; else the dataset's default


# field -> default column, per format
FORMATS: dict[str, dict[str, str]] = {
    "plain": dataclasses.asdict(ColumnMap()),
    "gsm8k": {"prompt": "question", "answer": "answer", "solve_rate": "solve_rate"},
    "math": {"prompt": "problem", "solution": "solution", "solve_rate": "solve_rate"},
    "humaneval": {
        "task_id": "task_id",
        "prompt": "prompt",
        "entry_point": "entry_point",
        "test": "test",
        "canonical_solution": "canonical_solution",
        "solve_rate": "solve_rate",
    },
}

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in a ```python code block.\n\n"
    "```python\n{code}```"
)


def column_map(format: str = "plain", columns: ColumnMap | Mapping[str, str | None] | None = None) -> dict:
    """The field -> column map of `format` with `columns` overriding some of its fields (a ColumnMap: all of
    a `plain` file's); an unknown format or field is a TaskDataError naming what exists."""
    if format not in FORMATS:
        raise TaskDataError(f"unknown task format {format!r}; formats: {', '.join(FORMATS)}")
    if isinstance(columns, ColumnMap):
        if format != "plain":
            raise TaskDataError(f"a ColumnMap describes plain files, not format {format!r}; pass a dict")
        return dataclasses.asdict(columns)
    fields = dict(FORMATS[format])
    unknown = sorted(set(columns or {}) - set(fields))
    if unknown:
        raise TaskDataError(f"format {format!r} has no field {unknown}; its fields: {', '.join(fields)}")
    fields.update(columns or {})
    return fields


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


# ---- rows to tasks -----------------------------------------------------------------------------------------


class _Row:
    """One row with its field -> column map and where it came from, for the errors."""

    def __init__(self, row: dict[str, Any], columns: dict[str, str | None], where: str):
        self.row, self.columns, self.where = row, columns, where

    def error(self, field: str, problem: str) -> TaskDataError:
        return TaskDataError(f"{self.where}: field {field!r} (column {self.columns[field]!r}) {problem}")

    def get(self, field: str) -> Any:
        column = self.columns.get(field)
        return None if column is None else self.row.get(column)

    def text(self, field: str) -> str:
        value = self.get(field)
        if not isinstance(value, str) or not value.strip():
            raise self.error(field, "is missing or not a non-empty string")
        return value

    def solve_rate(self) -> float | None:
        rate = self.get("solve_rate")
        if rate is None:
            return None
        try:
            return float(rate)
        except (TypeError, ValueError) as e:
            raise self.error("solve_rate", f"is not a number ({rate!r})") from e

    def meta(self, **extra: Any) -> dict[str, Any]:
        used = {c for c in self.columns.values() if c}
        return {**{k: v for k, v in self.row.items() if k not in used}, **extra}


def _plain(r: _Row, default_reward: str) -> Task:
    prompt = r.text("prompt")
    tests = r.get("tests")
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise r.error("tests", f"is not JSON ({e})") from e
    if tests is not None and not (isinstance(tests, list) and all(isinstance(t, dict) for t in tests)):
        raise r.error("tests", "must be a list of {input, output} objects")
    answer = r.get("answer")
    return Task(
        prompt=prompt,
        reward=r.get("reward") or default_reward,
        answer=None if answer is None else str(answer),
        tests=tests,
        solve_rate=r.solve_rate(),
        meta=r.meta(),
    )


def gsm8k_final_answer(solution: str) -> str | None:
    """The N of a GSM8K solution's final `#### N` line, thousands separators removed (None: no such line)."""
    if "####" not in solution:
        return None
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return final or None


def _gsm8k(r: _Row, default_reward: str) -> Task:
    prompt, solution = r.text("prompt"), r.text("answer")
    final = gsm8k_final_answer(solution)
    if final is None:
        raise r.error("answer", "has no final '#### N' line")
    return Task(prompt=prompt, reward="math", answer=final, solve_rate=r.solve_rate(), meta=r.meta(solution=solution))


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is
    none or its braces do not close."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip() or None
    return None


def _math(r: _Row, default_reward: str) -> Task:
    prompt, solution = r.text("prompt"), r.text("solution")
    answer = last_boxed(solution)
    if answer is None:
        raise r.error("solution", "has no complete \\boxed{...} answer")
    return Task(prompt=prompt, reward="math", answer=answer, solve_rate=r.solve_rate(), meta=r.meta(solution=solution))


def _humaneval(r: _Row, default_reward: str) -> Task:
    code, test = r.text("prompt"), r.text("test")
    entry_point = r.text("entry_point").strip()
    if not entry_point.isidentifier():
        raise r.error("entry_point", f"is not a Python identifier ({entry_point!r})")
    if not re.search(r"^def check\s*\(", test, re.MULTILINE):
        raise r.error("test", "defines no top-level check(candidate) function")
    extra = {"task_id": r.get("task_id")}
    if r.get("canonical_solution") is not None:
        extra["canonical_solution"] = r.get("canonical_solution")
    return Task(
        prompt=HUMANEVAL_INSTRUCTION.format(code=code if code.endswith("\n") else code + "\n"),
        reward="code",
        solve_rate=r.solve_rate(),
        meta=r.meta(**extra),
        check=CodeCheck(prefix=code, test=test, entry_point=entry_point),
    )


_MAKERS = {"plain": _plain, "gsm8k": _gsm8k, "math": _math, "humaneval": _humaneval}


# ---- files to rows -----------------------------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict]]:
    import gzip

    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{n}: not valid JSON ({e})") from e
            if not isinstance(row, dict):
                raise TaskDataError(f"{path}:{n}: a row must be a JSON object")
            yield f"{path}:{n}", row


def _pyarrow(path: Path):
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as e:
        raise TaskDataError(f"{path}: reading parquet or Arrow files needs pyarrow (pip install pyarrow)") from e
    return pyarrow


def _table_rows(path: Path, table) -> Iterator[tuple[str, dict]]:
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict]]:
    pa = _pyarrow(path)
    try:
        table = pa.parquet.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise TaskDataError(f"{path}: not a readable parquet file ({e})") from e
    yield from _table_rows(path, table)


def _arrow_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """An Arrow IPC stream file (what `save_to_disk` writes), or an Arrow IPC file."""
    pa = _pyarrow(path)
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        try:
            with pa.memory_map(str(path)) as source:
                table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid as e:
            raise TaskDataError(f"{path}: not an Arrow stream or file ({e})") from e
    yield from _table_rows(path, table)


def _saved_dataset_rows(root: Path) -> Iterator[tuple[str, dict]]:
    state_path = root / "state.json"
    try:
        state = json.loads(state_path.read_text())
        files = [entry["filename"] for entry in state["_data_files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise TaskDataError(f"{state_path}: not a datasets save_to_disk state (no _data_files list: {e})") from e
    if not files:
        raise TaskDataError(f"{state_path}: lists no data files")
    for name in files:
        path = root / name
        if not path.is_file():
            raise TaskDataError(f"{state_path}: lists {name}, which is not in {root}")
        yield from _arrow_rows(path)


def _directory_rows(root: Path) -> Iterator[tuple[str, dict]]:
    if (root / "dataset_dict.json").exists():
        splits = sorted(p.name for p in root.iterdir() if (p / "state.json").exists())
        raise TaskDataError(
            f"{root}: a DatasetDict saved with save_to_disk; point the path at one split: "
            + ", ".join(str(root / s) for s in splits)
        )
    if (root / "state.json").exists():
        yield from _saved_dataset_rows(root)
        return
    parquet = sorted(root.glob("*.parquet"))
    if not parquet:
        raise TaskDataError(
            f"{root}: neither a datasets save_to_disk directory (state.json and data-*.arrow) nor a directory "
            "of .parquet files"
        )
    for path in parquet:
        yield from _parquet_rows(path)


def _rows(path: Path) -> Iterator[tuple[str, dict]]:
    if path.is_dir():
        return _directory_rows(path)
    if not path.exists():
        raise TaskDataError(f"{path}: no such task file or directory")
    if path.suffix in (".jsonl", ".json") or path.name.endswith((".jsonl.gz", ".json.gz")):
        return _jsonl_rows(path)
    if path.suffix == ".parquet":
        return _parquet_rows(path)
    if path.suffix == ".arrow":
        return _arrow_rows(path)
    raise TaskDataError(
        f"{path}: unknown task file type {path.suffix!r}; use .jsonl (or .jsonl.gz), .parquet, .arrow or a "
        "directory saved by datasets"
    )


def load_tasks(
    path: str | Path,
    columns: ColumnMap | Mapping[str, str | None] | None = None,
    reward: str = "math",
    format: str = "plain",
) -> TaskDataset:
    """The tasks of a JSONL, parquet or Arrow file or a dataset directory, its rows read as `format` with
    `columns` overriding the format's column names; `reward` is the default reward of `plain` rows."""
    path = Path(path)
    fields = column_map(format, columns)
    make = _MAKERS[format]
    return TaskDataset([make(_Row(row, fields, where), reward) for where, row in _rows(path)], path.name)


def load_jsonl(path: str | Path, columns: ColumnMap = ColumnMap(), reward: str = "math") -> TaskDataset:
    return TaskDataset(
        [_plain(_Row(row, column_map("plain", columns), where), reward) for where, row in _jsonl_rows(Path(path))],
        Path(path).name,
    )


def load_parquet(path: str | Path, columns: ColumnMap = ColumnMap(), reward: str = "math") -> TaskDataset:
    return TaskDataset(
        [_plain(_Row(row, column_map("plain", columns), where), reward) for where, row in _parquet_rows(Path(path))],
        Path(path).name,
    )
