"""The upload stream of a batch (bridge/upload.py, docs/design.md section 6): encoded from a batch's arrays without
copying, decoded in pieces of any size into exactly the batch and its canonical digest (checked against the
rollout store's own digest of the batch), and refused with the field named when it breaks its framing, names
another batch, declares more than the assignment allows, or is not as long as meta.json implies."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from bridge.rollouts import BatchMeta, ReadLimits, RolloutBatch, RolloutStore, canonical_sha256, meta_json
from bridge.upload import UploadDecoder, UploadError, encode, max_stream_length, pieces_of

KEY = "ab" * 32


def batch(n: int = 4, full: bool = True, seed: int = 0) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, 8, n)
    completions = rng.integers(1, 40, n)
    lp = [
        np.concatenate([np.zeros(p, np.float32), -rng.random(c, np.float32) - 0.1])
        for p, c in zip(prompts, completions)
    ]
    return RolloutBatch.from_samples(
        BatchMeta("b-1", KEY, 3, 7, {"temperature": 0.6}),
        tokens=[rng.integers(0, 500, p + c) for p, c in zip(prompts, completions)],
        prompt_lens=prompts,
        logprobs=lp,
        task_ids=range(n),
        group_ids=[i // 2 for i in range(n)],
        seeds=range(n),
        finish=[0] * n,
        rewards=[1.0] * n,
        proofs=[rng.integers(0, 256, -(-int(c) // 32) * 258, dtype=np.uint8).tobytes() for c in completions],
        full_logprobs=[x - 0.01 * (x != 0) for x in lp] if full else None,
    )


def decoder(length: int, n: int = 4, **expect) -> UploadDecoder:
    fields = {"batch_id": "b-1", "node_key": KEY, "version": 3, "assignment_id": 7, **expect}
    return UploadDecoder(**fields, length=length, limits=ReadLimits.for_assignment(n, 64, 80))


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("piece", [1, 7, 4096, 10**7])
def test_any_pieces_decode_to_the_batch_and_its_commit_digest(tmp_path, full, piece):
    b = batch(full=full)
    length, pieces = encode(b)
    assert np.shares_memory(np.frombuffer(pieces[1], np.int32), b.tokens)  # the array itself, not a copy
    d = decoder(length)
    for p in pieces_of(pieces, piece):
        d.feed(p)
    assert d.done
    got = d.batch()
    assert all(np.array_equal(getattr(got, f), getattr(b, f)) for f, _, _ in b.fields())
    assert (got.full_logprobs is None) == (not full)
    store = RolloutStore.open(tmp_path / "store")  # the store's digest of the same batch, as an independent reference
    assert (
        d.sha256()
        == store.write(got)
        == canonical_sha256(b.arrays(), meta_json(b.meta, 4, len(b.tokens), len(b.proofs)))
    )


def test_refusals_name_the_field():
    b = batch()
    length, pieces = encode(b)
    stream = b"".join(bytes(p) for p in pieces)
    for expect, field in (
        ({"batch_id": "b-2"}, "meta.batch_id"),
        ({"version": 4}, "meta.version"),
        ({"assignment_id": 8}, "meta.assignment_id"),
        ({"node_key": "cd" * 32}, "meta.node_key"),
    ):
        with pytest.raises(UploadError) as err:
            decoder(length, **expect).feed(stream)
        assert err.value.field == field, err.value
    with pytest.raises(UploadError) as err:  # more samples than the assignment has
        UploadDecoder(
            batch_id="b-1",
            node_key=KEY,
            version=3,
            assignment_id=7,
            length=length,
            limits=ReadLimits.for_assignment(2, 64, 80),
        ).feed(stream)
    assert err.value.status == 413 and err.value.field == "meta.num_samples"
    with pytest.raises(UploadError, match="make a .*-byte stream"):  # Content-Length other than meta.json implies
        decoder(length + 4).feed(stream)
    with pytest.raises(UploadError, match="longer than"):
        decoder(length).feed(stream + b"x")
    with pytest.raises(UploadError, match="more than the 65536"):  # a meta.json length beyond the bound
        decoder(length).feed(struct.pack("<I", 1 << 20))
    evil = dataclasses.replace(b, meta=BatchMeta("../x", KEY, 3, 7, {}))
    with pytest.raises(UploadError) as err:
        decoder(encode(evil)[0]).feed(b"".join(bytes(p) for p in encode(evil)[1]))
    assert err.value.field == "meta.batch_id"
    flags = bytearray(stream)
    flags[4 + struct.unpack("<I", stream[:4])[0]] = 0x80  # an optional field this pool does not know
    with pytest.raises(UploadError, match="flags"):
        decoder(length).feed(bytes(flags))


def test_the_longest_stream_bounds_every_batch_within_the_limits():
    limits = ReadLimits.for_assignment(4, 64, 80)
    assert encode(batch())[0] <= max_stream_length(limits)
    assert max_stream_length(limits) < 4 * 80 * 12 + 4 * 2 * 258 + (1 << 16) + 200 + 4 * 60
