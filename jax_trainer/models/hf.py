"""The decoder's parameters under their Hugging Face names, and loading/exporting whole models.

`tensor_specs(cfg)` is the one table between the two worlds: for every HF tensor, the path of its parameter in
the nnx state (with its index in the layer axis for the decoder's stacked layers: `model.layers.3.mlp.up_proj`
is `layers.mlp.up_proj[3]`) and how the HF layout ([out, in] linears, flat heads) maps to ours ([in, out],
heads split out).
`jax_trainer.export` and `bridge.weights` move the bytes; this module builds the model around them.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from bridge.weights import ExportResult, TensorSpec
from jax_trainer.export import export_params, load_params
from jax_trainer.models import lora as lora_lib
from jax_trainer.models.config import ModelConfig
from jax_trainer.models.decoder import LAYER_AXIS, Decoder
from jax_trainer.models.layers import init_value
from jax_trainer.models.lora import LoraSpec
from jax_trainer.sharding import make_mesh, param_shardings

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jnp_dtype(name) -> jnp.dtype:
    if not isinstance(name, str):
        return jnp.dtype(name)
    if name not in JNP_DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {', '.join(JNP_DTYPES)}")
    return JNP_DTYPES[name]


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every parameter of `Decoder(cfg)` with its HF tensor; the order is the export order."""
    h, v = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec.same(("embed",), "model.embed_tokens.weight", (v, h))]
    for i in range(cfg.num_layers):
        layer_specs = _layer_specs(cfg, f"model.layers.{i}")
        specs += [dataclasses.replace(spec, layer=i) for spec in layer_specs]
    specs.append(TensorSpec.same(("final_norm", "weight"), "model.norm.weight", (h,)))
    if not cfg.tie_embeddings:
        specs.append(TensorSpec.linear(("lm_head",), "lm_head.weight", (v, h), (v, h), (1, 0)))
    return specs


def _layer_specs(cfg: ModelConfig, hf: str) -> list[TensorSpec]:
    """One layer's tensors (HF names under `hf`), at their paths in the stacked `layers` module."""
    h, n, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    p = ("layers",)
    att, mlp = p + ("attn",), p + ("mlp",)
    specs = [
        TensorSpec.same(p + ("input_norm", "weight"), f"{hf}.input_layernorm.weight", (h,)),
        # q/k/v: HF [heads*head_dim, hidden] -> [heads, head_dim, hidden] -> ours [hidden, heads, head_dim]
        TensorSpec.linear(att + ("q_proj",), f"{hf}.self_attn.q_proj.weight", (n * d, h), (n, d, h), (2, 0, 1)),
        TensorSpec.linear(att + ("k_proj",), f"{hf}.self_attn.k_proj.weight", (kv * d, h), (kv, d, h), (2, 0, 1)),
        TensorSpec.linear(att + ("v_proj",), f"{hf}.self_attn.v_proj.weight", (kv * d, h), (kv, d, h), (2, 0, 1)),
        # o: HF [hidden, heads*head_dim] -> [hidden, heads, head_dim] -> ours [heads, head_dim, hidden]
        TensorSpec.linear(att + ("o_proj",), f"{hf}.self_attn.o_proj.weight", (h, n * d), (h, n, d), (1, 2, 0)),
    ]
    if cfg.qkv_bias:
        for name, heads in (("q", n), ("k", kv), ("v", kv)):
            specs.append(
                TensorSpec.linear(
                    att + (f"{name}_bias",), f"{hf}.self_attn.{name}_proj.bias", (heads * d,), (heads, d), (0, 1)
                )
            )
    if cfg.o_bias:
        specs.append(TensorSpec.same(att + ("o_bias",), f"{hf}.self_attn.o_proj.bias", (h,)))
    if cfg.qk_norm:
        specs += [
            TensorSpec.same(att + ("q_norm", "weight"), f"{hf}.self_attn.q_norm.weight", (d,)),
            TensorSpec.same(att + ("k_norm", "weight"), f"{hf}.self_attn.k_norm.weight", (d,)),
        ]
    specs += [
        TensorSpec.same(p + ("post_attn_norm", "weight"), f"{hf}.post_attention_layernorm.weight", (h,)),
        TensorSpec.linear(mlp + ("gate_proj",), f"{hf}.mlp.gate_proj.weight", (m, h), (m, h), (1, 0)),
        TensorSpec.linear(mlp + ("up_proj",), f"{hf}.mlp.up_proj.weight", (m, h), (m, h), (1, 0)),
        TensorSpec.linear(mlp + ("down_proj",), f"{hf}.mlp.down_proj.weight", (h, m), (h, m), (1, 0)),
    ]
    if cfg.mlp_bias:
        specs += [
            TensorSpec.same(mlp + ("gate_bias",), f"{hf}.mlp.gate_proj.bias", (m,)),
            TensorSpec.same(mlp + ("up_bias",), f"{hf}.mlp.up_proj.bias", (m,)),
            TensorSpec.same(mlp + ("down_bias",), f"{hf}.mlp.down_proj.bias", (h,)),
        ]
    return specs


