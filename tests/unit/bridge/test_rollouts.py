"""Rollout store (bridge/rollouts/): layout, canonical digest, validation, commit protocol, listing, pruning.

References: the batches are built here from per-sample numpy data, the digest is recomputed here from the
definition in the module docstring (one concatenated byte string, no parallel hashing), and stored arrays are
read back with plain tensorstore and compared with the input.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

from bridge import rollouts
from bridge.rollouts import BatchMeta, BatchRef, RolloutBatch, RolloutStore, RolloutStoreError

SCHEMA = [
    ("tokens", "<i4"),
    ("offsets", "<i8"),
    ("prompt_lens", "<i4"),
    ("logprobs", "<f4"),
    ("task_ids", "<i8"),
    ("group_ids", "<i4"),
    ("target_lens", "<i4"),
    ("seeds", "<u8"),
    ("finish", "u1"),
    ("rewards", "<f4"),
    ("proofs", "u1"),
    ("proof_offsets", "<i8"),
]


def samples(rng: np.random.Generator, n: int = 6, group: int = 3, vocab: int = 500, max_len: int = 90) -> dict:
    """Per-sample data of a valid batch, as a worker would hold it."""
    out = {k: [] for k in ("tokens", "prompt_lens", "logprobs", "proofs")}
    for _ in range(n):
        length = int(rng.integers(3, max_len))
        prompt = int(rng.integers(1, length))
        logprobs = np.zeros(length, np.float32)
        logprobs[prompt:] = -rng.exponential(1.0, length - prompt)
        out["tokens"].append(rng.integers(0, vocab, length).astype(np.int32))
        out["prompt_lens"].append(prompt)
        out["logprobs"].append(logprobs)
        out["proofs"].append(rng.integers(0, 256, 258 * -(-(length - prompt) // 32), dtype=np.uint8).tobytes())
    out.update(
        task_ids=rng.integers(0, 10**6, n),
        group_ids=np.arange(n) // group,
        seeds=rng.integers(0, 2**63, n),
        finish=rng.integers(0, 2, n),
        rewards=rng.random(n).astype(np.float32),
        target_lens=rng.integers(0, 500, n),
    )
    return out


def make_batch(seed: int = 0, version: int = 3, batch_id: str = "b-1", **kwargs) -> tuple[RolloutBatch, dict]:
    data = samples(np.random.default_rng(seed), **kwargs)
    meta = BatchMeta(
        batch_id=batch_id,
        node_key="ab" * 32,
        version=version,
        assignment_id=7,
        sampling={"temperature": 0.6, "top_p": 1.0, "max_tokens": 64},
        model_dtype="bfloat16",
    )
    return RolloutBatch.from_samples(meta, **data), data


def reference_flat(data: dict) -> dict[str, np.ndarray]:
    lens = [len(t) for t in data["tokens"]]
    return {
        "tokens": np.concatenate(data["tokens"]),
        "offsets": np.cumsum([0] + lens),
        "prompt_lens": np.array(data["prompt_lens"]),
        "logprobs": np.concatenate(data["logprobs"]),
        "task_ids": np.asarray(data["task_ids"]),
        "group_ids": np.asarray(data["group_ids"]),
        "target_lens": np.asarray(data["target_lens"]),
        "seeds": np.asarray(data["seeds"]),
        "finish": np.asarray(data["finish"]),
        "rewards": np.asarray(data["rewards"]),
        "proofs": np.frombuffer(b"".join(data["proofs"]), np.uint8),
        "proof_offsets": np.cumsum([0] + [len(p) for p in data["proofs"]]),
    }


def reference_digest(flat: dict[str, np.ndarray], meta_bytes: bytes, schema=SCHEMA) -> str:
    """The canonical bytes exactly as the module docstring defines them, built as one byte string."""
    canon = b"intellect-rollout-batch/1\n"
    for name, dtype in schema:
        values = np.asarray(flat[name]).astype(dtype)
        canon += (
            name.encode()
            + b"\n"
            + np.dtype(dtype).name.encode()
            + b"\n"
            + struct.pack("<Q", len(values))
            + hashlib.sha256(values.tobytes()).digest()
        )
    canon += b"meta.json\n" + struct.pack("<Q", len(meta_bytes)) + hashlib.sha256(meta_bytes).digest()
    return hashlib.sha256(canon).hexdigest()


def assert_same(batch: RolloutBatch, flat: dict[str, np.ndarray]) -> None:
    for name, dtype in SCHEMA:
        got = getattr(batch, name)
        assert got.dtype == np.dtype(dtype), name
        np.testing.assert_array_equal(got, np.asarray(flat[name]).astype(dtype), err_msg=name)


@pytest.fixture
def mem_store() -> RolloutStore:
    return RolloutStore.open("memory://")


@pytest.mark.parametrize("compression", sorted(rollouts.CODECS))
def test_file_store_layout_roundtrip_and_digest(tmp_path: Path, compression: str):
    batch, data = make_batch(seed=1)
    flat = reference_flat(data)
    store = RolloutStore.open(tmp_path / "store", compression=compression)
    digest = store.write(batch)

    root = tmp_path / "store" / "v000003" / "b-1"
    meta_bytes = (root / "meta.json").read_bytes()
    assert digest == reference_digest(flat, meta_bytes)
    assert (root / "COMMIT").read_bytes() == digest.encode() + b"\n"
    meta = json.loads(meta_bytes)
    assert meta == {
        "schema": 1,
        "batch_id": "b-1",
        "node_key": "ab" * 32,
        "version": 3,
        "assignment_id": 7,
        "sampling": {"temperature": 0.6, "top_p": 1.0, "max_tokens": 64},
        "model_dtype": "bfloat16",
        "num_samples": 6,
        "num_tokens": len(flat["tokens"]),
        "num_proof_bytes": len(flat["proofs"]),
    }
    for name, dtype in SCHEMA:  # every array is a zarr v3 array that plain tensorstore reads back
        zarr = json.loads((root / name / "zarr.json").read_text())
        assert zarr["data_type"] == np.dtype(dtype).name and zarr["shape"] == [len(flat[name])]
        codecs = [c["name"] for c in zarr["codecs"]]
        assert codecs == (["bytes"] if compression == "none" else ["bytes", compression.split("-")[0]])
        assert (root / name / "0").is_file() or not np.any(flat[name])  # chunk keys "v2": name/0, no c/ dir
        arr = ts.open({"driver": "zarr3", "kvstore": f"file://{root / name}/"}).result().read().result()
        np.testing.assert_array_equal(arr, np.asarray(flat[name]).astype(dtype), err_msg=name)

    again = RolloutStore.open(f"file://{tmp_path / 'store'}").read(3, "b-1", expect_sha256=digest)
    assert_same(again, flat)
    assert again.meta == batch.meta
    assert again.sample_proof(2) == data["proofs"][2]


def test_memory_store_is_shared_through_its_context(mem_store: RolloutStore):
    batch, data = make_batch()
    mem_store.write(batch)
    assert_same(RolloutStore(mem_store.kvstore, mem_store.context).read(3, "b-1"), reference_flat(data))
    assert RolloutStore.open("memory://").list() == []  # a new context is a new, empty memory store
    same = RolloutStore.open({"driver": "memory"}, context=mem_store.context)
    assert same.list() == [BatchRef(3, "b-1")]
    assert mem_store.batch_url(3, "b-1") == "memory://v000003/b-1/"


def test_committed_batch_is_never_overwritten(mem_store: RolloutStore):
    batch, data = make_batch(seed=1)
    mem_store.write(batch)
    other, _ = make_batch(seed=2)
    with pytest.raises(RolloutStoreError, match=r"v000003/b-1: COMMIT: .*already committed"):
        mem_store.write(other)
    assert_same(mem_store.read(3, "b-1"), reference_flat(data))


class _FailingCommit:
    """A kvstore whose COMMIT writes fail, as a full disk or a lost connection would make them."""

    def __init__(self, kv):
        self.kv, self.path = kv, kv.path

    def write(self, key, value, **kw):
        if key.endswith("COMMIT"):
            raise OSError("disk full")
        return self.kv.write(key, value, **kw)

    def __truediv__(self, other):
        return self.kv / other

    def __getattr__(self, name):
        return getattr(self.kv, name)


def test_failed_write_leaves_nothing_readable_and_is_retried(mem_store: RolloutStore):
    batch, data = make_batch()
    real = mem_store.kvstore
    mem_store.kvstore = _FailingCommit(real)
    with pytest.raises(OSError, match="disk full"):
        mem_store.write(batch)
    mem_store.kvstore = real
    assert len(real.list().result()) > 12  # arrays and meta.json are all there ...
    assert mem_store.list() == []  # ... but no batch is
    with pytest.raises(RolloutStoreError, match=r"v000003/b-1: COMMIT: missing"):
        mem_store.read(3, "b-1")
    mem_store.write(make_batch(seed=5)[0])  # the leftover is cleared and the new batch written whole
    assert_same(mem_store.read(3, "b-1"), reference_flat(make_batch(seed=5)[1]))


_WRITER = """
import dataclasses, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_rollouts import make_batch
from bridge.rollouts import RolloutBatch, RolloutStore
store = RolloutStore.open({store!r})
batches = [make_batch(seed=s, n=48, max_len=400)[0] for s in range(7)]  # the loop below only writes
for i in range(10**6):
    b = batches[i % 7]
    store.write(RolloutBatch(**{{**b.__dict__, "meta": dataclasses.replace(b.meta, batch_id=f"w{{i}}")}}))
    print(i, flush=True)
