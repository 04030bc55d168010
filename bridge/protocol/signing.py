"""Node keys and request signatures (docs/design.md section 8).

A node's identity is its ed25519 public key (32 bytes, lowercase hex). Every node request carries

    X-Node-Key   hex public key          X-Timestamp  unix milliseconds
    X-Nonce      random hex (16-64)      X-Signature  hex signature of the signing string

where the signing string is `METHOD\\nTARGET\\nTIMESTAMP\\nNONCE\\nsha256hex(body)`: TARGET is the request target
exactly as sent on the wire, the path followed by `?QUERY` when there is a query string (no `?` without one),
and the body hash is taken over the raw body bytes (empty body: the hash of b""). The server accepts a
timestamp at most orchestrator.max_clock_skew_s (30 s) off its clock and each nonce once. Operators and the
learner use `Authorization: Bearer <token>` instead.

Heartbeats, nine requests in ten, may instead be authenticated with a session key: a node sends
`POST /v1/nodes/session` (signed) with a fresh X25519 public key, the service answers with a random 32-byte key
sealed to it (libsodium's sealed box), and the node's heartbeats then carry

    X-Session    the session id            X-Mac        hex HMAC-SHA256(session key, signing string)

in place of X-Signature (`session_mac`), with the same X-Node-Key, X-Timestamp and X-Nonce rules. Checking a MAC
costs the service about a twentieth of an ed25519 verification.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

import nacl.bindings
import nacl.exceptions
import nacl.signing
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE = "X-Node-Key", "X-Timestamp", "X-Nonce", "X-Signature"
HEADER_SESSION, HEADER_MAC = "X-Session", "X-Mac"
# every header a node request may authenticate with, in the order the service's check takes their values
AUTH_HEADERS = (HEADER_KEY, HEADER_TIMESTAMP, HEADER_NONCE, HEADER_SIGNATURE, HEADER_SESSION, HEADER_MAC)


def load_or_create_key(path: str | Path) -> Ed25519PrivateKey:
    """The node's private key from a PEM file; a new key is written there (mode 0600) if the file is missing."""
    path = Path(path)
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an ed25519 private key ({type(key).__name__})")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def public_key_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def signing_string(
    method: str, target: str, timestamp_ms: int | str, nonce: str, body: bytes, body_sha256: str | None = None
) -> bytes:
    """`METHOD\\nTARGET\\nTIMESTAMP\\nNONCE\\nsha256hex(body)`; TARGET is path[?query] as sent on the wire.

    `body_sha256` (64 lowercase hex) stands for the last line instead of hashing `body`: a streamed upload signs
    the digest its header announces, and the receiver checks the body against it as the body arrives
    (docs/design.md section 8, uploads)."""
    digest = hashlib.sha256(body).hexdigest() if body_sha256 is None else body_sha256
    return f"{method.upper()}\n{target}\n{timestamp_ms}\n{nonce}\n{digest}".encode()


def sign_request(
    key: Ed25519PrivateKey,
    method: str,
    target: str,
    body: bytes,
    timestamp_ms: int | None = None,
    nonce: str | None = None,
    body_sha256: str | None = None,
) -> dict[str, str]:
    """The four signature headers for one request (`body_sha256`: sign that digest in place of the body's, see
    `signing_string`)."""
    timestamp_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce = secrets.token_hex(16) if nonce is None else nonce
    signature = key.sign(signing_string(method, target, timestamp_ms, nonce, body, body_sha256))
    return {
        HEADER_KEY: public_key_hex(key),
        HEADER_TIMESTAMP: str(timestamp_ms),
        HEADER_NONCE: nonce,
        HEADER_SIGNATURE: signature.hex(),
    }


def session_mac(secret: bytes, method: str, target: str, timestamp_ms: int | str, nonce: str, body: bytes) -> str:
    """Hex HMAC-SHA256 of the signing string under a session key: what X-Mac carries."""
    return hmac.digest(secret, signing_string(method, target, timestamp_ms, nonce, body), "sha256").hex()


