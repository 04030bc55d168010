"""The clients of the orchestrator's API that workers, validators and the learner use: `OrchestratorClient`
(blocking, httpx) and `AsyncOrchestratorClient` (aiohttp), both built on one table of routes (`_Routes`), with
signed node requests (`bridge.protocol.signing`) and retries with jittered exponential backoff (`RetryPolicy`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel, ValidationError

from bridge.protocol.messages import (
    BanRequest,
    BatchAnnouncement,
    BatchList,
    BatchRecord,
    BatchStatus,
    ClaimRequest,
    ClaimResponse,
    HardwareReport,
    Health,
    HeartbeatRequest,
    HeartbeatResponse,
    Ledger,
    NodeInfo,
    NodeList,
    PolicyAnnouncement,
    PolicyInfo,
    PublicBatchList,
    RegisterRequest,
    RegisterResponse,
    Role,
    Verdict,
)
from bridge.protocol.signing import public_key_hex, sign_request


class OrchestratorError(Exception):
    """The service refused a request (`status` >= 400), or could not be reached after every retry (status 0)."""

    def __init__(self, status: int, detail: Any, method: str, target: str):
        self.status, self.detail, self.method, self.target = status, detail, method, target
        where = f"{method} {target}"
        super().__init__(f"{where}: HTTP {status}: {detail}" if status else f"{where}: {detail}")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of connection errors, time-outs, 5xx and 429: exponential backoff with full jitter.

    Delay before retry i (from 0) is uniform in [0, min(max_delay_s, base_delay_s * 2**i)]; a 429's
    Retry-After is honoured when it is longer (capped at max_delay_s). Every retry is signed afresh.
    """

    attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0

    def delay(self, retry: int, rng: random.Random, retry_after: float | None = None) -> float:
        jittered = rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2**retry))
        return min(self.max_delay_s, max(jittered, retry_after or 0.0))


_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
T = TypeVar("T", bound=BaseModel)


@dataclass(frozen=True)
class _Call:
    method: str
    path: str
    reply: type[BaseModel] | None  # None: the raw text
    body: BaseModel | None = None
    params: Mapping[str, Any] | None = None
    auth: Literal["node", "admin", "none"] = "none"


