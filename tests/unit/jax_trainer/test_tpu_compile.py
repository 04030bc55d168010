"""The learner compiled by XLA:TPU for TPU slices on this CPU host (libtpu's compile-only devices).

libtpu comes with `make install` (setup.py's `tpu-plan` extra), so these run in CI: no skip.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from intellect.config_io import load_config
from intellect.plan_tpu import plan_tpu
from jax_trainer import attention, step_cost, topology
from jax_trainer.config import LossConfig, OptimConfig
from jax_trainer.models import ModelConfig, abstract_model
from jax_trainer.models.decoder import has_pinned_host, resolve_scan_layers
from jax_trainer.plan import compile_step, plan_of
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

TINY = ModelConfig(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    qkv_bias=True,
)


def _hf_config(tmp_path, **changes):
    """A config.json of QwQ-32B's shape (configs/shapes/qwq-32b) with `changes`, in its own directory."""
    hf = json.loads(open("configs/shapes/qwq-32b/config.json").read())
    hf.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return tmp_path


def test_accelerator_types_map_to_libtpu_topologies():
    cases = {
        "v5p-8": ("v5p:2x2x1", 4),  # v5p-N counts TensorCores, two per chip
        "v5p-128": ("v5p:4x4x4", 64),
        "v6e-8": ("v6e:2x4", 8),  # v6e-N and v5e-N count chips
        "v5e-16": ("v5e:4x4", 16),
        "v4-8": ("v4:2x2x1", 4),
        "v5p:4x4x8": ("v5p:4x4x8", 128),  # libtpu's own names pass through
        "V6E:2x2": ("v6e:2x2", 4),
    }
    for name, (libtpu_name, chips) in cases.items():
        spec = topology.slice_spec(name)
        assert (spec.topology, spec.chips) == (libtpu_name, chips), name
    assert topology.slice_spec("v5p-8").chip.hbm_bytes == 95 * 2**30
    assert topology.slice_spec("v6e-8").chip.hbm_bytes == 32 * 2**30
    assert topology.slice_spec("v5e-16").chip.hbm_bytes == 16 * 2**30
    with pytest.raises(ValueError, match="counts TensorCores"):
        topology.slice_spec("v5p-9")
    with pytest.raises(ValueError, match="not an accelerator type"):
        topology.slice_spec("h100-8")
    with pytest.raises(ValueError, match="no slice of 3 chips"):
        topology.slice_spec("v6e-3")


def test_per_backend_choices_follow_the_mesh_not_the_host():
    """On this CPU host, a mesh of compile-only TPU devices gets splash, scanned layers and pinned-host offload."""
    _, devices = topology.tpu_devices("v5p-8")
    tpu_mesh = make_mesh(1, -1, 1, devices=devices)
    cpu_mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    assert jax.default_backend() == "cpu" and topology.platform(tpu_mesh) == "tpu"
    assert topology.has_pinned_host(devices[0]) and not topology.has_pinned_host(jax.devices()[0])
    seen = {}
    for name, mesh in (("tpu", tpu_mesh), ("cpu", cpu_mesh)):
        with jax.set_mesh(mesh):
            seen[name] = (attention.resolve("auto", jnp.bfloat16), resolve_scan_layers("auto"), has_pinned_host())

            def traced(x, name=name):  # inside a jit too, where only the abstract mesh is at hand
                seen[name + " jit"] = (topology.platform(), has_pinned_host())
                return x

            jax.jit(traced).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    assert seen == {
        "tpu": ("splash", True, True),
        "cpu": ("xla", False, False),
        "tpu jit": ("tpu", True),
        "cpu jit": ("cpu", False),
    }


