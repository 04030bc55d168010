"""Rollout batches on tensorstore (docs/design.md section 6): the schema, a writer, a validating reader, listing,
pruning. Import everything from here (`from bridge.rollouts import RolloutStore`); the parts live in:

- `bridge.rollouts.schema`: the fields, `meta.json`, the canonical digest, `BatchMeta`, `RolloutStoreError`;
- `bridge.rollouts.batch`: `RolloutBatch` (the flat arrays in memory) and `check_batch` (every invariant);
- `bridge.rollouts.limits`: `ReadLimits`, what a reader holds a batch to before reading its arrays;
- `bridge.rollouts.store`: `RolloutStore`, the writer, reader, listing and retention on a kvstore.
"""

from bridge.rollouts.batch import RolloutBatch, check_batch
from bridge.rollouts.limits import ReadLimits
from bridge.rollouts.schema import (
    _BATCH_ID,
    DIGEST_DOMAIN,
    FIELD_NAMES,
    FIELDS,
    FINISH_LENGTH,
    FINISH_STOP,
    MODEL_DTYPES,
    OPTIONAL_FIELDS,
    PROOF_CHUNK_BYTES,
    PROOF_CHUNK_TOKENS,
    SAMPLED_FIELD,
    SCHEMA_VERSION,
    SCHEMAS,
    BatchMeta,
    BatchRef,
    RolloutStoreError,
    batch_path,
    canonical_sha256,
    expected_lengths,
    meta_json,
    parse_meta,
    schema_fields,
)
from bridge.rollouts.store import CODECS, DEFAULT_MAX_BATCH_BYTES, RolloutStore

__all__ = [
    "CODECS",
    "DEFAULT_MAX_BATCH_BYTES",
    "DIGEST_DOMAIN",
    "FIELDS",
    "FIELD_NAMES",
    "FINISH_LENGTH",
    "FINISH_STOP",
    "MODEL_DTYPES",
    "OPTIONAL_FIELDS",
    "PROOF_CHUNK_BYTES",
    "PROOF_CHUNK_TOKENS",
    "SAMPLED_FIELD",
    "SCHEMAS",
    "SCHEMA_VERSION",
    "_BATCH_ID",
    "BatchMeta",
    "BatchRef",
    "ReadLimits",
    "RolloutBatch",
    "RolloutStore",
    "RolloutStoreError",
    "batch_path",
    "canonical_sha256",
    "check_batch",
    "expected_lengths",
    "meta_json",
    "parse_meta",
    "schema_fields",
]