def _ignored_hf_tensor(cfg: ModelConfig):
    def ignore(name: str) -> bool:
        # tied checkpoints sometimes still carry a copy of the head; old Llama files carry RoPE caches
        return (cfg.tie_embeddings and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq")

    return ignore


def abstract_model(
    cfg: ModelConfig,
    param_dtype="float32",
    compute_dtype="float32",
    remat: str | bool = "none",
    scan_layers: bool | str = "auto",
    scan_unroll: int = 1,
    lora: LoraSpec | None = None,
) -> Decoder:
    """The model's structure with shapes only (no memory allocated, nothing compiled)."""
    return nnx.eval_shape(
        lambda: Decoder(
            cfg,
            param_dtype=jnp_dtype(param_dtype),
            compute_dtype=jnp_dtype(compute_dtype),
            remat=remat,
            scan_layers=scan_layers,
            scan_unroll=scan_unroll,
            rngs=nnx.Rngs(0),
            lora=lora,
        )
    )


def _with_values(abstract: Decoder, values: dict) -> Decoder:
    graphdef, state = nnx.split(abstract)
    for path, var in nnx.to_flat_state(state):
        var.set_value(values[tuple(path)])
    return nnx.merge(graphdef, state)


def _shardings(abstract: Decoder, mesh: Mesh) -> dict[tuple, jax.sharding.Sharding]:
    return {tuple(k): v.get_value() for k, v in nnx.to_flat_state(param_shardings(nnx.state(abstract), mesh))}


def load_hf(
    model_dir: str | Path,
    mesh: Mesh | None = None,
    param_dtype="float32",
    compute_dtype="float32",
    remat: str | bool = "none",
    verify: bool = True,
    scan_layers: bool | str = "auto",
    scan_unroll: int = 1,
    attention: str = "auto",
    lora: LoraSpec | None = None,
    lora_seed: int = 0,
) -> Decoder:
    """A `Decoder` holding a Hugging Face checkpoint's weights, sharded over `mesh` (default: all devices, fsdp).

    Nothing is compiled: the model's structure comes from `nnx.eval_shape`, and each array is built from the
    checkpoint's memory maps straight into its sharding (`jax_trainer.export.load_params`), the layers' tensors
    stacked into their layer axis on the host. `attention` is the attention kernel (`ModelConfig.attention`).
    With `lora`, the adapters are fresh (`init_random`'s draws from `lora_seed`): B = 0, so the outputs are the
    checkpoint's.
    """
    cfg = dataclasses.replace(ModelConfig.from_dir(model_dir), attention=attention)
    mesh = mesh if mesh is not None else make_mesh()
    abstract = abstract_model(cfg, param_dtype, compute_dtype, remat, scan_layers, scan_unroll, lora)
    shardings = _shardings(abstract, mesh)
    arrays = load_params(
        model_dir,
        tensor_specs(cfg),
        shardings,
        param_dtype,
        verify=verify,
        ignore=_ignored_hf_tensor(cfg),
    )
    arrays.update(_random_values(abstract, shardings, lora_seed, nnx.LoRAParam))
    return _with_values(abstract, arrays)


INIT_PRNG = "unsafe_rbg"  # XLA's RngBitGenerator: one op per random array, instead of Threefry's expansion


@functools.lru_cache(maxsize=None)
def _initialiser(init: str, shape: tuple[int, ...], dtype, sharding, layered: bool):
    """A small jitted initialiser of one parameter shape, shared by every leaf of that shape and kind.

    A stacked (`layered`) leaf draws layer by layer (`lax.map` over per-layer keys), so that at most one
    layer's slice of the random bits is live at once whatever XLA does to partition the generator.
    """

    def create(key, std):
        if init != "normal" or not layered:
            return init_value(key, shape, dtype, init, std)
        keys = jax.random.split(key, shape[0])
        return jax.lax.map(lambda k: init_value(k, shape[1:], dtype, init, std), keys)

    return jax.jit(create, out_shardings=sharding)


def init_random(
    cfg: ModelConfig,
    mesh: Mesh | None = None,
    param_dtype="float32",
    compute_dtype="float32",
    remat: str | bool = "none",
    seed: int = 0,
    scan_layers: bool | str = "auto",
    scan_unroll: int = 1,
    lora: LoraSpec | None = None,
) -> Decoder:
    """A randomly initialised model, each parameter created directly in its sharding (never whole on one device).

    Distributions are those of transformers' `_init_weights`: normal(0, `cfg.initializer_range`) for the
    embedding, the projections and the head, ones for the norms, zeros for the biases. Each parameter is made
    by a small jitted initialiser (one per shape and kind, reused across same-shaped parameters) from its own
    `INIT_PRNG` key, folded in from `seed` by the parameter's position: no program holds the whole model.
    """
    mesh = mesh if mesh is not None else make_mesh()
    abstract = abstract_model(cfg, param_dtype, compute_dtype, remat, scan_layers, scan_unroll, lora)
    return _with_values(abstract, _random_values(abstract, _shardings(abstract, mesh), seed))


def _random_values(abstract: Decoder, shardings: dict, seed: int, only=nnx.Param) -> dict[tuple, jax.Array]:
    """Fresh values of the parameters of `abstract` that `only` selects (a variable type), each from its own key
    (`seed` folded in by its position among all parameters: a parameter's draw does not depend on `only`)."""
    root = jax.random.key(seed, impl=INIT_PRNG)
    values = {}
    for index, (path, var) in enumerate(nnx.to_flat_state(nnx.state(abstract))):
        if not isinstance(var, only):
            continue
        path, meta, shape = tuple(path), var.get_metadata(), var.get_value()
        init, std = meta["init"]
        layered = meta["axes"][0] == LAYER_AXIS
        create = _initialiser(init, tuple(shape.shape), shape.dtype, shardings[path], layered)
        values[path] = create(jax.random.fold_in(root, index), jnp.float32(std))
    return values


def model_arrays(model: Decoder) -> dict[tuple, jax.Array]:
    """The base model's parameters by path (the adapters left out)."""
    base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
    return {tuple(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, base))}