"""


def test_writer_killed_mid_write_leaves_only_complete_batches(tmp_path: Path):
    """A real writer process is SIGKILLed at an arbitrary point; every listed batch reads back whole."""
    script = _WRITER.format(
        root=str(Path(__file__).resolve().parents[3]), tests=str(Path(__file__).parent), store=str(tmp_path / "store")
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(3):  # let it commit a few batches, then kill it somewhere inside a later one
            assert proc.stdout.readline(), "the writer process died"
        time.sleep(0.013)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    store = RolloutStore.open(tmp_path / "store")
    listed = store.list()
    assert len(listed) >= 3
    for ref in listed:
        i = int(ref.batch_id[1:])
        assert_same(store.read(ref.version, ref.batch_id), reference_flat(make_batch(seed=i % 7, n=48, max_len=400)[1]))
    dirs = {p.name for p in (tmp_path / "store" / "v000003").iterdir()}
    for leftover in dirs - {ref.batch_id for ref in listed}:
        with pytest.raises(RolloutStoreError, match="COMMIT: missing"):
            store.read(3, leftover)


@pytest.mark.parametrize(
    "version, batch_id",
    [
        (3, "../escape"),
        (3, "a/b"),
        (3, ""),
        (3, ".hidden"),
        (3, "x" * 129),
        (3, "a\nb"),
        (3, "b\\c"),
        (-1, "ok"),
        (True, "ok"),
        ("3", "ok"),
        (2.0, "ok"),
    ],
)
def test_paths_that_escape_or_are_malformed_are_refused(tmp_path: Path, version, batch_id):
    store = RolloutStore.open(tmp_path / "root" / "store")
    batch, _ = make_batch()
    bad = RolloutBatch(
        **{**batch.__dict__, "meta": BatchMeta(**{**batch.meta.__dict__, "version": version, "batch_id": batch_id})}
    )
    with pytest.raises(RolloutStoreError, match="version|batch_id"):
        store.write(bad)
    with pytest.raises(RolloutStoreError, match="version|batch_id"):
        store.read(version, batch_id)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def _invalid_cases() -> dict[str, RolloutBatch]:
    """Batches breaking one invariant each, keyed "field:what"."""
    b, _ = make_batch(seed=4)
    cases = {}

    def case(key: str, **arrays) -> None:
        cases[key] = RolloutBatch(**{**b.__dict__, **{k: np.asarray(v) for k, v in arrays.items()}})

    def edit(name: str, index: int, value) -> np.ndarray:
        arr = getattr(b, name).copy()
        arr[index] = value
        return arr

    lengths = np.diff(b.offsets)
    case("offsets:not_increasing", offsets=edit("offsets", 2, b.offsets[1]))
    case("offsets:end", offsets=edit("offsets", -1, b.offsets[-1] - 1))
    case("prompt_lens:whole_sample", prompt_lens=edit("prompt_lens", 1, lengths[1]))
    case("prompt_lens:empty", prompt_lens=edit("prompt_lens", 0, 0))
    case("tokens:negative", tokens=edit("tokens", 5, -1))
    case("logprobs:nan", logprobs=edit("logprobs", int(b.offsets[0] + b.prompt_lens[0]), np.nan))
    case("logprobs:on_prompt", logprobs=edit("logprobs", 0, -0.5))
    case("rewards:inf", rewards=edit("rewards", 3, np.inf))
    case("finish:range", finish=edit("finish", 0, 2))
    case("group_ids:negative", group_ids=edit("group_ids", 0, -4))
    case("proofs:partial_chunk", proofs=b.proofs[:-1], proof_offsets=edit("proof_offsets", -1, b.proof_offsets[-1] - 1))
    shifted = b.proof_offsets.copy()
    shifted[1] += 258  # sample 0 claims one chunk more than its completion has, sample 1 one less
    case("proof_offsets:vs_completion", proof_offsets=shifted)
    case("task_ids:dtype", task_ids=b.task_ids.astype(np.int32))
    case("group_ids:length", group_ids=b.group_ids[:-1])
    return cases


INVALID = _invalid_cases()


@pytest.mark.parametrize("case", sorted(INVALID))
def test_writer_refuses_invalid_batches_naming_the_field(mem_store: RolloutStore, case: str):
    field = case.split(":")[0]
    with pytest.raises(RolloutStoreError, match=rf"^rollout batch v000003/b-1: {field}: "):
        mem_store.write(INVALID[case])
    assert mem_store.kvstore.list().result() == []


@pytest.mark.parametrize("case", sorted(k for k in INVALID if not k.endswith((":dtype", ":length"))))
def test_reader_validates_batches_from_a_writer_that_skipped_the_checks(
    mem_store: RolloutStore, monkeypatch, case: str
):
    """A hostile worker can commit a batch whose hash matches; the reader's own checks still refuse it."""
    monkeypatch.setattr(rollouts.store, "check_batch", lambda batch, vocab_size=None: None)  # the writer's
    mem_store.write(INVALID[case])
    monkeypatch.undo()
    with pytest.raises(RolloutStoreError, match=rf"^rollout batch v000003/b-1: {case.split(':')[0]}: "):
        mem_store.read(3, "b-1")


