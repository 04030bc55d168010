"""What a worker and a validator share as pool members: joining, staying reachable, and leaving cleanly.

- `join`: register with a hardware report; answer the compute challenge when the pool sets one; a refusal is
  fatal (`NodeRefused`, with the pool's reasons).
- `patiently`: call the orchestrator again and again with capped exponential backoff while it is unreachable
  or answers 5xx/429 (it may be restarting); a ban (403) is fatal (`NodeBanned`); a key the orchestrator no
  longer knows (a fresh database) makes the node register again.
- `Stop`: SIGTERM/SIGINT set a flag the loops poll, so the batch in hand is finished (or given up) before the
  node deregisters; a second signal exits at once.
- `touch`: the health file a container's HEALTHCHECK reads (its mtime is the last good heartbeat).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bridge.protocol.challenge import solve_challenge
from bridge.protocol.clients import OrchestratorClient, OrchestratorError
from bridge.protocol.messages import GpuInfo, HardwareReport, RegisterResponse
from bridge.protocol.signing import load_or_create_key, public_key_hex

log = logging.getLogger(__name__)
T = TypeVar("T")


class NodeRefused(RuntimeError):
    """The pool refused to admit this node."""


class NodeBanned(RuntimeError):
    """The pool banned this node."""


class Stop:
    """A stop flag raised by SIGTERM or SIGINT (a second signal raises KeyboardInterrupt)."""

    def __init__(self, install: bool = True):
        self.event = threading.Event()
        if install and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        log.info(
            "%s: finishing the work in hand, then leaving the pool (signal again to exit now)",
            signal.Signals(signum).name,
        )
        self.event.set()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`; True if a stop was requested meanwhile."""
        return self.event.wait(max(0.0, seconds))


def hardware_report() -> HardwareReport:
    """This machine's GPUs (through torch, when CUDA is there), CPUs and memory."""
    import torch

    report = HardwareReport.this_machine_cpu_only()
    if torch.cuda.is_available():
        gpus = [
            GpuInfo(
                name=torch.cuda.get_device_name(i)[:64],
                memory_gib=torch.cuda.get_device_properties(i).total_memory / 2**30,
            )
            for i in range(torch.cuda.device_count())
        ]
        report = report.model_copy(update={"gpus": gpus})
    return report


def connect(key_path: Path, orchestrator_url: str) -> tuple[str, OrchestratorClient]:
    """(hex public key, signing client) of the node whose ed25519 key is at `key_path` (created if missing)."""
    key = load_or_create_key(key_path)
    return public_key_hex(key), OrchestratorClient(orchestrator_url, key=key)


def leave(client: OrchestratorClient) -> None:
    """Deregister (two tries at most: leaving is a courtesy, a silent node is marked dead anyway) and close."""
    try:
        client.retry = dataclasses.replace(client.retry, attempts=2)
        client.deregister()
        log.info("deregistered from %s", client.base_url)
    except Exception as err:
        log.warning("could not deregister: %s", err)
    client.close()


def join(client: OrchestratorClient, role: str, hardware: HardwareReport) -> RegisterResponse:
    reply = client.register(role, hardware)
    if reply.status == "challenge" and reply.challenge is not None:
        t0 = time.perf_counter()
        answer = solve_challenge(reply.challenge.seed, reply.challenge.size)
        log.info("compute challenge of size %d solved in %.2f s", reply.challenge.size, time.perf_counter() - t0)
        reply = client.register(role, hardware, challenge_answer=answer)
    if reply.status != "admitted":
        raise NodeRefused(f"{client.base_url} refused this {role}: {'; '.join(reply.reasons) or reply.status}")
    log.info(
        "joined %s as %s %s... (policy version %d)", client.base_url, role, reply.node_key[:16], reply.policy.version
    )
    return reply


def _retryable(err: OrchestratorError) -> bool:
    return err.status == 0 or err.status == 429 or err.status >= 500


def patiently(
    call: Callable[[], T],
    stop: Stop,
    what: str,
    rejoin: Callable[[], object] | None = None,
    transient: tuple[type[BaseException], ...] = (),
    max_delay_s: float = 30.0,
    attempts: int | None = None,
) -> T | None:
    """`call()` until it succeeds; None if a stop was requested first. See the module docstring.

    Besides the orchestrator's retryable answers, exceptions of the `transient` types (a store or a relay
    that is down) are retried too, `attempts` times at most (None: without end), then raised."""
    delay, failures = 1.0, 0
    while True:
        try:
            return call()
        except OrchestratorError as err:
            if err.status == 403 and "banned" in str(err.detail).lower():
                raise NodeBanned(f"{what}: {err}") from err
            if err.status in (401, 403) and "unknown" in str(err.detail).lower() and rejoin is not None:
                log.warning("%s: the orchestrator does not know this node any more; registering again", what)
                rejoin()
                continue
            if not _retryable(err):
                raise
            failures += 1
            log.warning("%s failed (%s); retry %d in %.1f s", what, err, failures, delay)
        except transient as err:
            failures += 1
            if attempts is not None and failures >= attempts:
                raise
            log.warning("%s failed (%s: %s); retry %d in %.1f s", what, type(err).__name__, err, failures, delay)
        if stop.wait(delay * random.uniform(0.8, 1.2)):
            return None
        delay = min(max_delay_s, delay * 2)


def touch(path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
