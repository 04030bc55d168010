"""Schema 2 of rollout batches: the per-token `sampled` mask of multi-turn episodes (docs/design.md section 6).

A schema-2 batch's digest, built here byte by byte from the documented definition, covers the mask; changing one
bit of it in the store is caught; every invariant of the mask is refused by name on write and on read; the
upload stream carries it; and a schema-1 batch still writes, reads and hashes exactly as before, its mask being
its completion tokens.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest
from test_rollouts import SCHEMA, reference_digest, reference_flat, samples

from bridge.rollouts import (
    FIELDS,
    BatchMeta,
    ReadLimits,
    RolloutBatch,
    RolloutStore,
    RolloutStoreError,
    canonical_sha256,
    meta_json,
)
from bridge.upload import UploadDecoder, UploadError, encode, max_stream_length

META = BatchMeta("b-1", "ab" * 32, version=3, assignment_id=7, sampling={"temperature": 1.0}, model_dtype="float32")


def episode_data(seed: int = 0, n: int = 4) -> dict:
    """Per-sample data of a valid schema-2 batch: each sample a prompt, then model turns (sampled) separated by
    environment turns (not sampled), ending with a model turn; logprobs only on sampled tokens; proofs sized by
    the sampled tokens."""
    rng = np.random.default_rng(seed)
    out = {k: [] for k in ("tokens", "prompt_lens", "logprobs", "proofs", "sampled")}
    for _ in range(n):
        prompt = int(rng.integers(1, 12))
        mask = [0] * prompt
        for turn in range(int(rng.integers(1, 4))):
            if turn:
                mask += [0] * int(rng.integers(1, 9))  # an environment turn
            mask += [1] * int(rng.integers(1, 40))  # a model turn
        mask = np.array(mask, np.uint8)
        logprobs = np.where(mask == 1, -rng.exponential(1.0, len(mask)), 0.0).astype(np.float32)
        out["tokens"].append(rng.integers(0, 500, len(mask)).astype(np.int32))
        out["prompt_lens"].append(prompt)
        out["logprobs"].append(logprobs)
        out["sampled"].append(mask)
        out["proofs"].append(rng.integers(0, 256, 258 * -(-int(mask.sum()) // 32), dtype=np.uint8).tobytes())
    out.update(
        task_ids=rng.integers(0, 100, n),
        group_ids=np.arange(n) // 2,
        seeds=rng.integers(0, 2**63, n),
        finish=rng.integers(0, 2, n),
        rewards=rng.random(n).astype(np.float32),
        target_lens=np.zeros(n, np.int64),
    )
    return out


def episode_batch(seed: int = 0, **changes) -> tuple[RolloutBatch, dict]:
    data = {**episode_data(seed), **changes}
    return RolloutBatch.from_samples(META, **data), data


def reference_digest_v2(flat: dict, sampled: np.ndarray, meta_bytes: bytes) -> str:
    """Schema 2's canonical bytes as design.md section 6 defines them: its own domain, the schema-1 fields,
    then `sampled`, then meta.json."""
    canon = b"intellect-rollout-batch/2\n"
    for name, dtype in [*SCHEMA, ("sampled", "u1")]:
        values = np.asarray(sampled if name == "sampled" else flat[name]).astype(dtype)
        canon += name.encode() + b"\n" + np.dtype(dtype).name.encode() + b"\n" + struct.pack("<Q", len(values))
        canon += hashlib.sha256(values.tobytes()).digest()
    canon += b"meta.json\n" + struct.pack("<Q", len(meta_bytes)) + hashlib.sha256(meta_bytes).digest()
    return hashlib.sha256(canon).hexdigest()


@pytest.fixture
def store(tmp_path) -> RolloutStore:
    return RolloutStore.open(tmp_path / "store")


def test_schema_2_digest_covers_the_mask_and_roundtrips(store, tmp_path):
    batch, data = episode_batch()
    assert batch.schema == 2
    digest = store.write(batch)
    root = tmp_path / "store" / "v000003" / "b-1"
    meta_bytes = (root / "meta.json").read_bytes()
    assert json.loads(meta_bytes)["schema"] == 2
    sampled = np.concatenate(data["sampled"])
    assert digest == reference_digest_v2(reference_flat(data), sampled, meta_bytes)
    assert digest == canonical_sha256(batch.arrays(), meta_bytes)
    back = store.read(3, "b-1", expect_sha256=digest)
    np.testing.assert_array_equal(back.sampled, sampled)
    for i in range(batch.num_samples):
        np.testing.assert_array_equal(back.sample_mask(i), data["sampled"][i])
    np.testing.assert_array_equal(back.token_mask(), sampled)

    # one bit of the mask changed: another digest, and the stored batch altered so is refused
    flipped = sampled.copy()
    k = int(np.flatnonzero(flipped == 1)[-1])
    flipped[k] = 0
    assert reference_digest_v2(reference_flat(data), flipped, meta_bytes) != digest
    import tensorstore as ts

    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{root / 'sampled'}/"}).result()
    arr[k].write(0).result()
    with pytest.raises(RolloutStoreError, match=r"v000003/b-1: COMMIT: the batch's canonical sha256"):
        store.read(3, "b-1")


def test_schema_1_batches_read_as_before_with_their_completion_as_the_mask(store, tmp_path):
    data = samples(np.random.default_rng(3))
    batch = RolloutBatch.from_samples(META, **data)
    assert batch.schema == 1 and batch.sampled is None
    digest = store.write(batch)
    meta_bytes = (tmp_path / "store" / "v000003" / "b-1" / "meta.json").read_bytes()
    assert json.loads(meta_bytes)["schema"] == 1
    assert digest == reference_digest(reference_flat(data), meta_bytes)  # the schema-1 digest, unchanged
    assert not (tmp_path / "store" / "v000003" / "b-1" / "sampled").exists()
    back = store.read(3, "b-1")
    assert back.sampled is None and back.schema == 1
    for i in range(back.num_samples):
        want = np.r_[np.zeros(data["prompt_lens"][i]), np.ones(len(data["tokens"][i]) - data["prompt_lens"][i])]
        np.testing.assert_array_equal(back.sample_mask(i), want)
    np.testing.assert_array_equal(back.token_mask(), np.concatenate([back.sample_mask(i) for i in range(6)]))


def _invalid() -> dict[str, RolloutBatch]:
    """Schema-2 batches that break one invariant each, keyed by the field the error must name."""
    good = episode_data()
    cases = {}

    def case(key: str, **changes):
        cases[key] = RolloutBatch.from_samples(META, **{**good, **changes})  # from_samples only concatenates

    masks = good["sampled"]
    two = [m.copy() for m in masks]
    two[1][-1] = 2
    case("sampled:not 0 or 1", sampled=two)
    on_prompt = [m.copy() for m in masks]
    on_prompt[0][0] = 1
    case("sampled:prompt", sampled=on_prompt)
    late = [m.copy() for m in masks]
    late[2][good["prompt_lens"][2]] = 0  # the first completion token unsampled
    lp = [x.copy() for x in good["logprobs"]]
    lp[2][good["prompt_lens"][2]] = 0
    case("sampled:first", sampled=late, logprobs=lp)
    tail = [m.copy() for m in masks]
    tail[3][-1] = 0  # ends with an environment token
    lp = [x.copy() for x in good["logprobs"]]
    lp[3][-1] = 0
    case("sampled:last", sampled=tail, logprobs=lp)
    env_lp = [x.copy() for x in good["logprobs"]]
    gaps = [i for i, m in enumerate(masks) if (np.diff(m[good["prompt_lens"][i] :].astype(int)) != 0).any()]
    i = gaps[0]
    j = int(np.flatnonzero(masks[i][good["prompt_lens"][i] :] == 0)[0]) + good["prompt_lens"][i]
    env_lp[i][j] = -0.5  # a logprob claimed for an environment token
    case("logprobs:env", logprobs=env_lp)
    proofs = list(good["proofs"])
    proofs[0] = proofs[0] + bytes(258)  # proofs for more sampled tokens than the mask holds
    case("proof_offsets:sampled", proofs=proofs)
    return cases


INVALID = _invalid()


@pytest.mark.parametrize("case", sorted(INVALID))
def test_mask_invariants_are_refused_by_name_on_write_and_on_read(store, monkeypatch, case):
    field = case.split(":")[0]
    with pytest.raises(RolloutStoreError, match=rf"^rollout batch v000003/b-1: {field}: "):
        store.write(INVALID[case])
    from bridge import rollouts

    monkeypatch.setattr(rollouts.store, "check_batch", lambda batch, vocab_size=None: None)  # a hostile writer
    store.write(INVALID[case])
    monkeypatch.undo()
    with pytest.raises(RolloutStoreError, match=rf"^rollout batch v000003/b-1: {field}: "):
        store.read(3, "b-1")


def test_a_schema_2_meta_without_the_mask_and_an_unknown_schema_are_refused(store, tmp_path):
    data = samples(np.random.default_rng(4))
    store.write(RolloutBatch.from_samples(META, **data))  # schema 1, then meta.json claims schema 2
    root = tmp_path / "store" / "v000003" / "b-1"
    meta = json.loads((root / "meta.json").read_bytes())
    for schema, message in ((2, r"sampled: zarr.json missing"), (3, r"meta.schema: 3: this reader knows schemas 1, 2")):
        meta["schema"] = schema
        raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        (root / "meta.json").write_bytes(raw)
        arrays = RolloutBatch.from_samples(META, **data).arrays()
        (root / "COMMIT").write_bytes(canonical_sha256(arrays, raw).encode() + b"\n")
        with pytest.raises(RolloutStoreError, match=message):
            store.read(3, "b-1")


def test_the_upload_stream_carries_the_mask_within_its_bounds():
    batch, _ = episode_batch(5)
    length, pieces = encode(batch)
    meta = meta_json(META, batch.num_samples, len(batch.tokens), len(batch.proofs), 2)
    assert bytes(pieces[0])[4:-1] == meta
    limits = ReadLimits.for_assignment(batch.num_samples, max_tokens=200, max_model_len=300)
    assert length <= max_stream_length(limits)
    decoder = UploadDecoder(
        batch_id="b-1", node_key="ab" * 32, version=3, assignment_id=7, length=length, limits=limits
    )
    for piece in pieces:
        decoder.feed(piece)
    got = decoder.batch()
    np.testing.assert_array_equal(got.sampled, batch.sampled)
    assert decoder.sha256() == canonical_sha256(batch.arrays(), meta)
    # the same values announced as schema 1 would be a stream T bytes shorter than meta.json implies
    short = UploadDecoder(
        batch_id="b-1", node_key="ab" * 32, version=3, assignment_id=7, length=length - len(batch.tokens), limits=limits
    )
    with pytest.raises(UploadError, match="stream"):
        short.feed(pieces[0])
    assert [name for name, _, _ in FIELDS] == [name for name, _ in SCHEMA]