def test_vocabulary_and_meta_checks(mem_store: RolloutStore):
    batch, data = make_batch(vocab=500)
    top = int(max(t.max() for t in data["tokens"]))
    mem_store.write(batch, vocab_size=top + 1)
    mem_store.read(3, "b-1", vocab_size=top + 1)
    with pytest.raises(RolloutStoreError, match=rf"b-1: tokens: token id >= vocabulary size {top}"):
        mem_store.read(3, "b-1", vocab_size=top)
    for key, value in [("node_key", "not-hex"), ("model_dtype", "int8"), ("assignment_id", -1)]:
        bad = RolloutBatch(
            **{**batch.__dict__, "meta": BatchMeta(**{**batch.meta.__dict__, "batch_id": "b-2", key: value})}
        )
        with pytest.raises(RolloutStoreError, match=rf"v000003/b-2: meta.{key}: "):
            mem_store.write(bad)
    with pytest.raises(RolloutStoreError, match=r"b-1: COMMIT: sha256 .* differs from the accepted 0+"):
        mem_store.read(3, "b-1", expect_sha256="0" * 64)
    with pytest.raises(RolloutStoreError, match=r"b-1: meta.json: declares \d+ bytes of arrays, more than"):
        mem_store.read(3, "b-1", max_batch_bytes=1000)


