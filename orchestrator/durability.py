"""Group commit for SQLite: a reply that follows a write leaves only once the write is on disk, and the event
loop never waits for the disk.

SQLite runs in WAL mode with `synchronous=NORMAL`: a commit appends its frames to the `-wal` file without an
fsync, so the transaction itself takes microseconds and survives a crash of the process at once. To survive a
crash of the machine too, the reply to every request that committed is held back until the `-wal` file has
been fsynced after that commit (what `synchronous=FULL` does per commit). One fsync, run in a thread, covers
every commit made before it started, so under load many replies share one fsync while heartbeats that wrote
nothing are answered without waiting.

Requests are tracked with a context variable that the session's `after_commit` event sets; the ASGI
middleware holds back `http.response.start` until the fsync that follows.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker

_COMMITTED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("committed", default=None)


def _mark_committed(_session: Session) -> None:
    holder = _COMMITTED.get()
    if holder is not None:
        holder[0] = True


class WalSync:
    def __init__(self, db_path: str | Path, db: sessionmaker[Session]):
        self.wal_path = Path(f"{db_path}-wal")
        self._waiters: list[asyncio.Future] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        event.listen(db, "after_commit", _mark_committed)

    def _fsync(self) -> None:
        fd = os.open(self.wal_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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

    async def wait(self) -> None:
        """Return once every commit made so far is on disk."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._flusher())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        await waiter

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def middleware(self, app: Callable) -> Callable:
        """ASGI middleware holding back the reply of a request that committed until its commit is durable."""

        async def durable(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            holder = [False]
            token = _COMMITTED.set(holder)

            async def send_when_durable(message):
                if message["type"] == "http.response.start" and holder[0]:
                    await self.wait()
                await send(message)

            try:
                await app(scope, receive, send_when_durable)
            finally:
                _COMMITTED.reset(token)

        return durable