@pytest.mark.parametrize("name", ["v5p-8", "v6e-8"])
def test_grpo_step_with_splash_compiles_for_a_tpu_slice(name):
    """A small scanned model's whole GRPO step, attention "auto", compiled by XLA:TPU: splash's Mosaic kernels are in
    the program, and each chip holds its fsdp shard of every parameter (sizes from the shapes, not from XLA)."""
    spec, devices = topology.tpu_devices(name)
    mesh = make_mesh(1, -1, 1, devices=devices)
    model = abstract_model(TINY, "float32", "bfloat16", "full", resolve_scan_layers("auto", topology.platform(mesh)))
    assert model.scan_layers is True
    trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig())
    compiled, *_ = inputs = compile_step(trainer, micro_batches=2, rows=spec.chips, seq_len=256)
    assert step_cost.mosaic_calls(compiled) >= 2, "no Mosaic tpu_custom_call: splash is not in the program"
    plan = plan_of(*inputs)
    h, m, v, n, kv, d, layers = 256, 512, 512, 8, 2, 32, 3
    per_layer = h * n * d * 2 + h * kv * d * 2 + 3 * h * m + (n + 2 * kv) * d + 2 * h  # q,o; k,v; mlp; biases; norms
    embed_and_head = 2 * v * h + h
    fsdp = spec.chips
    # the [layers, hidden, ...] kernels and the embedding split over fsdp along `embed`; biases and norms do not
    sharded = layers * (h * n * d * 2 + h * kv * d * 2 + 3 * h * m) + 2 * v * h
    expected = 4 * (sharded // fsdp + (layers * per_layer + embed_and_head - sharded))
    assert plan.params == expected, (plan.params, expected)
    assert plan.devices == spec.chips and plan.host_devices == 0  # TPU chips: not the host's memory
    assert plan.fits(spec.chip.hbm_bytes)


def test_scaled_cost_matches_a_direct_compile_of_the_unrolled_step(tmp_path):
    """XLA counts a loop body once: `intellect plan --topology`'s FLOPs for a scanned 3-layer step, scaled from 1- and
    2-layer compiles, against XLA:TPU's own count for the same step unrolled at 3 layers (one logprob chunk)."""
    shape = _hf_config(
        tmp_path,
        num_hidden_layers=3,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        head_dim=32,
    )
    overrides = [
        "--model.path", str(shape), "--model.max_seq_len=256", "--data.max_prompt_len=64",
        "--data.max_new_tokens=192", "--trainer.fsdp=4", "--trainer.tensor=1", "--trainer.micro_batch_size=8",
        "--model.attention=xla",
    ]  # fmt: skip
    cfg = load_config("configs/qwen2_5_0_5b_gsm8k.toml", overrides)
    result = plan_tpu(cfg, "v5p-8")
    assert result["scanned"] and result["fits"] and result["attention"] == "xla" and result["cost_loops"] == 0
    _, devices = topology.tpu_devices("v5p-8")
    mesh = make_mesh(1, 4, 1, devices=devices)
    model_cfg = dataclasses.replace(ModelConfig.from_dir(shape), attention="xla")
    direct = GRPOTrainer(
        abstract_model(model_cfg, "float32", "bfloat16", "full", False),
        mesh,
        cfg.loss,
        cfg.optim,
        cfg.trainer.model_copy(update={"logprob_chunk": 256}),
    )
    flops, nbytes = step_cost.analysed(compile_step(direct, 1, 8, 256)[0])
    cost = result["cost"]
    assert math.isclose(cost.flops, flops, rel_tol=0.02), (cost.flops, flops)
    assert cost.bytes * 0.9 <= nbytes <= cost.bytes_high * 1.1, (cost.bytes, nbytes, cost.bytes_high)


def test_the_tpu_recipe_sharding_compiles_at_a_shallow_depth(tmp_path):
    """configs/intellect2_qwq32b.toml's mesh (data 1 x fsdp 16 x tensor 4 on v5p-128) and QwQ-32B's widths, at one
    layer and 1024 tokens: splash runs per chip under the mesh, and the parameters split 64 ways (within 1%)."""
    shape = _hf_config(tmp_path, num_hidden_layers=1)
    overrides = [
        "--model.path", str(shape), "--model.max_seq_len=1024", "--data.max_prompt_len=256",
        "--data.max_new_tokens=768", "--data.length_targets=[256, 512]",
    ]  # fmt: skip
    cfg = load_config("configs/intellect2_qwq32b.toml", overrides)
    result = plan_tpu(cfg, "v5p-128", cost=False)
    assert result["mesh"] == {"data": 1, "fsdp": 16, "tensor": 4} and result["chips"] == 64
    assert result["attention"] == "splash" and result["mosaic_calls"] >= 2
    hf = json.loads((shape / "config.json").read_text())
    h, v, m = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    n, kv, d = hf["num_attention_heads"], hf["num_key_value_heads"], h // hf["num_attention_heads"]
    total = 2 * v * h + h * (n + 2 * kv) * d * 2 + 3 * h * m  # embed, head, q/o + k/v, mlp (biases, norms: small)
    assert math.isclose(result["plan"].params, 4 * total / 64, rel_tol=0.01), (result["plan"].params, 4 * total / 64)
    assert result["fits"]


def test_a_batch_too_large_for_the_chip_exits_non_zero_and_names_what_to_change(tmp_path):
    """XLA:TPU refuses a program that cannot fit the chip's HBM, as it would on the slice: `intellect plan` says so,
    exits 1 and names the figure to change."""
    shape = _hf_config(
        tmp_path, num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=512, head_dim=32,
    )  # fmt: skip
    cmd = [
        sys.executable, "-m", "intellect", "plan", "configs/qwen2_5_0_5b_gsm8k.toml", "--topology", "v5e-4",
        "--model.path", str(shape), "--model.remat=none", "--model.max_seq_len=256", "--data.max_prompt_len=64",
        "--data.max_new_tokens=192",
    ]  # fmt: skip
    fits = subprocess.run(cmd + ["--trainer.micro_batch_size=16"], capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0 and "fits in 16.00 GiB per chip" in fits.stdout, fits.stdout + fits.stderr[-3000:]
    assert "roofline" in fits.stdout and "attention splash" in fits.stdout, fits.stdout
    done = subprocess.run(cmd + ["--trainer.micro_batch_size=32768"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "DOES NOT FIT in 16.00 GiB per chip" in done.stdout and "RESOURCE_EXHAUSTED" in done.stdout, done.stdout
    assert "lower trainer.micro_batch_size" in done.stdout and "model.remat" in done.stdout, done.stdout


def test_without_libtpu_the_plan_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` raises ImportError
    with pytest.raises(topology.LibtpuMissing, match=r"needs libtpu.*\.\[tpu-plan\]"):
        topology.tpu_devices("v5p-8")
