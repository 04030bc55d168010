"""[validator] device: what "auto" resolves to, the error for a GPU the machine lacks (naming the key), the
prefill batch size a GPU's free memory allows, and the device reaching the validator's prefill."""

from __future__ import annotations

import types

import pydantic
import pytest
import torch

from bridge.shardcast.config import ShardcastConfig
from gpu_workers.config import DataConfig, ValidatorConfig, WorkerConfig
from gpu_workers.node import Stop
from gpu_workers.prefill import CPU_BATCH_TOKENS, batch_tokens_for, resolve_device
from gpu_workers.tasks import synthetic_tasks

HAS_CUDA = torch.cuda.is_available()


def _validator(tmp_path, device: str, **kwargs):
    from gpu_workers.validator import Validator

    return Validator(
        ValidatorConfig(orchestrator_url="http://127.0.0.1:9", device=device, allow_uncalibrated=True),
        WorkerConfig(max_tokens=16),
        DataConfig(samples_per_prompt=2, max_prompt_len=64, max_new_tokens=16),
        ShardcastConfig(),
        synthetic_tasks("sort", 8, 0, 3),
        key_path=tmp_path / "v.key",
        weights_dir=tmp_path / "weights",
        store=str(tmp_path / "store"),
        stop=Stop(install=False),
        **kwargs,
    )


def test_auto_is_the_first_gpu_when_torch_sees_one_else_the_cpu(monkeypatch):
    assert resolve_device("auto") == ("cuda:0" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_device(s) for s in ("auto", "cuda", "cuda:1", "cpu")] == ["cuda:0", "cuda:0", "cuda:1", "cpu"]
    with pytest.raises(ValueError, match=r"validator\.device = 'cuda:2': this machine has 2 CUDA device"):
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match=r"worker\.device = 'gpu': expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu", key="worker.device")
    with pytest.raises(pydantic.ValidationError, match="device"):
        ValidatorConfig(device="gpu")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_an_explicit_gpu_on_a_machine_without_one_stops_the_validator_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"validator\.device = 'cuda': torch .* sees no CUDA device"):
        _validator(tmp_path, "cuda")
    assert not (tmp_path / "v.key").exists()  # refused before anything else was set up


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
def test_the_validator_command_prints_it_as_a_config_error(tmp_path, capsys):
    from intellect import cli

    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'[run]\ndir = "{tmp_path / "run"}"\n')
    assert cli.main(["validator", str(recipe), "--validator.device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "validator.device = 'cuda:1'" in err and "Traceback" not in err


def test_batch_tokens_follow_the_free_memory():
    qwen_0_5b = dict(hidden=896, intermediate=4864, heads=14, vocab=151936, max_len=1536, dtype_bytes=2)
    # per token, by hand: 2 B x (6 x 896 + 3 x 4864 + 14 x 1536) + 151936 x (2 + 4) B = 82,944 + 911,616 B
    assert batch_tokens_for(16 * 2**30, **qwen_0_5b) == int(16 * 2**30 * 0.8) // 994_560 == 13_819
    assert batch_tokens_for(8 * 2**30, **qwen_0_5b) == int(8 * 2**30 * 0.8) // 994_560
    assert batch_tokens_for(0, **qwen_0_5b) == 1  # one sequence at a time, never none
    with pytest.raises(ValueError, match="vocab 0"):
        batch_tokens_for(2**30, **{**qwen_0_5b, "vocab": 0})


def test_the_device_reaches_the_prefill_the_validator_loads(tmp_path, tiny_model, monkeypatch):
    from gpu_workers import validator as validator_module

    model = tiny_model()

    class Fetcher:
        def __init__(self, servers, **kwargs):
            self.servers = servers

        def same_servers(self, servers):
            return list(servers) == list(self.servers)

        def fetch(self, version, weights_dir, **kwargs):
            return types.SimpleNamespace(path=model)

    monkeypatch.setattr(validator_module, "ShardcastClient", Fetcher)
    v = _validator(tmp_path, "auto", servers=("http://shardcast",))
    v.client.close()
    expected = "cuda:0" if HAS_CUDA else "cpu"
    assert v.device == expected
    prefill = v._version(0).prefill
    assert prefill.device == expected and next(prefill.model.parameters()).device == torch.device(expected)
    if not HAS_CUDA:
        assert prefill.batch_tokens == CPU_BATCH_TOKENS


def test_an_uncalibrated_bfloat16_replay_pool_s_validator_refuses_to_start(tmp_path, tiny_model, caplog):
    """A bfloat16/float16 replay pool's validator needs a calibration of the pool's model (`intellect calibrate`:
    docs/verifiable-sampling.md, 'Calibrating a pool'): without one it refuses to start, saying what to run; with
    one of the model it starts; float32 pools and `allow_uncalibrated` need none (the latter warns)."""
    from bridge.weights import model_digest
    from gpu_workers.calibration import CalibrationError
    from gpu_workers.validator import Validator

    model = tiny_model()

    def start(dtype: str, **validator) -> list[str]:
        caplog.clear()
        with caplog.at_level("INFO", logger="validator"):
            v = Validator(
                ValidatorConfig(orchestrator_url="http://127.0.0.1:9", device="cpu", dtype=dtype, **validator),
                WorkerConfig(max_tokens=16, dtype=dtype),
                DataConfig(samples_per_prompt=2, max_prompt_len=64, max_new_tokens=16),
                ShardcastConfig(),
                synthetic_tasks("sort", 8, 0, 3),
                model_dir=model,
                key_path=tmp_path / "v.key",
                weights_dir=tmp_path / "weights",
                store=str(tmp_path / f"store-{dtype}"),
                stop=Stop(install=False),
            )
            v.client.close()
        return [r.getMessage() for r in caplog.records]

    with pytest.raises(CalibrationError, match="intellect calibrate"):
        start("bfloat16")
    with pytest.raises(CalibrationError, match="another|intellect calibrate"):
        start("bfloat16", calibrated_model="0" * 64, calibrated_dtype="bfloat16")
    with pytest.raises(CalibrationError, match="float16"):
        start("float16", calibrated_model=model_digest(model), calibrated_dtype="bfloat16")
    assert any("calibrated for model" in m for m in start("bfloat16", calibrated_model=model_digest(model),
                                                          calibrated_dtype="bfloat16"))  # fmt: skip
    assert any("allow_uncalibrated" in m for m in start("bfloat16", allow_uncalibrated=True))
    assert any("no calibration needed" in m for m in start("float32"))
