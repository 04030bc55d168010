"""The config schema and loader: precedence of sources, errors that name key and source, TOML round trip."""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path

import pytest

from intellect.config import SECTIONS, Config, ConfigError
from intellect.config_io import config_to_toml, load_config

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def error_of(*args, **kwargs) -> str:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    return str(info.value)


# ---- precedence: defaults < TOML < env < flags, for the same key -----------------------------------------


@pytest.mark.parametrize(
    "use_file, use_env, use_flag, expected",
    [
        (False, False, False, 3e-7),  # the issue's default learning rate
        (True, False, False, 1e-5),
        (False, True, False, 2e-5),
        (True, True, False, 2e-5),
        (False, False, True, 3e-5),
        (True, True, True, 3e-5),
    ],
)
def test_precedence(tmp_path, use_file, use_env, use_flag, expected):
    path = write(tmp_path, "[optim]\nlr = 1e-5\n") if use_file else None
    env = {"INTELLECT_OPTIM__LR": "2e-5"} if use_env else {}
    flags = ["--optim.lr", "3e-5"] if use_flag else []
    assert load_config(path, flags, env=env).optim.lr == expected


def test_later_sources_override_key_by_key(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 1e-5\nwarmup_steps = 7\n[run]\nname = 'from-file'\n")
    cfg = load_config(path, ["--run.name=from-flag"], env={"INTELLECT_OPTIM__WARMUP_STEPS": "9"})
    assert (cfg.optim.lr, cfg.optim.warmup_steps, cfg.run.name) == (1e-5, 9, "from-flag")


def test_included_files_come_first_and_the_including_file_wins(tmp_path):
    """A recipe takes its calibration (a fragment `intellect calibrate` writes) with `include`."""
    fragment = tmp_path / "calibration.toml"
    fragment.write_text("[validator]\nreplay_logit_tolerance = 0.35\n\n[orchestrator]\nnear_tie_rate = 0.0024\n")
    recipe = write(tmp_path, f'include = ["{fragment}"]\n\n[orchestrator]\nnear_tie_rate = 0.003\n')
    cfg = load_config(recipe, env={})
    assert (cfg.validator.replay_logit_tolerance, cfg.orchestrator.near_tie_rate) == (0.35, 0.003)
    fragment.write_text("[validator]\nreplay_logit_tolerance = -1\n")  # an error names the included file
    assert str(fragment) in error_of(recipe)
    fragment.write_text(f'include = "{recipe}"\n')
    assert "includes itself" in error_of(recipe)
    recipe.write_text(f'include = ["{tmp_path / "missing.toml"}"]\n')
    assert "missing.toml" in error_of(recipe) and f"included by {recipe}" in error_of(recipe)
    recipe.write_text("include = [1]\n")
    assert "must be a path or a list of paths" in error_of(recipe)


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("INTELLECT_OPTIM__LR", "1e-6")
    assert load_config(None).optim.lr == 1e-6


def test_pydantic_settings_reads_no_environment_by_itself(monkeypatch):
    monkeypatch.setenv("OPTIM", '{"lr": 0.5}')
    monkeypatch.setenv("optim__lr", "0.5")
    assert Config().optim.lr == 3e-7
    assert load_config(None, env={}).optim.lr == 3e-7


def test_values_are_read_as_toml_literals_when_they_fit():
    cfg = load_config(
        None,
        [
            "--optim.lr",
            "1e-6",  # float
            "--model.remat",
            "false",  # bool
            "--data.length_targets",
            "[8, 16]",  # list
            "--run.name",
            "42",  # a string field keeps the text, not the integer
            "--run.dir",
            "runs/x",  # not a TOML literal: the raw text
            "--model.path",
            '"quoted/dir"',  # a TOML string literal
            "--run.log_level=debug",  # the = form
            "--trainer.micro-batch-size",
            "8",  # dashes read as underscores
        ],
        env={"INTELLECT_DATA__TASK": "code", "INTELLECT_LOSS__TIS_CAP": "2"},
    )
    assert cfg.optim.lr == 1e-6 and cfg.model.remat == "none"  # the boolean of older recipes, read as a policy
    assert cfg.data.length_targets == [8, 16]
    assert cfg.run.name == "42" and cfg.run.dir == Path("runs/x") and cfg.model.path == "quoted/dir"
    assert cfg.run.log_level == "DEBUG" and cfg.trainer.micro_batch_size == 8
    assert cfg.data.task == "code" and cfg.loss.tis_cap == 2.0


def test_none_clears_an_optional_field(tmp_path):
    path = write(tmp_path, "[loss]\ntis_cap = 2.0\n")
    assert load_config(path, env={}).loss.tis_cap == 2.0
    assert load_config(path, ["--loss.tis_cap", "none"], env={}).loss.tis_cap is None


def test_reserved_and_foreign_env_vars_are_ignored():
    cfg = load_config(None, env={"INTELLECT_VLLM": "cpu", "PATH": "/bin", "OPTIM__LR": "5"})
    assert cfg == Config()


# ---- unknown keys: named, with their source and the closest valid key ------------------------------------


def test_unknown_key_in_toml_file(tmp_path):
    path = write(tmp_path, "[optim]\nlrr = 1e-6\n")
    message = error_of(path)
    assert "lrr" in message and str(path) in message and "'lr' under [optim]" in message


def test_unknown_section_in_toml_file(tmp_path):
    path = write(tmp_path, "[optimm]\nlr = 1e-6\n")
    message = error_of(path)
    assert "optimm" in message and str(path) in message and "did you mean [optim]?" in message


def test_top_level_key_in_toml_file_points_to_its_section(tmp_path):
    message = error_of(write(tmp_path, "lr = 1e-6\n"))
    assert "[optim]" in message and "'lr'" in message


def test_unknown_key_in_env():
    message = error_of(env={"INTELLECT_OPTIM__LRR": "1"})
    assert "lrr" in message and "INTELLECT_OPTIM__LRR" in message and "did you mean INTELLECT_OPTIM__LR?" in message


def test_unknown_section_in_env():
    message = error_of(env={"INTELLECT_OPTIMM__LR": "1"})
    assert "optimm" in message and "INTELLECT_OPTIMM__LR" in message and "INTELLECT_OPTIM__LR?" in message


def test_env_var_without_section_and_key_is_an_error():
    message = error_of(env={"INTELLECT_LR": "1"})
    assert "INTELLECT_LR" in message and "INTELLECT_SECTION__KEY" in message


def test_unknown_key_in_flag():
    message = error_of(None, ["--optim.lrr", "1"])
    assert "lrr" in message and "flag --optim.lrr" in message and "did you mean --optim.lr?" in message


def test_unknown_section_in_flag():
    message = error_of(None, ["--optimm.lr", "1"])
    assert "optimm" in message and "flag --optimm.lr" in message and "did you mean --optim.lr?" in message


def test_key_of_another_section_is_pointed_there():
    assert "did you mean --optim.lr?" in error_of(None, ["--model.lr", "1"])


def test_every_unknown_key_is_reported_at_once(tmp_path):
    message = error_of(write(tmp_path, "[optim]\nlrr = 1\n"), ["--run.nmae", "x"], env={"INTELLECT_LOSS__DELTAA": "1"})
    assert "lrr" in message and "nmae" in message and "deltaa" in message


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--optim.lr"], "flag --optim.lr has no value"),
        (["--optim.lr", "--run.name", "x"], "flag --optim.lr has no value"),
        (["optim.lr=1"], "expected an override --section.key VALUE, got 'optim.lr=1'"),
        (["--lr", "1"], "expected an override --section.key VALUE, got '--lr'"),
    ],
)
def test_malformed_flags(flags, expected):
    assert expected in error_of(None, flags)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_missing_and_invalid_files(tmp_path):
    assert "nope.toml" in error_of(tmp_path / "nope.toml")
    bad = write(tmp_path, "[optim\nlr = 1\n")
    assert "not valid TOML" in error_of(bad) and str(bad) in error_of(bad)


