"""SHARDCAST delta files: made by `write_deltas`, listed in the manifest, rebuilt by `apply_delta`.

Versions here are safetensors files written by hand (an 8-byte length, a JSON header, bf16 values as uint16),
each one a copy of the previous with a few values moved by one unit in the last place, as an lr 3e-7 step
moves them; what a delta rebuilds is compared byte for byte with the file it stands for.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from bridge.shardcast import delta
from bridge.shardcast.errors import ManifestError
from bridge.shardcast.manifest import parse_manifest

pytest.importorskip("zstandard")

from delta_versions import N, initial, publish, safetensors_bytes, step  # noqa: E402


def rebuild(base: Path, delta_file: Path, size: int, tmp: Path) -> bytes:
    out = tmp / "rebuilt"
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        digest = delta.apply_delta(base, delta_file, fd, size)
    finally:
        os.close(fd)
    data = out.read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    return data


def test_deltas_rebuild_every_version_bit_exact_over_several_anchors(tmp_path):
    root = tmp_path / "weights"
    weights = initial()
    history = {}
    for version in range(11):
        if version:
            weights = step(weights, version)
        files = {"model.safetensors": safetensors_bytes(weights), "config.json": b'{"v": 1}'}
        history[version] = files
        doc = publish(root, version, files, every=4)
        bases = sorted(d["base"] for d in doc["deltas"])
        # the previous version, and the newest anchor (a multiple of 4) when that is another one
        expected = [] if version == 0 else sorted({version - 1, (version - 1) // 4 * 4})
        assert bases == expected, version
        for d in doc["deltas"]:
            assert d["file"] == "model.safetensors"  # config.json is under 4 KiB: not worth a delta
            full = history[version][d["file"]]
            assert d["size"] * 10 < len(full)
            base_file = root / f"v{d['base']:06d}" / d["file"]
            assert d["base_sha256"] == hashlib.sha256(base_file.read_bytes()).hexdigest()
            assert rebuild(base_file, root / f"v{version:06d}" / d["name"], len(full), tmp_path) == full
        manifest = parse_manifest((root / f"v{version:06d}" / "manifest.json").read_bytes(), "test", version=version)
        assert [d.name for d in manifest.deltas] == [d["name"] for d in doc["deltas"]]
        assert set(manifest.served) == {"model.safetensors", "config.json", *(d["name"] for d in doc["deltas"])}


def test_a_dtype_change_or_a_new_tensor_gets_no_delta(tmp_path):
    root = tmp_path / "weights"
    weights = initial()
    publish(root, 0, {"model.safetensors": safetensors_bytes(weights), "other.safetensors": safetensors_bytes(weights)})
    more = {**weights, "c.bias": np.zeros(8, np.uint16)}  # a new tensor
    as_f32 = {k: v.astype(np.float32) for k, v in weights.items()}  # a dtype change
    doc = publish(
        root, 1, {"model.safetensors": safetensors_bytes(more), "other.safetensors": safetensors_bytes(as_f32)}
    )
    assert doc["deltas"] == []
    # the same size but another header (a tensor renamed): still no delta
    renamed = {"z.weight" if k == "a.weight" else k: v for k, v in weights.items()}
    doc = publish(
        root,
        2,
        {"model.safetensors": safetensors_bytes(renamed), "other.safetensors": safetensors_bytes(step(weights, 2))},
    )
    # other.safetensors: none against v1 (f32), one against the anchor v0 (bf16 again, the same header)
    assert [(d["file"], d["base"]) for d in doc["deltas"]] == [("other.safetensors", 0)]
    doc = publish(
        root,
        3,
        {"model.safetensors": safetensors_bytes(renamed), "other.safetensors": safetensors_bytes(step(weights, 3))},
    )
    assert sorted((d["file"], d["base"]) for d in doc["deltas"]) == [
        ("model.safetensors", 2),
        ("other.safetensors", 0),
        ("other.safetensors", 2),
    ]


def test_a_delta_that_does_not_pay_is_not_written(tmp_path):
    root = tmp_path / "weights"
    rng = np.random.default_rng(1)
    publish(root, 0, {"model.safetensors": safetensors_bytes({"w": rng.integers(0, 65535, N, dtype=np.uint16)})})
    doc = publish(root, 1, {"model.safetensors": safetensors_bytes({"w": rng.integers(0, 65535, N, dtype=np.uint16)})})
    assert doc["deltas"] == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_broken_delta_or_base_is_an_error_never_a_silent_file(tmp_path, damage):
    """(A client checks a delta's own sha256 before it applies it; this is what applying one anyway does.)"""
    root = tmp_path / "weights"
    weights = initial()
    publish(root, 0, {"model.safetensors": safetensors_bytes(weights)})
    full = safetensors_bytes(step(weights, 1))
    doc = publish(root, 1, {"model.safetensors": full})
    (d,) = doc["deltas"]
    dpath = root / "v000001" / d["name"]
    raw = bytearray(dpath.read_bytes())
    if damage == "flip":  # the zstd frame's checksum-less body: a flipped bit gives wrong bytes or an error
        raw[len(raw) // 2] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(os.urandom(len(raw)))
    dpath.write_bytes(bytes(raw))
    try:
        data = rebuild(root / "v000000" / "model.safetensors", dpath, len(full), tmp_path)
    except delta.DeltaError:
        return
    assert hashlib.sha256(data).hexdigest() != hashlib.sha256(full).hexdigest()  # caught by the file's sha256


def test_a_base_of_another_size_is_refused(tmp_path):
    root = tmp_path / "weights"
    weights = initial()
    publish(root, 0, {"model.safetensors": safetensors_bytes(weights)})
    full = safetensors_bytes(step(weights, 1))
    (d,) = publish(root, 1, {"model.safetensors": full})["deltas"]
    short = tmp_path / "short"
    short.write_bytes(full[:-2])
    with pytest.raises(delta.DeltaError):
        rebuild(short, root / "v000001" / d["name"], len(full), tmp_path)


def manifest_with(deltas) -> bytes:
    files = [{"name": "model.safetensors", "size": 100, "sha256": "a" * 64}]
    return json.dumps({"version": 5, "files": files, "total_size": 100, "deltas": deltas}).encode()


GOOD = {
    "name": "model.safetensors.v000004.xzst",
    "file": "model.safetensors",
    "base": 4,
    "base_sha256": "b" * 64,
    "encoding": "xor-zstd",
    "size": 10,
    "sha256": "c" * 64,
}


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"file": "nope.safetensors"}, "is not one of the files"),
        ({"base": 5}, "is not older than version 5"),
        ({"base": -1}, "is not a version"),
        ({"name": "model.safetensors"}, "listed twice"),
        ({"name": "../x"}, "not an acceptable file name"),
        ({"sha256": "C" * 64}, "64 lower-case hex"),
        ({"base_sha256": None}, "64 lower-case hex"),
        ({"size": -1}, "is not a size"),
        ({"size": True}, "is not a size"),
        ({"encoding": 3}, "not an encoding name"),
    ],
)
def test_hostile_delta_entries_are_refused(bad, message):
    assert parse_manifest(manifest_with([GOOD]), "t").deltas[0].base == 4
    with pytest.raises(ManifestError, match=message):
        parse_manifest(manifest_with([{**GOOD, **bad}]), "t")
    with pytest.raises(ManifestError, match="listed twice"):
        parse_manifest(manifest_with([GOOD, GOOD]), "t")
    with pytest.raises(ManifestError, match="'deltas' must be a list"):
        parse_manifest(manifest_with({"a": 1}), "t")


