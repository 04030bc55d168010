"""The clients of the orchestrator's API that workers, validators and the learner use: `OrchestratorClient`
(blocking, httpx) and `AsyncOrchestratorClient` (aiohttp), both built on one table of routes (`_Routes`), with
signed node requests (`bridge.protocol.signing`) and retries with jittered exponential backoff (`RetryPolicy`).

A node's client opens a session (`POST /v1/nodes/session`) before its first heartbeat and authenticates its
heartbeats with the session key from then on (X-Session, X-Mac), renewing it after three quarters of its
lifetime; everything else it signs. A heartbeat whose session the service no longer knows (it restarted, or the
session expired) is answered 401 and sent again at once, signed; the next one opens a new session (after
`SESSION_RETRY_S` if that session never worked). Where the service offers no sessions (an older one, or
orchestrator.session_ttl_s = 0), the client signs every request and asks again every `SESSION_RETRY_S`.
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

import nacl.exceptions
import nacl.public
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
    SessionRequest,
    SessionResponse,
    Verdict,
)
from bridge.protocol.signing import public_key_hex, session_headers, sign_request

SESSION_RETRY_S = 300.0  # after a refused or failed session opening, sign for this long before asking again


class OrchestratorError(Exception):
    """The service refused a request (`status` >= 400), or could not be reached after every retry (status 0)."""

    def __init__(self, status: int, detail: Any, method: str, target: str):
        self.status, self.detail, self.method, self.target = status, detail, method, target
        where = f"{method} {target}"
        super().__init__(f"{where}: HTTP {status}: {detail}" if status else f"{where}: {detail}")


class _SessionRefused(OrchestratorError):
    """401 to a request authenticated with the session key: the client drops the session and signs it again."""


@dataclass(frozen=True)
class _NodeSession:
    session: str
    secret: bytes
    expires_at: float
    routes: frozenset[str]


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
    session_ok: bool = False  # worth opening a session for (the service names the routes that take one)


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
        return self._call(_Call("POST", "/v1/nodes/heartbeat", HeartbeatResponse, body, auth="node", session_ok=True))

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
        consumed: Iterable[str] = (),
    ) -> PolicyInfo:
        body = PolicyAnnouncement(
            version=version,
            learner_step=learner_step,
            relays=relays,
            manifest_sha256=manifest_sha256,
            consumed=list(consumed),
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
        self._node_session: _NodeSession | None = None
        self._session_due_at = 0.0  # when to open (or renew) a session, on this client's clock
        self._session_worked = False  # a request authenticated with the current session was answered

    @property
    def session_id(self) -> str | None:
        """The id of the session the client's heartbeats are authenticated with, if one is open."""
        return self._node_session.session if self._node_session is not None else None

    def _wants_session(self, call: _Call) -> bool:
        return call.session_ok and self.key is not None and self.clock() >= self._session_due_at

    def _session_call(self) -> tuple[_Call, nacl.public.PrivateKey]:
        box = nacl.public.PrivateKey.generate()
        body = SessionRequest(box_key=bytes(box.public_key).hex())
        return _Call("POST", "/v1/nodes/session", SessionResponse, body, auth="node"), box

    def _session_opened(self, box: nacl.public.PrivateKey, reply: SessionResponse | None) -> None:
        """Keep the session of `reply` (None: the opening failed; sign until SESSION_RETRY_S from now)."""
        now = self.clock()
        try:
            secret = nacl.public.SealedBox(box).decrypt(bytes.fromhex(reply.sealed_key)) if reply else None
        except (ValueError, nacl.exceptions.CryptoError):
            secret = None
        if secret is None:
            self._session_due_at = now + SESSION_RETRY_S
            return
        self._node_session = _NodeSession(reply.session, secret, reply.expires_at, frozenset(reply.routes))
        self._session_worked = False
        self._session_due_at = now + 0.75 * max(0.0, reply.expires_at - now)

    def _encode(self, call: _Call) -> tuple[str, bytes, dict[str, str], bool]:
        """(request target, body, headers, whether the session key authenticates it): signed or with the session
        key (node), or with the bearer token (admin, when one is set). The target is sent exactly as signed."""
        target = call.path + (f"?{urllib.parse.urlencode(call.params)}" if call.params else "")
        content = call.body.model_dump_json().encode() if call.body is not None else b""
        headers = {"Content-Type": "application/json"} if call.body is not None else {}
        if call.auth == "admin" and self.admin_token:
            headers["Authorization"] = f"Bearer {self.admin_token}"
        by_session = False
        if call.auth == "node":
            if self.key is None:
                raise ValueError(f"{call.method} {call.path} is signed by a node: give the client a key")
            now, session = self.clock(), self._node_session
            by_session = session is not None and call.path in session.routes and now < session.expires_at
            if by_session:
                headers.update(
                    session_headers(
                        self.node_key, session.session, session.secret, call.method, target, content, int(now * 1000)
                    )
                )
            else:
                headers.update(sign_request(self.key, call.method, target, content, timestamp_ms=int(now * 1000)))
        return target, content, headers, by_session

    def _outcome(
        self, call: _Call, status: int, headers: Mapping[str, str], body: bytes, by_session: bool = False
    ) -> tuple[bool, Any]:
        """(True, the parsed reply), or (False, Retry-After seconds or None) for a retryable status; raises
        OrchestratorError for any other error status (_SessionRefused, after dropping the session, for a 401 to
        a request the session key authenticated)."""
        if by_session and status == 401:  # a session that worked before is renewed at once (a restart forgot it)
            self._node_session = None
            self._session_due_at = 0.0 if self._session_worked else self.clock() + SESSION_RETRY_S
            raise _SessionRefused(status, "session refused", call.method, call.path)
        if by_session and status < 400:
            self._session_worked = True
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
        if self._wants_session(call):
            opening, box = self._session_call()
            try:
                self._session_opened(box, self._attempts(opening))
            except OrchestratorError:
                self._session_opened(box, None)
        try:
            return self._attempts(call)
        except _SessionRefused:
            return self._attempts(call)  # signed this time

    def _attempts(self, call: _Call) -> Any:
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers, by_session = self._encode(call)
            try:
                response = self._http.request(call.method, self.base_url + target, content=content, headers=headers)
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, response.status_code, response.headers, response.content, by_session)
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
        if self._wants_session(call):
            opening, box = self._session_call()
            try:
                self._session_opened(box, await self._attempts(opening))
            except OrchestratorError:
                self._session_opened(box, None)
        try:
            return await self._attempts(call)
        except _SessionRefused:
            return await self._attempts(call)  # signed this time

    async def _attempts(self, call: _Call) -> Any:
        import aiohttp
        import yarl

        if self._session is None:
            self._session = aiohttp.ClientSession()
        last = ""
        for attempt in range(self.retry.attempts):
            retry_after = None
            target, content, headers, by_session = self._encode(call)
            url = yarl.URL(self.base_url + target, encoded=True)  # sent exactly as signed
            try:
                async with self._session.request(
                    call.method, url, data=content, headers=headers, timeout=self._timeout
                ) as response:
                    status, reply_headers, body = response.status, response.headers, await response.read()
            except self._network_errors as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                done, value = self._outcome(call, status, reply_headers, body, by_session)
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