def test_meta_must_describe_the_batch_at_its_path(mem_store: RolloutStore):
    batch, _ = make_batch()
    mem_store.write(batch)
    for key in mem_store.kvstore.list().result():  # copy v000003/b-1 to v000004/b-1, COMMIT included
        mem_store.kvstore.write(b"v000004" + key[7:], mem_store.kvstore.read(key).result().value).result()
    with pytest.raises(RolloutStoreError, match=r"v000004/b-1: meta.json: describes v000003/b-1"):
        mem_store.read(4, "b-1")


def test_listing_window_newest_first_and_pruning(tmp_path: Path):
    store = RolloutStore.open(tmp_path / "s")
    for version, batch_id in [(1, "a"), (2, "b"), (2, "a"), (3, "c"), (1000000, "z")]:
        store.write(make_batch(version=version, batch_id=batch_id, n=2, group=2)[0])
    store.kvstore.write("v000003/partial/meta.json", b"{}").result()  # a batch being written: not listed
    store.kvstore.write("v3/x/COMMIT", b"0" * 64).result()  # not a name this store writes
    assert store.list() == [
        BatchRef(1000000, "z"),
        BatchRef(3, "c"),
        BatchRef(2, "a"),
        BatchRef(2, "b"),
        BatchRef(1, "a"),
    ]
    assert store.list(min_version=2, max_version=3) == [BatchRef(3, "c"), BatchRef(2, "a"), BatchRef(2, "b")]
    assert store.prune(3) == [BatchRef(2, "a"), BatchRef(2, "b"), BatchRef(1, "a")]
    assert store.list() == [BatchRef(1000000, "z"), BatchRef(3, "c")]
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["v000003", "v1000000", "v3"]
    assert store.prune(4) == [BatchRef(3, "c")]  # uncommitted leftovers of pruned versions go too
    assert not (tmp_path / "s" / "v000003").exists()
    store.read(1000000, "z")


