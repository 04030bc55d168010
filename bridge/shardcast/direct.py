"""Direct I/O for a client's downloads: bytes go socket -> reusable buffer -> disk, never through the page cache.

A client that lands a version to use it (a worker) has no reason to keep a second copy of every byte in the
page cache, and paying for one is not free: each page of a new file is a fresh allocation (on some virtual
machines, a host page fault per page, which costs as much as the transfer itself), and the dirty pages must
then be flushed before STABLE. Here each part of a file is received into a buffer from a small pool that is
allocated and touched once per client, hashed from that buffer (still in the CPU cache), and written with
`O_DIRECT` straight to the file's reserved blocks; the fsync before STABLE has only metadata left.

A relay does not use this: it serves what it fetched with sendfile, from the page cache.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

log = logging.getLogger("shardcast.direct")

ALIGN = 4096  # offsets and lengths of O_DIRECT writes are multiples of this (any logical block size up to 4 KiB)
HAVE_DIRECT = hasattr(os, "O_DIRECT")


class BufferPool:
    """`count` page-aligned buffers of `size` bytes. One download at a time may claim the pool (a second
    concurrent download of the same client lands its bytes through the page cache instead), so a download's
    parts can always get a buffer in the order they were taken (see `Download`)."""

    def __init__(self, count: int, size: int):
        if size % ALIGN or size <= 0 or count < 2:
            raise ValueError(f"buffer pool: {count} buffers of {size} bytes (need >= 2, a multiple of {ALIGN})")
        self.size = size
        self._buffers = [mmap.mmap(-1, size) for _ in range(count)]
        self._free = list(self._buffers)
        self._claim = threading.Lock()
        self._retired = False
        # the first touch of each page is paid now, in the background, not during the first transfer; it
        # writes into the buffers, so no download may have them before it is over (`claim` waits for it)
        self._touched = threading.Event()
        threading.Thread(target=self._touch, name="shardcast-buffers", daemon=True).start()

    def _touch(self) -> None:
        try:
            for buf in self._buffers:
                for off in range(0, self.size, mmap.PAGESIZE):
                    buf[off] = 0
        finally:
            self._touched.set()

    def claim(self) -> bool:
        """Take the pool for one download (once its pages are touched); False when another download holds it
        or it was retired."""
        if not self._claim.acquire(blocking=False):
            return False
        if self._retired:
            self._claim.release()
            return False
        self._touched.wait()
        return True

    def retire(self) -> None:
        """Never lend these buffers again (a thread of an interrupted download may still write into one)."""
        self._retired = True

    def unclaim(self) -> None:
        self._claim.release()

    def available(self) -> int:
        return len(self._free)

    def take(self) -> mmap.mmap:
        """A free buffer; the caller (holding the download's lock) has checked `available()`."""
        return self._free.pop()

    def give_back(self, buf: mmap.mmap) -> None:
        self._free.append(buf)


def open_direct(path) -> int | None:
    """A write descriptor with O_DIRECT, or None where the platform or filesystem refuses it."""
    if not HAVE_DIRECT:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def write_part(direct_fd: int | None, fd: int, view: memoryview, offset: int) -> bool:
    """Write `view` at `offset`: the 4 KiB-aligned bulk through `direct_fd`, an unaligned tail (the end of a
    file) through the ordinary `fd`. Returns False when the filesystem refused O_DIRECT at write time (then
    everything went through `fd`), so the caller can stop trying."""
    bulk = len(view) - len(view) % ALIGN if direct_fd is not None and offset % ALIGN == 0 else 0
    done = 0
    refused = False
    while done < bulk:
        try:
            done += os.pwrite(direct_fd, view[done:bulk], offset + done)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.info("O_DIRECT write refused (%s); writing through the page cache", e)
            refused = True
            break
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return not refused