def session_headers(
    node_key: str, session: str, secret: bytes, method: str, target: str, body: bytes, timestamp_ms: int | None = None
) -> dict[str, str]:
    """The headers of one request authenticated with a session key instead of a signature."""
    timestamp_ms = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
    nonce = secrets.token_hex(16)
    return {
        HEADER_KEY: node_key,
        HEADER_TIMESTAMP: str(timestamp_ms),
        HEADER_NONCE: nonce,
        HEADER_SESSION: session,
        HEADER_MAC: session_mac(secret, method, target, timestamp_ms, nonce, body),
    }


_P25519 = 2**255 - 19
_Y8 = 0x7A03AC9277FDC74EC6CC392CFA53202A0F67100D760B3CBA4FD84D3D706A17C7
# y of the curve's 8 points of small order (x follows from y up to its sign). With one of them as the public key,
# a fixed signature verifies for many messages: RFC 8032 verification (OpenSSL's) does not exclude them.
_SMALL_ORDER_Y = frozenset({0, 1, _P25519 - 1, _Y8, _P25519 - _Y8})


@functools.lru_cache(maxsize=16384)
def weak_public_key(node_key: str) -> str | None:
    """Why the hex ed25519 public key `node_key` is refused as an identity, or None: a non-canonical encoding
    (y >= 2**255 - 19) or a point of small order (the identity `01 00...00` among them)."""
    raw = bytes.fromhex(node_key)
    if len(raw) != 32:
        return "not 32 bytes"
    y = int.from_bytes(raw, "little") & ((1 << 255) - 1)
    if y >= _P25519:
        return "a non-canonical encoding (y >= 2**255 - 19)"
    if y in _SMALL_ORDER_Y:  # x = 0 with the sign bit set (non-canonical) only occurs with y = 1 or -1
        return "a point of small order, for which signatures prove nothing"
    return None


def weak_box_key(box_key: str) -> str | None:
    """Why the hex X25519 public key `box_key` is refused, or None: a non-canonical encoding (u >= 2**255 - 19, or
    the top bit set) or a point of small order, for which a sealed box could be opened by anyone (libsodium
    refuses the exchange: its shared secret would be all zeros)."""
    raw = bytes.fromhex(box_key)
    if len(raw) != 32:
        return "not 32 bytes"
    if int.from_bytes(raw, "little") >= _P25519:
        return "a non-canonical encoding (u >= 2**255 - 19)"
    try:
        nacl.bindings.crypto_scalarmult(secrets.token_bytes(32), raw)
    except (RuntimeError, nacl.exceptions.CryptoError):
        return "a point of small order"
    return None


@functools.lru_cache(maxsize=16384)
def _public_key(node_key: str) -> nacl.signing.VerifyKey:
    if weak_public_key(node_key) is not None:
        raise ValueError(f"weak ed25519 public key {node_key[:16]}...")
    return nacl.signing.VerifyKey(bytes.fromhex(node_key))


def verify_signature(
    node_key: str,
    signature_hex: str,
    method: str,
    target: str,
    timestamp_ms: str,
    nonce: str,
    body: bytes,
    body_sha256: str | None = None,
) -> bool:
    """True if `signature_hex` is `node_key`'s signature of the request; False for any malformed input and for a
    weak key (`weak_public_key`). Verified by libsodium (PyNaCl): about half the CPU of OpenSSL's ed25519 per
    request, which is what the orchestrator spends most on; it also refuses small-order keys and signature
    points, and non-canonical signatures, which an honest signer never makes. `body_sha256`: the digest signed in
    place of the body's (`signing_string`)."""
    try:
        signature = bytes.fromhex(signature_hex)
        if len(signature) != 64:
            return False
        _public_key(node_key).verify(signing_string(method, target, timestamp_ms, nonce, body, body_sha256), signature)
    except (ValueError, TypeError, nacl.exceptions.CryptoError):
        return False
    return True
