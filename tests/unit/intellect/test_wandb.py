"""Weights & Biases logging (issue 35, item 5): `run.wandb_mode` sends every metrics.jsonl record to W&B.

One real offline run (`wandb` installed, no network, no key): the records written through `MetricsLog` are read
back from the run's `.wandb` transaction log (a LevelDB-style log of `wandb_internal_pb2.Record` protobufs, parsed
here independently of the code under test) and compared with the lines of metrics.jsonl, flattened by hand. A
fake `wandb` module then checks what the launcher, the learner's hook and evaluation hand over, and the mode and
dependency rules.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import types
from pathlib import Path

import pytest

from intellect.config import Config, ConfigError
from intellect.config_io import load_config
from intellect.metrics import MetricsLog, wandb_mode, wandb_sink

RECORDS = [
    {
        "role": "learner",
        "step": 1,
        "time": 1700000000.5,
        "loss": 0.25,
        "grad_norm": 1.5,
        "staleness_hist": {"0": 12, "1": 4},
        "batch_ids": ["b-1", "b-2"],
    },
    {"role": "eval", "step": 1, "time": 1700000001.0, "accuracy": 0.375, "model": "runs/x/weights/v000001"},
    {"role": "learner", "step": 2, "time": 1700000002.0, "loss": -0.125, "grad_norm": 0.75, "staleness_hist": {}},
    {"role": "pool", "step": 2, "time": 1700000003.0, "accepted": 3, "online": True},
]
# The same records as W&B history rows, written out by hand: numbers under ROLE/KEY, nested ones under
# ROLE/KEY/SUBKEY, booleans as 0/1; strings and lists are not metrics.
ROWS = [
    {
        "learner/step": 1,
        "learner/time": 1700000000.5,
        "learner/loss": 0.25,
        "learner/grad_norm": 1.5,
        "learner/staleness_hist/0": 12,
        "learner/staleness_hist/1": 4,
    },
    {"eval/step": 1, "eval/time": 1700000001.0, "eval/accuracy": 0.375},
    {"learner/step": 2, "learner/time": 1700000002.0, "learner/loss": -0.125, "learner/grad_norm": 0.75},
    {"pool/step": 2, "pool/time": 1700000003.0, "pool/accepted": 3, "pool/online": 1},
]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # block padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


@pytest.fixture
def no_wandb_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # W&B's settings and ~/.netrc: none
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "home").mkdir()


def _records_so_far(path: Path) -> list:
    """The complete records of a .wandb file that may still be being written."""
    from google.protobuf.message import DecodeError

    try:
        return _wandb_records(path)
    except DecodeError:  # the last chunk is still being written
        return []


def test_an_offline_run_holds_the_metrics_of_metrics_jsonl(tmp_path, no_wandb_key):
    pytest.importorskip("wandb")
    cfg = Config(run={"dir": tmp_path / "run", "name": "wb test", "wandb_mode": "online"})  # no key: offline
    log = MetricsLog(cfg, "launcher")
    assert log.sink.mode == "offline"
    for record in RECORDS:
        log.write(record)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == RECORDS
    (path,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    # `finish` can return before W&B's writer process has flushed the file (seen on a loaded machine: the
    # 7-byte header alone): wait for the run's exit record, which W&B writes last
    deadline = time.monotonic() + 120
    records = _records_so_far(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, f"{path} has no exit record after 120 s"
        time.sleep(0.2)
        records = _records_so_far(path)
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [{k: v for k, v in row.items() if not k.startswith("_")} for row in history] == ROWS
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type, run.project) == ("wb test", "launcher", "intellect")
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["run"]["wandb_mode"] == "online" and config["data"]["format"] == "plain"
    assert "admin_token" not in config["orchestrator"] and "database_url" not in config["orchestrator"]


class FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.rows, self.metrics, self.finished = kwargs, [], [], False

    def define_metric(self, name, step_metric=None):
        self.metrics.append((name, step_metric))

    def log(self, row):
        self.rows.append(dict(row))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")
    module.Settings = lambda **kw: kw
    module.init = lambda **kw: runs.append(FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def test_the_launcher_and_evaluation_log_what_they_write(tmp_path, fake_wandb, no_wandb_key):
    from intellect.launcher import Launcher

    cfg = load_config(None, ["--run.dir", str(tmp_path / "run"), "--run.wandb_mode", "offline"], env={})
    launcher = Launcher(cfg, None, [], console=None)
    assert fake_wandb == []  # a W&B run starts with the first record
    launcher.metrics(RECORDS[3])
    launcher.metrics_log.close()
    (run,) = fake_wandb
    assert run.rows == [ROWS[3]] and run.finished
    assert run.metrics == [("pool/step", None), ("pool/*", "pool/step")]
    assert (run.kwargs["mode"], run.kwargs["job_type"], run.kwargs["group"]) == ("offline", "launcher", "intellect")
    assert run.kwargs["dir"] == str(tmp_path / "run") and run.kwargs["resume"] == "allow"
    # evaluation writes through MetricsLog to the file `intellect eval --metrics` names; its run id is stable
    elsewhere = tmp_path / "eval.jsonl"
    for _ in range(2):
        log = MetricsLog(cfg, "eval", elsewhere)
        log.write(RECORDS[1])
        log.close()
    assert [r.rows for r in fake_wandb[1:]] == [[ROWS[1]], [ROWS[1]]]
    assert fake_wandb[1].kwargs["id"] == fake_wandb[2].kwargs["id"] != fake_wandb[0].kwargs["id"]
    assert [json.loads(x) for x in elsewhere.read_text().splitlines()] == [RECORDS[1], RECORDS[1]]
    assert [json.loads(x) for x in cfg.run.metrics_path.read_text().splitlines()] == [RECORDS[3]]


def test_the_learner_hook_logs_each_step(tmp_path, fake_wandb, no_wandb_key, monkeypatch):
    """`intellect train` hands its W&B sink to the Learner as `on_record` and closes it when the run ends
    (tests/unit/jax_trainer/test_train_step.py checks that the Learner calls it with each record it writes).
    The learner here is a stand-in that writes two records: what `intellect train` built it with is checked."""
    import argparse
    import types

    from intellect import train
    from jax_trainer import host

    built = []

    class StandIn:
        weights_dir = tmp_path / "weights"

        def __init__(self, on_record):
            self.on_record, self.closed = on_record, False

        def run(self, params):
            for record in (RECORDS[0], RECORDS[2]):
                if self.on_record is not None:
                    self.on_record(record)
            return types.SimpleNamespace(step=2)

        def close(self):
            self.closed = True

    def build_learner(cfg, release_memory, on_record=None):
        built.append(StandIn(on_record))
        return built[-1], None

    monkeypatch.setattr(host, "prepare", lambda *a, **k: {"retain_freed_memory": True})
    monkeypatch.setattr(train, "build_learner", build_learner)
    args = argparse.Namespace(config=None, overrides=["--run.dir", str(tmp_path), "--run.wandb_mode", "offline"])
    assert train.run(args) == 0
    (learner,) = built
    assert learner.closed and learner.on_record is not None
    (run,) = fake_wandb
    assert run.rows == [ROWS[0], ROWS[2]] and run.kwargs["job_type"] == "learner" and run.finished
    # without W&B the learner gets no hook at all
    built.clear()
    assert train.run(argparse.Namespace(config=None, overrides=["--run.dir", str(tmp_path)])) == 0
    assert built[0].on_record is None and len(fake_wandb) == 1


def test_mode_rules_and_a_missing_package(tmp_path, monkeypatch, no_wandb_key):
    assert wandb_sink(Config(), "learner") is None  # disabled by default: wandb is never imported
    netrc = tmp_path / "home" / ".netrc"
    assert wandb_mode("online", {"NETRC": str(netrc)}) == "offline"
    assert wandb_mode("online", {"WANDB_API_KEY": "k" * 40}) == "online"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_mode("online", {"NETRC": str(netrc)}) == "online"
    assert wandb_mode("offline", {"WANDB_API_KEY": "k"}) == "offline"
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"run.wandb_mode = 'offline' needs the wandb package: pip install"):
        MetricsLog(Config(run={"dir": tmp_path, "wandb_mode": "offline"}), "eval")
