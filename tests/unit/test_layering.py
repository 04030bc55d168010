"""The layering of the packages, read from the source with `ast` (no module is imported).

`bridge` holds the contracts every role shares (wire messages, rollout schema, SHARDCAST, the safetensors
layout) and imports no role; each role imports `bridge` and not another role's framework: the JAX learner
(`jax_trainer`) no torch, the vLLM workers (`gpu_workers`) no JAX, the service (`orchestrator`) no project
package but `bridge`; the command line (`intellect`) composes them and no library imports it. Imports inside
functions count as much as top-level ones. No module imports itself back through its top-level imports
(imports under `if TYPE_CHECKING:` run only for the type checker and are left out of that check).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest


def _root() -> Path:
    here = Path(__file__).resolve()
    return next(p for p in here.parents if (p / "pyproject.toml").exists())


ROOT = _root()
LIBRARIES = ("bridge", "jax_trainer", "gpu_workers", "orchestrator")
PACKAGES = (*LIBRARIES, "intellect")
ROLES = ("jax_trainer", "gpu_workers", "orchestrator", "intellect")
JAX = ("jax", "jaxlib", "flax", "optax", "orbax", "chex")
TORCH = ("torch", "torchvision", "vllm")

# (importing module, imported module) pairs allowed against a rule, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for top in (*PACKAGES, "tests", "benchmarks"):
        for path in sorted((ROOT / top).rglob("*.py")):
            found[_module_name(path)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """The modules an import statement names: `from a import b` names `a.b` where that is a module, else `a`."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_package else 0)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    for alias in node.names:
        sub = f"{name}.{alias.name}"
        yield sub if sub in MODULES else name


def imports(module: str, top_level_only: bool = False) -> Iterator[tuple[str, int]]:
    """(imported module, line) of every import of `module`; with `top_level_only`, those that run when it is
    imported (module and class bodies, not functions, not `if TYPE_CHECKING:` blocks)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"

    def walk(node: ast.AST) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield from ((name, child.lineno) for name in _imported(child, module, is_package))
            elif top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            elif top_level_only and isinstance(child, ast.If) and _is_type_checking(child):
                yield from walk(ast.Module(body=child.orelse, type_ignores=[]))
            else:
                yield from walk(child)

    yield from walk(tree)


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return name.split(".")[0] in packages


def _violations(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for module in MODULES:
        if not _in(module, packages):
            continue
        for name, line in imports(module):
            if _in(name, forbidden) and not _in(name, (module.split(".")[0],)) and (module, name) not in EXCEPTIONS:
                found.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize(
    ("packages", "forbidden"),
    [
        (("bridge",), ROLES),
        (("bridge",), JAX + TORCH),
        (("jax_trainer",), TORCH),
        (("gpu_workers",), JAX),
        (("orchestrator",), tuple(p for p in PACKAGES if p != "bridge")),
        (("jax_trainer",), ("gpu_workers", "orchestrator")),
        (("gpu_workers",), ("jax_trainer", "orchestrator")),
        (LIBRARIES, ("intellect",)),
    ],
    ids=[
        "bridge-imports-no-role",
        "bridge-no-framework",
        "jax_trainer-no-torch",
        "gpu_workers-no-jax",
        "orchestrator-only-bridge",
        "jax_trainer-no-other-role",
        "gpu_workers-no-other-role",
        "libraries-no-intellect",
    ],
)
def test_layering(packages, forbidden):
    found = _violations(packages, forbidden)
    assert not found, "\n".join(found)


def test_no_import_cycles():
    graph = {m: sorted({n for n, _ in imports(m, top_level_only=True) if n in MODULES and n != m}) for m in MODULES}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for name in graph[module]:
            if state.get(name) == 1:
                cycles.append(" -> ".join(path[path.index(name) :] + [name]))
            elif name not in state:
                visit(name, path + [name])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_walk_sees_the_packages():
    """The walk finds the modules and the imports inside functions (a guard against a test that checks nothing)."""
    assert {"bridge.rollouts", "orchestrator.app", "jax_trainer.learner", "gpu_workers.worker"} <= set(MODULES)
    assert any(not _in(n, PACKAGES) for n, _ in imports("intellect.cli"))