class _Routes:
    """Every route once. The subclass's `_call` (blocking or async) does the HTTP, so each method returns the
    reply model, or an awaitable of it in the async client."""

    _call: Callable[[_Call], Any]

    def health(self) -> Health:
        return self._call(_Call("GET", "/healthz", Health))

    def policy(self) -> PolicyInfo:
        return self._call(_Call("GET", "/v1/policy", PolicyInfo))

    def register(self, role: Role, hardware: HardwareReport, challenge_answer: str | None = None) -> RegisterResponse:
        body = RegisterRequest(role=role, hardware=hardware, challenge_answer=challenge_answer)
        return self._call(_Call("POST", "/v1/nodes/register", RegisterResponse, body, auth="node"))

    def heartbeat(
        self, loaded_versions: Iterable[int] = (), metrics: Mapping[str, float] | None = None
    ) -> HeartbeatResponse:
        body = HeartbeatRequest(loaded_versions=list(loaded_versions), metrics=dict(metrics or {}))
        return self._call(_Call("POST", "/v1/nodes/heartbeat", HeartbeatResponse, body, auth="node"))

    def deregister(self) -> NodeInfo:
        """Sign off: the node is marked dead and its open assignments go back to the queue."""
        return self._call(_Call("POST", "/v1/nodes/deregister", NodeInfo, auth="node"))

    def announce_batch(self, announcement: BatchAnnouncement) -> BatchRecord:
        return self._call(_Call("POST", "/v1/batches", BatchRecord, announcement, auth="node"))

    def claim(self, lease_s: float | None = None) -> ClaimResponse:
        return self._call(
            _Call("POST", "/v1/validation/claim", ClaimResponse, ClaimRequest(lease_s=lease_s), auth="node")
        )

    def verdict(self, batch_id: str, verdict: Verdict) -> BatchRecord:
        return self._call(_Call("POST", f"/v1/batches/{batch_id}/verdict", BatchRecord, verdict, auth="node"))

    def batches(
        self,
        status: BatchStatus = "accepted",
        min_version: int | None = None,
        after: int | None = None,
        limit: int | None = None,
    ) -> BatchList | PublicBatchList:
        """Batches by status. Called with the admin token (the learner), accepted batches returned are counted
        as delivered to the learner, which frees room in the async window for new assignments; without it, only
        the public fields (PublicBatchList)."""
        params = {"status": status, "min_version": min_version, "after": after, "limit": limit}
        reply = BatchList if getattr(self, "admin_token", None) else PublicBatchList
        return self._call(
            _Call("GET", "/v1/batches", reply, params={k: v for k, v in params.items() if v is not None}, auth="admin")
        )

    def announce_policy(
        self,
        version: int,
        learner_step: int | None = None,
        relays: list[str] | None = None,
        manifest_sha256: str | None = None,
    ) -> PolicyInfo:
        body = PolicyAnnouncement(
            version=version, learner_step=learner_step, relays=relays, manifest_sha256=manifest_sha256
        )
        return self._call(_Call("POST", "/v1/policy", PolicyInfo, body, auth="admin"))

    def nodes(self, after: str | None = None, limit: int | None = None) -> NodeList:
        """A page of nodes in key order (the service's default page without `limit`); see `next_after`."""
        params = {k: v for k, v in {"after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/nodes", NodeList, params=params, auth="admin"))

    def ban(self, node_key: str, reason: str = "banned by an operator") -> NodeInfo:
        return self._call(_Call("POST", f"/v1/nodes/{node_key}/ban", NodeInfo, BanRequest(reason=reason), auth="admin"))

    def ledger(self, after: str | None = None, limit: int | None = None) -> Ledger:
        """A page of the ledger in node-key order (the service's default page without `limit`); see
        `next_after`."""
        params = {k: v for k, v in {"after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/ledger", Ledger, params=params))

    def ledger_csv(self, after: str | None = None, limit: int | None = None) -> str:
        """A page of the ledger as CSV; the X-Next-After reply header names the next page's `after`."""
        params = {k: v for k, v in {"format": "csv", "after": after, "limit": limit}.items() if v is not None}
        return self._call(_Call("GET", "/v1/ledger", None, params=params))


class _Base(_Routes):
    def __init__(
        self,
        base_url: str,
        key: Ed25519PrivateKey | None,
        admin_token: str | None,
        retry: RetryPolicy,
        seed: int | None,
        clock: Callable[[], float],
    ):
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self.key = key
        self.node_key = public_key_hex(key) if key is not None else None
        self.admin_token = admin_token
        self.retry = retry
        self._rng = random.Random(seed)

    def _encode(self, call: _Call) -> tuple[str, bytes, dict[str, str]]:
        """(request target, body, headers): signed (node) or with the bearer token (admin, when one is set).
        The target is sent exactly as signed."""
        target = call.path + (f"?{urllib.parse.urlencode(call.params)}" if call.params else "")
        content = call.body.model_dump_json().encode() if call.body is not None else b""
        headers = {"Content-Type": "application/json"} if call.body is not None else {}
        if call.auth == "admin" and self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        if call.auth == "node":
            if self.key is None:
                raise ValueError(f"{call.method} {call.path} is signed by a node: give the client a key")
            headers.update(sign_request(self.key, call.method, target, content, timestamp_ms=int(self.clock() * 1000)))
        return target, content, headers

    def _outcome(self, call: _Call, status: int, headers: Mapping[str, str], body: bytes) -> tuple[bool, Any]:
        """(True, the parsed reply), or (False, Retry-After seconds or None) for a retryable status; raises
        OrchestratorError for any other error status."""
        if status in _RETRY_STATUS:
            after = headers.get("Retry-After", "")
            return False, float(after) if after.replace(".", "", 1).isdigit() else None
        text = body.decode("utf-8", errors="replace")
        if status >= 400:
            try:
                detail = json.loads(text).get("detail", text)
            except (ValueError, AttributeError):
                detail = text
            raise OrchestratorError(status, detail, call.method, call.path)
        if call.reply is None:
            return True, text
        try:
            return True, call.reply.model_validate_json(body)
        except ValidationError as exc:
            raise OrchestratorError(
                status, f"reply does not match {call.reply.__name__}: {exc}", call.method, call.path
            ) from exc

    def _give_up(self, call: _Call, last: str) -> OrchestratorError:
        return OrchestratorError(
            0,
            f"no answer from {self.base_url} after {self.retry.attempts} attempts (last: {last})",
            call.method,
            call.path,
        )


