"""TOPLOC proofs: commit to a sample's decode-step hidden states, and check a commitment against a recomputation.

Byte-compatible with the reference implementation (PyPI `toploc` 0.1.6, the C++ tensor path that
`build_proofs_bytes` / `verify_proofs_bytes` take with `skip_prefill=True`); docs/design.md section 7 states the
format. Per chunk of `chunk` rows (the last may be shorter), flattened row-major:

1. Top-k by absolute value, computed by torch's CPU `topk` on the chunk's `abs()` exactly as the reference
   computes it. That matters because most real chunks tie at the k-th value (bf16 has few values) and the
   entries that win the tie are whichever torch's algorithm leaves in front (libstdc++ `partial_sort` when
   k * 64 <= n, else `nth_element`). A worker's GPU topk may pick other tied entries; each such entry
   then counts as an exponent mismatch, with this code as with the reference. Torch runs serially here
   (see `_topk_indices`); callers that want parallelism verify several samples at once, on threads.
2. Modulus m: the largest integer <= 65497 for which the flat indices are distinct mod m.
3. The polynomial of degree < k over GF(65497) through (index mod m, bf16 bit pattern mod 65497); it is
   unique, so the order of the points does not matter. Computed by Newton divided differences, batched over
   chunks with numpy int64 (every product of two residues fits).
4. Proof bytes: m, then the k coefficients in ascending degree, each a big-endian u16 (258 bytes for k=128).

Verification takes the validator's own top-k of the chunk, evaluates the proof at those indices mod m and
splits both bf16 patterns into exponent (bits 7-14) and mantissa (bits 0-6); the sign is ignored, as in the
reference. It reports the exponent mismatches and, over the entries whose exponents match, the mean and the
upper median (sorted[len // 2]) of |mantissa difference|; 2**64 for both when no exponent matched.

Departures from the reference, all where it crashes or cannot answer: a malformed proof (wrong length,
modulus 0, below the number of points or above 65497, a coefficient >= 65497, not bytes) and a missing or
surplus proof each give a rejecting `ChunkCheck` instead of a crash; a chunk with fewer than `topk` entries
commits to all of them (the reference emits null proofs there), so its proof is 2 + 2 * entries bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

PRIME = 65497
"""The field GF(65497) the polynomial lives in; also the largest modulus tried."""

NO_MATCH = float(2**64)
"""Mantissa error mean/median reported when no exponent matched (the reference's convention)."""

_BATCH_CHUNKS = 1024  # chunks interpolated together (bounds the int64 work arrays to a few MB)


@dataclass(frozen=True)
class ChunkCheck:
    """The comparison of one chunk with its proof; every field grows with the disagreement."""

    exp_mismatches: int
    """Top-k entries whose bf16 exponent differs from the proof's."""
    mant_err_mean: float
    """Mean |mantissa difference| (in units of the 7-bit mantissa) over entries with matching exponents."""
    mant_err_median: float
    """Upper median of the same errors."""


@dataclass(frozen=True)
class Thresholds:
    """Acceptance limits for every chunk of a sample (the reference's values by default)."""

    max_exp_mismatches: int = 38
    """Most exponent mismatches (of topk) a chunk may have."""
    max_mant_err_mean: float = 10
    """Largest mean mantissa error a chunk may have."""
    max_mant_err_median: float = 8
    """Largest median mantissa error a chunk may have."""

    def accepts(self, checks: list[ChunkCheck]) -> bool:
        """True when there is at least one check and every one is within all three limits."""
        return len(checks) > 0 and all(
            c.exp_mismatches <= self.max_exp_mismatches
            and c.mant_err_mean <= self.max_mant_err_mean
            and c.mant_err_median <= self.max_mant_err_median
            for c in checks
        )


def build_proofs(hidden, chunk: int = 32, topk: int = 128) -> list[bytes]:
    """Proof bytes for each chunk of `chunk` rows of `hidden` ([n, H] bf16: a torch tensor or uint16 bits)."""
    return build_proofs_batch([hidden], chunk, topk)[0]


def build_proofs_batch(hiddens: list, chunk: int = 32, topk: int = 128) -> list[list[bytes]]:
    """`build_proofs` of several samples at once: the interpolations of all their chunks run as one batch,
    which costs about what one sample's does (the work is a few hundred vectorised passes)."""
    _check_sizes(chunk, topk)
    points: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}  # k -> (proof slot, indices, values)
    proofs: list[list[bytes]] = []
    slot = 0
    for hidden in hiddens:
        count = 0
        for flat in _chunk_groups(_as_bits(hidden), chunk):
            indices = _topk_indices(flat, topk)
            values = np.take_along_axis(flat, indices, axis=1)
            points.setdefault(indices.shape[1], []).append((slot + count, indices, values))
            count += len(flat)
        proofs.append([b""] * count)
        slot += count
    where = [(i, j) for i, sample in enumerate(proofs) for j in range(len(sample))]
    for group in points.values():
        all_indices = np.concatenate([g[1] for g in group])
        all_values = np.concatenate([g[2] for g in group])
        all_slots = [first + row for first, rows, _ in group for row in range(len(rows))]
        for start in range(0, len(all_slots), _BATCH_CHUNKS):
            indices = all_indices[start : start + _BATCH_CHUNKS]
            moduli = _injective_moduli(indices)
            values = all_values[start : start + _BATCH_CHUNKS].astype(np.int64) % PRIME
            coeffs = _interpolate(indices % moduli[:, None], values)
            words = np.concatenate([moduli[:, None], coeffs], axis=1).astype(">u2")
            for at, row in zip(all_slots[start : start + _BATCH_CHUNKS], words):
                sample, position = where[at]
                proofs[sample][position] = row.tobytes()
    return proofs


