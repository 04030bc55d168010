"""Real-format task data (issue 35, item 4): GSM8K, MATH and HumanEval rows, the example files in configs/data/,
datasets saved by Hugging Face `datasets` (save_to_disk directories and parquet), column overrides from
`[data]`, and malformed rows named by file, row and field.

Expected answers are written out by hand from the example files' text. `datasets` is not installed in this
environment, so the save_to_disk directories are written with pyarrow in the layout `datasets` documents
(`data-XXXXX-of-NNNNN.arrow` Arrow stream files listed in `state.json`, beside `dataset_info.json`); where
`datasets` is installed, one test writes the directory with `datasets` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpu_workers.rewards import Limits, code_reward, score
from gpu_workers.rewards.code import check_program
from gpu_workers.tasks import TaskDataError, load_tasks
from gpu_workers.tasks.dataset import last_boxed

DATA = Path(__file__).resolve().parents[3] / "configs" / "data"


@pytest.fixture
def code_runs():
    """Sandboxed where bwrap works, else the operator's opt-in (same limits), as test_tasks_rewards does."""
    from gpu_workers.rewards import code

    code.allow_unsandboxed(code.sandbox_status() is not None)
    yield
    code.allow_unsandboxed(False)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def save_to_disk_layout(root: Path, rows: list[dict], shards: int = 2) -> None:
    """A `Dataset.save_to_disk` directory written with pyarrow: Arrow stream shards, state.json, dataset_info.json."""
    root.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    size = -(-len(rows) // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        with pa.OSFile(str(root / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(i * size, size))
    state = {
        "_data_files": [{"filename": n} for n in names],
        "_fingerprint": "0123456789abcdef",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": "train",
    }
    (root / "state.json").write_text(json.dumps(state))
    (root / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "features": {}}))


# ---- GSM8K and MATH ----------------------------------------------------------------------------------------


def test_gsm8k_example_file_gives_the_final_numbers_and_scores_with_math_verify():
    tasks = load_tasks(DATA / "gsm8k_example.jsonl", format="gsm8k")
    assert [t.answer for t in tasks] == ["25", "120", "180", "2000"]  # "#### 2,000" loses its separator
    assert all(t.reward == "math" for t in tasks)
    assert tasks[0].prompt.startswith("A baker fills 7 trays") and tasks[0].meta["solution"].endswith("#### 25")
    assert score(tasks[0], "84 - 59 leaves 25 rolls. The answer is $\\boxed{25}$.").value == 1.0
    assert score(tasks[3], "They order 2,000 pencils, so the answer is 2000.").value == 1.0
    assert score(tasks[0], "The answer is $\\boxed{26}$.").value == 0.0


def test_math_example_file_takes_the_last_box_keeps_level_and_type_and_verifies_symbolically():
    tasks = load_tasks(DATA / "math_example.jsonl", format="math")
    assert [t.answer for t in tasks] == ["\\frac{19}{12}", "5", "6\\sqrt{2}", "(3, -1)"]
    assert [(t.meta["level"], t.meta["type"]) for t in tasks] == [
        ("Level 1", "Prealgebra"),
        ("Level 2", "Algebra"),
        ("Level 2", "Prealgebra"),
        ("Level 3", "Algebra"),
    ]
    assert score(tasks[0], "So the sum is $\\boxed{\\frac{38}{24}}$.").value == 1.0  # equal, not the same text
    assert score(tasks[2], "Therefore $\\boxed{\\sqrt{72}}$ simplifies to $\\boxed{6\\sqrt{2}}$.").value == 1.0
    assert score(tasks[2], "$\\boxed{3\\sqrt{8}}$").value == 1.0  # 3 * 2 * sqrt(2)
    assert score(tasks[3], "$\\boxed{(3,-1)}$").value == 1.0
    assert score(tasks[3], "$\\boxed{(-1, 3)}$").value == 0.0
    assert score(tasks[1], "$\\boxed{2}$").value == 0.0


def test_last_boxed_balances_nested_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{\\sqrt{2}}} end") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None and last_boxed("no box") is None


# ---- HumanEval ---------------------------------------------------------------------------------------------


