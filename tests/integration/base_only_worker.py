"""A cheating worker for test_lora_pool.py: `intellect worker` that, for a version shipped as a LoRA adapter,
serves the base alone (skips the merge) while it claims the adapter's version. Built from the public pieces:
`gpu_workers.adapters.servable` replaced where the worker calls it.

    python base_only_worker.py CONFIG [--section.key value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import gpu_workers.worker
from gpu_workers.adapters import adapter_manifest
from intellect.cli import main


def base_only(version_dir, weights_dir, fetch_base):
    manifest = adapter_manifest(Path(version_dir))
    return Path(version_dir) if manifest is None else fetch_base(manifest["base_version"])


if __name__ == "__main__":
    gpu_workers.worker.servable = base_only
    sys.exit(main(["worker", *sys.argv[1:]]))