def verify_proofs(hidden, proofs: list[bytes], chunk: int = 32, topk: int = 128) -> list[ChunkCheck]:
    """Check `proofs` against the validator's own `hidden` ([n, H] bf16), one `ChunkCheck` per chunk.

    A malformed proof, a chunk without a proof and a proof without a chunk each give a rejecting check, so
    the result has max(chunks, proofs) entries and never raises for any content of `proofs`.
    """
    return verify_proofs_batch([hidden], [proofs], chunk, topk)[0]


def verify_proofs_batch(
    hiddens: list, proofs: list[list[bytes]], chunk: int = 32, topk: int = 128
) -> list[list[ChunkCheck]]:
    """`verify_proofs` of several samples (hiddens[i] against proofs[i]): the polynomial evaluations of all
    their chunks run as one batch, which costs about what one sample's do (k vectorised passes)."""
    bits = [_as_bits(hidden) for hidden in hiddens]
    _check_sizes(chunk, topk)
    if len(bits) != len(proofs):
        raise ValueError(f"proofs: {len(proofs)} samples' proofs for {len(bits)} hidden states")
    results: list[list[ChunkCheck]] = []
    pending: dict[int, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}  # points -> chunks
    for sample_bits, sample_proofs in zip(bits, proofs):
        try:
            sample_proofs = list(sample_proofs)
        except TypeError:  # not even a sequence: no proofs, so every chunk is rejected
            sample_proofs = []
        checks: list[ChunkCheck] = []
        for flat in _chunk_groups(sample_bits, chunk):
            first = len(checks)
            checks += [ChunkCheck(topk, NO_MATCH, NO_MATCH)] * len(flat)
            rows = [
                r
                for r in range(min(len(flat), len(sample_proofs) - first))
                if _well_formed(sample_proofs[first + r], min(topk, flat.shape[1]))
            ]
            if not rows:
                continue
            words = np.frombuffer(b"".join(bytes(sample_proofs[first + r]) for r in rows), dtype=">u2")
            words = words.reshape(len(rows), -1).astype(np.int64)
            residues = np.all(words[:, 1:] < PRIME, axis=1)  # a coefficient >= PRIME is no field element
            rows, words = np.array(rows)[residues], words[residues]
            if not len(rows):
                continue
            indices = _topk_indices(flat, topk)[rows]
            pending.setdefault(words.shape[1], []).append(
                (len(results), first, rows, words, flat[rows[:, None], indices].astype(np.int64), indices)
            )
        checks += [ChunkCheck(topk, NO_MATCH, NO_MATCH)] * (len(sample_proofs) - len(checks))
        results.append(checks)
    for group in pending.values():
        words = np.concatenate([g[3] for g in group])
        claimed = _evaluate(words[:, 1:], np.concatenate([g[5] for g in group]) % words[:, :1])
        verdicts = iter(_compare(claimed, np.concatenate([g[4] for g in group])))
        for sample, first, rows, *_ in group:
            for r in rows:
                results[sample][first + int(r)] = next(verdicts)
    return results


def proof_sizes(rows: int, hidden_size: int, chunk: int = 32, topk: int = 128) -> list[int]:
    """Byte length of each proof for `rows` decode steps of width `hidden_size` (258 per full chunk at k=128)."""
    _check_sizes(chunk, topk)
    return [2 + 2 * min(topk, min(chunk, rows - start) * hidden_size) for start in range(0, rows, chunk)]