class OrchestratorClient(_Base):
    """Blocking client (httpx): `OrchestratorClient(url, key=load_or_create_key(path))` for a node,
    `admin_token=` for the learner or an operator. Use as a context manager, or call `close()`.

    `seed` fixes the retry jitter, `clock` (unix seconds) the signature timestamps, `sleep` the waits between
    retries, and `http` an httpx.Client to use instead of a new one (tests).
    """

    def __init__(
        self,
        base_url: str,
        key: Ed25519PrivateKey | None = None,
        admin_token: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
        seed: int | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        http: Any = None,
    ):
        import httpx

        super().__init__(base_url, key, admin_token, retry, seed, clock)
        self._network_errors = (httpx.TransportError,)
        self._owned = http is None
        self._http = httpx.Client(timeout=timeout_s) if http is None else http
        self._sleep = sleep

    def _call(self, call: _Call) -> Any:
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers = self._encode(call)
            try:
                response = self._http.request(call.method, self.base_url + target, content=content, headers=headers)
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, response.status_code, response.headers, response.content)
                if done:
                    return value
                retry_after, last = value, f"HTTP {response.status_code}"
            if attempt + 1 < self.retry.attempts:
                self._sleep(self.retry.delay(attempt, self._rng, retry_after))
        raise self._give_up(call, last)

    def all_batches(
        self, status: BatchStatus = "accepted", min_version: int | None = None, after: int = 0, page: int = 1000
    ) -> tuple[list[BatchRecord], int]:
        """Every batch with `status` judged after the cursor `after`, fetched page by page: (records, the
        cursor for the next call). The learner's listing (with the admin token, which marks them delivered)."""
        records: list[BatchRecord] = []
        while True:
            reply = self.batches(status, min_version=min_version, after=after, limit=page)
            records += reply.batches
            after = reply.next_after
            if len(reply.batches) < page:
                return records, after

    def close(self) -> None:
        if self._owned:
            self._http.close()

    def __enter__(self) -> OrchestratorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncOrchestratorClient(_Base):
    """The same methods as `OrchestratorClient`, awaited (aiohttp, which keeps up with thousands of concurrent
    requests in one process). `session` lets many clients share one aiohttp.ClientSession."""

    def __init__(
        self,
        base_url: str,
        key: Ed25519PrivateKey | None = None,
        admin_token: str | None = None,
        timeout_s: float = 30.0,
        retry: RetryPolicy = RetryPolicy(),
        seed: int | None = None,
        clock: Callable[[], float] = time.time,
        session: Any = None,
    ):
        import aiohttp

        super().__init__(base_url, key, admin_token, retry, seed, clock)
        self._network_errors = (aiohttp.ClientError, asyncio.TimeoutError)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owned = session is None

    async def _call(self, call: _Call) -> Any:
        import aiohttp
        import yarl

        if self._session is None:
            self._session = aiohttp.ClientSession()
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers = self._encode(call)
            url = yarl.URL(self.base_url + target, encoded=True)  # sent exactly as signed
            try:
                async with self._session.request(
                    call.method, url, data=content, headers=headers, timeout=self._timeout
                ) as response:
                    status, reply_headers, body = response.status, response.headers, await response.read()
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, status, reply_headers, body)
                if done:
                    return value
                retry_after, last = value, f"HTTP {status}"
            if attempt + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt, self._rng, retry_after))
        raise self._give_up(call, last)

    async def aclose(self) -> None:
        if self._owned and self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> AsyncOrchestratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
