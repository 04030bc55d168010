"""A cheating worker for test_worker_validator.py: `intellect worker` whose engine runs every version it loads
with Gaussian noise of relative size NOISE added to each floating weight, i.e. a model other than the policy,
while it claims the policy's version. Built from the public pieces: an `Engine` subclass put in place of the
worker's engine.

    python cheating_worker.py NOISE CONFIG [--section.key value ...]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import gpu_workers.worker
from gpu_workers.engine import Engine
from intellect.cli import main


def tampered(src: Path, version: int, noise: float) -> Path:
    """A copy of version directory `src` beside it, every floating tensor plus noise (seeded by `version`)."""
    src = Path(src)
    out = src.parent / f"tampered-v{version:06d}"
    if out.exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors", "STABLE"))
    gen = torch.Generator().manual_seed(version)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point():
                tensors[name] = (
                    t.float() + torch.randn(t.shape, generator=gen) * noise * t.float().std().clamp_min(1e-3)
                ).to(t.dtype)
        save_file(tensors, tmp / f.name, metadata={"format": "pt"})
    tmp.rename(out)
    return out


def cheating_engine(noise: float) -> type[Engine]:
    class TamperedEngine(Engine):
        def __init__(self, model_dir, version, *args, **kwargs):
            super().__init__(tampered(model_dir, version, noise), version, *args, **kwargs)

        def swap(self, new_dir, version):
            return super().swap(tampered(new_dir, version, noise), version)

    return TamperedEngine


if __name__ == "__main__":
    gpu_workers.worker.Engine = cheating_engine(float(sys.argv[1]))  # the class the worker builds its engine from
    sys.exit(main(["worker", *sys.argv[2:]]))