def test_prune_removes_commit_first(mem_store: RolloutStore, monkeypatch):
    for batch_id in ("a", "b"):
        mem_store.write(make_batch(version=1, batch_id=batch_id, n=2, group=2)[0])
    order = []
    kv = mem_store.kvstore

    class Recording:
        path = kv.path

        def write(self, key, value, **kw):
            order.append(("write", key))
            return kv.write(key, value, **kw)

        def delete_range(self, rng):
            order.append(("delete_range", rng.inclusive_min))
            return kv.delete_range(rng)

        def __getattr__(self, name):
            return getattr(kv, name)

    mem_store.kvstore = Recording()
    mem_store.prune(2)
    assert order == [("write", "v000001/a/COMMIT"), ("write", "v000001/b/COMMIT"), ("delete_range", b"v000001/")]
    assert kv.list().result() == []


def test_open_accepts_paths_urls_and_specs(tmp_path: Path, monkeypatch):
    batch, data = make_batch()
    RolloutStore.open(str(tmp_path / "p")).write(batch)
    monkeypatch.chdir(tmp_path)
    spec = {"driver": "file", "path": str(tmp_path / "p")}
    for location in ["p", f"file://{tmp_path}/p", f"file://{tmp_path}/p/", spec]:
        store = RolloutStore.open(location)
        assert store.url == f"file://{tmp_path}/p/"
        assert_same(store.read(3, "b-1"), reference_flat(data))
    assert RolloutStore.open("gs://bucket/run/rollouts").kvstore.spec().to_json() == {
        "driver": "gcs",
        "bucket": "bucket",
        "path": "run/rollouts/",
    }
    with pytest.raises(ValueError, match="rollout store: cannot open"):
        RolloutStore.open("nosuchscheme://x")
    with pytest.raises(ValueError, match="compression 'lzma' is not one of"):
        RolloutStore.open("memory://", compression="lzma")


