"""Who may call what: signed node requests (docs/design.md section 8), session keys for heartbeats, the admin bearer
token, and the per-node rate limit on batch announcements.

A signed request is refused with 401 when a header is missing or malformed, the key is weak (a point of small
order or a non-canonical encoding, `bridge.protocol.weak_public_key`), the timestamp is more than
`max_clock_skew_s` off the service's clock, the nonce was seen within that window, or the signature does not
verify; and with 403 when the (authentic) key is unknown or banned, which the caller checks after `verify`.

Session keys (`SessionTable`). An admitted node may open a session with a signed request that carries a fresh
X25519 public key; it gets a random 32-byte key sealed to that public key, which nobody who only watched the
exchange can open. Routes that allow it (the heartbeat alone) then take X-Session and X-Mac (HMAC-SHA256 of the
same signing string under that key) in place of X-Signature, with the same timestamp and nonce checks; every
other route still takes a signature only, so whatever a node commits itself to (a batch, a verdict) stays signed
with its identity key. Sessions live in memory: one per node (a new one ends the old), ended by deregistration,
refused once expired, and all gone after a restart, when the node's MAC is answered 401 and it signs again.

Replays across a restart. Nonces are held in memory while the service runs; a clean stop writes the unexpired
ones to the database (`stop_run`) and the next start reloads them (`start_run`), so a request seen before the
restart is still refused as replayed. After an unclean stop (a crash, kill -9, power loss: `service_runs` has no
stop time) the nonces of the last moments are lost, so every request stamped up to start + max_clock_skew_s
(the newest stamp the old process could have accepted) is answered 503 with Retry-After: a client re-signs
every retry with a fresh stamp, and gets through within max_clock_skew_s.
"""

from __future__ import annotations

import hmac
import math
import re
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import nacl.public
from fastapi import HTTPException, Request
from sqlalchemy import delete, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from bridge.protocol.signing import (
    HEADER_KEY,
    HEADER_MAC,
    HEADER_NONCE,
    HEADER_SESSION,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    session_mac,
    verify_signature,
    weak_public_key,
)
from orchestrator.db import SeenNonce, ServiceRun

_KEY = re.compile(r"[0-9a-f]{64}")
_SIGNATURE = re.compile(r"[0-9a-f]{128}")
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_TIMESTAMP = re.compile(r"[0-9]{1,16}")
_SESSION = re.compile(r"[0-9a-f]{32}")
_MAC = re.compile(r"[0-9a-f]{64}")


def unauthorized(reason: str) -> HTTPException:
    return HTTPException(401, reason, headers={"WWW-Authenticate": "ed25519-signature"})


class NonceCache:
    """Nonces seen within the clock-skew window; each is forgotten once its timestamp could no longer pass.

    Expiry times are added in clock order, so pruning pops from the front of a queue and touches only what
    it forgets (a full scan every sweep cost more than the heartbeats it guards, at 1,000 nodes). If the clock
    steps back, a nonce is forgotten late, never early."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        # Two queues of plain floats and strings rather than one of tuples: neither is an object the garbage
        # collector tracks, and a tuple per request would be (a young collection walks it until it is untracked).
        self._expiries: deque[float] = deque()
        self._nonces: deque[str] = deque()

    def add(self, nonce: str, expires: float) -> bool:
        """False if `nonce` is already held (a replay)."""
        if nonce in self._seen:
            return False
        self._seen.add(nonce)
        self._expiries.append(expires)
        self._nonces.append(nonce)
        return True

    def prune(self, now: float) -> None:
        expiries, nonces = self._expiries, self._nonces
        while expiries and expiries[0] <= now:
            expiries.popleft()
            self._seen.discard(nonces.popleft())

    def __len__(self) -> int:
        return len(self._seen)

    def entries(self) -> list[tuple[float, str]]:
        """(expiry, nonce) of every nonce held, in the order they were added."""
        return list(zip(self._expiries, self._nonces))


@dataclass(frozen=True)
class NodeSession:
    node: str
    secret: bytes
    expires: float


class SessionTable:
    """The open sessions: at most one per node, so the table is never larger than the pool."""

    def __init__(self, ttl_s: float, clock: Callable[[], float]):
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_id: dict[str, NodeSession] = {}
        self._by_node: dict[str, str] = {}

    def open(self, node: str, box_key: str) -> tuple[str, bytes, float]:
        """A new session of `node` (its previous one ends): (id, the key sealed to `box_key`, expiry)."""
        self.end(node)
        secret, session = secrets.token_bytes(32), secrets.token_hex(16)
        sealed = nacl.public.SealedBox(nacl.public.PublicKey(bytes.fromhex(box_key))).encrypt(secret)
        expires = self.clock() + self.ttl_s
        self._by_id[session], self._by_node[node] = NodeSession(node, secret, expires), session
        return session, sealed, expires

    def get(self, session: str, node: str, now: float) -> NodeSession | None:
        """`node`'s session `session` if it is open and unexpired."""
        found = self._by_id.get(session)
        return found if found is not None and found.node == node and now < found.expires else None

    def end(self, node: str) -> None:
        session = self._by_node.pop(node, None)
        if session is not None:
            del self._by_id[session]

    def prune(self, now: float) -> None:
        for node in [s.node for s in self._by_id.values() if s.expires <= now]:
            self.end(node)