def test_the_learners_export_writes_deltas_against_the_versions_beside_it(tmp_path):
    """`bridge.weights.write_version` (the learner's export) into `weights/v00000N/`: deltas against the
    previous version and the anchor, each rebuilding the exported file bit for bit; another directory name:
    none."""
    import ml_dtypes

    from bridge.weights import TensorSpec, write_version

    specs = [TensorSpec.same(("w",), "model.w", (512, 256)), TensorSpec.same(("b",), "model.b", (256,))]
    rng = np.random.default_rng(0)
    master = {s.hf_name: rng.normal(0, 0.02, s.hf_shape).astype(np.float32) for s in specs}
    root = tmp_path / "weights"
    for version in range(3):
        if version:
            for name, w in master.items():  # an lr-3e-7-sized step: a few bf16 values move by one ulp
                w -= 3e-7 * np.sign(rng.standard_normal(w.shape)).astype(np.float32)
        write_version(
            specs,
            lambda s: master[s.hf_name].astype(ml_dtypes.bfloat16),
            root / f"v{version:06d}",
            version=version,
            fsync=False,
            hf_config={"model_type": "qwen2"},
        )
    manifest = parse_manifest((root / "v000002" / "manifest.json").read_bytes(), "t", version=2)
    assert sorted((d.file, d.base) for d in manifest.deltas) == [
        ("model-00001-of-00001.safetensors", 0),
        ("model-00001-of-00001.safetensors", 1),
    ]
    target = (root / "v000002" / "model-00001-of-00001.safetensors").read_bytes()
    for d in manifest.deltas:
        assert d.size * 10 < len(target)
        base = root / f"v{d.base:06d}" / d.file
        assert rebuild(base, root / "v000002" / d.name, len(target), tmp_path) == target
    elsewhere = write_version(
        specs,
        lambda s: master[s.hf_name].astype(ml_dtypes.bfloat16),
        tmp_path / "export",
        version=3,
        fsync=False,
        hf_config={"model_type": "qwen2"},
    )
    assert "deltas" not in json.loads((elsewhere.path / "manifest.json").read_text())