def adapter_arrays(model: Decoder) -> dict[tuple, jax.Array]:
    """The LoRA adapters' parameters by path (empty without adapters)."""
    return {tuple(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}


def export_hf(
    model: Decoder,
    out_dir: str | Path,
    *,
    version: int,
    source_dir: str | Path | None = None,
    hf_config: dict | None = None,
    dtype="bfloat16",
    max_shard_bytes: int = 2 << 30,
    fsync: bool = True,
) -> ExportResult | None:
    """Write `model` as a Hugging Face directory (docs/design.md section 4) loadable by transformers and vLLM;
    a model with LoRA adapters is written merged, by the merge contract (`bridge.adapters.merge_weight`)."""
    if model.lora is not None:
        return _export_merged(model, out_dir, version, source_dir, hf_config, dtype, max_shard_bytes, fsync)
    return export_params(
        model_arrays(model),
        tensor_specs(model.cfg),
        out_dir,
        version=version,
        source_dir=source_dir,
        hf_config=hf_config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        fsync=fsync,
    )


def with_random_b(model: Decoder, std: float, seed: int = 0) -> Decoder:
    """`model` with every adapter's B drawn from normal(0, `std`) (numpy's generator of `seed`, in the adapters'
    path order), A kept: a fresh adapter (B = 0) leaves the outputs unchanged, this one moves them, as a trained
    one does (for tests and benchmarks of adapters)."""
    import numpy as np

    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    rng = np.random.default_rng(seed)

    def draw(path, x):
        if "lora_b" not in jax.tree_util.keystr(path):
            return x
        return jax.device_put(jnp.asarray(rng.normal(0, std, x.shape), x.dtype), x.sharding)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, adapters), rest)