def start_run(db: sessionmaker[Session], nonces: NonceCache, now: float, max_skew_s: float) -> tuple[int, float]:
    """Record this start: (its run id, the newest timestamp to refuse). After a clean stop the nonces it saved go
    back into `nonces` (nothing is refused); after an unclean one, stamps up to now + max_skew_s are refused."""
    with db.begin() as s:
        last = s.scalars(select(ServiceRun).order_by(ServiceRun.id.desc()).limit(1)).first()
        refuse_up_to = now + max_skew_s if last is not None and last.stopped_at is None else 0.0
        if not refuse_up_to:
            for nonce, expires in s.execute(
                select(SeenNonce.nonce, SeenNonce.expires).where(SeenNonce.expires > now).order_by(SeenNonce.expires)
            ):
                nonces.add(nonce, expires)
        s.execute(delete(SeenNonce))
        run = ServiceRun(started_at=now)
        s.add(run)
        s.flush()
        return run.id, refuse_up_to


def stop_run(db: sessionmaker[Session], nonces: NonceCache, run_id: int, now: float) -> None:
    """A clean stop: the unexpired nonces and the stop time, in one transaction."""
    rows = [{"nonce": nonce, "expires": expires} for expires, nonce in nonces.entries() if expires > now]
    with db.begin() as s:
        s.execute(delete(SeenNonce))
        if rows:
            s.execute(insert(SeenNonce), rows)
        s.execute(update(ServiceRun).where(ServiceRun.id == run_id).values(stopped_at=now))


def request_target(scope: dict) -> bytes:
    """The path and query of an ASGI request as the client sent them: what a signature covers."""
    target = scope.get("raw_path") or scope["path"].encode()
    return target + b"?" + scope["query_string"] if scope["query_string"] else target