def test_humaneval_program_is_prompt_completion_test_and_check_call():
    task = load_tasks(DATA / "humaneval_example.jsonl", format="humaneval")[1]
    row = _rows(DATA / "humaneval_example.jsonl")[1]
    assert task.reward == "code" and task.meta["task_id"] == "Example/1" and task.check.entry_point == "count_vowels"
    assert row["prompt"] in task.prompt  # the model sees the signature and docstring
    body = "    return sum(c in 'aeiouAEIOU' for c in text)\n"
    program = check_program(task.check, body)
    assert program == row["prompt"] + body + "\n\n" + row["test"] + "\n\ncheck(count_vowels)\n"
    namespace: dict = {}
    exec(compile(program, "program", "exec"), namespace)  # trusted, hand-written code: runs and passes
    bad = check_program(task.check, "    return 0\n")
    with pytest.raises(AssertionError):
        exec(compile(bad, "bad", "exec"), {})


def test_humaneval_tasks_score_in_the_code_sandbox(code_runs):
    tasks = load_tasks(DATA / "humaneval_example.jsonl", format="humaneval")
    for task in tasks:  # each canonical solution (a body continuing the prompt) passes its own test
        assert score(task, task.meta["canonical_solution"]).value == 1.0, task.meta["task_id"]
    whole = (
        "Here it is:\n```python\ndef balanced(brackets):\n    d = 0\n    for c in brackets:\n"
        "        d += 1 if c == '(' else -1\n        if d < 0:\n            return False\n    return d == 0\n```"
    )
    assert score(tasks[2], whole).value == 1.0  # a whole function in a code block redefines the stub
    counts = "def balanced(brackets):\n    return brackets.count('(') == brackets.count(')')\n"
    wrong = score(tasks[2], f"```python\n{counts}```")
    assert wrong.value == 0.0 and "AssertionError" in wrong.reason  # ')(' has equal counts but is unbalanced
    slow = code_reward(tasks[0], "    while True:\n        pass\n", Limits(cpu_s=1, wall_s=3))
    assert slow.value == 0.0 and ("wall-clock" in slow.reason or "exit" in slow.reason)


def test_humaneval_programs_run_inside_bubblewrap():
    """Where the sandbox can be made, a HumanEval program runs in it like stdin/stdout programs: the canonical
    solution passes, and a completion that forks (refused by the seccomp filter) fails its check."""
    from gpu_workers.rewards import code

    why = code.sandbox_status()
    if why is not None:
        pytest.skip(f"no sandbox on this machine: {why} (.ci/run installs bubblewrap)")
    task = load_tasks(DATA / "humaneval_example.jsonl", format="humaneval")[0]
    assert score(task, task.meta["canonical_solution"]).value == 1.0
    forks = "    import os\n    os.fork()\n" + task.meta["canonical_solution"]
    result = score(task, forks)
    assert result.value == 0.0 and "check failed" in result.reason


def test_stdin_stdout_code_tasks_are_kept(code_runs):
    tasks = load_tasks(DATA / "code_stdio_example.jsonl")
    assert [t.reward for t in tasks] == ["code", "code"] and tasks[0].check is None
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert score(tasks[0], good).value == 1.0
    assert score(tasks[1], "```python\nprint(input()[::-1])\n```").value == 1.0


# ---- dataset directories and column overrides --------------------------------------------------------------


def test_save_to_disk_directory_with_renamed_columns(tmp_path):
    rows = [{"q": r["question"], "a": r["answer"], "id": i} for i, r in enumerate(_rows(DATA / "gsm8k_example.jsonl"))]
    save_to_disk_layout(tmp_path / "gsm8k-train", rows, shards=2)
    tasks = load_tasks(tmp_path / "gsm8k-train", columns={"prompt": "q", "answer": "a"}, format="gsm8k")
    assert [t.answer for t in tasks] == ["25", "120", "180", "2000"]  # both shards, in order
    assert [t.meta["id"] for t in tasks] == [0, 1, 2, 3]
    assert tasks.name == "gsm8k-train"


def test_directory_written_by_datasets_itself(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _rows(DATA / "math_example.jsonl")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "math"))
    assert [t.answer for t in load_tasks(tmp_path / "math", format="math")] == [
        "\\frac{19}{12}",
        "5",
        "6\\sqrt{2}",
        "(3, -1)",
    ]


