"""Group commit for SQLite: a reply that follows a write leaves only once the write is on disk, and the event
loop never waits for the disk.

SQLite runs in WAL mode with `synchronous=NORMAL`: a commit appends its frames to the `-wal` file without an
fsync, so the transaction itself takes microseconds and survives a crash of the process at once. To survive a
crash of the machine too, the reply to every request that committed is held back until the `-wal` file has
been fsynced after that commit (what `synchronous=FULL` does per commit). One fsync, run in a thread of its
own, covers every commit made before it started, so under load many replies share one fsync while heartbeats
that wrote nothing are answered without waiting.

Checkpoints (copying the WAL back into the database file, and syncing that) would otherwise run inside
whichever commit crosses SQLite's threshold, holding the event loop for tens of milliseconds: the service's
connections have automatic checkpoints off, and the flusher thread runs a PASSIVE checkpoint (which never
blocks a writer) after an fsync, at most every `CHECKPOINT_EVERY_S`.

Requests are tracked with a context variable that the engine's `commit` event sets (ORM sessions and Core
connections alike); the ASGI middleware holds back `http.response.start` until the fsync that follows, and the
node routes' lanes (fast_lane.py, server.py) hold back their replies the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, event

CHECKPOINT_EVERY_S = 1.0

log = logging.getLogger("orchestrator")
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


def _release(thens: list[Callable[[BaseException | None], None]], error: BaseException | None) -> None:
    for then in thens:
        try:
            then(error)
        except Exception:  # one reply's failure does not hold back the others
            log.exception("releasing a reply after the WAL fsync failed")


class WalSync:
    """Group commit: `when_durable` / `waiter` / `wait` once every commit made so far is on disk. A thread of its
    own fsyncs the WAL as soon as anyone waits, every waiter registered before that fsync started is released by
    it, and it hands them back to their event loop in one call. The loop spends one hop on a durable reply (a
    task, a thread-pool future and the waiters' futures had cost it three or four, each behind every request
    ready at that moment)."""

    def __init__(self, db_path: str | Path, engine: Engine):
        self.db_path = Path(db_path)
        self.wal_path = Path(f"{db_path}-wal")
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpointed = time.monotonic()
        self._cond = threading.Condition()
        self._waiting: list[tuple[asyncio.AbstractEventLoop, Callable[[BaseException | None], None]]] = []
        self._thread: threading.Thread | None = None
        self._closing = False
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

    def _flusher(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:  # closing, nobody left waiting
                    return
                batch, self._waiting = self._waiting, []
            error: BaseException | None = None
            try:
                self._fsync()
            except Exception as exc:  # the replies fail (500) rather than claim a durability they do not have
                error = exc
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for loop, then in batch:
                by_loop.setdefault(loop, []).append(then)
            for loop, thens in by_loop.items():
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody awaits its replies
                    loop.call_soon_threadsafe(_release, thens, error)

    def when_durable(self, then: Callable[[BaseException | None], None]) -> None:
        """Call `then(None)` in this event loop once every commit made so far is on disk; `then(error)` if the
        fsync failed."""
        loop = asyncio.get_running_loop()
        with self._cond:
            self._waiting.append((loop, then))
            if self._thread is None or not self._thread.is_alive():
                self._closing = False
                self._thread = threading.Thread(target=self._flusher, name="wal-fsync", daemon=True)
                self._thread.start()
            self._cond.notify()

    def waiter(self) -> asyncio.Future:
        """A future done once every commit made so far is on disk (its exception: the fsync's error)."""
        future = asyncio.get_running_loop().create_future()

        def settle(error: BaseException | None) -> None:
            if not future.done():
                future.set_result(None) if error is None else future.set_exception(error)

        self.when_durable(settle)
        return future

    async def wait(self) -> None:
        """Return once every commit made so far is on disk."""
        await self.waiter()

    async def close(self) -> None:
        """Release every waiter still registered, stop the thread and close the checkpoint's connection."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join, 10)
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

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
