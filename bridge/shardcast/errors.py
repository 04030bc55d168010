"""Every error SHARDCAST raises; each message says what was wrong and where (which server, file or field)."""

from __future__ import annotations


class ShardcastError(Exception):
    """Base of every SHARDCAST error."""


class ManifestError(ShardcastError):
    """A manifest that is malformed, inconsistent, or does not describe the directory it sits in."""


class TransferError(ShardcastError):
    """A server could not be reached, answered wrongly, stalled or broke off; the message names it."""

    def __init__(self, server, message: str, status: int | None = None):
        super().__init__(f"{server}: {message}")
        self.server = server
        self.status = status


class NotFound(TransferError):
    """The server does not hold what was asked for (404): not a fault of the server."""


class FetchError(ShardcastError):
    """A version could not be fetched or landed; the message names the version and the servers' last errors."""


class WaitTimeout(ShardcastError):
    """No server offered the awaited version in time; the message lists every server's last error."""
