"""Validation of every name that crosses the network: versions, file names, version directories, server URLs.

Nothing from a URL, a manifest or a server's answer becomes a path before it passes through here. File names
are plain names (no directories, nothing hidden) drawn from a small alphabet that covers every file an HF
export holds, so a validated name can be joined to a version directory without escaping it.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from bridge.shardcast.errors import ShardcastError

# The weights layout's names (docs/design.md section 4, `bridge.weights`), spelled out here so that origins, relays and
# clients do not import numpy and the weight converters with it (a test checks that the two agree).
MANIFEST_FILE = "manifest.json"
STABLE_FILE = "STABLE"

MAX_VERSION = 10**15  # far beyond any optimizer step count; keeps version text short
_VERSION_TEXT = re.compile(r"0|[1-9][0-9]{0,14}")
_VERSION_DIR = re.compile(r"v([0-9]{6,15})")
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")
_RESERVED = frozenset({MANIFEST_FILE, STABLE_FILE})


def version_dirname(version: int) -> str:
    """The directory of a version inside a weights, relay or client directory: `v000123`."""
    return f"v{version:06d}"


def parse_version_dirname(name: str) -> int | None:
    """The version a directory name stands for, or None for anything else (partials, hidden, stray)."""
    match = _VERSION_DIR.fullmatch(name)
    if match is None:
        return None
    version = int(match.group(1))
    return version if version_dirname(version) == name else None


def parse_version(text: str, where: str) -> int:
    """A version number given as text (URL segment, query, command line): plain decimal, no sign, no padding."""
    if not isinstance(text, str) or not _VERSION_TEXT.fullmatch(text):
        raise ShardcastError(f"{where}: {text!r} is not a version (a decimal integer 0..{MAX_VERSION - 1})")
    return int(text)


def check_version(value: object, where: str) -> int:
    """A version number from JSON: an int (not a bool) in 0..MAX_VERSION-1."""
    if type(value) is not int or not 0 <= value < MAX_VERSION:
        raise ShardcastError(f"{where}: {value!r} is not a version (an integer 0..{MAX_VERSION - 1})")
    return value


def check_file_name(name: object, where: str) -> str:
    """A file name inside a version: plain, not hidden, not `manifest.json`/`STABLE`, letters digits . _ -."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in _RESERVED or ".." in name:
        raise ShardcastError(
            f"{where}: {name!r} is not an acceptable file name (a plain name of letters, digits, '.', '_', '-', "
            f"not starting with '.', without '..', at most 200 characters, not {MANIFEST_FILE} or {STABLE_FILE})"
        )
    return name


@dataclass(frozen=True)
class ServerURL:
    """A SHARDCAST server: plain HTTP, host and port (integrity comes from the sha256 of every file)."""

    host: str
    port: int
    prefix: str = ""  # a path the server is mounted under, without the trailing slash

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.prefix}"

    def path(self, path: str) -> str:
        return self.prefix + path


def parse_server_url(url: str) -> ServerURL:
    """`http://host[:port][/prefix]` -> ServerURL; anything else is refused, naming the URL."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise ShardcastError(f"server URL {url!r}: {e}") from e
    if parts.scheme != "http" or not parts.hostname:
        raise ShardcastError(
            f"server URL {url!r}: expected http://HOST:PORT (plain HTTP; files are verified by sha256)"
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ShardcastError(f"server URL {url!r}: must not carry a query, fragment or credentials")
    return ServerURL(parts.hostname, port or 80, parts.path.rstrip("/"))


def parse_server_list(text: str | list[str]) -> list[ServerURL]:
    """`URL[,URL...]` (or a list of URLs) -> distinct servers in the given order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    servers: list[ServerURL] = []
    for item in items:
        if item.strip():
            server = parse_server_url(item)
            if server not in servers:
                servers.append(server)
    if not servers:
        raise ShardcastError(f"no server URL in {text!r}")
    return servers
