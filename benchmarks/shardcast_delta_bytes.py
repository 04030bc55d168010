"""Bytes per version sent as SHARDCAST deltas (issue 20): consecutive bf16 exports, delta against the previous.

Two sources of consecutive versions:

- `--synthetic` (default): random weights of a Qwen2.5-0.5B-shaped model (494M parameters with tied embeddings;
  `--layers` makes it smaller), float32 master weights stepped by AdamW exactly as optax.adamw does it (b1 0.9,
  b2 0.99, eps 1e-8, weight decay 0.01, the learner's defaults) at `--lr` (3e-7, INTELLECT-2's), each version
  exported as bf16 safetensors. The gradients are random, not a learner's: every step draws g = 0.5 * c + n
  with c fixed per tensor (a consistent direction, so Adam's normalised step stays near 1, the worst case for
  deltas) and n fresh noise. One tensor is made at a time (peak memory about five copies of the embedding in
  float32, ~2.7 GB).
- `--exports DIR`: a directory of real exports (`v000000/`, `v000001/`, ...), e.g. the demo's run.

For every version and every weights file it writes the delta files with `bridge.shardcast.delta.write_deltas`
(the code path of the learner's export) and compares encodings on the same data: xor-zstd (what SHARDCAST
sends), xor with the bytes of each bf16 value split into two planes then zstd, and changed-index/value runs
(delta-coded uint32 indexes and the new values, zstd). Prints one JSON document.

    python benchmarks/shardcast_delta_bytes.py --versions 4 --out /tmp/delta-bench
    python benchmarks/shardcast_delta_bytes.py --exports runs/demo/weights
    python benchmarks/shardcast_delta_bytes.py --hops --layers 0 --versions 10 --no-compare

`--hops` (issue 38): the versions are published into an origin one at a time, the learner's way (deltas against
the previous version and the newest anchor, `delta.delta_bases`), and travel origin -> relay -> clients on
127.0.0.1, each hop through a byte-counting TCP proxy. Per version it reports the bytes the relay downloaded, a
client that follows every version, and a client two versions behind (and, apart, the delta files the relay
fetched upstream because that client asked for them) (it holds v-2: a delta chain through
v-1), each landing checked byte for byte; and the rebuild's CPU cost (`apply_delta` of the previous-version
delta, seconds per GB of rebuilt file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge.shardcast import delta  # noqa: E402

QWEN_0_5B = {"hidden": 896, "intermediate": 4864, "layers": 24, "vocab": 151936, "heads": 14, "kv_heads": 2}


def tensor_shapes(layers: int, c: dict = QWEN_0_5B) -> list[tuple[str, tuple[int, ...]]]:
    h, i, d = c["hidden"], c["intermediate"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * d
    shapes = [("model.embed_tokens.weight", (c["vocab"], h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return shapes + [("model.norm.weight", (h,))]


def header(shapes) -> bytes:
    doc, pos = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        doc[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, rounding to nearest even (as ml_dtypes and XLA do)."""
    u = x.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def synthetic_versions(
    out: Path, versions: int, layers: int, lr: float, seed: int, config: dict = QWEN_0_5B
) -> list[Path]:
    """Write v000000..v{versions} as one bf16 safetensors file each; returns their directories."""
    b1, b2, eps, wd = 0.9, 0.99, 1e-8, 0.01
    shapes = tensor_shapes(layers, config)
    dirs = [out / f"v{v:06d}" for v in range(versions + 1)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    files = [open(d / "model.safetensors", "wb") for d in dirs]
    head = header(shapes)
    for f in files:
        f.write(head)
    rng = np.random.default_rng(seed)
    for name, shape in shapes:
        norm = name.endswith("norm.weight")
        w = np.ones(shape, np.float32) if norm else rng.normal(0, 0.02, shape).astype(np.float32)
        if name.endswith(".bias"):
            w = rng.normal(0, 0.02, shape).astype(np.float32)
        files[0].write(bf16_bits(w).tobytes())
        m = np.zeros(shape, np.float32)
        v = np.zeros(shape, np.float32)
        direction = rng.standard_normal(shape, dtype=np.float32)
        for t in range(1, versions + 1):
            g = 0.5 * direction + rng.standard_normal(shape, dtype=np.float32)
            g *= 1e-3
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            del g
            step = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w
            w -= lr * step
            del step
            files[t].write(bf16_bits(w).tobytes())
        del w, m, v, direction
    for f in files:
        f.close()
    for v, d in enumerate(dirs):
        data = d / "model.safetensors"
        entry = {"name": data.name, "size": data.stat().st_size, "sha256": _sha256(data)}
        doc = {"version": v, "files": [entry], "total_size": entry["size"]}
        (d / "manifest.json").write_text(json.dumps(doc))
        (d / "STABLE").write_text(f"{v}\n")
    return dirs


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def other_encodings(base: Path, target: Path) -> dict:
    """Sizes of the alternatives on the same pair of files, chunk by chunk (streamed through zstd level 3)."""
    import zstandard

    sizes = {"xor_planes_zstd": 0, "index_value_zstd": 0}
    changed = total = 0
    cplanes = zstandard.ZstdCompressor(level=delta.LEVEL).compressobj()
    cindex = zstandard.ZstdCompressor(level=delta.LEVEL).compressobj()
    chunk = 8 << 20
    with open(base, "rb") as fb, open(target, "rb") as ft:
        pos = 0
        while block := ft.read(chunk):
            other = fb.read(len(block))
            a = np.frombuffer(block[: len(block) // 2 * 2], np.uint16)
            b = np.frombuffer(other[: len(other) // 2 * 2], np.uint16)
            x = a ^ b
            sizes["xor_planes_zstd"] += len(cplanes.compress((x & 0xFF).astype(np.uint8).tobytes()))
            sizes["xor_planes_zstd"] += len(cplanes.compress((x >> 8).astype(np.uint8).tobytes()))
            idx = np.flatnonzero(x).astype(np.int64) + pos
            gaps = np.diff(idx, prepend=pos).astype(np.uint32)
            sizes["index_value_zstd"] += len(cindex.compress(gaps.tobytes() + a[idx - pos].tobytes()))
            changed += idx.size
            total += a.size
            pos += a.size
    sizes["xor_planes_zstd"] += len(cplanes.flush())
    sizes["index_value_zstd"] += len(cindex.flush())
    return {**sizes, "changed_values": changed, "values": total}


def measure(dirs: list[Path], work: Path, compare: bool) -> list[dict]:
    rows = []
    for prev, cur in zip(dirs, dirs[1:]):
        v = int(cur.name[1:])
        manifest = json.loads((cur / "manifest.json").read_text())
        stage = work / f"deltas-{v}"
        stage.mkdir(parents=True, exist_ok=True)
        for entry in manifest["files"]:
            os.symlink((cur / entry["name"]).resolve(), stage / entry["name"])
        t0 = time.monotonic()
        # every delta kept here, to be measured; the export leaves out those over MAX_RATIO of their file
        deltas = delta.write_deltas(stage, manifest["files"], [(v - 1, prev)], max_ratio=float("inf"))
        encode_s = time.monotonic() - t0
        full = manifest["total_size"]
        weights = {e["name"]: e["size"] for e in manifest["files"] if e["name"].endswith(".safetensors")}
        sizes = {e["name"]: e["size"] for e in manifest["files"]}
        used = [d for d in deltas if d["size"] <= delta.MAX_RATIO * sizes[d["file"]]]
        sent = full - sum(sizes[d["file"]] for d in used) + sum(d["size"] for d in used)
        row = {
            "version": v,
            "full_bytes": full,
            "weights_bytes": sum(weights.values()),
            "xor_zstd_delta_bytes": sum(d["size"] for d in deltas if d["file"] in weights),
            "bytes_sent_with_deltas": sent,
            "ratio_full_over_sent": round(full / sent, 1),
            "encode_s": round(encode_s, 2),
        }
        if compare:
            alt = {"xor_planes_zstd": 0, "index_value_zstd": 0, "changed_values": 0, "values": 0}
            for name in weights:
                for k, n in other_encodings(prev / name, cur / name).items():
                    alt[k] += n
            row.update(alt)
            row["changed_fraction"] = round(alt["changed_values"] / max(alt["values"], 1), 5)
        rows.append(row)
        shutil.rmtree(stage)
    return rows


class CountingProxy:
    """A TCP forwarder on 127.0.0.1 to `target` that counts the bytes it sends back (what its client downloads)."""

    def __init__(self, target: str):
        import socket
        import threading
        from urllib.parse import urlsplit

        u = urlsplit(target)
        self.target = (u.hostname, u.port)
        self.received = 0
        self._lock = threading.Lock()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            conn, _ = self.sock.accept()
            up = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(conn, up, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, conn, True), daemon=True).start()

    def _pipe(self, src, dst, count: bool) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
                if count:
                    with self._lock:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass

    def take(self) -> int:
        with self._lock:
            n, self.received = self.received, 0
        return n


def _serve(serve, *args, **kw) -> str:
    """Run a SHARDCAST server coroutine on its own event loop in a daemon thread; returns its URL."""
    import asyncio
    import threading

    started, box = threading.Event(), {}

    def ready(url: str) -> None:
        box["url"] = url
        started.set()

    def run() -> None:
        asyncio.run(serve(*args, host="127.0.0.1", port=0, ready=ready, **kw))

    threading.Thread(target=run, daemon=True).start()
    if not started.wait(30):
        sys.exit("a server did not start")
    return box["url"]


def _publish(origin: Path, src: Path) -> dict:
    """Publish the synthetic version `src` into `origin` as the learner's export does: files, deltas, STABLE."""
    v = int(src.name[1:])
    doc = json.loads((src / "manifest.json").read_text())
    stage = origin / f".staging-{v}"
    stage.mkdir(parents=True)
    for e in doc["files"]:
        os.link(src / e["name"], stage / e["name"])
    doc["deltas"] = delta.write_deltas(stage, doc["files"], delta.delta_bases(origin, v))
    (stage / "manifest.json").write_text(json.dumps(doc))
    os.rename(stage, origin / src.name)
    (origin / src.name / "STABLE").write_text(f"{v}\n")
    return doc


def _same(a: Path, b: Path) -> bool:
    return all(_sha256(a / n) == _sha256(b / n) for n in ("model.safetensors",))


def hops(dirs: list[Path], work: Path) -> list[dict]:
    """Origin -> relay -> clients, one version at a time, counting each hop's bytes; see the module docstring."""
    from bridge.shardcast import ShardcastClient
    from bridge.shardcast.origin import serve_origin
    from bridge.shardcast.relay import serve_relay

    origin_dir, relay_dir, follow, behind = (work / n for n in ("origin", "relay", "follow", "behind"))
    origin_dir.mkdir(parents=True)
    _publish(origin_dir, dirs[0])
    origin = CountingProxy(_serve(serve_origin, origin_dir))
    relay = CountingProxy(_serve(serve_relay, relay_dir, origin.url, keep=3, fsync=False, grace_s=5.0))
    opts = {"timeout": 60.0, "patience": 120.0, "fsync": False, "direct_io": False}
    c = ShardcastClient(relay.url, **opts)
    c.fetch(0, follow, wait=120)
    origin.take(), relay.take()
    rows = []
    for src in dirs[1:]:
        v = int(src.name[1:])
        doc = _publish(origin_dir, src)
        full = doc["total_size"]
        c.fetch(v, follow, wait=120)
        relay_bytes, follow_bytes = origin.take(), relay.take()
        row = {
            "version": v,
            "full_bytes": full,
            "relay_bytes": relay_bytes,
            "follow_bytes": follow_bytes,
            "relay_ratio": round(full / max(relay_bytes, 1), 1),
            "follow_ratio": round(full / max(follow_bytes, 1), 1),
            "landed_identical": _same(follow / src.name, src),
        }
        if v >= 2:
            held = behind / f"v{v - 2:06d}"
            shutil.rmtree(behind, ignore_errors=True)
            held.mkdir(parents=True)
            for f in (follow / held.name).iterdir():
                os.link(f, held / f.name)
            result = ShardcastClient(relay.url, **opts).fetch(v, behind)
            row["behind2_bytes"] = relay.take()
            row["relay_lazy_bytes"] = origin.take()  # delta files the relay fetched on the client's request
            row["behind2_ratio"] = round(full / max(row["behind2_bytes"], 1), 1)
            row["behind2_chain"] = [r.version for r in result.chain]
            row["landed_identical"] = row["landed_identical"] and _same(behind / src.name, src)
        d = next(d for d in doc["deltas"] if d["base"] == v - 1)
        out = work / "rebuilt"
        fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        t0 = time.process_time()
        delta.apply_delta(origin_dir / f"v{v - 1:06d}" / d["file"], origin_dir / src.name / d["name"], fd, full)
        row["rebuild_cpu_s_per_gb"] = round((time.process_time() - t0) / (full / 1e9), 2)
        os.close(fd)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        for old in sorted(follow.glob("v0*"))[:-3]:
            shutil.rmtree(old)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exports", type=Path, help="measure these exports instead of synthetic ones")
    ap.add_argument("--out", type=Path, default=Path("/tmp/shardcast-delta-bytes"))
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compare", action="store_true", help="only xor-zstd (skip the other encodings)")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic versions in --out")
    ap.add_argument("--hops", action="store_true", help="origin -> relay -> clients with byte-counting proxies")
    args = ap.parse_args()
    if not delta.HAVE_ZSTD:
        sys.exit("the zstandard module is not installed")
    t0 = time.monotonic()
    if args.exports:
        dirs = sorted(p for p in args.exports.iterdir() if (p / "STABLE").exists())
        source = {"exports": str(args.exports)}
    else:
        shutil.rmtree(args.out, ignore_errors=True)
        dirs = synthetic_versions(args.out, args.versions, args.layers, args.lr, args.seed)
        params = sum(int(np.prod(s)) for _, s in tensor_shapes(args.layers))
        source = {
            "synthetic": "Qwen2.5-0.5B-shaped random weights, AdamW on random gradients",
            "parameters": params,
            "layers": args.layers,
            "lr": args.lr,
        }
    work = args.out / "work"
    if args.hops:
        rows = hops(dirs, work)
        shutil.rmtree(work, ignore_errors=True)
        if not args.exports and not args.keep:
            shutil.rmtree(args.out, ignore_errors=True)
        later = rows[1:] or rows
        summary = {
            "min_relay_ratio": min(r["relay_ratio"] for r in rows),
            "min_follow_ratio": min(r["follow_ratio"] for r in rows),
            "min_behind2_ratio": min((r["behind2_ratio"] for r in rows if "behind2_ratio" in r), default=None),
            "all_identical": all(r["landed_identical"] for r in rows),
            "rebuild_cpu_s_per_gb_median": float(np.median([r["rebuild_cpu_s_per_gb"] for r in later])),
        }
        print(json.dumps({"source": source, "hops": rows, **summary, "seconds": round(time.monotonic() - t0, 1)}))
        return
    rows = measure(dirs, work, not args.no_compare)
    shutil.rmtree(work, ignore_errors=True)
    if not args.exports and not args.keep:
        shutil.rmtree(args.out, ignore_errors=True)
    ratios = [r["ratio_full_over_sent"] for r in rows]
    print(
        json.dumps(
            {
                "source": source,
                "versions": rows,
                "min_ratio": min(ratios),
                "max_ratio": max(ratios),
                "seconds": round(time.monotonic() - t0, 1),
                "machine": platform.node(),
                "cpus": os.cpu_count(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