# ---- bad values: full key, source, pydantic's reason -----------------------------------------------------


def test_bad_value_from_flag():
    message = error_of(None, ["--optim.lr", "fast"])
    assert "optim.lr" in message and "flag --optim.lr" in message and "valid number" in message


def test_bad_value_from_file(tmp_path):
    path = write(tmp_path, "[trainer]\nsteps = 'many'\n")
    message = error_of(path)
    assert "trainer.steps" in message and str(path) in message and "valid integer" in message


def test_bad_choice_from_env():
    message = error_of(env={"INTELLECT_LOSS__AGGREGATION": "sum"})
    assert "loss.aggregation" in message and "INTELLECT_LOSS__AGGREGATION" in message and "token_mean" in message


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--optim.lr", "-1"], "optim.lr"),
        (["--loss.eps_low", "1.5"], "loss.eps_low"),
        (["--optim.b2", "1.0"], "optim.b2"),
        (["--data.samples_per_prompt", "1"], "data.samples_per_prompt"),
        (["--orchestrator.port", "70000"], "orchestrator.port"),
        (["--worker.top_p", "0"], "worker.top_p"),
        (["--validator.max_exp_mismatches", "129"], "validator.max_exp_mismatches"),
        (["--trainer.fsdp", "0"], "trainer.fsdp"),
        (["--trainer.data", "-1"], "trainer.fsdp"),  # two axes set to fill
        (["--loss.delta", "1.1"], "loss.delta"),  # must exceed 1 + eps_high
        (["--trainer.steps_per_batch", "0"], "trainer.steps_per_batch"),
        (["--data.solve_rate_min", "0.9"], "data.solve_rate_max"),
        (["--data.length_targets", "[0]"], "data.length_targets"),
        (["--orchestrator.dead_after_s", "5"], "orchestrator.dead_after_s"),
        (["--shardcast.keep_versions", "2"], "shardcast.keep_versions"),  # async_level 2 needs 3 versions
        (["--worker.temperature", "1.0"], "loss.temperature"),
        (["--data.max_new_tokens", "32768"], "model.max_seq_len"),
    ],
)
def test_out_of_range_values_are_rejected(flags, key):
    assert key in error_of(None, flags)