class Authenticator:
    def __init__(self, max_skew_s: float, admin_token: str | None, clock: Callable[[], float], session_ttl_s: float):
        self.max_skew_s = max_skew_s
        self.admin_token = admin_token
        self.clock = clock
        self.nonces = NonceCache()
        self.sessions = SessionTable(session_ttl_s, clock)
        self.refuse_up_to = 0.0  # set by start_run after an unclean stop: older stamps may be replays

    def verify(
        self,
        method: str,
        target: bytes,
        body: bytes,
        key: str | None,
        stamp: str | None,
        nonce: str | None,
        signature: str | None,
        session: str | None = None,
        mac: str | None = None,
        session_ok: bool = False,
        body_sha256: str | None = None,
    ) -> str:
        """The hex key of the node that signed the request `method target` (the path and query as sent, see
        `request_target`) with `body` (the header values given), or authenticated it with its session key where
        the route takes one (`session_ok`); 401 otherwise. `body_sha256`: the digest the request signed in place
        of its body's (an upload: its batch's COMMIT digest, which the ingest checks the body against).

        The ed25519 check (about 0.1 ms of CPU, the largest part of a heartbeat's) runs on the event loop:
        measured at 1,000 nodes, handing it to threads (it releases the GIL) cost more in thread hand-offs and
        GIL convoys than it saved, p50 latency 46 ms against 15 ms inline."""
        by_session = not signature and bool(session or mac)
        if signature and (session or mac):
            raise unauthorized(f"send {HEADER_SIGNATURE}, or {HEADER_SESSION} and {HEADER_MAC}: not both")
        if by_session and not session_ok:
            raise unauthorized(
                f"this route takes an ed25519 signature ({HEADER_SIGNATURE}); "
                "a session key authenticates heartbeats only"
            )
        values = {HEADER_KEY: key, HEADER_TIMESTAMP: stamp, HEADER_NONCE: nonce}
        values.update({HEADER_SESSION: session, HEADER_MAC: mac} if by_session else {HEADER_SIGNATURE: signature})
        missing = [name for name, value in values.items() if not value]
        if missing:
            raise unauthorized(f"missing signature header(s): {', '.join(missing)}")
        for name, pattern, what in (
            (HEADER_KEY, _KEY, "64 lowercase hex characters"),
            (HEADER_TIMESTAMP, _TIMESTAMP, "unix milliseconds"),
            (HEADER_NONCE, _NONCE, "16 to 64 lowercase hex characters"),
            (HEADER_SIGNATURE, _SIGNATURE, "128 lowercase hex characters"),
            (HEADER_SESSION, _SESSION, "32 lowercase hex characters"),
            (HEADER_MAC, _MAC, "64 lowercase hex characters"),
        ):
            if name in values and not pattern.fullmatch(values[name]):
                raise unauthorized(f"malformed {name}: expected {what}")
        weak = weak_public_key(key)
        if weak is not None:
            raise unauthorized(f"{HEADER_KEY} is {weak}: use a key made by ed25519 key generation")
        now = self.clock()
        skew = int(stamp) / 1000 - now
        if abs(skew) > self.max_skew_s:
            raise unauthorized(
                f"{HEADER_TIMESTAMP} is {abs(skew):.1f} s {'ahead of' if skew > 0 else 'behind'} "
                f"the service's clock (at most {self.max_skew_s:g} s allowed): sync the clock"
            )
        if int(stamp) / 1000 <= self.refuse_up_to:
            wait = max(1, math.ceil(self.refuse_up_to - now))
            raise HTTPException(
                503,
                "the service restarted after an unclean stop and cannot tell a replay from a "
                f"request stamped before {self.refuse_up_to:.3f}: sign it again in {wait} s",
                headers={"Retry-After": str(wait)},
            )
        if by_session:
            found = self.sessions.get(session, key, now)
            if found is None:
                raise unauthorized(
                    f"unknown or expired session {HEADER_SESSION} for this {HEADER_KEY}: sign the request, or open "
                    "a new session (POST /v1/nodes/session)"
                )
            expected = session_mac(found.secret, method, target.decode("latin-1"), stamp, nonce, body)
            if not hmac.compare_digest(expected, mac):
                raise unauthorized(
                    f"bad MAC: {HEADER_MAC} is not HMAC-SHA256 under the session key of "
                    "METHOD\\nPATH?QUERY\\nTIMESTAMP\\nNONCE\\nsha256hex(body)"
                )
        elif not verify_signature(key, signature, method, target.decode("latin-1"), stamp, nonce, body, body_sha256):
            raise unauthorized(
                f"bad signature: {HEADER_SIGNATURE} does not verify for {HEADER_KEY} over "
                "METHOD\\nPATH?QUERY\\nTIMESTAMP\\nNONCE\\nsha256hex(body)"
            )
        if not self.nonces.add(nonce, now + 2 * self.max_skew_s):
            raise unauthorized(f"replayed request: {HEADER_NONCE} {nonce} was already used")
        return key

    def is_admin(self, request: Request) -> bool:
        """True for a valid bearer token, False without an Authorization header; 401/403 for a wrong one."""
        header = request.headers.get("Authorization")
        if header is None:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPException(
                401, "Authorization must be 'Bearer <admin token>'", headers={"WWW-Authenticate": "Bearer"}
            )
        if self.admin_token is None:
            raise HTTPException(403, "admin routes are disabled: set orchestrator.admin_token")
        if not hmac.compare_digest(token.encode(), self.admin_token.encode()):
            raise HTTPException(403, "wrong admin token")
        return True

    def require_admin(self, request: Request) -> None:
        if not self.is_admin(request):
            raise HTTPException(
                401, "admin route: send 'Authorization: Bearer <admin token>'", headers={"WWW-Authenticate": "Bearer"}
            )


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per node (or client address): `rate_per_min` on average, `burst` at once."""

    def __init__(self, rate_per_min: float, burst: int, clock: Callable[[], float], what: str = "batch announcements"):
        self.rate = rate_per_min / 60.0
        self.burst = burst
        self.clock = clock
        self.what = what
        self._buckets: dict[str, _Bucket] = {}

    def prune(self) -> None:
        """Forget buckets that have refilled (they would start full anyway): the table holds active keys only."""
        now = self.clock()
        full_after = self.burst / self.rate
        for key in [k for k, b in self._buckets.items() if now - b.updated >= full_after]:
            del self._buckets[key]

    def take(self, key: str) -> None:
        """Spend one token of `key`'s bucket; raises 429 with Retry-After when it is empty."""
        now = self.clock()
        bucket = self._buckets.setdefault(key, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
        bucket.updated = now
        if bucket.tokens < 1:
            wait = (1 - bucket.tokens) / self.rate
            raise HTTPException(
                429,
                f"rate limit: at most {self.rate * 60:g} {self.what} per minute "
                f"(burst {self.burst}); retry in {wait:.1f} s",
                headers={"Retry-After": str(math.ceil(wait))},
            )
        bucket.tokens -= 1
