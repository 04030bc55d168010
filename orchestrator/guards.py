"""What keeps a hostile request body from reaching a 5xx or the log: strict JSON decoding, error answers that never
echo the input, and log lines of bounded length. Both lanes (FastAPI and the fast lane) use these.

- `decode_json`: the only JSON decoder a request body meets before validation. It refuses what Python's `json`
  accepts and the models or the reply encoder then choke on: `NaN`, `Infinity`, numbers that overflow a float
  (`1e999`), lone surrogates (escaped or raw), invalid UTF-8, integers over 4,300 digits and nesting deeper than
  200 levels (refused by the parser's limit, without recursing on the interpreter's stack). Its messages name
  the line and column, never the text there.
- `validation_errors`: FastAPI's 422 `detail` without `input` and `ctx` (which repeat the request: a NaN there
  made the answer itself fail with a 500), each location and message cut to a bounded length.
- `BoundedFormatter`: log records cut to `max_chars` (message and traceback each), so that no request can grow
  the log by more than a few kB.
"""

from __future__ import annotations

import email.message
import functools
import ipaddress
import logging
import math
import re
from collections.abc import Iterable
from typing import Any

import pydantic_core

MAX_LOC_CHARS = 64
MAX_MSG_CHARS = 300
MAX_ERRORS = 32
# A number that may overflow a float: an exponent of three digits or more, or 300 digits in a row. Only a body
# with one is walked for infinities (the parser reads 1e999 as inf).
_BIG_NUMBER = re.compile(rb"[eE]\+?0*[1-9][0-9]{2}|[0-9]{300}")


@functools.lru_cache(maxsize=65536)
def address_group(host: str) -> str:
    """The unit per-address limits count in: an IPv4 address, or the /64 of an IPv6 one (one subscriber's
    allocation; anything else, such as a Unix socket's name, as it is)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


class BodyError(ValueError):
    """A body that is not strict JSON; the message says why and where, not what."""


def decode_json(body: bytes) -> Any:
    """The value of a request body, or BodyError."""
    try:
        value = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:  # the parser's messages give line and column only
        raise BodyError(f"JSON decode error: {exc}") from None
    if _BIG_NUMBER.search(body) is not None and not _all_finite(value):
        raise BodyError("JSON decode error: a number overflows a 64-bit float")
    return value


def _all_finite(value: Any) -> bool:
    stack = [value]
    while stack:  # iterative: the parser bounds the depth, this bounds nothing on the interpreter's stack
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


@functools.lru_cache(maxsize=256)
def is_json_content_type(content_type: bytes | None) -> bool:
    """FastAPI's rule for parsing a body as JSON: `application/json` or `application/*+json`; a request without a
    Content-Type is not JSON (FastAPI's strict content type, the default)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _clean(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, anything that cannot be UTF-8 (a lone surrogate) replaced."""
    if len(text) > limit:
        text = text[:limit] + "..."
    return text.encode("utf-8", "replace").decode("utf-8")


def validation_errors(errors: Iterable[dict]) -> list[dict]:
    """The `detail` of a 422: type, location and message of each error (at most MAX_ERRORS), nothing of the input."""
    out = []
    for error in errors:
        if len(out) == MAX_ERRORS:
            out.append(
                {
                    "type": "too_many_errors",
                    "loc": [],
                    "msg": f"more than {MAX_ERRORS} errors; the first {MAX_ERRORS} are listed",
                }
            )
            break
        loc = [part if isinstance(part, int) else _clean(str(part), MAX_LOC_CHARS) for part in error.get("loc", ())]
        out.append(
            {
                "type": _clean(str(error.get("type", "value_error")), MAX_LOC_CHARS),
                "loc": loc,
                "msg": _clean(str(error.get("msg", "")), MAX_MSG_CHARS),
            }
        )
    return out


def json_error(message: str) -> list[dict]:
    """The 422 `detail` of a body that is not strict JSON (FastAPI's wording: type json_invalid at `body`)."""
    return [{"type": "json_invalid", "loc": ["body"], "msg": _clean(message, MAX_MSG_CHARS)}]


class BoundedFormatter(logging.Formatter):
    """Wraps a handler's formatter: each record's message and traceback are cut to `max_chars` each before the
    inner formatter sees them."""

    def __init__(self, inner: logging.Formatter | None = None, max_chars: int = 4000):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.max_chars = max_chars

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if len(message) > self.max_chars:
            record.msg, record.args = (
                (f"{message[: self.max_chars]}... [{len(message) - self.max_chars} characters cut]"),
                None,
            )
        if record.exc_info and not record.exc_text:
            text = self.inner.formatException(record.exc_info)
            if len(text) > self.max_chars:  # the end of a traceback names the error: keep the head and the tail
                half = self.max_chars // 2
                text = f"{text[:half]}\n... [{len(text) - self.max_chars} characters cut] ...\n{text[-half:]}"
            record.exc_text = text
        return self.inner.format(record)


def bound_log_lines(
    max_chars: int = 4000, loggers: Iterable[str] = ("", "uvicorn", "uvicorn.error", "uvicorn.access")
) -> None:
    """Every handler of `loggers` (the root's and uvicorn's) formats through a BoundedFormatter."""
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not isinstance(handler.formatter, BoundedFormatter):
                handler.setFormatter(BoundedFormatter(handler.formatter, max_chars))
