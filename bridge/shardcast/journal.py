"""A download's files and parts, restored from the journal of an interrupted fetch (`disk`), and the journal."""

from __future__ import annotations

import logging
import shutil
import threading

from bridge.shardcast import disk
from bridge.shardcast.direct import open_direct
from bridge.shardcast.names import version_dirname
from bridge.shardcast.parts import _File, _Part, _split

log = logging.getLogger("shardcast.download")


class Resume:
    """Mixin of `Download`: `_prepare` (files, parts, journal, rebuilt files, allocation) and `_write_journal`."""

    def _prepare(self) -> None:
        """Files and parts, restored from the journal of an interrupted fetch of the same manifest."""
        journal = disk.read_journal(self.partial, self.manifest, self.entries)
        if journal is None and self.partial.exists():
            shutil.rmtree(self.partial)
        self.partial.mkdir(exist_ok=True)
        # told before the rebuilds, so that a relay serves each delta file it mirrors as soon as it is checked,
        # while it rebuilds the full files from it (`_rebuild_one`)
        self.listener.started(self.manifest, self.partial)
        fresh = []
        part_bytes = min(self.part_bytes, self.buffers.size) if self._direct else self.part_bytes
        rebuilt = self._rebuild(journal) if self.use_deltas and self.manifest.deltas else set()
        for entry in self.entries:
            path = self.partial / entry.name
            saved = journal.get(entry.name) if journal else None
            if entry.parts:  # a file with part hashes is fetched in exactly those parts
                hashed = _split(entry.size, self.manifest.part_size)
                if saved is not None and [p[:2] for p in saved["parts"]] != [[q.start, q.length] for q in hashed]:
                    saved = None
            if entry.name in rebuilt:
                size = self.manifest.part_size if entry.parts else part_bytes
                f = _File(
                    entry,
                    path,
                    [_Part(p.start, p.length, p.length) for p in _split(entry.size, size)],
                    threading.Condition(self._lock),
                )
                f.verified = True
            elif saved is not None and path.is_file() and path.stat().st_size == entry.size:
                parts = [_Part(*p) for p in saved["parts"]]
                if entry.parts and not saved["verified"]:
                    # complete parts are checked against their sha256 again before they count (`_worker`)
                    for p in parts:
                        if self._direct and p.done < p.length:
                            p.done = 0
                elif self._direct and not saved["verified"]:  # whole parts stay; the rest is fetched anew
                    parts = [
                        q
                        for p in parts
                        for q in ([p] if p.done == p.length else _split(p.start + p.length, part_bytes, p.start))
                    ]
                    for p in parts:
                        p.ready = p.done == p.length
                f = _File(entry, path, parts, threading.Condition(self._lock))
                f.verified = saved["verified"]
            else:
                size = self.manifest.part_size if entry.parts else part_bytes
                f = _File(entry, path, _split(entry.size, size), threading.Condition(self._lock))
                fresh.append(f)
            if f.verified and f.part_hashed:
                for p in f.parts:
                    p.verified = p.ready = True
            if entry.name not in rebuilt:
                self._resumed += entry.size if f.verified else sum(p.done for p in f.parts)
            self._files.append(f)
            if f.verified:
                self._landed += 1
            else:
                self._queue.extend((f, p) for p in f.parts if p.done < p.length or f.part_hashed)
        disk.check_space(self.partial, sum(f.entry.size for f in fresh), f"version {self.version}")
        for f in fresh:
            # a new file, not the old one truncated: a relay may still be sending checked parts of the old one
            f.path.unlink(missing_ok=True)
            disk.allocate(f.path, f.entry.size)
        if self._direct:
            for f in self._files:
                # a part is received whole into one buffer, so a part hash's part must fit in one
                fits = not f.part_hashed or self.manifest.part_size <= self.buffers.size
                if not f.verified and fits:
                    f.dfd = open_direct(f.path)
                    f.direct = f.dfd is not None
        if self._resumed:
            log.info("%s: resuming, %.1f MiB already here", version_dirname(self.version), self._resumed / 2**20)

    def _write_journal(self) -> None:
        with self._lock:
            # a direct part still in its buffer may not be in the file yet: it counts as not received
            files = {
                f.entry.name: {
                    "verified": f.verified,
                    "parts": [[p.start, p.length, p.done if p.buf is None else 0] for p in f.parts],
                }
                for f in self._files
            }
        try:
            disk.write_journal(self.partial, self.manifest, files)
        except OSError as e:
            log.warning("cannot record progress in %s: %s", self.partial, e)
