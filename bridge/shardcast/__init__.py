"""SHARDCAST: policy weights from the learner's origin, through relays, to every worker (docs/design.md section 5).

- `origin` serves the learner's weights directory; `relay` mirrors upstreams and serves what it verified;
  both answer the same HTTP protocol (`server`), so relays chain.
- `ShardcastClient` (`client`) finds, fetches and verifies versions; relays use it for their upstreams.
- `names` and `manifest` validate everything that comes from the network before it becomes a path or a size.
- `delta` writes and applies delta files (a version's file against an older version's), which the manifest
  lists beside the full files; `download` rebuilds files from them where it holds the base.
"""

from bridge.shardcast.client import ShardcastClient
from bridge.shardcast.download import FetchResult
from bridge.shardcast.errors import FetchError, ManifestError, ShardcastError, TransferError, WaitTimeout
from bridge.shardcast.manifest import Manifest, parse_manifest

__all__ = [
    "FetchError",
    "FetchResult",
    "Manifest",
    "ManifestError",
    "ShardcastClient",
    "ShardcastError",
    "TransferError",
    "WaitTimeout",
    "parse_manifest",
]
