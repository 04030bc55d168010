"""The orchestrator's API as every role sees it (docs/design.md section 8): `messages` (the request and reply
models), `signing` (node keys and request signatures), `challenge` (the registration compute challenge) and
`clients` (the blocking and async clients that workers, validators and the learner use). The deterministic
assignment of task ids and seeds is `bridge.assignment`.

The service (`orchestrator/`) declares its routes with these same models, so the two sides cannot drift apart.
This package's names are importable from `bridge.protocol` itself.
"""

from bridge.protocol.challenge import challenge_matrices, solve_challenge
from bridge.protocol.clients import AsyncOrchestratorClient, OrchestratorClient, OrchestratorError, RetryPolicy
from bridge.protocol.messages import (BATCH_ID_PATTERN, MAX_INT, PROTOCOL_VERSION, Assignment, BanRequest,
                                      BatchAnnouncement, BatchId, BatchList, BatchRecord, BatchStatus, Challenge,
                                      CheckName, ClaimRequest, ClaimResponse, Count, Finite, GpuInfo, HardwareReport,
                                      Health, HeartbeatRequest, HeartbeatResponse, Hex64, Ledger, LedgerEntry, Name,
                                      NodeInfo, NodeKey, NodeList, NodeState, PolicyAnnouncement, PolicyInfo,
                                      PoolRequirements, PublicBatchList, PublicBatchRecord, RegisterRequest,
                                      RegisterResponse, Reply, Request, Role, Seconds, Text, Url, Verdict, Version)
from bridge.protocol.signing import (HEADER_KEY, HEADER_NONCE, HEADER_SIGNATURE, HEADER_TIMESTAMP,
                                     load_or_create_key, public_key_hex, sign_request, signing_string,
                                     verify_signature, weak_public_key)

__all__ = [
    "BATCH_ID_PATTERN", "HEADER_KEY", "HEADER_NONCE", "HEADER_SIGNATURE", "HEADER_TIMESTAMP", "MAX_INT",
    "PROTOCOL_VERSION", "Assignment", "AsyncOrchestratorClient", "BanRequest", "BatchAnnouncement", "BatchId",
    "BatchList", "BatchRecord", "BatchStatus", "Challenge", "CheckName", "ClaimRequest", "ClaimResponse", "Count",
    "Finite", "GpuInfo", "HardwareReport", "Health", "HeartbeatRequest", "HeartbeatResponse", "Hex64", "Ledger",
    "LedgerEntry", "Name", "NodeInfo", "NodeKey", "NodeList", "NodeState", "OrchestratorClient",
    "OrchestratorError", "PolicyAnnouncement", "PolicyInfo", "PoolRequirements", "PublicBatchList",
    "PublicBatchRecord", "RegisterRequest", "RegisterResponse", "Reply", "Request", "RetryPolicy", "Role", "Seconds",
    "Text", "Url", "Verdict", "Version", "challenge_matrices", "load_or_create_key", "public_key_hex",
    "sign_request", "signing_string", "solve_challenge", "verify_signature", "weak_public_key",
]
