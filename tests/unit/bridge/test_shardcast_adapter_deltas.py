"""SHARDCAST delta files of adapter versions (`ship = "adapter"`): `bridge.adapters.write_adapter` into
`weights/v00000N/` beside the full version 0 writes them as `write_version` does, and a client holding the
previous adapter rebuilds the next one from its delta, served by a real origin on 127.0.0.1.

The adapters are bfloat16 (a few lora_A / lora_B pairs) moved by small AdamW-sized steps; what a client lands
is compared byte for byte with what the learner wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import Served

from bridge.adapters import A_SUFFIX, B_SUFFIX, PEFT_PREFIX, WEIGHTS_FILE, verify_adapter, write_adapter
from bridge.shardcast import ShardcastClient, delta
from bridge.shardcast.manifest import parse_manifest
from bridge.shardcast.origin import serve_origin
from bridge.weights import TensorSpec, model_digest, write_version

pytest.importorskip("zstandard")
ml_dtypes = pytest.importorskip("ml_dtypes")

RANK, IN, OUT = 8, 512, 384
MODULES = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in ("q", "v")]
CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": ["q_proj", "v_proj"]}


def adapter_specs() -> list[TensorSpec]:
    specs = []
    for module in MODULES:
        for suffix, shape in ((A_SUFFIX, (RANK, IN)), (B_SUFFIX, (OUT, RANK))):
            name = PEFT_PREFIX + module + suffix
            specs.append(TensorSpec.same((name,), name, shape))
    return specs


def trained_adapters(steps: int, lr: float = 2e-5, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """float32 masters after each of `steps` sign-like steps of size `lr` (A drawn as PEFT draws it, B grown
    from zero by the first steps), one dict per version from 1."""
    rng = np.random.default_rng(seed)
    master = {}
    for spec in adapter_specs():
        bound = 1 / np.sqrt(IN)
        scale = bound if spec.hf_name.endswith(A_SUFFIX) else 1e-3
        master[spec.hf_name] = rng.uniform(-scale, scale, spec.hf_shape).astype(np.float32)
    out = []
    for _ in range(steps):
        for w in master.values():
            w -= lr * np.sign(rng.standard_normal(w.shape)).astype(np.float32)
        out.append({k: v.copy() for k, v in master.items()})
    return out


def write_full_version_0(root: Path) -> str:
    """A (tiny) full version 0, the base the adapters apply to; its `model_digest`."""
    spec = TensorSpec.same(("w",), "model.embed_tokens.weight", (64, 32))
    write_version(
        [spec],
        lambda s: np.ones(s.hf_shape, ml_dtypes.bfloat16),
        root / "v000000",
        version=0,
        fsync=False,
        hf_config={"model_type": "llama"},
    )
    return model_digest(root / "v000000")


def write_one(out: Path, version: int, digest: str, tensors: dict[str, np.ndarray], base_version=0) -> None:
    write_adapter(
        adapter_specs(),
        lambda s: tensors[s.hf_name].astype(ml_dtypes.bfloat16),
        out,
        version=version,
        config=CONFIG,
        base_digest=digest,
        dtype="bfloat16",
        base_version=base_version,
    )


def write_adapters(root: Path, digest: str, versions: list[dict[str, np.ndarray]]) -> None:
    """Versions 1, 2, ... into `root/v00000N/`, as the learner ships them."""
    for version, tensors in enumerate(versions, start=1):
        write_one(root / f"v{version:06d}", version, digest, tensors)


def rebuild(base: Path, delta_file: Path, size: int, out: Path) -> bytes:
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        digest = delta.apply_delta(base, delta_file, fd, size)
    finally:
        os.close(fd)
    assert digest == hashlib.sha256(out.read_bytes()).hexdigest()
    return out.read_bytes()


def test_adapter_versions_get_deltas_against_older_adapters_as_full_versions_do(tmp_path):
    root = tmp_path / "weights"
    digest = write_full_version_0(root)
    write_adapters(root, digest, trained_adapters(3))
    manifests = {v: json.loads((root / f"v{v:06d}" / "manifest.json").read_text()) for v in (1, 2, 3)}
    # version 1's bases are version 0 (the previous one and the anchor), a full version without an adapter file
    assert manifests[1]["deltas"] == []
    for v in (2, 3):
        manifest = parse_manifest((root / f"v{v:06d}" / "manifest.json").read_bytes(), "t", version=v)
        assert [(d.file, d.base) for d in manifest.deltas] == [(WEIGHTS_FILE, v - 1)]
        target = (root / f"v{v:06d}" / WEIGHTS_FILE).read_bytes()
        (d,) = manifest.deltas
        assert d.size * 2 <= len(target)  # written only where it saves at least half
        assert d.base_sha256 == hashlib.sha256((root / f"v{v - 1:06d}" / WEIGHTS_FILE).read_bytes()).hexdigest()
        base = root / f"v{v - 1:06d}" / WEIGHTS_FILE
        assert rebuild(base, root / f"v{v:06d}" / d.name, len(target), tmp_path / "rebuilt") == target
        assert verify_adapter(root / f"v{v:06d}", digest)["version"] == v  # the delta file beside it is no harm
    # a directory not named for its version (as `write_version`), or an adapter not shipped in a full version's
    # place (no base_version: the learner's copy beside a merged version): no deltas
    write_one(root / "export", 4, digest, trained_adapters(4)[-1])
    write_one(root / "v000004", 4, digest, trained_adapters(4)[-1], base_version=None)
    for name in ("export", "v000004"):
        assert "deltas" not in json.loads((root / name / "manifest.json").read_text())
        assert not list((root / name).glob("*.xzst"))


def test_a_step_that_moves_every_value_gets_no_delta(tmp_path):
    """lr 2e-3 on bfloat16: every value changes, the XOR does not compress to half, the full file is sent."""
    root = tmp_path / "weights"
    digest = write_full_version_0(root)
    write_adapters(root, digest, trained_adapters(2, lr=2e-3))
    assert json.loads((root / "v000002" / "manifest.json").read_text())["deltas"] == []
    assert not list((root / "v000002").glob("*.xzst"))


def client(url: str) -> ShardcastClient:
    return ShardcastClient([url], timeout=5.0, patience=5.0, part_bytes=256 << 10, fsync=False, direct_io=False)


def test_a_client_holding_the_previous_adapter_rebuilds_the_next_from_its_delta(tmp_path):
    root = tmp_path / "weights"
    digest = write_full_version_0(root)
    write_adapters(root, digest, trained_adapters(3))
    published = {
        v: {p.name: p.read_bytes() for p in (root / f"v{v:06d}").iterdir() if p.suffix != ".xzst"} for v in (1, 2, 3)
    }
    origin = Served(serve_origin, root)
    try:
        out = tmp_path / "worker"
        client(origin.url).fetch(0, out)
        first = client(origin.url).fetch(1, out)  # no older adapter held: in full
        assert first.rebuilt_files == 0
        result = client(origin.url).fetch(2, out)
        assert result.rebuilt_files == 1
        size = len(published[2][WEIGHTS_FILE])
        assert result.received_bytes * 2 < size  # the delta, adapter_config.json and manifest.json
        alone = tmp_path / "only-version-0"  # holds version 0 alone: no adapter to rebuild from
        client(origin.url).fetch(0, alone)
        assert client(origin.url).fetch(3, alone).rebuilt_files == 0
    finally:
        origin.close()
    for landed, v in ((out, 2), (alone, 3)):
        vdir = landed / f"v{v:06d}"
        assert sorted(p.name for p in vdir.iterdir()) == sorted(published[v])
        for name, data in published[v].items():
            assert (vdir / name).read_bytes() == data, name
        assert verify_adapter(vdir, digest)["base_version"] == 0
