"""Every field of every config section reaches the component that uses it, and each section is declared once.

The first test builds a `Config` whose every field differs from its default (values made from each field's
type and bounds, so a field added later is covered without editing this test), writes it as TOML, reads it
back with `load_config`, and builds each component the way its command does: `trainer_for` (the GRPO step),
`intellect.worker_cli.build_worker`, `intellect.validator_cli.build_validator`, and the learner's model
(`abstract_from_hf_config`). A component holds the sections it reads; every field of each must be the loaded
value. A field that no component holds fails the test unless `READ_BY_COMMANDS` says which command reads it.
"""

from __future__ import annotations

import ast
import json
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from bridge.config import Section
from intellect.config import SECTIONS, Config
from intellect.config_io import config_to_toml, load_config

ROOT = Path(__file__).resolve().parents[3]
LIBRARIES = ("bridge", "jax_trainer", "gpu_workers", "orchestrator")

# Where each section is declared: next to the component that uses it.
HOMES = {
    "model": "jax_trainer.config",
    "trainer": "jax_trainer.config",
    "loss": "jax_trainer.config",
    "optim": "jax_trainer.config",
    "data": "gpu_workers.config",
    "worker": "gpu_workers.config",
    "validator": "gpu_workers.config",
    "shardcast": "bridge.shardcast.config",
    "orchestrator": "orchestrator.config",
    "ingest": "orchestrator.config",
    "run": "intellect.config",
}

# Fields that no component object holds: the commands read them themselves.
READ_BY_COMMANDS = {
    "run": "every command and the launcher: run directory, local process counts, logging",
    "orchestrator": "`intellect orchestrator` (intellect.orchestrator_cli.build_app) hands it to the service",
    "ingest": "`intellect orchestrator` and `intellect ingest` hand it to the ingest (orchestrator.ingest)",
    "model.path": "`intellect train`: the base model directory",
    "model.max_seq_len": "`intellect train`: the packed row length of the rollout pipeline",
}


def _bounds(info) -> dict[str, float]:
    out = {}
    for m in info.metadata:
        for name in ("gt", "ge", "lt", "le"):
            if getattr(m, name, None) is not None:
                out[name] = getattr(m, name)
    return out


