"""SHARDCAST's validation of names, versions, server URLs and manifests, and its weighted server choice.

Manifests are written here with hashlib and json (the layout of docs/design.md section 4), and `bridge.weights`'
own `verify_manifest` serves as the independent judge of what a valid version directory is.
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from bridge.shardcast.manifest import MAX_MANIFEST_BYTES, ManifestError, parse_manifest, read_version_dir
from bridge.shardcast.names import (
    ShardcastError,
    check_file_name,
    parse_server_list,
    parse_server_url,
    parse_version,
    parse_version_dirname,
    version_dirname,
)
from bridge.shardcast.pool import ServerPool
from bridge.shardcast.server import client_group, parse_range
from bridge.weights import verify_manifest


def manifest_doc(files: dict[str, bytes], version: int = 7) -> dict:
    entries = [{"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in sorted(files.items())]
    return {
        "version": version,
        "files": entries,
        "total_size": sum(len(d) for d in files.values()),
        "created": "2026-01-01T00:00:00+00:00",
    }


FILES = {"config.json": b"{}", "model-00001-of-00001.safetensors": b"\x00" * 1000, "empty.txt": b""}


@pytest.mark.parametrize("text, value", [("0", 0), ("7", 7), ("123456789012345", 123456789012345)])
def test_parse_version_accepts_plain_decimals(text, value):
    assert parse_version(text, "here") == value


@pytest.mark.parametrize(
    "text", ["", "-1", "+1", "007", "1.0", "1e3", "0x10", " 1", "1 ", "١", "1234567890123456", "../1", "1/2"]
)
def test_parse_version_refuses_anything_else(text):
    with pytest.raises(ShardcastError, match="here"):
        parse_version(text, "here")


@pytest.mark.parametrize(
    "name, version",
    [
        ("v000000", 0),
        ("v000123", 123),
        ("v1234567", 1234567),
        ("v00001", None),
        ("v0000123", None),
        (".v000001.partial", None),
        ("v000001.tmp", None),
        ("x000001", None),
        ("v-00001", None),
    ],
)
def test_version_directory_names(name, version):
    assert parse_version_dirname(name) == version
    if version is not None:
        assert version_dirname(version) == name


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model-00001-of-00004.safetensors",
        "tokenizer_config.json",
        "merges.txt",
        "chat_template.jinja",
        "_x",
        "a" * 200,
    ],
)
def test_file_names_of_an_hf_export_are_accepted(name):
    assert check_file_name(name, "f") == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".",
        "..",
        "../x",
        "a/b",
        "/etc/passwd",
        "a\\b",
        ".hidden",
        "a..b",
        "manifest.json",
        "STABLE",
        "a\x00b",
        "a b",
        "é",
        "a" * 201,
        None,
        3,
        "~root",
        "%2e%2e",
        "x\n",
    ],
)
def test_file_names_that_could_escape_or_collide_are_refused(name):
    with pytest.raises(ShardcastError, match="not an acceptable file name"):
        check_file_name(name, "f")


def test_server_urls():
    assert str(parse_server_url("http://127.0.0.1:8100")) == "http://127.0.0.1:8100"
    assert str(parse_server_url("http://relay.example/sc/")) == "http://relay.example:80/sc"
    assert parse_server_list("http://a:1, http://b:2,,http://a:1") == [
        parse_server_url("http://a:1"),
        parse_server_url("http://b:2"),
    ]
    for bad in ["https://a:1", "ftp://a", "a:1", "http://:1", "http://a:99999", "http://u:p@a:1", "http://a:1/?q"]:
        with pytest.raises(ShardcastError, match="server URL"):
            parse_server_url(bad)
    with pytest.raises(ShardcastError, match="no server"):
        parse_server_list(" , ")


def test_manifest_as_exported_is_accepted(tmp_path):
    doc = manifest_doc(FILES)
    raw = json.dumps(doc, indent=2).encode()
    m = parse_manifest(raw, "m", version=7)
    assert m.version == 7 and m.total_size == 1002 and m.raw == raw
    assert [(e.name, e.size, e.sha256) for e in m.files] == [(f["name"], f["size"], f["sha256"]) for f in doc["files"]]
    assert m.sha256 == hashlib.sha256(raw).hexdigest()
    # read_version_dir agrees with bridge.weights.verify_manifest on a complete directory
    vdir = tmp_path / "v000007"
    vdir.mkdir()
    for name, data in FILES.items():
        (vdir / name).write_bytes(data)
    (vdir / "manifest.json").write_bytes(raw)
    (vdir / "STABLE").write_text("7\n")
    assert verify_manifest(vdir)["files"] == doc["files"]
    assert read_version_dir(vdir, 7).files == m.files
    (vdir / "config.json").write_bytes(b"{}  ")  # a size change: both refuse it
    with pytest.raises(ValueError):
        verify_manifest(vdir)
    with pytest.raises(ManifestError, match="config.json: size 4 but the manifest says 2"):
        read_version_dir(vdir, 7)


def _mutated(mutate) -> bytes:
    doc = manifest_doc(FILES)
    mutate(doc)
    return json.dumps(doc).encode()


def _set_file(i, key, value):
    def mutate(doc):
        doc["files"][i][key] = value

    return mutate


HOSTILE = {
    "traversal": (_set_file(0, "name", "../../etc/passwd"), r"files\[0\].name: '../../etc/passwd'"),
    "absolute": (_set_file(0, "name", "/etc/passwd"), r"files\[0\].name"),
    "subdir": (_set_file(1, "name", "a/b"), r"files\[1\].name"),
    "stable": (_set_file(0, "name", "STABLE"), r"files\[0\].name"),
    "huge": (_set_file(1, "size", 1 << 62), r"files\[1\].size"),
    "negative": (_set_file(1, "size", -1), r"files\[1\].size"),
    "bool size": (_set_file(1, "size", True), r"files\[1\].size"),
    "float size": (_set_file(1, "size", 2.0), r"files\[1\].size"),
    "sha upper": (_set_file(2, "sha256", "A" * 64), r"files\[2\].sha256"),
    "sha short": (_set_file(2, "sha256", "a" * 63), r"files\[2\].sha256"),
    "duplicate": (lambda d: d["files"].append(dict(d["files"][0])), r"files\[3\].name: 'config.json' is listed twice"),
    "total": (lambda d: d.update(total_size=5), r"'total_size' is 5 but the files add up to 1002"),
    "version": (lambda d: d.update(version=8), "declares version 8, expected 7"),
    "bool version": (lambda d: d.update(version=True), "field 'version'"),
    "no files": (lambda d: d.update(files=[]), "field 'files'"),
    "files not list": (lambda d: d.update(files={"a": 1}), "field 'files'"),
    "entry not object": (lambda d: d["files"].__setitem__(0, "config.json"), r"files\[0\] must be an object"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_manifests_are_refused_naming_the_field(case):
    mutate, message = HOSTILE[case]
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_mutated(mutate), "http://x/v/7/manifest.json", version=7)


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b" " * (MAX_MANIFEST_BYTES + 1), "exceeds the limit"),
    ],
)
def test_malformed_or_oversized_manifest_bytes(raw, message):
    with pytest.raises(ManifestError, match=message):
        parse_manifest(raw, "m")


def test_manifest_total_over_the_callers_limit():
    raw = json.dumps(manifest_doc(FILES)).encode()
    with pytest.raises(ManifestError, match="over the limit of 1000"):
        parse_manifest(raw, "m", max_total=1000)


def test_pool_chooses_in_proportion_to_bandwidth_times_success_squared():
    a, b, c = parse_server_list("http://a:1,http://b:1,http://c:1")
    pool = ServerPool([a, b, c], rng=random.Random(0))
    pool.record(a, True, 300 << 20, 1.0)  # 300 MiB/s
    pool.record(b, True, 100 << 20, 1.0)  # 100 MiB/s
    pool.record(c, True, 100 << 20, 1.0)
    pool.record(c, False)  # success 0.7 -> weight x 0.49
    expected = {a: 300, b: 100, c: 100 * 0.7**2}
    n = 20000
    counts = {s: 0 for s in expected}
    for _ in range(n):
        counts[pool.choose([a, b, c])] += 1
    total = sum(expected.values())
    for server, weight in expected.items():
        assert abs(counts[server] / n - weight / total) < 0.015, (server, counts)


def test_pool_bandwidth_is_an_ewma_and_distrust_zeroes_success():
    a, b = parse_server_list("http://a:1,http://b:1")
    pool = ServerPool([a, b], rng=random.Random(1))
    pool.record(a, True, 100 << 20, 1.0)
    pool.record(a, True, 200 << 20, 1.0)
    assert pool.stats[a].bandwidth == pytest.approx(0.7 * (100 << 20) + 0.3 * (200 << 20))
    pool.record(a, True, 1000, 0.001)  # under 1 MiB: too small to measure bandwidth
    assert pool.stats[a].bandwidth == pytest.approx(0.7 * (100 << 20) + 0.3 * (200 << 20))
    assert pool.stats[b].bandwidth is None  # unmeasured: weighted as the best measured
    pool.distrust(b)
    picks = [pool.choose([a, b]) for _ in range(4000)]
    assert 0 < picks.count(b) < 40  # 0.05**2 of a's weight: rare, never impossible


def test_shardcast_layout_names_match_the_weights_layout_and_need_no_numpy():
    import subprocess
    import sys

    from bridge import weights
    from bridge.shardcast import names

    assert (names.MANIFEST_FILE, names.STABLE_FILE) == (weights.MANIFEST_FILE, weights.STABLE_FILE)
    code = "import sys, bridge.shardcast, bridge.shardcast.relay; print('numpy' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@pytest.mark.parametrize(
    "header, size, expected",
    [
        (None, 10, None),
        ("bytes=0-", 10, (0, 10)),
        ("bytes=3-5", 10, (3, 3)),
        ("bytes=3-99", 10, (3, 7)),
        ("bytes=-4", 10, (6, 4)),
        ("bytes=-99", 10, (0, 10)),
        ("BYTES=9-9", 10, (9, 1)),
        (" bytes=0-0 ", 10, (0, 1)),
    ],
)
def test_parse_range_selects_the_bytes_asked_for(header, size, expected):
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(
    "header, size",
    [
        ("bytes=-0", 10),
        ("bytes=-0", 0),
        ("bytes=-5", 0),
        ("bytes=0-", 0),
        ("bytes=10-", 10),
        ("bytes=5-4", 10),
        ("bytes=-", 10),
        ("bytes=0-1,3-4", 10),
        ("lines=0-1", 10),
        ("bytes=1e3-", 10),
        ("bytes=" + "9" * 20 + "-", 10),
        ("bytes=\u0661-", 10),  # a non-ASCII digit
    ],
)
def test_parse_range_refuses_what_selects_no_byte_or_is_malformed(header, size):
    with pytest.raises(ValueError):
        parse_range(header, size)


def test_client_groups_are_addresses_and_ipv6_slash_64s():
    assert client_group("203.0.113.7") == "203.0.113.7"
    assert client_group("2001:db8:1:2:aaaa::1") == client_group("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert client_group("2001:db8:1:3::1") != client_group("2001:db8:1:2::1")
    assert client_group("::ffff:198.51.100.9") == "198.51.100.9"
    assert client_group("fe80::1%eth0") == "fe80::/64" and client_group("not an address") == "not an address"


# ---- part hashes (pipelined relays) ----------------------------------------------------------------------

PART = 64 << 10  # the smallest part size a manifest may declare
PARTED = {"config.json": b"{}", "big.safetensors": random.Random(1).randbytes(2 * PART + 5), "empty.txt": b""}


def parted_doc(files: dict[str, bytes] = PARTED, part_size: int = PART, version: int = 7) -> dict:
    """A manifest with part hashes, computed here from slices of the data (independently of the writer)."""
    doc = manifest_doc(files, version)
    doc["part_size"] = part_size
    for entry in doc["files"]:
        data = files[entry["name"]]
        entry["parts"] = [hashlib.sha256(data[i : i + part_size]).hexdigest() for i in range(0, len(data), part_size)]
    return doc


def test_manifest_with_part_hashes_is_accepted():
    doc = parted_doc()
    m = parse_manifest(json.dumps(doc).encode(), "m", version=7)
    assert m.part_size == PART
    by_name = {e.name: e for e in m.files}
    assert len(by_name["big.safetensors"].parts) == 3 and by_name["empty.txt"].parts == ()
    assert by_name["config.json"].parts == (hashlib.sha256(b"{}").hexdigest(),)
    assert m.part_range(2, 2 * PART + 5) == (2 * PART, 5)
    old = parse_manifest(json.dumps(manifest_doc(FILES)).encode(), "m", version=7)  # no part hashes: still valid
    assert old.part_size is None and all(e.parts == () for e in old.files)


def _parted(mutate) -> bytes:
    doc = parted_doc()
    mutate(doc)
    return json.dumps(doc).encode()


def _big(key, value):  # files are sorted by name: [big.safetensors, config.json, empty.txt]
    def mutate(doc):
        doc["files"][0][key] = value

    return mutate


def _big_part(j, value):
    def mutate(doc):
        doc["files"][0]["parts"][j] = value

    return mutate


HOSTILE_PARTS = {
    "part_size text": (lambda d: d.update(part_size="65536"), r"'part_size' '65536' is not a multiple of 4096"),
    "part_size bool": (lambda d: d.update(part_size=True), r"'part_size' True"),
    "part_size float": (lambda d: d.update(part_size=65536.0), r"'part_size' 65536.0"),
    "part_size small": (lambda d: d.update(part_size=4096), r"'part_size' 4096 is not .* in 65536\.\.1073741824"),
    "part_size huge": (lambda d: d.update(part_size=2 << 30), r"'part_size' 2147483648"),
    "part_size unaligned": (lambda d: d.update(part_size=PART + 1), r"'part_size' 65537 is not a multiple of 4096"),
    "part_size null": (lambda d: d.update(part_size=None), r"'part_size' None"),
    "parts missing": (lambda d: d["files"][1].pop("parts"), r"files\[1\]\.parts: NoneType instead of a list of 1"),
    "parts not list": (_big("parts", "ab" * 32), r"files\[0\]\.parts: str instead of a list of 3"),
    "one part short": (lambda d: d["files"][0]["parts"].pop(), r"files\[0\]\.parts: 2 part sha256s, but 131077 .*3"),
    "one part extra": (lambda d: d["files"][0]["parts"].append("0" * 64), r"files\[0\]\.parts: 4 part sha256s"),
    "empty file part": (lambda d: d["files"][2].update(parts=["0" * 64]), r"files\[2\]\.parts: 1 part sha256s"),
    "upper hex": (_big_part(1, "A" * 64), r"files\[0\]\.parts\[1\]: 'AAAA.*' is not 64 lower-case hex digits"),
    "short hex": (_big_part(2, "a" * 63), r"files\[0\]\.parts\[2\]: .* is not 64 lower-case hex digits"),
    "not hex": (_big_part(0, "g" * 64), r"files\[0\]\.parts\[0\]"),
    "number": (_big_part(0, 12), r"files\[0\]\.parts\[0\]: '12' is not 64"),
    "null": (_big_part(0, None), r"files\[0\]\.parts\[0\]: 'None'"),
    "no part_size": (
        lambda d: d.pop("part_size"),
        r"files\[0\]\.parts: part hashes without the manifest's 'part_size'",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PARTS))
def test_malformed_part_hashes_are_refused_naming_what_is_wrong(case):
    mutate, message = HOSTILE_PARTS[case]
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_parted(mutate), "http://x/v/7/manifest.json", version=7)


@pytest.mark.parametrize("chunk", [1, 4095, PART, 3 * PART + 7])
def test_part_hasher_hashes_the_stream_and_every_part(chunk):
    from bridge.shardcast.manifest import PartHasher

    data = random.Random(chunk).randbytes(3 * PART + 1234)
    hasher = PartHasher(PART)
    for i in range(0, len(data), chunk):
        hasher.update(data[i : i + chunk])
    assert hasher.hexdigest() == hashlib.sha256(data).hexdigest()
    assert hasher.part_digests() == [hashlib.sha256(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)]
    exact = PartHasher(PART, whole=False)
    exact.update(data[: 2 * PART])
    assert len(exact.part_digests()) == 2  # a stream ending on a boundary has no empty last part


def test_the_learners_export_lists_the_part_hashes(tmp_path):
    """`bridge.weights.write_version` writes `part_size` and every file's part hashes; each is the sha256 of
    that slice of the file as written, and `parse_manifest` accepts the whole."""
    import ml_dtypes
    import numpy as np

    from bridge.weights import TensorSpec, write_version

    specs = [TensorSpec.same(("w",), "model.w", (300, 256)), TensorSpec.same(("b",), "model.b", (256,))]
    rng = np.random.default_rng(0)
    values = {s.hf_name: rng.normal(0, 0.02, s.hf_shape).astype(ml_dtypes.bfloat16) for s in specs}
    out = write_version(
        specs,
        lambda s: values[s.hf_name],
        tmp_path / "v000004",
        version=4,
        fsync=False,
        hf_config={"model_type": "qwen2"},
        part_size=PART,
        max_shard_bytes=100 << 10,
    ).path
    manifest = parse_manifest((out / "manifest.json").read_bytes(), "t", version=4)
    assert manifest.part_size == PART and len(manifest.files) >= 3
    assert any(len(e.parts) > 1 for e in manifest.files)
    for entry in manifest.files:
        data = (out / entry.name).read_bytes()
        slices = [hashlib.sha256(data[i : i + PART]).hexdigest() for i in range(0, len(data), PART)]
        assert list(entry.parts) == slices, entry.name
    verify_manifest(out)
