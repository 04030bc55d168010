"""A misbehaving SHARDCAST server for test_shardcast.py: `intellect shardcast origin|relay` whose file responses
carry wrong bytes ("corrupt": one byte in every MiB flipped) or trickle out ("slow:BYTES_PER_S"). Built from
the public server class, its `_send` (the file body of a response) replaced.

    python faulty_shardcast.py FAULT shardcast origin|relay [args ...]
"""

from __future__ import annotations

import asyncio
import os
import sys

from bridge.shardcast.server import ShardcastServer
from intellect.cli import main

BLOCK = 1 << 20


def parse(text: str) -> tuple[str, float]:
    kind, _, rate = text.partition(":")
    if kind == "corrupt" and not rate:
        return kind, 0.0
    if kind == "slow" and float(rate) > 0:
        return kind, float(rate)
    raise SystemExit(f"fault {text!r}: expected 'corrupt' or 'slow:BYTES_PER_S'")


def faulty_send(kind: str, rate: float):
    step = max(1, min(BLOCK, int(rate / 10))) if kind == "slow" else BLOCK

    async def send(self, request, resp, f, offset: int, count: int) -> None:
        loop = asyncio.get_running_loop()
        while count:
            n = min(count, step)
            data = bytearray(await loop.run_in_executor(None, os.pread, f.fileno(), n, offset))
            if kind == "corrupt":
                for pos in range(-offset % BLOCK, len(data), BLOCK):
                    data[pos] ^= 0xFF
            await asyncio.wait_for(resp.write(data), self.timeout)
            if kind == "slow":
                await asyncio.sleep(n / rate)
            offset += n
            count -= n

    return send


if __name__ == "__main__":
    ShardcastServer._send = faulty_send(*parse(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
