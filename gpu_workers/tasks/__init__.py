"""Task datasets (files in plain, GSM8K, MATH or HumanEval format, or synthetic families), prompt construction
and length targets."""

from gpu_workers.tasks.dataset import (
    FORMATS,
    CodeCheck,
    ColumnMap,
    Task,
    TaskDataError,
    TaskDataset,
    load_jsonl,
    load_parquet,
    load_tasks,
)
from gpu_workers.tasks.prompt import LENGTH_SUFFIX, length_target, prompt_text, prompt_tokens
from gpu_workers.tasks.synthetic import FAMILIES, synthetic_tasks

__all__ = [
    "CodeCheck",
    "ColumnMap",
    "FAMILIES",
    "FORMATS",
    "LENGTH_SUFFIX",
    "Task",
    "TaskDataError",
    "TaskDataset",
    "length_target",
    "load_jsonl",
    "load_parquet",
    "load_tasks",
    "prompt_text",
    "prompt_tokens",
    "synthetic_tasks",
]