def test_conflict_names_every_key_and_its_source():
    message = error_of(None, ["--trainer.batch_size", "256"])
    assert "trainer.batch_size: flag --trainer.batch_size" in message
    assert "data.prompts_per_step: default" in message and "data.samples_per_prompt: default" in message


# ---- schema ----------------------------------------------------------------------------------------------


def test_sections_are_the_eleven_roles():
    assert list(SECTIONS) == [
        "model",
        "trainer",
        "loss",
        "optim",
        "data",
        "orchestrator",
        "ingest",
        "shardcast",
        "worker",
        "validator",
        "run",
    ]


def test_issue_defaults():
    cfg = Config()
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.delta, cfg.loss.kl_coef) == (0.2, 0.2, 4.0, 0.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.b1, cfg.optim.b2) == (3e-7, 0.01, 0.9, 0.99)
    assert (cfg.optim.eps, cfg.optim.grad_clip) == (1e-8, 0.1)
    assert (cfg.data.samples_per_prompt, cfg.data.solve_rate_min, cfg.data.solve_rate_max) == (16, 0.1, 0.8)
    assert (cfg.worker.temperature, cfg.worker.top_p, cfg.trainer.async_level) == (0.6, 1.0, 2)
    v = cfg.validator
    assert (v.max_exp_mismatches, v.max_mantissa_err_mean, v.max_mantissa_err_median) == (38, 10, 8)
    assert cfg.orchestrator.host == "127.0.0.1"


def test_a_pool_is_safe_by_default():
    """Issue 49's defaults as shipped: a bfloat16 replay pool's validator refuses to start without a calibration
    and, calibrated, without the near-tie ledger; float32 needs neither; a pool's learner divides by the
    validator's logprobs unless "inference" trusts the workers, and "validator" needs a pool."""
    from gpu_workers.calibration import calibration_problem
    from intellect.train import engine_logprobs_source

    cfg = Config()
    assert (cfg.worker.sampler, cfg.worker.dtype, cfg.validator.allow_uncalibrated) == ("replayable", "bfloat16", False)
    refusal = calibration_problem(cfg.validator, cfg.worker, None, cfg.orchestrator.near_tie_rate)
    assert refusal is not None and "intellect calibrate" in refusal
    calibrated = cfg.validator.model_copy(update={"calibrated_model": "ab" * 32, "calibrated_dtype": "bfloat16"})
    assert cfg.orchestrator.near_tie_rate is None  # the ledger's rate comes from the calibration, never a guess
    assert "near_tie_rate" in calibration_problem(calibrated, cfg.worker, None, cfg.orchestrator.near_tie_rate)
    fp32 = cfg.worker.model_copy(update={"dtype": "float32"})
    assert calibration_problem(cfg.validator, fp32, None, None) is None

    # unset, a pool's pi_old is the validators' (no worker moves it); a single box without validators recomputes it
    assert (cfg.trainer.accepted_from, cfg.loss.logprob_source) == ("orchestrator", "validator")
    assert engine_logprobs_source(cfg) == "validator"
    recompute = load_config(None, ["--loss.logprob_source", "recompute"], env={})
    assert engine_logprobs_source(recompute) == "validator"  # TIS and the mismatch masks divide by the validator's
    assert engine_logprobs_source(load_config(None, ["--loss.logprob_source", "validator"], env={})) == "validator"
    assert engine_logprobs_source(load_config(None, ["--loss.logprob_source", "inference"], env={})) == "worker"
    single_box = ["--trainer.accepted_from", "store"]
    assert engine_logprobs_source(load_config(None, single_box, env={})) == "worker"
    assert load_config(None, single_box, env={}).loss.logprob_source == "recompute"
    assert "trainer.accepted_from" in error_of(None, [*single_box, "--loss.logprob_source", "validator"])