def _export_merged(model: Decoder, out_dir, version, source_dir, hf_config, dtype, max_shard_bytes, fsync):
    """`export_hf` of a model with adapters: each adapted kernel gathered in float32 with its A and B, merged on
    the host by `bridge.adapters.merge_weight` (what workers and validators compute), then cast."""
    from bridge.adapters import PEFT_PREFIX, merge_weight
    from bridge.weights import resolve_dtype
    from jax_trainer.export import host_values

    specs, arrays = tensor_specs(model.cfg), model_arrays(model)
    base = host_values(arrays, specs, "float32")
    lora_specs = {s.hf_name: s for s in lora_lib.peft_specs(model.cfg, model.lora)}
    adapters = host_values(adapter_arrays(model), list(lora_specs.values()), "float32")
    np_dtype = resolve_dtype(dtype)

    def host_value(spec):
        w = base(spec)
        module = PEFT_PREFIX + spec.hf_name.removesuffix(".weight")
        a_spec, b_spec = lora_specs.get(module + ".lora_A.weight"), lora_specs.get(module + ".lora_B.weight")
        if a_spec is not None:
            w = merge_weight(w, adapters(a_spec), adapters(b_spec), model.lora.scaling)
        return w.astype(np_dtype)

    return export_params(
        arrays,
        specs,
        out_dir,
        version=version,
        source_dir=source_dir,
        hf_config=hf_config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        fsync=fsync,
        host_value=host_value,
    )


def load_adapter(model: Decoder, adapter_dir: str | Path, base_digest: str | None = None) -> Decoder:
    """`model` (built with the adapter's `LoraSpec`, e.g. `load_hf(..., lora=spec_from_peft_config(...))`) holding
    the adapters of a PEFT adapter directory (verified by `bridge.adapters.verify_adapter`, against `base_digest`
    when given), each array in the sharding of the one it replaces."""
    import numpy as np

    from bridge.adapters import WEIGHTS_FILE, verify_adapter
    from bridge.safetensors_io import SafetensorsFile

    if model.lora is None:
        raise lora_lib.LoraError("load_adapter: the model has no LoRA adapters (build it with lora=...)")
    verify_adapter(adapter_dir, base_digest)
    weights = SafetensorsFile(Path(adapter_dir) / WEIGHTS_FILE)
    specs = lora_lib.peft_specs(model.cfg, model.lora)
    expected = {s.hf_name for s in specs}
    if set(weights.tensors) != expected:
        extra, missing = sorted(set(weights.tensors) - expected), sorted(expected - set(weights.tensors))
        raise lora_lib.LoraError(
            f"{adapter_dir}: the adapter's tensors are not those of {model.lora} (unexpected {extra[:3]}, "
            f"missing {missing[:3]})"
        )
    current = adapter_arrays(model)
    layers: dict[tuple, dict[int, np.ndarray]] = {}
    for spec in specs:
        value = weights.array(spec.hf_name)
        if value.shape != spec.hf_shape:
            raise lora_lib.LoraError(
                f"{adapter_dir}: {spec.hf_name} is {list(value.shape)}, expected {list(spec.hf_shape)}"
            )
        layers.setdefault(spec.path, {})[spec.layer] = spec.to_jax(value)
    values = {}
    for path, by_layer in layers.items():
        old = current[path]
        stacked = np.stack([by_layer[i] for i in range(len(by_layer))]).astype(old.dtype)
        values[path] = jax.device_put(stacked, old.sharding)
    graphdef, state = nnx.split(model)
    for path, var in nnx.to_flat_state(state):
        if tuple(path) in values:
            var.set_value(values[tuple(path)])
    return nnx.merge(graphdef, state)


def export_adapter(
    model: Decoder,
    out_dir: str | Path,
    *,
    version: int,
    base_digest: str,
    base_model: str = "",
    dtype="float32",
    base_version: int | None = None,
) -> ExportResult | None:
    """Write `model`'s LoRA adapters as a PEFT adapter directory (`bridge.adapters`: `adapter_config.json`,
    `adapter_model.safetensors`, a manifest naming the base by `base_digest`); None on process > 0."""
    from bridge.adapters import write_adapter
    from jax_trainer.export import host_values

    if model.lora is None:
        raise lora_lib.LoraError("export_adapter: the model has no LoRA adapters (model.lora is not set)")
    specs = lora_lib.peft_specs(model.cfg, model.lora)
    return write_adapter(
        specs,
        host_values(adapter_arrays(model), specs, dtype),
        out_dir,
        version=version,
        config=lora_lib.peft_config(model.lora, base_model),
        base_digest=base_digest,
        dtype=dtype,
        writer=jax.process_index() == 0,
        base_version=base_version,
    )