def test_from_samples_refuses_lossy_casts():
    data = samples(np.random.default_rng(0))
    data["task_ids"] = [2**40] * 6
    data["tokens"][0] = np.array([1, 2, 2**33], np.int64)
    with pytest.raises(RolloutStoreError, match="tokens: values do not fit int32"):
        RolloutBatch.from_samples(make_batch()[0].meta, **data)
    data = samples(np.random.default_rng(0))
    data["rewards"] = data["rewards"][:5]
    with pytest.raises(RolloutStoreError, match="rewards: 5 entries for 6 samples"):
        RolloutBatch.from_samples(make_batch()[0].meta, **data)


def test_store_file_is_independent_of_the_working_directory(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RolloutStore.open("rel/store")
    store.write(make_batch()[0])
    assert os.path.isfile(tmp_path / "rel" / "store" / "v000003" / "b-1" / "COMMIT")


def _with_full_logprobs(seed: int = 5) -> tuple[RolloutBatch, dict, list[np.ndarray]]:
    """A batch whose worker recorded full-distribution logprobs: processed + log(kept top-p mass) <= processed."""
    batch, data = make_batch(seed=seed)
    rng = np.random.default_rng(seed)
    full = []
    for lp, p in zip(data["logprobs"], data["prompt_lens"]):
        f = lp.copy()
        f[p:] += np.log(rng.uniform(0.85, 1.0, len(lp) - p)).astype(np.float32)
        full.append(f)
    return RolloutBatch.from_samples(batch.meta, **data, full_logprobs=full), data, full


def test_full_logprobs_are_optional_hashed_when_present_and_read_back(tmp_path: Path):
    batch, data, full = _with_full_logprobs()
    store = RolloutStore.open(tmp_path / "store")
    digest = store.write(batch)
    root = tmp_path / "store" / "v000003" / "b-1"
    flat = {**reference_flat(data), "full_logprobs": np.concatenate(full)}
    assert digest == reference_digest(flat, (root / "meta.json").read_bytes(), SCHEMA + [("full_logprobs", "<f4")])
    again = store.read(3, "b-1", expect_sha256=digest)
    np.testing.assert_array_equal(again.full_logprobs, flat["full_logprobs"])
    np.testing.assert_array_equal(again.sample_ratio_logprobs(2), full[2])
    old, _ = make_batch(seed=5, batch_id="b-2")  # a batch without the field (older writers) reads as before
    store.write(old)
    back = store.read(3, "b-2")
    assert back.full_logprobs is None and not (root.parent / "b-2" / "full_logprobs").exists()
    np.testing.assert_array_equal(back.sample_ratio_logprobs(2), data["logprobs"][2])
    # removing the field from a committed batch breaks its digest: presence is part of what was committed
    for path in sorted((root / "full_logprobs").iterdir(), reverse=True):
        path.unlink()
    (root / "full_logprobs").rmdir()
    with pytest.raises(RolloutStoreError, match="COMMIT: the batch's canonical sha256"):
        store.read(3, "b-1")


def test_full_logprobs_above_the_processed_ones_or_on_prompts_are_refused(mem_store: RolloutStore):
    batch, data, full = _with_full_logprobs()
    above = [f.copy() for f in full]
    above[1][-1] = data["logprobs"][1][-1] + 0.01  # a kept mass above 1
    on_prompt = [f.copy() for f in full]
    on_prompt[0][0] = -0.3
    for values, reason in ((above, "above the processed one"), (on_prompt, "on a prompt token")):
        bad = RolloutBatch.from_samples(batch.meta, **data, full_logprobs=values)
        with pytest.raises(RolloutStoreError, match=f"^rollout batch v000003/b-1: full_logprobs: .*{reason}"):
            mem_store.write(bad)