def test_retained_keeps_the_newest_versions_and_the_newest_anchor():
    assert delta.retained(range(1, 14), 3, every=8) == {8, 11, 12, 13}
    assert delta.retained(range(1, 14), 3, keep_anchor=False, every=8) == {11, 12, 13}
    assert delta.retained([0, 1, 2, 3, 4], 3, every=8) == {0, 2, 3, 4}
    assert delta.retained([16, 17, 8], 3, every=8) == {8, 16, 17}  # the newest anchor is among the newest
    assert delta.retained([5, 6, 7], 2, every=8) == {6, 7}  # no anchor held
    with pytest.raises(ValueError, match="keep must be positive"):
        delta.retained([1], 0)


@pytest.mark.parametrize("keep_anchor", [True, False])
def test_relay_store_holds_the_anchor_four_versions_after_it(tmp_path, keep_anchor):
    import asyncio

    from bridge.shardcast.store import VersionStore

    root = tmp_path / "relay"
    for v in range(7, 14):  # anchor 8, then 5 versions after it
        publish(root, v, {"w.bin": bytes([v]) * 64})

    async def scan():
        store = VersionStore(root, keep=3, grace_s=0.0, keep_anchor=keep_anchor)
        store.scan()
        store.prune()
        return sorted(store.advertised)

    expected = [8, 11, 12, 13] if keep_anchor else [11, 12, 13]
    assert asyncio.run(scan()) == expected
    assert sorted(int(p.name[1:]) for p in root.glob("v0*")) == expected


def test_retained_keeps_the_bases_the_newest_manifest_lists():
    # the newest version (13) has deltas against 12 and the anchor 4 (an interval of 4): 4 is kept, not 8
    assert delta.retained(range(1, 14), 3, every=8, bases=[12, 4]) == {4, 11, 12, 13}
    assert delta.retained(range(5, 14), 3, every=8, bases=[12, 4]) == {11, 12, 13}  # 4 is not held
