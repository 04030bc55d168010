"""`intellect import` and `intellect export` as a user runs them: HF dir -> orbax checkpoint -> HF dir."""

from __future__ import annotations

import subprocess
import sys

from safetensors.numpy import load_file


def _intellect(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "intellect", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def _tensors(model_dir):
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_import_then_export_gives_back_the_same_tensors(tiny_model, tmp_path):
    src = tiny_model(family="llama")
    imported = _intellect("import", src, tmp_path / "ckpt", "--trainer.fsdp", "4", "--trainer.tensor", "2")
    assert imported.returncode == 0, imported.stderr[-3000:]
    again = _intellect("import", src, tmp_path / "ckpt")
    assert again.returncode == 1 and "refusing" in again.stdout
    exported = _intellect("export", tmp_path / "ckpt", tmp_path / "out", "--dtype", "float32")
    assert exported.returncode == 0, exported.stderr[-3000:]
    before, after = _tensors(src), _tensors(tmp_path / "out")
    assert set(before) == set(after)
    for name in before:
        assert before[name].tobytes() == after[name].tobytes(), name
    assert (tmp_path / "out" / "STABLE").exists() and (tmp_path / "out" / "tokenizer.json").exists()