def _other(annotation, default, bounds: dict[str, float], where: Path):
    """A valid value of `annotation` other than `default`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        for kind in (a for a in args if a is not type(None)):  # the first member with another value
            value = _other(kind, default, bounds, where)
            if value is not None:
                return value
    if origin is typing.Literal:
        return next((a for a in args if a != default), None)
    if origin is list:
        (item,) = args
        return [_other(item, None, {}, where)] if item is not str else ["http://127.0.0.1:1"]
    if origin is dict:
        return {"prompt": "x"}  # data.columns: a field every data.format has
    if annotation is bool:
        return not default
    if annotation in (int, float):
        low = bounds.get("gt", bounds.get("ge", 0))
        high = bounds.get("lt", bounds.get("le"))
        if default is None:
            value = low + 2
        elif high is not None and default + 1 >= high:  # near the top: halfway to the top, or to the bottom
            value = (default + (high if default < high else low)) / 2 if annotation is float else default - 1
        else:
            value = default + 1
        return annotation(value)
    if annotation is str:
        return "x" if default is None else f"{default}-x"
    if annotation is Path:
        return where
    if isinstance(annotation, type) and issubclass(annotation, Section):  # a sub-table: each field non-default
        fields = annotation.model_fields
        values = {
            name: _other(info.annotation, info.get_default(call_default_factory=True), _bounds(info), where)
            for name, info in fields.items()
        }
        if "targets" in fields:  # model.lora: a subset of the projections
            values["targets"] = ["v", "down"]
        return annotation(**values)
    raise AssertionError(f"no non-default value for {annotation!r}: extend _other in this test")


def non_default_config(tmp_path: Path) -> Config:
    values = {
        section: {
            name: _other(info.annotation, info.default, _bounds(info), tmp_path / section / name)
            for name, info in cls.model_fields.items()
        }
        for section, cls in SECTIONS.items()
    }
    fixed = {f"{section}.{name}" for section, fields in values.items() for name, v in fields.items() if v is None}
    values = {section: {k: v for k, v in fields.items() if v is not None} for section, fields in values.items()}
    m, t, loss, d, w, o = (values[s] for s in ("model", "trainer", "loss", "data", "worker", "orchestrator"))
    # the cross-field checks, each still with values other than the defaults
    t.update(data=-1, fsdp=2, tensor=2, batch_size=d["prompts_per_step"] * d["samples_per_prompt"])
    m["max_seq_len"] = d["max_prompt_len"] + d["max_new_tokens"] + 1
    w["temperature"] = loss["temperature"]
    w["max_tokens"] = d["max_new_tokens"] - 1
    d["length_targets"] = [d["max_new_tokens"] // 2]
    d["solve_rate_min"], d["solve_rate_max"] = 0.2, 0.7
    # a reasoning-gym task: a generator and config reasoning-gym has, and no task file (data.path stays unset)
    d.update(task="reasoning_gym", generator="letter_counting", generator_config={"min_words": 4})
    d["curriculum"] = [{"max_words": 5}, {"max_words": 8}]  # levels of that generator's config
    d.pop("path")
    fixed.add("data.path")
    # single-turn: a multi-turn pool (data.env, which refuses length targets) is checked on its own in
    # tests/unit/gpu_workers/test_episodes.py; its limits and env_config here still differ from their defaults
    d.pop("env")
    fixed.add("data.env")
    d["online_filter"] = True  # dynamic sampling (non-default: on) needs the online filter on
    fixed.add("data.online_filter")
    loss["delta"] = 1 + loss["eps_high"] + 1.5
    if loss["policy_loss"] == "dr_grpo":  # the Dr. GRPO preset fixes these two (both still non-default)
        loss.update(aggregation="seq_mean_token_sum_norm", std_normalize=False)
    loss.update(mismatch_low=0.4, mismatch_high=2.5)  # a ratio window around 1
    values["shardcast"]["keep_versions"] = t["async_level"] + 2
    o.update(heartbeat_interval_s=5.0, unhealthy_after_s=20.0, dead_after_s=100.0)
    # what a node must reach: its orchestrator (not called here) and a rollout store it can open
    w["orchestrator_url"] = values["validator"]["orchestrator_url"] = "http://127.0.0.1:9"
    values["validator"]["store_url"] = str(tmp_path / "store")
    values["validator"]["device"] = "cpu"  # a device every machine has (the default is "auto")
    values["validator"]["calibrated_model"] = "ab" * 32  # a digest's form (allow_uncalibrated: not checked)
    values["run"]["dir"] = tmp_path / "run"
    cfg = Config(**values)
    path = tmp_path / "everything.toml"
    path.write_text(config_to_toml(cfg))
    loaded = load_config(path, env={})
    assert loaded == cfg
    for section, cls in SECTIONS.items():
        for name, info in cls.model_fields.items():
            if f"{section}.{name}" not in fixed:  # a Literal of one value (worker.engine) has no other
                assert getattr(getattr(loaded, section), name) != info.default, f"{section}.{name} kept its default"
    return loaded


def _components(cfg: Config, tiny_model) -> dict[str, tuple[object, dict[str, str]]]:
    """name -> (component as its command builds it, {attribute holding a section: that section's name})."""
    from gpu_workers.tasks import synthetic_tasks
    from intellect.learner_setup import abstract_from_hf_config, trainer_for
    from intellect.validator_cli import build_validator
    from intellect.worker_cli import build_worker
    from jax_trainer.sharding import make_mesh

    hf_config = json.loads((tiny_model() / "config.json").read_text())
    model = abstract_from_hf_config(cfg, hf_config, adapters=True)
    # a LoRA model's KL reference is its own base
    reference = abstract_from_hf_config(cfg, hf_config) if cfg.loss.kl_coef and model.lora is None else None
    trainer = trainer_for(cfg, model, make_mesh(fsdp=-1), reference)
    tasks = synthetic_tasks("sort", 8, 0, 3)
    worker = build_worker(cfg, tasks)
    validator = build_validator(cfg, tasks)
    for node in (worker, validator):
        node.client.close()
    return {
        "GRPOTrainer": (trainer, {"loss": "loss", "optim": "optim", "config": "trainer"}),
        "Worker": (worker, {"config": "worker", "data": "data", "shardcast": "shardcast"}),
        "Validator": (validator, {"config": "validator", "worker": "worker", "data": "data", "shardcast": "shardcast"}),
        "model": (model, {}),
    }


def test_every_field_reaches_the_component_that_uses_it(tmp_path, tiny_model):
    cfg = non_default_config(tmp_path)
    components = _components(cfg, tiny_model)
    reached = set()
    for name, (component, held) in components.items():
        for attribute, section in held.items():
            got, want = getattr(component, attribute), getattr(cfg, section)
            assert isinstance(got, SECTIONS[section]), f"{name}.{attribute} is a {type(got).__name__}"
            for field in SECTIONS[section].model_fields:
                assert getattr(got, field) == getattr(want, field), f"{name} sees another {section}.{field}"
                reached.add(f"{section}.{field}")
    # values a component derives from its sections, and the model the learner builds from [model]
    worker, validator, model = (components[n][0] for n in ("Worker", "Validator", "model"))
    assert worker.max_tokens == validator.declared.max_tokens == cfg.worker.max_tokens
    assert validator.declared.thresholds.max_exp_mismatches == cfg.validator.max_exp_mismatches
    tolerance = validator.declared.tolerance
    assert tolerance.replay_logit_tolerance == cfg.validator.replay_logit_tolerance is not None
    assert tolerance.tie_logit_tolerance == cfg.validator.tie_logit_tolerance is not None
    assert tolerance.max_logprob_diff == cfg.validator.max_logprob_diff is not None
    assert tolerance.mean_logprob_diff == cfg.validator.mean_logprob_diff is not None
    assert tolerance.mean_signed_logprob_diff == cfg.validator.mean_signed_logprob_diff
    assert tolerance.logprob_diff_allowance == cfg.validator.logprob_diff_allowance
    assert tolerance.near_ties_per_token == cfg.validator.near_ties_per_token
    assert tolerance.near_ties_per_batch_token == cfg.validator.near_ties_per_batch_token
    assert validator.declared.max_model_len == cfg.data.max_prompt_len + cfg.worker.max_tokens
    assert worker.weights_dir == cfg.worker.weights_dir and validator.weights_dir == cfg.validator.weights_dir
    import jax
    import numpy as np
    from flax import nnx

    assert np.dtype(model.compute_dtype).name == cfg.model.compute_dtype and model.remat == cfg.model.remat
    assert model.scan_layers == cfg.model.scan_layers and model.scan_unroll == cfg.model.scan_unroll
    assert model.layers.attn.cfg.attention == cfg.model.attention
    assert {np.dtype(x.dtype).name for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {cfg.model.param_dtype}
    reached |= {"model.param_dtype", "model.compute_dtype", "model.remat", "model.scan_layers", "model.scan_unroll"}
    reached.add("model.attention")
    lora = cfg.model.lora
    assert (model.lora.rank, model.lora.alpha, list(model.lora.targets)) == (lora.rank, lora.alpha, lora.targets)
    reached.add("model.lora")  # its seed: the draws of `load_hf` (tests/unit/jax_trainer/test_lora.py)

    unread = [
        f"{section}.{field}"
        for section, cls in SECTIONS.items()
        for field in cls.model_fields
        if f"{section}.{field}" not in reached
        and section not in READ_BY_COMMANDS
        and f"{section}.{field}" not in READ_BY_COMMANDS
    ]
    assert not unread, f"fields no component holds (pass the section to its component, or list them): {unread}"


def test_each_section_is_declared_once_next_to_its_component():
    """`intellect.config` composes the components' own classes; no library keeps a second copy of a section
    (a `*Settings` class, or a `from_config` that copies fields)."""
    import importlib

    for section, module in HOMES.items():
        cls = SECTIONS[section]
        assert cls is getattr(importlib.import_module(module), cls.__name__), (section, module)
        assert cls.__module__ == module and issubclass(cls, Section)
    assert set(HOMES) == set(SECTIONS)
    copies = []
    for package in LIBRARIES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and node.name.endswith("Settings"):
                    copies.append(f"{path.relative_to(ROOT)}: class {node.name}")
                if isinstance(node, ast.FunctionDef) and node.name == "from_config":
                    copies.append(f"{path.relative_to(ROOT)}: def from_config")
    assert not copies, copies


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_field_has_a_description(section):
    cls: type[BaseModel] = SECTIONS[section]
    missing = [name for name, info in cls.model_fields.items() if not (info.description or "").strip()]
    assert not missing, f"[{section}] fields without a docstring: {missing}"
