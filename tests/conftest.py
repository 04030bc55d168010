"""Shared test fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(family="qwen2", **make_tiny_model_kwargs) -> Path`.

    Each distinct set of arguments is built once per session, in a session temp dir; treat it as read-only.
    """
    from intellect.tiny_model import make_tiny_model

    built: dict[str, Path] = {}

    def build(family: str = "qwen2", **kwargs) -> Path:
        key = json.dumps({"family": family, **kwargs}, sort_keys=True)
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, **kwargs)
        return built[key]

    return build
