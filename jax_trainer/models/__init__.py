"""flax.nnx decoder models (Qwen2, Qwen3, Llama) and their Hugging Face bridge."""

from jax_trainer.models.config import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from jax_trainer.models.decoder import Decoder
from jax_trainer.models.hf import abstract_model, export_hf, init_random, load_hf, model_arrays, tensor_specs

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "Decoder",
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModelError",
    "abstract_model",
    "export_hf",
    "init_random",
    "load_hf",
    "model_arrays",
    "tensor_specs",
]
