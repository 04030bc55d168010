"""Group commit for SQLite: a reply that follows a write leaves only once the write is on disk, and the event
loop never waits for the disk.

SQLite runs in WAL mode with `synchronous=NORMAL`: a commit appends its frames to the `-wal` file without an
fsync, so the transaction itself takes microseconds and survives a crash of the process at once. To survive a
crash of the machine too, the reply to every request that committed is held back until the `-wal` file has
been fsynced after that commit (what `synchronous=FULL` does per commit). One fsync, run in a thread, covers
every commit made before it started, so under load many replies share one fsync while heartbeats that wrote
nothing are answered without waiting.

Checkpoints (copying the WAL back into the database file, and syncing that) would otherwise run inside
whichever commit crosses SQLite's threshold, holding the event loop for tens of milliseconds: the service's
connections have automatic checkpoints off, and the flusher thread runs a PASSIVE checkpoint (which never
blocks a writer) after an fsync, at most every `CHECKPOINT_EVERY_S`.

Requests are tracked with a context variable that the engine's `commit` event sets (ORM sessions and Core
connections alike); the ASGI
middleware holds back `http.response.start` until the fsync that follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, event

CHECKPOINT_EVERY_S = 1.0

_COMMITTED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("committed", default=None)


def _mark_committed(_connection: Connection) -> None:
    holder = _COMMITTED.get()
    if holder is not None:
        holder[0] = True


@contextlib.contextmanager
def tracking_commits() -> Iterator[list[bool]]:
    """Within the block (one request's task), [True] once anything committed."""
    holder = [False]
    token = _COMMITTED.set(holder)
    try:
        yield holder
    finally:
        _COMMITTED.reset(token)


class WalSync:
    def __init__(self, db_path: str | Path, engine: Engine):
        self.db_path = Path(db_path)
        self.wal_path = Path(f"{db_path}-wal")
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpointed = time.monotonic()
        self._waiters: list[asyncio.Future] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        event.listen(engine, "commit", _mark_committed)

    def _fsync(self) -> None:
        fd = os.open(self.wal_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if time.monotonic() - self._checkpointed >= CHECKPOINT_EVERY_S:
            self.checkpoint()

    def checkpoint(self) -> None:
        """A PASSIVE checkpoint on a connection of its own (called in the flusher's thread)."""
        if self._checkpointer is None:
            self._checkpointer = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self._checkpointed = time.monotonic()

    async def _flusher(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._waiters = self._waiters, []
            try:
                await asyncio.to_thread(self._fsync)
            except OSError as exc:  # the replies fail (500) rather than claim a durability they do not have
                for waiter in batch:
                    waiter.set_exception(exc)
            else:
                for waiter in batch:
                    waiter.set_result(None)

    def waiter(self) -> asyncio.Future:
        """A future done once every commit made so far is on disk (its exception: the fsync's OSError)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._flusher())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        return waiter

    async def wait(self) -> None:
        """Return once every commit made so far is on disk."""
        await self.waiter()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._checkpointer is not None:
            self._checkpointer.close()

    def middleware(self, app: Callable) -> Callable:
        """ASGI middleware holding back the reply of a request that committed until its commit is durable."""

        async def durable(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            with tracking_commits() as holder:

                async def send_when_durable(message):
                    if message["type"] == "http.response.start" and holder[0]:
                        await self.wait()
                    await send(message)

                await app(scope, receive, send_when_durable)

        return durable
