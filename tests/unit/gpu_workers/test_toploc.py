"""TOPLOC codec against vectors made with the reference `toploc` 0.1.6, torch's own top-k, and malformed input.

The vectors are vendored in `tests/vectors/toploc/` (its README says how they were made).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_workers.toploc import (
    NO_MATCH,
    PRIME,
    ChunkCheck,
    Thresholds,
    _topk_indices,
    build_proofs,
    build_proofs_batch,
    verify_proofs,
)

VECTORS = next(p for p in Path(__file__).resolve().parents if p.name == "tests") / "vectors" / "toploc"
ACCEPTED = ("identical", "scale_1.01", "noise_0.004")
REJECTED = ("scale_1.10", "other")


def _case_list() -> list[dict]:
    return json.loads((VECTORS / "cases.json").read_text())["cases"]


def _cases() -> list:
    return [pytest.param(c, id=c["file"].removesuffix(".npz")) for c in _case_list()]


def _load(case: dict) -> dict[str, np.ndarray]:
    with np.load(VECTORS / case["file"]) as z:
        return {key: z[key] for key in z.files}


def _reference_proofs(case: dict, arrays: dict[str, np.ndarray]) -> list[bytes]:
    blob = arrays["proofs"].tobytes()
    offsets = np.cumsum([0, *case["proof_bytes"]])
    return [blob[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _random_hidden(rows: int, hidden: int, seed: int = 0) -> np.ndarray:
    import ml_dtypes

    values = np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32)
    return values.astype(ml_dtypes.bfloat16).view(np.uint16)


@pytest.mark.parametrize("case", _cases())
def test_build_matches_reference_bytes(case):
    arrays = _load(case)
    assert build_proofs(arrays["acts_identical"], chunk=case["chunk"], topk=case["topk"]) == _reference_proofs(
        case, arrays
    )


@pytest.mark.parametrize("case", _cases())
def test_verify_matches_reference_results(case):
    arrays = _load(case)
    proofs = _reference_proofs(case, arrays)
    for name, expected in case["results"].items():
        checks = verify_proofs(arrays[f"acts_{name}"], proofs, chunk=case["chunk"], topk=case["topk"])
        assert [c.exp_mismatches for c in checks] == [e[0] for e in expected], name
        for check, (_, mean, median) in zip(checks, expected):
            assert check.mant_err_mean == pytest.approx(mean, rel=1e-9, abs=0), name
            assert check.mant_err_median == pytest.approx(median, rel=1e-9, abs=0), name


@pytest.mark.parametrize("case", _cases())
def test_reference_thresholds_accept_and_reject(case):
    arrays = _load(case)
    proofs = _reference_proofs(case, arrays)
    for name in ACCEPTED + REJECTED:
        accepted = Thresholds().accepts(verify_proofs(arrays[f"acts_{name}"], proofs))
        assert accepted == (name in ACCEPTED), name


def test_batch_of_samples_matches_reference_bytes():
    """All vector cases (different hidden sizes and lengths) plus short samples in one `build_proofs_batch`."""
    cases = [c for c in _case_list() if (c["chunk"], c["topk"]) == (32, 128)]
    arrays = [_load(c) for c in cases]
    short = [_random_hidden(1, 64, seed=4), _random_hidden(33, 64, seed=5)]  # chunks of fewer than 128 entries
    batch = build_proofs_batch([a["acts_identical"] for a in arrays] + short)
    assert batch[: len(cases)] == [_reference_proofs(c, a) for c, a in zip(cases, arrays)]
    assert batch[len(cases) :] == [build_proofs(h) for h in short]
    assert build_proofs_batch([]) == []


@pytest.mark.parametrize("case", _cases())
def test_torch_tensor_input_gives_the_same_bytes(case):
    torch = pytest.importorskip("torch")
    arrays = _load(case)
    bits = arrays["acts_identical"]
    tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    assert build_proofs(tensor) == build_proofs(bits)
    assert verify_proofs(tensor, build_proofs(bits)) == verify_proofs(bits, build_proofs(bits))


def test_modulus_is_searched_downward_when_indices_collide():
    """Cases 3 and 5 each hold a chunk whose top-k indices collide mod 65497 (README of the vectors)."""
    cases = {c["file"]: c for c in _case_list()}
    for name in ("case_3.npz", "case_5.npz"):
        arrays = _load(cases[name])
        ours = build_proofs(arrays["acts_identical"])
        moduli = [int.from_bytes(p[:2], "big") for p in ours]
        assert moduli[0] == 65496 and all(m == PRIME for m in moduli[1:]), (name, moduli)
        assert ours == _reference_proofs(cases[name], arrays)


@pytest.mark.parametrize("topk", [128, 1, 2, 7, 33, 64])
def test_proof_format_against_a_plain_python_evaluation(topk):
    """Big-endian modulus then ascending coefficients: evaluating with Python ints gives back the bits, for
    odd and even numbers of points (the field arithmetic reduces lazily, every other pass)."""
    rng = np.random.default_rng(1)
    magnitude = rng.permutation(40 * 256) + 0x3000  # distinct finite |values|: the top-k has no tie
    bits = (magnitude | (rng.integers(0, 2, magnitude.size) << 15)).astype(np.uint16).reshape(40, 256)
    for row0, proof in zip((0, 32), build_proofs(bits, topk=topk)):
        assert len(proof) == 2 + 2 * topk
        flat = bits[row0 : row0 + 32].reshape(-1)
        order = np.argsort(flat & 0x7FFF)[::-1]
        modulus = int.from_bytes(proof[:2], "big")
        coeffs = [int.from_bytes(proof[i : i + 2], "big") for i in range(2, len(proof), 2)]
        for index in order[:topk].tolist():
            x = index % modulus
            assert sum(c * pow(x, j, PRIME) for j, c in enumerate(coeffs)) % PRIME == int(flat[index]) % PRIME
        assert Thresholds().accepts(verify_proofs(bits[row0 : row0 + 32], [proof], topk=topk))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("size,k", [(300, 128), (4096, 128), (8192, 128), (131072, 128), (5000, 7)])
def test_topk_ties_are_broken_as_torch_cpu_does(size, k, threads, monkeypatch):
    """bf16 ties at the k-th value are common; each row's set must be the reference's 1-D `abs().topk(k)`,
    whether the rows go to torch in one 2-D call (one thread) or one by one (more threads)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    rng = np.random.default_rng(size + k)
    rows = [
        rng.integers(-5, 6, size),
        np.round(rng.standard_normal(size), 1),
        rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 3.0, -3.0], size),
    ]
    tensor = torch.from_numpy(np.stack(rows).astype(np.float32)).to(torch.bfloat16)
    bits = tensor.view(torch.int16).numpy().view(np.uint16)
    batched = _topk_indices(bits, k)
    for row in range(len(rows)):
        expected = set(tensor[row].abs().topk(k).indices.tolist())  # what toploc 0.1.6 calls per chunk
        assert set(batched[row].tolist()) == expected, row
        assert set(_topk_indices(bits[row : row + 1], k)[0].tolist()) == expected, row