def split_proofs(blob: bytes, rows: int, hidden_size: int, chunk: int = 32, topk: int = 128) -> list[bytes]:
    """Cut one sample's concatenated proofs (a rollout batch stores them so) into per-chunk proofs.

    Raises ValueError saying both lengths when `blob` does not have exactly the bytes `rows` steps need.
    """
    sizes = proof_sizes(rows, hidden_size, chunk, topk)
    if len(blob) != sum(sizes):
        raise ValueError(
            f"proofs: {len(blob)} bytes, but {rows} decode steps of hidden size {hidden_size} need "
            f"{sum(sizes)} ({len(sizes)} chunks of up to {chunk} rows)"
        )
    offsets = np.cumsum([0, *sizes]).tolist()
    return [bytes(blob[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def _as_bits(hidden) -> np.ndarray:
    """`hidden` as a C-contiguous uint16 [n, H] array of bf16 bit patterns, or a ValueError saying why not."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(hidden, torch.Tensor):
        if hidden.dtype != torch.bfloat16:
            raise ValueError(f"hidden: expected a torch.bfloat16 tensor, got {hidden.dtype}")
        bits = hidden.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    elif isinstance(hidden, np.ndarray):
        if hidden.dtype == np.uint16:
            bits = hidden
        elif hidden.dtype.name == "bfloat16":
            bits = hidden.view(np.uint16)
        else:
            raise ValueError(
                f"hidden: expected uint16 bf16 bit patterns (or ml_dtypes bfloat16), got numpy {hidden.dtype}"
            )
    else:
        raise ValueError(f"hidden: expected a torch bf16 tensor or a numpy uint16 array, got {type(hidden)}")
    if bits.ndim != 2:
        raise ValueError(f"hidden: expected 2 dims [decode steps, hidden size], got shape {tuple(bits.shape)}")
    if bits.shape[0] > 0 and bits.shape[1] == 0:
        raise ValueError(f"hidden: hidden size is 0 (shape {tuple(bits.shape)})")
    return np.ascontiguousarray(bits)


def _check_sizes(chunk: int, topk: int) -> None:
    for name, value in (("chunk", chunk), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def _chunk_groups(bits: np.ndarray, chunk: int, most: int = 64) -> list[np.ndarray]:
    """The chunks as flat rows, in order: views [C, chunk * H] of up to `most` full `chunk`-row blocks each
    (bounding the memory of a batch), then the shorter last block, if any, as [1, rest * H]."""
    rows, width = bits.shape
    full = rows // chunk
    groups = [
        bits[start * chunk : min(start + most, full) * chunk].reshape(-1, chunk * width)
        for start in range(0, full, most)
    ]
    if rows > full * chunk:
        groups.append(bits[full * chunk :].reshape(1, -1))
    return groups


def _topk_indices(flat: np.ndarray, topk: int) -> np.ndarray:
    """int64 [C, k]: per row of `flat` (uint16 bf16 bits), the indices of the `topk` largest |values| (all if
    fewer), as the reference picks them: torch's CPU `topk` of the row's `abs()`, whose choice among entries
    tied at the k-th value (common in bf16) follows its algorithm (libstdc++ partial_sort when k * 64 <= n,
    else nth_element). A 2-D topk runs each row exactly as a 1-D one. With one torch thread the rows go in
    one 2-D call; with more, one 1-D call per row, because a 2-D call opens an OpenMP region whose thread
    wake-up costs more than it saves at these sizes on a busy machine (measured: ~1 ms per chunk at 2
    threads on a loaded 2-core box), while a 1-D call never opens one. `abs()` is done in numpy for the
    same reason."""
    import torch

    k = min(topk, flat.shape[1])
    if k == flat.shape[1]:
        return np.broadcast_to(np.arange(k, dtype=np.int64), flat.shape).copy()
    magnitudes = torch.from_numpy(np.bitwise_and(flat, 0x7FFF).view(np.int16)).view(torch.bfloat16)
    if torch.get_num_threads() == 1:
        return magnitudes.topk(k, dim=1).indices.numpy()
    return np.stack([magnitudes[row].topk(k).indices.numpy() for row in range(len(flat))])


def _injective_moduli(indices: np.ndarray) -> np.ndarray:
    """Per row of `indices` [C, k], the largest m <= PRIME with the row's entries distinct mod m.

    PRIME itself is tried for all rows at once (it almost always works); other rows search downward in
    batches of 64 candidates.
    """
    residues = np.sort(indices % PRIME, axis=1)
    moduli = np.full(len(indices), PRIME, dtype=np.int64)
    for row in np.flatnonzero(np.any(np.diff(residues, axis=1) == 0, axis=1)):
        moduli[row] = _injective_modulus(indices[row], PRIME - 1)
    return moduli


def _injective_modulus(indices: np.ndarray, top: int) -> int:
    """The largest m <= top with `indices` distinct mod m, searched downward in batches of candidates."""
    while top >= len(indices):
        ms = np.arange(top, max(top - 64, len(indices) - 1), -1, dtype=np.int64)
        residues = np.sort(indices[None, :] % ms[:, None], axis=1)
        injective = np.all(np.diff(residues, axis=1) != 0, axis=1)
        if injective.any():
            return int(ms[np.argmax(injective)])
        top = int(ms[-1]) - 1
    raise ValueError(f"no modulus <= {PRIME} makes these {len(indices)} top-k indices distinct")


@lru_cache(maxsize=1)
def _inverses() -> np.ndarray:
    """Multiplicative inverses mod PRIME of 0..PRIME-1 (0 maps to 0), by Fermat: a**(PRIME - 2)."""
    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    exponent = PRIME - 2
    while exponent:
        if exponent & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        exponent >>= 1
    return result


def _interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients (ascending degree) of the polynomials through (x[c], y[c]) over GF(PRIME), per row c.

    x: [C, k] residues distinct within a row; y: [C, k] residues. Newton divided differences (k - 1
    vectorised passes), then the Newton form expanded from the innermost factor outward, touching only
    coefficients that are not yet zero. Reductions mod PRIME, the costly part, happen every other pass: a
    pass multiplies by a residue (< 2**16), so values stay below 2**34 after one unreduced pass and below
    2**51 after two, far inside int64. A difference d of two residues lies in (-PRIME, PRIME), and numpy
    reads inverse[d] for a negative d at d + PRIME, which is d's residue.
    """
    inverse = _inverses()
    k = x.shape[1]
    dd = y.copy()
    for level in range(1, k):  # dd[m] = (dd[m] - dd[m - 1]) / (x_m - x_{m - level}) for m >= level
        dd[:, level:] = (dd[:, level:] - dd[:, level - 1 : -1]) * inverse[x[:, level:] - x[:, :-level]]
        if level % 2 == 0 or level == k - 1:
            dd[:, level:] %= PRIME
    dd %= PRIME
    padded = np.zeros((x.shape[0], k + 1), dtype=np.int64)  # [0, coefficients...]
    padded[:, 1] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):  # coeffs = coeffs * (X - x_i) + dd_i, now of degree k - 1 - i
        top = k - i
        raw = padded[:, :top] - x[:, i : i + 1] * padded[:, 1 : top + 1]
        raw[:, 0] += dd[:, i]
        padded[:, 1 : top + 1] = raw % PRIME if i % 2 == 0 else raw
    return padded[:, 1:]


def _evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner evaluation over GF(PRIME) of each row's polynomial at that row's points: [C, d], [C, k] -> [C, k].

    Reduced every other step (from a residue, two steps stay below 2**50)."""
    result = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)
    for step, i in enumerate(range(coeffs.shape[1] - 2, -1, -1)):
        np.multiply(result, x, out=result)
        np.add(result, coeffs[:, i : i + 1], out=result)
        if step % 2 or i == 0:
            np.remainder(result, PRIME, out=result)
    return result


def _well_formed(proof, points: int) -> bool:
    """A bytes-like proof of the right length for `points` points whose modulus lies in points..PRIME."""
    if not isinstance(proof, (bytes, bytearray, memoryview)) or len(proof) != 2 + 2 * points:
        return False
    return points <= int.from_bytes(bytes(proof[:2]), "big") <= PRIME


def _compare(claimed: np.ndarray, actual: np.ndarray) -> list[ChunkCheck]:
    """Per row: exponent mismatches and mantissa errors between the proof's values and the validator's bits."""
    match = ((claimed >> 7) & 0xFF) == ((actual >> 7) & 0xFF)
    matched = match.sum(axis=1)
    errors = np.where(match, np.abs((claimed & 0x7F) - (actual & 0x7F)), 1 << 20)  # unmatched sort last
    errors.sort(axis=1)
    checks = []
    for row in range(len(claimed)):
        count = int(matched[row])
        if count == 0:
            checks.append(ChunkCheck(claimed.shape[1], NO_MATCH, NO_MATCH))
        else:
            checks.append(
                ChunkCheck(
                    claimed.shape[1] - count, float(errors[row, :count].sum()) / count, float(errors[row, count // 2])
                )
            )
    return checks