def test_every_field_is_documented_and_sections_forbid_extra_keys():
    for name, section in SECTIONS.items():
        assert section.model_config["extra"] == "forbid", name
        for key, field in section.model_fields.items():
            assert field.description and "\n" not in field.description, f"{name}.{key}"


def test_optional_fields_default_to_none():
    """TOML has no null, so config_to_toml omits None; reading back gives the default, which must be None."""
    for name, section in SECTIONS.items():
        for key, field in section.model_fields.items():
            if type(None) in typing.get_args(field.annotation):
                assert field.default is None, f"{name}.{key}"


# ---- TOML round trip and the demo recipe -----------------------------------------------------------------


def test_toml_round_trip(tmp_path):
    odd = 'quote " backslash \\ tab \t newline \n unicode é 🙂 del \x7f'
    cfg = load_config(
        DEMO,
        [
            "--run.name",
            odd,
            "--loss.tis_cap",
            "2.5",
            "--optim.lr",
            "1e-07",
            "--shardcast.relays",
            '["http://a:1", "http://b:2"]',
            "--loss.eps_high",
            "0.28",
        ],
        env={},
    )
    text = config_to_toml(cfg)
    parsed = tomllib.loads(text)
    assert parsed["run"]["name"] == odd and parsed["loss"]["tis_cap"] == 2.5 and parsed["optim"]["lr"] == 1e-7
    assert parsed["shardcast"]["relays"] == ["http://a:1", "http://b:2"] and parsed["loss"]["eps_high"] == 0.28
    assert "database_url" not in parsed["orchestrator"]  # None is omitted
    assert load_config(write(tmp_path, text), env={}) == cfg


def test_defaults_round_trip(tmp_path):
    assert load_config(write(tmp_path, config_to_toml(Config())), env={}) == Config()


def test_demo_recipe_resolves():
    cfg = load_config(DEMO, env={})
    assert Path(cfg.model.path).is_relative_to(cfg.run.dir)  # the tiny model lives under the run dir
    assert cfg.trainer.async_level == 2
    assert cfg.orchestrator.allow_cpu_nodes
    assert cfg.trainer.batch_size <= 256 and cfg.model.max_seq_len <= 512  # minutes on a 2-core CPU
    assert cfg.run.sft_steps > 0 and cfg.data.eval_tasks > 0  # a warm start, and accuracy to show
    assert cfg.worker.dtype == cfg.validator.dtype  # TOPLOC compares hidden states in one dtype


def test_config_show_of_the_defaults_loads_back_as_the_defaults(tmp_path):
    from intellect.config import Config
    from intellect.config_io import config_to_toml, load_config

    text = config_to_toml(Config())
    path = tmp_path / "shown.toml"
    path.write_text(text)
    assert load_config(path) == Config()


def test_lora_table_reads_and_bad_targets_name_the_field(tmp_path):
    cfg = load_config(write(tmp_path, '[model.lora]\nrank = 8\ntargets = ["q", "v"]\n'), env={})
    assert (cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.targets) == (8, 32.0, ["q", "v"])
    assert load_config(None, env={}).model.lora is None  # off by default: the whole model trains
    message = error_of(write(tmp_path, '[model.lora]\ntargets = ["q", "qkv"]\n'))
    assert "model.lora" in message and "targets" in message and "qkv" in message
    assert "q, k, v, o, gate, up, down" in message
    assert "model.lora.rank" in error_of(write(tmp_path, "[model.lora]\nrank = 0\n"))
