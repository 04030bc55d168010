"""Built-in verifiable task families generated from a seed, for demos and tests (no files, no hub).

- `arithmetic`: "What is 4821 + 377?" with `digits`-digit operands and +, - or *; reward `math`.
- `reverse`: "Reverse the string: kqzt" (letters); reward `exact`.
- `sort`: "Sort the digits in ascending order: 5 1 4" ; reward `exact`.

The same (family, n, seed, digits) always gives the same tasks, on every machine.
"""

from __future__ import annotations

import numpy as np

from gpu_workers.tasks.dataset import Task, TaskDataset

FAMILIES = ("arithmetic", "reverse", "sort")


def _arithmetic(rng: np.random.Generator, digits: int) -> Task:
    low, high = 10 ** (digits - 1) if digits > 1 else 0, 10**digits
    a, b = (int(x) for x in rng.integers(low, high, 2))
    op = ("+", "-", "*")[int(rng.integers(0, 3))]
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return Task(
        prompt=f"What is {a} {op} {b}?",
        reward="math",
        answer=str(value),
        meta={"family": "arithmetic", "a": a, "b": b, "op": op},
    )


def _reverse(rng: np.random.Generator, digits: int) -> Task:
    letters = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, digits))
    return Task(
        prompt=f"Reverse the string: {letters}", reward="exact", answer=letters[::-1], meta={"family": "reverse"}
    )


def _sort(rng: np.random.Generator, digits: int) -> Task:
    values = [int(v) for v in rng.integers(0, 10, digits)]
    return Task(
        prompt=f"Sort the digits in ascending order: {' '.join(map(str, values))}",
        reward="exact",
        answer=" ".join(map(str, sorted(values))),
        meta={"family": "sort"},
    )


_MAKERS = {"arithmetic": _arithmetic, "reverse": _reverse, "sort": _sort}


def synthetic_tasks(family: str, n: int, seed: int = 0, digits: int = 3) -> TaskDataset:
    if family not in _MAKERS:
        raise ValueError(f"unknown synthetic task family {family!r}; available: {', '.join(FAMILIES)}")
    if n <= 0 or digits <= 0:
        raise ValueError(f"synthetic tasks: n ({n}) and digits ({digits}) must be positive")
    rng = np.random.default_rng([seed, FAMILIES.index(family)])
    return TaskDataset([_MAKERS[family](rng, digits) for _ in range(n)], f"{family}-{digits}d-seed{seed}")
