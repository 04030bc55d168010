"""Which server to ask next: a random choice weighted by measured bandwidth and success.

Every server has two exponentially weighted moving averages (weight `ALPHA` on the newest sample): the
bandwidth of its transfers in bytes/s, and its success rate (1 per transfer that worked, 0 per failure).
A server is chosen with probability proportional to `bandwidth * max(success, FLOOR)**2`; a server not
measured yet is given the best bandwidth measured so far, so new servers get tried. The floor keeps a
failed server reachable with a small probability, so that it can recover once it works again.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from bridge.shardcast.names import ServerURL

ALPHA = 0.3
FLOOR = 0.05


@dataclass
class ServerStats:
    bandwidth: float | None = None  # bytes/s, EWMA over transfers
    success: float = 1.0  # EWMA of 1 (worked) / 0 (failed)

    def weight(self, unmeasured: float) -> float:
        bandwidth = self.bandwidth if self.bandwidth is not None else unmeasured
        return bandwidth * max(self.success, FLOOR) ** 2


class ServerPool:
    """Thread-safe statistics of a set of servers; a client keeps one for its lifetime."""

    def __init__(self, servers: Iterable[ServerURL], rng: random.Random | None = None):
        self.servers = list(servers)
        self.stats = {s: ServerStats() for s in self.servers}
        self._rng = rng or random.Random()
        self._lock = threading.Lock()

    def choose(self, candidates: Iterable[ServerURL]) -> ServerURL | None:
        candidates = [s for s in candidates if s in self.stats]
        if not candidates:
            return None
        with self._lock:
            measured = [st.bandwidth for st in self.stats.values() if st.bandwidth is not None]
            unmeasured = max(measured, default=1.0)
            weights = [self.stats[s].weight(unmeasured) for s in candidates]
            return self._rng.choices(candidates, weights=weights)[0]

    def record(self, server: ServerURL, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        """One transfer's outcome; its bandwidth counts only when it moved at least 1 MiB."""
        with self._lock:
            st = self.stats[server]
            st.success = (1 - ALPHA) * st.success + ALPHA * (1.0 if ok else 0.0)
            if nbytes >= 1 << 20 and seconds > 0:
                rate = nbytes / seconds
                st.bandwidth = rate if st.bandwidth is None else (1 - ALPHA) * st.bandwidth + ALPHA * rate

    def best_bandwidth(self, candidates: Iterable[ServerURL]) -> float | None:
        """The highest bandwidth measured of `candidates` (bytes/s), None when none is measured."""
        with self._lock:
            measured = [self.stats[s].bandwidth for s in candidates if s in self.stats]
        return max((b for b in measured if b is not None), default=None)

    def distrust(self, server: ServerURL) -> None:
        """The server sent bytes that failed a sha256 check."""
        with self._lock:
            self.stats[server].success = 0.0
