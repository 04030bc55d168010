"""Task datasets, prompts and rewards (math-verify, sandboxed code, exact, length)."""

from __future__ import annotations

import json

import pytest

from gpu_workers.rewards import Limits, code_reward, length_reward, register, score
from gpu_workers.tasks import (
    ColumnMap,
    Task,
    TaskDataError,
    length_target,
    load_jsonl,
    prompt_text,
    prompt_tokens,
    synthetic_tasks,
)


def test_jsonl_with_a_column_mapping_and_solve_rate_filter(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [
        {"problem": "1+1?", "solution": "2", "rate": 0.5, "src": "a"},
        {"problem": "2+2?", "solution": "4", "rate": 0.95},
        {"problem": "3+3?", "solution": "6"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_jsonl(path, ColumnMap(prompt="problem", answer="solution", solve_rate="rate"))
    assert [t.answer for t in ds] == ["2", "4", "6"] and ds[0].meta == {"src": "a"}
    kept = ds.filter_solve_rate(0.1, 0.8)
    assert [t.prompt for t in kept] == ["1+1?", "3+3?"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"t.jsonl:1: not valid JSON"),
        ('{"prompt": ""}', r"t.jsonl:1: field 'prompt' \(column 'prompt'\)"),
        ('{"prompt": "x", "tests": "[1, 2]"}', r"t.jsonl:1: field 'tests' \(column 'tests'\) must be a list"),
        ('{"prompt": "x", "solve_rate": "high"}', r"t.jsonl:1: field 'solve_rate' \(column 'solve_rate'\) is not a"),
    ],
)
def test_bad_rows_name_file_line_and_column(tmp_path, line, message):
    (tmp_path / "t.jsonl").write_text(line + "\n")
    with pytest.raises(TaskDataError, match=message):
        load_jsonl(tmp_path / "t.jsonl")


def test_synthetic_tasks_are_deterministic_and_correct():
    a = synthetic_tasks("arithmetic", 20, seed=3)
    assert [t.prompt for t in a] == [t.prompt for t in synthetic_tasks("arithmetic", 20, seed=3)]
    assert [t.prompt for t in a] != [t.prompt for t in synthetic_tasks("arithmetic", 20, seed=4)]
    for t in a:
        x, op, y = t.meta["a"], t.meta["op"], t.meta["b"]
        assert int(t.answer) == eval(f"{x} {op} {y}")  # an independent evaluation of the same expression
    rev = synthetic_tasks("reverse", 5, digits=6)
    assert all(t.answer == t.prompt.split(": ")[1][::-1] for t in rev)
    srt = synthetic_tasks("sort", 5, digits=5)
    assert all(t.answer.split() == sorted(t.prompt.split(": ")[1].split()) for t in srt)
    with pytest.raises(ValueError, match="available: arithmetic, reverse, sort"):
        synthetic_tasks("chess", 1)


def test_prompt_has_the_length_target_and_the_chat_template(tiny_model):
    from transformers import AutoTokenizer

    task = Task(prompt="What is 2 + 3?", reward="math", answer="5")
    target = length_target([100, 200, 300], seed=7)
    assert target == 200
    assert prompt_text(task, target).endswith("Think for 200 tokens before giving a response.")
    tok = AutoTokenizer.from_pretrained(tiny_model(family="qwen2"))
    ids = prompt_tokens(task, tok, target)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\nWhat is 2 + 3?") and text.endswith("<|im_start|>assistant\n")


def test_math_reward_uses_symbolic_equivalence():
    task = Task(prompt="half?", reward="math", answer="1/2")
    assert score(task, "so the answer is \\boxed{0.5}").value == 1.0
    assert score(task, "I think it is \\boxed{\\frac{1}{2}}").value == 1.0
    assert score(task, "the answer is \\boxed{2}").value == 0.0
    assert score(task, "no idea").value == 0.0


def test_math_reference_answer_parses_however_starved_the_process(monkeypatch):
    """math-verify's wall-clock alarm fires on a starved process: every time-limited parse times out here, as it
    did on a worker at load 15 (a multi-turn episode's feedback then differed from its validator's). The reference
    answer, trusted pool data, is parsed without the alarm; the completion keeps it (an attacker writes it)."""
    import math_verify.parser
    from math_verify.errors import TimeoutException

    from gpu_workers.rewards import math as math_rewards

    def starved(timeout_seconds=10):
        def decorate(fn):
            def wrapper(*args, **kwargs):
                if timeout_seconds:
                    raise TimeoutException("Operation timed out!")
                return fn(*args, **kwargs)

            return wrapper

        return decorate

    math_rewards._reference.cache_clear()
    monkeypatch.setattr(math_verify.parser, "timeout", starved)
    task = Task(prompt="6400?", reward="math", answer="6400")
    result = score(task, "the answer is \\boxed{6400}")
    assert "does not parse" not in result.reason  # the reference was read
    assert (result.value, result.reason) == (0.0, "no answer found in the completion")  # the completion timed out
    monkeypatch.undo()
    assert score(task, "the answer is \\boxed{6400}").value == 1.0


def test_exact_reward_reads_the_final_line():
    task = Task(prompt="Reverse the string: abc", reward="exact", answer="cba")
    assert score(task, "let me think\nAnswer: cba.").value == 1.0
    assert score(task, "cba\nor maybe abc").value == 0.0


@pytest.fixture
def code_runs():
    """Code rewards run here: sandboxed, or (where no sandbox can be made) by the operator's opt-in, whose limits
    are the same; tests/unit/gpu_workers/test_code_sandbox.py covers the sandbox itself."""
    from gpu_workers.rewards import code

    code.allow_unsandboxed(code.sandbox_status() is not None)
    yield
    code.allow_unsandboxed(False)


def test_code_reward_runs_tests_in_a_limited_subprocess(code_runs):
    tests = [{"input": "3 4\n", "output": "7"}, {"input": "10 -2\n", "output": "8"}]
    task = Task(prompt="add", reward="code", tests=tests)
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert score(task, good).value == 1.0
    half = "```python\na, b = map(int, input().split())\nprint(7)\n```"
    assert score(task, half).value == 0.5
    loop = Task(prompt="x", reward="code", tests=[{"input": "", "output": "1"}])
    result = code_reward(loop, "while True:\n    pass", Limits(cpu_s=1, wall_s=3))
    assert result.value == 0.0 and ("wall-clock" in result.reason or "exit" in result.reason)
    net = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\nprint(1)"
    assert score(loop, net).value == 0.0  # no network (or nothing listening): never a pass
    hog = "x = bytearray(4 * 1024**3)\nprint(1)"
    assert code_reward(loop, hog, Limits(memory_mb=256)).value == 0.0


def test_a_crashing_verifier_gives_zero_and_a_reason():
    def broken(task, completion):
        raise RuntimeError("boom")

    register("broken-for-test", broken)
    result = score(Task(prompt="x", reward="broken-for-test"), "anything")
    assert result.value == 0.0 and "RuntimeError: boom" in result.reason


@pytest.mark.parametrize("mode, expected", [("exact", 1.0 - 0.01 * 50), ("max", 1.0 - 0.01 * 50), ("clip", 0.0)])
def test_length_reward_variants(mode, expected):
    assert length_reward(1.0, length=150, target=100, alpha=0.01, mode=mode) == pytest.approx(expected)
    under = length_reward(1.0, length=60, target=100, alpha=0.01, mode=mode)
    assert under == pytest.approx({"exact": 0.6, "max": 1.0, "clip": 0.9}[mode])
    assert length_reward(1.0, length=10, target=0, alpha=0.01, mode=mode) == 1.0