def test_parquet_file_and_directory_of_parquet_files(tmp_path):
    rows = _rows(DATA / "humaneval_example.jsonl")
    (tmp_path / "split").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:2]), tmp_path / "split" / "test-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "split" / "test-00001-of-00002.parquet")
    tasks = load_tasks(tmp_path / "split", format="humaneval")
    assert [t.check.entry_point for t in tasks] == ["running_max", "count_vowels", "balanced"]
    single = load_tasks(tmp_path / "split" / "test-00001-of-00002.parquet", format="humaneval")
    assert [t.meta["task_id"] for t in single] == ["Example/2"]


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    rows = _rows(DATA / "gsm8k_example.jsonl")
    save_to_disk_layout(tmp_path / "dd" / "train", rows[:3], shards=1)
    save_to_disk_layout(tmp_path / "dd" / "test", rows[3:], shards=1)
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(TaskDataError, match=r"DatasetDict.*dd/test, .*dd/train"):
        load_tasks(tmp_path / "dd", format="gsm8k")
    assert len(load_tasks(tmp_path / "dd" / "train", format="gsm8k")) == 3


# ---- malformed rows ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "format, row, message",
    [
        ("gsm8k", {"question": "q", "answer": "42"}, r"field 'answer' \(column 'answer'\) has no final '#### N'"),
        ("gsm8k", {"answer": "#### 1"}, r"field 'prompt' \(column 'question'\) is missing"),
        ("math", {"problem": "p", "solution": "it is 3"}, r"field 'solution' \(column 'solution'\) has no complete"),
        ("math", {"problem": "p", "solution": "\\boxed{3", "level": 1}, r"field 'solution'.*no complete \\boxed"),
        (
            "humaneval",
            {"prompt": "def f():\n", "entry_point": "f g", "test": "def check(c):\n    pass\n"},
            r"field 'entry_point' \(column 'entry_point'\) is not a Python identifier",
        ),
        (
            "humaneval",
            {"prompt": "def f():\n", "entry_point": "f", "test": "assert f() == 1\n"},
            r"field 'test' \(column 'test'\) defines no top-level check",
        ),
        ("humaneval", {"prompt": "def f():\n", "entry_point": "f"}, r"field 'test' \(column 'test'\) is missing"),
    ],
)
def test_a_malformed_row_names_file_row_and_field(tmp_path, format, row, message):
    good = {
        "gsm8k": {"question": "q", "answer": "#### 1"},
        "math": {"problem": "p", "solution": "\\boxed{1}"},
        "humaneval": {"prompt": "def f():\n", "entry_point": "f", "test": "def check(c):\n    pass\n"},
    }[format]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(TaskDataError, match=rf"rows.jsonl:2: {message}"):
        load_tasks(path, format=format)
    save_to_disk_layout(tmp_path / "saved", [good, good, row], shards=1)  # same columns in every row
    with pytest.raises(TaskDataError, match=rf"data-00000-of-00001.arrow: row 2: {message}"):
        load_tasks(tmp_path / "saved", format=format)


def test_unknown_fields_formats_and_paths_are_named(tmp_path):
    with pytest.raises(TaskDataError, match=r"format 'math' has no field \['question'\]; its fields: prompt"):
        load_tasks(DATA / "math_example.jsonl", columns={"question": "q"}, format="math")
    with pytest.raises(TaskDataError, match="unknown task format 'alpaca'; formats: plain, gsm8k, math, humaneval"):
        load_tasks(DATA / "math_example.jsonl", format="alpaca")
    with pytest.raises(TaskDataError, match="no such task file"):
        load_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskDataError, match="neither a datasets save_to_disk directory"):
        load_tasks(tmp_path / "empty")


# ---- [data] ------------------------------------------------------------------------------------------------


def test_data_format_and_columns_from_a_recipe_reach_the_task_sets(tmp_path):
    from intellect.config import ConfigError
    from intellect.config_io import load_config
    from intellect.tasks_setup import heldout_tasks, training_tasks

    rows = [{"q": r["question"], "a": r["answer"]} for r in _rows(DATA / "gsm8k_example.jsonl")]
    save_to_disk_layout(tmp_path / "saved", rows, shards=2)
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        f'[data]\npath = "{tmp_path / "saved"}"\nformat = "gsm8k"\ncolumns = {{prompt = "q", answer = "a"}}\n'
        "eval_tasks = 1\n"
    )
    data = load_config(recipe, env={}).data
    assert [t.answer for t in training_tasks(data)] == ["25", "120", "180"]
    assert [t.answer for t in heldout_tasks(data)] == ["2000"]
    with pytest.raises(ConfigError, match=r"data.columns \['question'\]: format 'gsm8k' has the fields prompt"):
        load_config(recipe, ["--data.columns", '{question = "q"}'], env={})
