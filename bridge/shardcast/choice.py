"""A download's choice of server for each request, and the refresh of which servers hold the version."""

from __future__ import annotations

import threading
import time

from bridge.shardcast.errors import FetchError
from bridge.shardcast.names import ServerURL
from bridge.shardcast.parts import _File, _Tried

REFRESH_S = 2.0  # how often a long fetch asks which servers hold the version by now


class ServerChoice:
    """Mixin of `Download`: `_choose` a server (with back-off and patience), `_refresh_candidates`."""

    def _choose(self, f: _File, tried: _Tried) -> ServerURL:
        """A server for the next request. When every candidate has failed this part, back off, ask all servers
        again who holds the version (one may have come up or caught up), and start over; give up after
        `patience` seconds without a byte received."""
        if time.monotonic() - self._last_refresh > REFRESH_S:  # servers that caught up since share the load
            self._last_refresh = time.monotonic()
            threading.Thread(target=self._refresh_candidates, name="shardcast-refresh", daemon=True).start()
        while True:
            with self._lock:
                if self._error is not None:
                    raise self._error
                choices = self.candidates - self._distrusted - tried.failed
                stalled = time.monotonic() - self._last_progress
            if choices:
                server = self.pool.choose(sorted(choices, key=str))
                if server is not None:
                    return server
            if self._distrusted >= set(self.pool.servers):
                raise FetchError(
                    f"version {self.version}: every server sent bytes that failed the sha256 check "
                    f"({', '.join(sorted(map(str, self._distrusted)))})"
                )
            if stalled > self.patience:
                with self._lock:
                    errors = "; ".join(
                        self._last_error.get(s, f"{s}: no answer")
                        for s in sorted(set(self._last_error) | self.candidates, key=str)
                    )
                raise FetchError(
                    f"version {self.version}, {f.entry.name}: nothing received for "
                    f"{self.patience:.0f} s; last errors: {errors or 'no server offers it'}"
                )
            time.sleep(tried.backoff)
            tried.backoff = min(2 * tried.backoff, 2.0)
            tried.failed.clear()
            self._refresh_candidates()

    def _refresh_candidates(self) -> None:
        """Add the servers that offer the version now (one asking at a time; the others go on)."""
        if not self._refresh_lock.acquire(blocking=False):
            return
        try:
            found = self.refresh()
        finally:
            self._last_refresh = time.monotonic()
            self._refresh_lock.release()
        with self._lock:
            self.candidates |= found

    def _server_summary(self) -> dict[str, dict]:
        servers = set(self._bytes) | set(self._errors) | self._distrusted
        return {
            str(s): {"bytes": self._bytes[s], "errors": self._errors[s], "distrusted": s in self._distrusted}
            for s in sorted(servers, key=str)
        }
