"""The repository stands alone: no tracked file refers to a path outside it or to a design document that is not
in it, the README stays short, and every relative link in the README and under docs/ leads to a file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
README_MAX_BYTES = 12_500

# Spelled in pieces so that this file does not match itself.
FORBIDDEN = (
    ".." + "/shared",  # the sibling directory the project was developed beside
    "shared/" + "vectors",
    "shared/" + "notes",
    "DESIGN" + " section",  # the old out-of-repository design document; cite docs/design.md section N
    "DESIGN" + ".md",
    "STYLE" + ".md",
    "/work" + "/",
)
# A run of ../ followed by a name: resolved from the file's directory, it must stay inside the repository,
# unless it names a system directory (path-traversal payloads in the tests of hostile input).
PARENT_PATH = re.compile(r"((?:\.\./)+)([A-Za-z0-9_.-]+)")
TRAVERSAL_TARGETS = frozenset({"etc", "tmp", "proc", "dev", "root", "usr", "var", "bin", "sys"})
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = []
    for name in out.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path.resolve() == Path(__file__).resolve():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (test vectors, images)
        files.append(path)
    return files


def _escapes(path: Path, text: str) -> list[str]:
    escaping = []
    for match in PARENT_PATH.finditer(text):
        target = (path.parent / match.group(1) / match.group(2)).resolve()
        if not target.is_relative_to(ROOT) and match.group(2) not in TRAVERSAL_TARGETS:
            escaping.append(match.group(0))
    return escaping


def test_no_file_refers_outside_the_repository():
    problems = []
    for path in _tracked_text_files():
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(text.splitlines(), 1):
            problems += [f"{rel}:{lineno}: {bad!r}" for bad in FORBIDDEN if bad in line]
            problems += [f"{rel}:{lineno}: {bad!r} leaves the repository" for bad in _escapes(path, line)]
    assert not problems, "references outside the repository:\n" + "\n".join(problems)


def test_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes (at most {README_MAX_BYTES}): move reference "
        "material to docs/ and measurements to benchmarks/RESULTS.md"
    )


def test_relative_links_in_docs_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for lineno, line in enumerate(page.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                    continue  # a URL or an anchor in the same page
                resolved = (page.parent / target.split("#", 1)[0]).resolve()
                if not resolved.is_relative_to(ROOT) or not resolved.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{lineno}: {target}")
    assert not broken, "relative links that lead nowhere:\n" + "\n".join(broken)