def _rejects(check: ChunkCheck, topk: int = 128) -> bool:
    return check == ChunkCheck(topk, NO_MATCH, NO_MATCH)


def test_malformed_proofs_reject():
    bits = _random_hidden(40, 128)
    genuine = build_proofs(bits)
    assert Thresholds().accepts(verify_proofs(bits, genuine))
    proof = genuine[0]
    coeffs = proof[2:]
    malformed = {
        "empty": b"",
        "short": proof[:-1],
        "long": proof + b"\x00",
        "modulus only": proof[:2],
        "modulus 0": b"\x00\x00" + coeffs,
        "modulus below topk": (100).to_bytes(2, "big") + coeffs,
        "modulus 65498": (65498).to_bytes(2, "big") + coeffs,
        "modulus 65535": b"\xff\xff" + coeffs,
        "coefficient >= prime": proof[:2] + (PRIME).to_bytes(2, "big") + coeffs[2:],
        "not bytes": "a string",
        "none": None,
    }
    for name, bad in malformed.items():
        checks = verify_proofs(bits, [bad, genuine[1]])
        assert _rejects(checks[0]) and not _rejects(checks[1]), name
        assert not Thresholds().accepts(checks), name


def test_proof_count_must_match_chunk_count():
    bits = _random_hidden(40, 128)
    genuine = build_proofs(bits)
    fewer = verify_proofs(bits, genuine[:1])
    more = verify_proofs(bits, genuine + [genuine[0]])
    assert len(fewer) == 2 and _rejects(fewer[1]) and not Thresholds().accepts(fewer)
    assert len(more) == 3 and _rejects(more[2]) and not Thresholds().accepts(more)
    assert verify_proofs(bits, []) == [ChunkCheck(128, NO_MATCH, NO_MATCH)] * 2
    assert verify_proofs(bits, None) == [ChunkCheck(128, NO_MATCH, NO_MATCH)] * 2
    assert not Thresholds().accepts([])
    assert build_proofs(bits[:0]) == [] and not Thresholds().accepts(verify_proofs(bits[:0], []))


def test_chunk_smaller_than_topk_commits_to_all_entries():
    bits = _random_hidden(33, 64)  # the second chunk has 64 entries
    proofs = build_proofs(bits)
    assert [len(p) for p in proofs] == [258, 2 + 2 * 64]
    assert Thresholds().accepts(verify_proofs(bits, proofs))
    assert not Thresholds().accepts(verify_proofs(bits, [proofs[0], proofs[0]]))


_HYPOTHESIS_BITS = _random_hidden(40, 128, seed=2)
_HYPOTHESIS_PROOFS = build_proofs(_HYPOTHESIS_BITS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.one_of(st.binary(max_size=300), st.binary(min_size=258, max_size=258), st.sampled_from(_HYPOTHESIS_PROOFS)),
        max_size=4,
    )
)
def test_arbitrary_proof_bytes_never_raise_and_reject(proofs):
    checks = verify_proofs(_HYPOTHESIS_BITS, proofs)
    assert len(checks) == max(2, len(proofs))
    assert Thresholds().accepts(checks) == (proofs == _HYPOTHESIS_PROOFS)


def test_malformed_hidden_raises_value_error():
    bits = _random_hidden(4, 128)
    with pytest.raises(ValueError, match="uint16"):
        build_proofs(bits.astype(np.float32))
    with pytest.raises(ValueError, match="2 dims"):
        build_proofs(bits.reshape(-1))
    with pytest.raises(ValueError, match="2 dims"):
        verify_proofs(bits.reshape(2, 2, 128), [])
    with pytest.raises(ValueError, match="numpy uint16"):
        build_proofs(bits.tolist())
    with pytest.raises(ValueError, match="hidden size is 0"):
        build_proofs(np.zeros((3, 0), np.uint16))
    with pytest.raises(ValueError, match="chunk"):
        build_proofs(bits, chunk=0)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="bfloat16"):
        build_proofs(torch.zeros(4, 128))
