"""Random corruption of stored batches: the reader raises `RolloutStoreError` or returns exactly the original.

A valid batch is written once; every example copies its stored files into a fresh `memory://` store, applies
one to three random corruptions (flipped, truncated, appended or replaced bytes; a deleted file; a changed
JSON value in `meta.json` or an array's `zarr.json`; a changed array element written through tensorstore, so
that the encoding stays valid; two same-shaped arrays swapped) and reads the batch. Any exception other than
`RolloutStoreError` fails the test, and so does a successful read that differs from the original in any array
element, dtype or meta field.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_rollouts import make_batch

from bridge.rollouts import FIELD_NAMES, RolloutStore, RolloutStoreError, canonical_sha256, meta_json

ORIGINAL, _ = make_batch(seed=11, n=4, group=2, max_len=70)
_PRISTINE = RolloutStore.open("memory://")
DIGEST = _PRISTINE.write(ORIGINAL)
FILES = {key.decode(): _PRISTINE.kvstore.read(key).result().value for key in _PRISTINE.kvstore.list().result()}
KEYS = sorted(FILES)
JSON_KEYS = [k for k in KEYS if k.endswith(".json")]
SAME_SHAPE = [
    ("group_ids", "target_lens"),
    ("prompt_lens", "group_ids"),
    ("offsets", "proof_offsets"),
    ("task_ids", "offsets"),
]

json_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(0, 2**40), max_size=2),
    st.sampled_from(
        [
            "int32",
            "int64",
            "float32",
            "uint8",
            "float64",
            "zstd",
            "blosc",
            "big",
            "gzip",
            "crc32c",
            "regular",
            "default",
        ]
    ),
)


def _leaves(doc, path=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, path + (i,))
    yield path


def _set(doc, path, value):
    if not path:
        return value
    doc[path[0]] = _set(doc[path[0]], path[1:], value)
    return doc


@st.composite
def corruption(draw):
    kind = draw(st.sampled_from(["flip", "truncate", "append", "replace", "delete", "json", "element", "swap"]))
    if kind == "json":
        key = draw(st.sampled_from(JSON_KEYS))
        doc = json.loads(FILES[key])
        paths = list(_leaves(doc))
        return kind, key, draw(st.sampled_from(paths)), draw(json_values)
    if kind == "element":
        name = draw(st.sampled_from(FIELD_NAMES))
        size = len(getattr(ORIGINAL, name))
        return kind, name, draw(st.integers(0, size - 1)), draw(st.integers(-(2**31), 2**31 - 1))
    if kind == "swap":
        return (kind, *draw(st.sampled_from(SAME_SHAPE)))
    key = draw(st.sampled_from(KEYS))
    size = len(FILES[key])
    if kind == "flip":
        return kind, key, draw(st.integers(0, max(size - 1, 0))), draw(st.integers(1, 255))
    if kind == "truncate":
        return kind, key, draw(st.integers(0, max(size - 1, 0)))
    if kind in ("append", "replace"):
        return kind, key, draw(st.binary(max_size=64))
    return kind, key


def _apply(store: RolloutStore, op) -> None:
    kv = store.kvstore
    kind, key = op[0], op[1]
    if kind in ("flip", "truncate", "append", "replace", "delete", "json"):
        current = kv.read(key).result()
        data = current.value if current.state == "value" else b""
        if kind == "flip" and data:
            pos = op[2] % len(data)
            data = data[:pos] + bytes([data[pos] ^ op[3]]) + data[pos + 1 :]
        elif kind == "truncate":
            data = data[: op[2]]
        elif kind == "append":
            data = data + op[2]
        elif kind == "replace":
            data = op[2]
        elif kind == "json":
            try:
                data = json.dumps(_set(json.loads(data), op[2], op[3])).encode()
            except (ValueError, KeyError, IndexError, TypeError):
                data = data[:-1]  # an earlier corruption broke the JSON: break it further
        kv.write(key, None if kind == "delete" else data).result()
    elif kind == "element":
        prefix = f"{ORIGINAL.ref.path}/{key}/"
        try:
            arr = ts.open({"driver": "zarr3"}, kvstore=kv / prefix, context=store.context, open=True).result()
            dtype = arr.dtype.numpy_dtype
            value = np.array(op[3]).astype(dtype) if dtype.kind in "iuf" else op[3]
            arr[op[2] % max(arr.shape[0], 1)] = value
        except (ValueError, IndexError, TypeError, OverflowError):
            pass  # earlier corruptions left no array to write into
    elif kind == "swap":
        a, b = (f"{ORIGINAL.ref.path}/{name}/0" for name in (op[1], op[2]))
        va, vb = kv.read(a).result().value, kv.read(b).result().value
        kv.write(a, vb).result()
        kv.write(b, va).result()


def _assert_original(batch) -> None:
    assert batch.meta == ORIGINAL.meta
    for name in FIELD_NAMES:
        got, want = getattr(batch, name), getattr(ORIGINAL, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got, want), f"{name} was altered but read back without an error"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(corruption(), min_size=1, max_size=3))
def test_corrupted_batch_raises_store_error_or_reads_back_unaltered(ops):
    store = RolloutStore.open("memory://")
    for key, value in FILES.items():
        store.kvstore.write(key, value).result()
    for op in ops:
        _apply(store, op)
    try:
        batch = store.read(ORIGINAL.meta.version, ORIGINAL.meta.batch_id, vocab_size=500)
    except RolloutStoreError as e:
        assert e.batch == ORIGINAL.ref.path and e.field
        assert str(e).startswith(f"rollout batch {ORIGINAL.ref.path}: {e.field}: ")
        return
    _assert_original(batch)


def test_pristine_copy_reads_back():
    store = RolloutStore.open("memory://")
    for key, value in FILES.items():
        store.kvstore.write(key, value).result()
    _assert_original(store.read(ORIGINAL.meta.version, ORIGINAL.meta.batch_id))


def test_rewritten_and_recommitted_batch_is_refused_against_the_accepted_digest():
    """A worker that alters a batch after validation and writes a matching COMMIT passes the hash check,
    but not the check against the digest the validator accepted."""
    store = RolloutStore.open("memory://")
    for key, value in FILES.items():
        store.kvstore.write(key, value).result()
    prefix = ORIGINAL.ref.path + "/"
    rewards = ts.open(
        {"driver": "zarr3"}, kvstore=store.kvstore / (prefix + "rewards/"), open=True, context=store.context
    ).result()
    rewards[0] = 1e6
    arrays = {**ORIGINAL.arrays(), "rewards": rewards.read().result()}
    forged = canonical_sha256(arrays, meta_json(ORIGINAL.meta, 4, len(ORIGINAL.tokens), len(ORIGINAL.proofs)))
    store.kvstore.write(prefix + "COMMIT", forged.encode()).result()
    assert store.read(ORIGINAL.meta.version, ORIGINAL.meta.batch_id).rewards[0] == np.float32(1e6)
    with pytest.raises(RolloutStoreError, match=f"COMMIT: sha256 {forged} differs from the accepted {DIGEST}"):
        store.read(ORIGINAL.meta.version, ORIGINAL.meta.batch_id, expect_sha256=DIGEST)


_HOSTILE = """
import json, sys
sys.path[:0] = [{tests!r}, {root!r}]
import test_rollouts_corruption as T
from bridge.rollouts import RolloutStore, RolloutStoreError
cases = {{
    "chunk_shape 2**40": ("v000003/b-1/rewards/zarr.json", ("chunk_grid", "configuration", "chunk_shape", 0), 2**40),
    "chunk_shape 2**31": ("v000003/b-1/tokens/zarr.json", ("chunk_grid", "configuration", "chunk_shape", 0), 2**31),
    "shape 2**40": ("v000003/b-1/proofs/zarr.json", ("shape", 0), 2**40),
    "num_tokens 2**40": ("v000003/b-1/meta.json", ("num_tokens",), 2**40),
    "num_samples 2**28": ("v000003/b-1/meta.json", ("num_samples",), 2**28),
}}
out = {{}}
for name, (key, path, value) in cases.items():
    store = RolloutStore.open("memory://")
    for k, v in T.FILES.items():
        store.kvstore.write(k, v).result()
    T._apply(store, ("json", key, path, value))
    try:
        store.read(3, "b-1")
        out[name] = "read"
    except RolloutStoreError as e:
        out[name] = e.field
print(json.dumps(out))
"""


def test_sizes_that_would_exhaust_memory_are_refused_before_reading():
    """Declared sizes are checked before tensorstore allocates (a chunk of 2**40 elements aborts the process
    with std::bad_alloc otherwise), so this runs in a child process: a regression fails here, not the run."""
    here = Path(__file__).resolve()
    script = _HOSTILE.format(tests=str(here.parent), root=str(here.parents[3]))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "chunk_shape 2**40": "rewards",
        "chunk_shape 2**31": "tokens",
        "shape 2**40": "proofs",
        "num_tokens 2**40": "meta.json",
        "num_samples 2**28": "meta.json",
    }
