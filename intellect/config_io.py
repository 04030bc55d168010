"""Reading a config from its sources, and writing one back as TOML (`intellect.config` holds the schema).

Values come from four sources, later wins:

    defaults  <  TOML file  <  INTELLECT_SECTION__KEY environment variables  <  --section.key VALUE flags

`load_config` merges the sources itself and hands pydantic one dict (pydantic-settings is told not to read
the environment on its own), so that every error can say which key was wrong, where it came from, and what
was probably meant. Values from the environment and from flags are strings: each is read as a TOML literal
(`1e-6`, `true`, `[1, 2]`, `"x"`) when that literal suits the field's type, otherwise as the raw text
(`--run.name 42` stays the string "42"); `none` or `null` clears an optional field. Relative paths are
relative to the working directory, not to the TOML file. `config_to_toml` writes a config back as TOML.

A file may start with `include = ["other.toml", ...]` (paths relative to the working directory, like every
path in a recipe): each included file is read first, in order, and the including file's own values win over
them. What `intellect calibrate` writes is such a fragment (`[validator]` and `[orchestrator]` keys), so one
recipe carries its pool's calibration to every role.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter, ValidationError

from intellect.config import SECTIONS, Config, ConfigError

ENV_PREFIX = "INTELLECT_"
# INTELLECT_* variables that are not config keys (INTELLECT_VLLM picks the vLLM wheel in setup.py).
RESERVED_ENV = frozenset({"INTELLECT_VLLM"})


# ---------------------------------------------------------------------------------------------------------
# Loading: each source becomes a list of entries, checked against the schema, then merged in order.


@dataclass(frozen=True)
class _Origin:
    """Where a value came from, and how that source would spell another key (for suggestions)."""

    kind: Literal["file", "env", "flag"]
    where: str  # the file's path, the variable's name, or the flag as typed

    def describe(self) -> str:
        return {
            "file": f"file {self.where}",
            "env": f"environment variable {self.where}",
            "flag": f"flag {self.where}",
        }[self.kind]

    def spell(self, section: str, key: str | None) -> str:
        if self.kind == "env":
            return f"{ENV_PREFIX}{section.upper()}__{(key or 'KEY').upper()}"
        if self.kind == "flag":
            return f"--{section}.{key or 'KEY'}"
        return f"'{key}' under [{section}]" if key else f"[{section}]"


@dataclass(frozen=True)
class _Entry:
    section: str
    key: str
    value: Any
    origin: _Origin
    raw: bool  # a string from the environment or a flag, still to be read as a TOML literal


def _closest(name: str, choices: Iterable[str]) -> str | None:
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _unknown_key_error(section: str, key: str | None, origin: _Origin) -> str | None:
    """None if `section.key` (or, without key, `section`) exists; else a message with the closest valid key."""
    what = (
        f"'{section}' ('{section}.{key}', from {origin.describe()})"
        if key is not None
        else (f"[{section}] (from {origin.describe()})")
    )
    if section not in SECTIONS:
        guess = _closest(section, SECTIONS)
        if guess:
            fields = SECTIONS[guess].model_fields
            guess_key = None if key is None else key if key in fields else _closest(key, fields)
            hint = f"did you mean {origin.spell(guess, guess_key)}?"
        else:
            owners = [s for s, model in SECTIONS.items() if section in model.model_fields]
            hint = (
                f"keys belong in a section: did you mean {origin.spell(owners[0], section)}?"
                if owners
                else f"sections: {', '.join(SECTIONS)}"
            )
        return f"unknown section {what}; {hint}"
    fields = SECTIONS[section].model_fields
    if key is None or key in fields:
        return None
    guess = _closest(key, fields)
    owners = [s for s, model in SECTIONS.items() if key in model.model_fields]
    if owners:  # the exact key of another section beats a near miss in this one
        hint = f"did you mean {origin.spell(owners[0], key)}?"
    elif guess:
        hint = f"did you mean {origin.spell(section, guess)}?"
    else:
        hint = f"keys of [{section}]: {', '.join(fields)}"
    return f"unknown key '{key}' in section '{section}' ('{section}.{key}', from {origin.describe()}); {hint}"


def _file_entries(path: Path, including: tuple[Path, ...] = ()) -> tuple[list[_Entry], list[str]]:
    """The entries of a TOML file, those of the files it includes first; `including`: the files that include it."""
    origin = _Origin("file", str(path))
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        via = f" (included by {including[-1]})" if including else ""
        raise ConfigError(f"cannot read config file {path}{via}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    entries, errors = [], []
    include = doc.pop("include", [])
    if isinstance(include, str):
        include = [include]
    if not isinstance(include, list) or not all(isinstance(p, str) for p in include):
        errors.append(f"'include' in {path} must be a path or a list of paths (strings), got {include!r}")
        include = []
    chain = (*including, Path(path).resolve())
    for name in include:
        if Path(name).resolve() in chain:
            errors.append(f"'include' in {path}: {name} includes itself (through {' -> '.join(map(str, chain))})")
            continue
        more, problems = _file_entries(Path(name), chain)
        entries += more
        errors += problems
    for section, table in doc.items():
        if section not in SECTIONS:
            errors.append(_unknown_key_error(section, None, origin))
        elif not isinstance(table, dict):
            errors.append(f"'{section}' in {path} must be a table ([{section}]), got {table!r}")
        else:
            entries += [_Entry(section, key, value, origin, raw=False) for key, value in table.items()]
    return entries, errors


def _env_entries(env: Mapping[str, str]) -> tuple[list[_Entry], list[str]]:
    entries, errors = [], []
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX) or name.upper() in RESERVED_ENV:
            continue
        section, sep, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not (sep and section and key):
            errors.append(
                f"environment variable {name} is not a config key: expected "
                f"{ENV_PREFIX}SECTION__KEY, e.g. {ENV_PREFIX}OPTIM__LR"
            )
            continue
        entries.append(_Entry(section, key, env[name], _Origin("env", name), raw=True))
    return entries, errors


_FLAG = re.compile(r"--(?P<name>[^=\s]+)(?:=(?P<value>.*))?", re.DOTALL)


def _flag_entries(overrides: Sequence[str]) -> tuple[list[_Entry], list[str]]:
    """`--section.key VALUE` and `--section.key=VALUE`; dashes in names read as underscores."""
    entries, errors, i = [], [], 0
    while i < len(overrides):
        token = overrides[i]
        i += 1
        match = _FLAG.fullmatch(token)
        if not match or "." not in match["name"]:
            errors.append(f"expected an override --section.key VALUE, got {token!r}")
            continue
        value = match["value"]
        if value is None:
            if i == len(overrides) or overrides[i].startswith("--"):
                errors.append(f"flag {token} has no value (write {token} VALUE or {token}=VALUE)")
                continue
            value, i = overrides[i], i + 1
        section, _, key = match["name"].replace("-", "_").partition(".")
        entries.append(_Entry(section, key, value, _Origin("flag", f"--{match['name']}"), raw=True))
    return entries, errors


_NOT_TOML = object()


def _toml_literal(text: str) -> Any:
    """The value of `text` read as a TOML literal, or `_NOT_TOML`."""
    if "\n" in text or "\r" in text:
        return _NOT_TOML
    try:
        doc = tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return _NOT_TOML
    return doc["v"] if doc.keys() == {"v"} else _NOT_TOML


def _read_string(text: str, section: str, key: str) -> Any:
    """A string from the environment or a flag as the field wants it: None, a TOML literal, or the text."""
    candidates = [None] if text.strip().lower() in ("none", "null") else []
    literal = _toml_literal(text)
    candidates += [literal] if literal is not _NOT_TOML else []
    adapter = TypeAdapter(SECTIONS[section].model_fields[key].annotation)
    for value in candidates + [text]:
        try:
            adapter.validate_python(value)
            return value
        except ValidationError:
            continue
    return literal if literal is not _NOT_TOML else text  # let the full validation explain what is wrong


def _format_validation_error(exc: ValidationError, origins: Mapping[str, _Origin]) -> str:
    def source(key: str) -> str:
        return origins[key].describe() if key in origins else "default"

    lines = []
    for err in exc.errors():
        loc = [str(part) for part in err["loc"]]
        if err["type"] == "config_conflict":
            keys = err["ctx"]["keys"]
            where = "; ".join(f"{k}: {source(k)}" for k in keys)
            lines.append(f"{err['msg']} ({where})")
            continue
        key = ".".join(loc[:2])
        # a sub-table's field (model.lora.rank) by its dotted name; an item of a list or dict in brackets
        inner = [part for part in loc[2:] if not part.isdigit()]
        if inner and len(inner) == len(loc[2:]) and _is_section_field(loc[0], loc[1]):
            item = "".join(f".{part}" for part in loc[2:])
        else:
            item = "".join(f"[{part}]" for part in loc[2:])
        lines.append(f"invalid value for {key}{item} ({source(key)}): {err['msg']}; got {err['input']!r}")
    return "\n".join(lines)


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> Config:
    """Resolve defaults < TOML file `path` < INTELLECT_* variables in `env` (default os.environ) < overrides.

    `overrides` are command-line tokens: `["--optim.lr", "1e-6", "--run.name=x"]`. Raises ConfigError.
    """
    entries, errors = _file_entries(Path(path)) if path is not None else ([], [])
    for more, problems in (_env_entries(os.environ if env is None else env), _flag_entries(overrides)):
        entries += more
        errors += problems
    errors += [e for e in (_unknown_key_error(x.section, x.key, x.origin) for x in entries) if e]
    if errors:
        raise ConfigError("\n".join(errors))
    merged: dict[str, dict[str, Any]] = {}
    origins: dict[str, _Origin] = {}
    for x in entries:
        value = _read_string(x.value, x.section, x.key) if x.raw else x.value
        merged.setdefault(x.section, {})[x.key] = value
        origins[f"{x.section}.{x.key}"] = x.origin
    try:
        return Config(**merged)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, origins)) from None


# ---------------------------------------------------------------------------------------------------------
# Writing TOML (tomllib only reads). None values are left out: TOML has no null, and every optional field
# defaults to None, so leaving it out reads back the same.

_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}


def _is_section_field(section: str, key: str) -> bool:
    """Whether `section.key` is a sub-table with fields of its own (`model.lora`)."""
    field = SECTIONS[section].model_fields.get(key) if section in SECTIONS else None
    kinds = typing.get_args(field.annotation) or (field.annotation,) if field is not None else ()
    return any(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds)


def _toml_value(value: Any) -> str:
    if isinstance(value, BaseModel):  # a sub-table (model.lora), written inline
        value = value.model_dump()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # 'inf', '-inf', '1e-07' and '0.2' are all TOML floats
    if isinstance(value, (str, Path)):
        chars = (_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in str(value))
        return '"' + "".join(chars) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table, its keys quoted
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__} value {value!r}")


def config_to_toml(cfg: Config) -> str:
    """The config as a TOML document, one commented key per field, that `load_config` reads back equal."""
    blocks = []
    for section, field in Config.model_fields.items():
        lines = [f"# {field.description}", f"[{section}]"]
        part = getattr(cfg, section)
        for key, sub in type(part).model_fields.items():
            value = getattr(part, key)
            if value is not None:
                lines += [f"# {sub.description}", f"{key} = {_toml_value(value)}"]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"
