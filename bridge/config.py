"""The base every role's config section is built on, so that each component declares its own section.

A section is a pydantic model next to the code that uses it (`jax_trainer.config`, `gpu_workers.config`,
...); `intellect.config` composes them into the one `Config` that recipes, environment variables and flags
fill in. Unknown keys are errors, and each field's docstring becomes its description (the TOML writer and
`intellect config` print it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors and attribute docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def require(ok: bool, keys: tuple[str, ...], message: str) -> None:
    """Fail a cross-field check; `keys` (dotted) let the loader say where each value came from."""
    if not ok:
        raise PydanticCustomError("config_conflict", message, {"keys": keys})
