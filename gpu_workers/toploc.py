"""TOPLOC proofs: commit to a sample's decode-step hidden states, and check a commitment against a recomputation.

Byte-compatible with the reference implementation (PyPI `toploc` 0.1.6, the C++ tensor path that
`build_proofs_bytes` / `verify_proofs_bytes` take with `skip_prefill=True`); DESIGN.md section 7 states the
format. Per chunk of `chunk` rows (the last may be shorter), flattened row-major:

1. Top-k by absolute value. Which entries win a tie at the k-th value is decided the way torch's CPU `topk`
   decides it, because the reference uses that and most real chunks tie there (bf16 has few values): torch
   runs libstdc++ `std::partial_sort` when k * 64 <= n, else `std::nth_element`, on (|value|, index) pairs
   compared by |value| alone, NaN above everything. Without a tie the set is plain; with one, the two
   algorithms are replayed step by step on the keys (`_heap_select`, `_introselect`).
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

_NAN_KEY = 0x7F81  # every NaN bit pattern once the sign is cleared: all NaNs tie, above +inf (0x7F80)


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
            c.exp_mismatches <= self.max_exp_mismatches and c.mant_err_mean <= self.max_mant_err_mean
            and c.mant_err_median <= self.max_mant_err_median for c in checks)


def build_proofs(hidden, chunk: int = 32, topk: int = 128) -> list[bytes]:
    """Proof bytes for each chunk of `chunk` rows of `hidden` ([n, H] bf16: a torch tensor or uint16 bits)."""
    bits = _as_bits(hidden)
    _check_sizes(chunk, topk)
    chunks = _chunks(bits, chunk)
    indices = [_topk_indices(flat, topk) for flat in chunks]
    moduli = [_injective_modulus(idx) for idx in indices]
    proofs: list[bytes] = [b""] * len(chunks)
    for group in _group_by_len(indices):
        x = np.stack([indices[c] % moduli[c] for c in group])
        y = np.stack([chunks[c][indices[c]] for c in group]).astype(np.int64) % PRIME
        coeffs = _interpolate(x, y)
        for row, c in enumerate(group):
            proofs[c] = np.concatenate([[moduli[c]], coeffs[row]]).astype(">u2").tobytes()
    return proofs


def verify_proofs(hidden, proofs: list[bytes], chunk: int = 32, topk: int = 128) -> list[ChunkCheck]:
    """Check `proofs` against the validator's own `hidden` ([n, H] bf16), one `ChunkCheck` per chunk.

    A malformed proof, a chunk without a proof and a proof without a chunk each give a rejecting check, so
    the result has max(chunks, proofs) entries and never raises for any content of `proofs`.
    """
    bits = _as_bits(hidden)
    _check_sizes(chunk, topk)
    chunks = _chunks(bits, chunk)
    try:
        proofs = list(proofs)
    except TypeError:  # not even a sequence: no proofs, so every chunk is rejected
        proofs = []
    checks = [ChunkCheck(topk, NO_MATCH, NO_MATCH)] * max(len(chunks), len(proofs))
    indices = [_topk_indices(flat, topk) for flat in chunks[:len(proofs)]]
    parsed = [_parse_proof(proof, len(idx)) for proof, idx in zip(proofs, indices)]
    valid = [c for c, p in enumerate(parsed) if p is not None]
    for group in _group_by_len([indices[c] for c in valid]):
        members = [valid[g] for g in group]
        x = np.stack([indices[c] % parsed[c][0] for c in members])
        coeffs = np.stack([parsed[c][1] for c in members])
        claimed = _evaluate(coeffs, x)
        actual = np.stack([chunks[c][indices[c]] for c in members]).astype(np.int64)
        for row, c in enumerate(members):
            checks[c] = _compare(claimed[row], actual[row])
    return checks


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
            raise ValueError(f"hidden: expected uint16 bf16 bit patterns (or ml_dtypes bfloat16), "
                             f"got numpy {hidden.dtype}")
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


def _chunks(bits: np.ndarray, chunk: int) -> list[np.ndarray]:
    """Flat row-major views of consecutive `chunk`-row blocks (the last may be shorter)."""
    return [bits[r:r + chunk].reshape(-1) for r in range(0, bits.shape[0], chunk)]


def _group_by_len(arrays: list[np.ndarray]) -> list[list[int]]:
    """Positions of `arrays` grouped by length, so that each group stacks into one batch."""
    groups: dict[int, list[int]] = {}
    for pos, a in enumerate(arrays):
        groups.setdefault(len(a), []).append(pos)
    return list(groups.values())


def _topk_indices(flat: np.ndarray, topk: int) -> np.ndarray:
    """Flat int64 indices of the `topk` largest |values| (all of them if fewer), chosen as torch's CPU topk."""
    keys = np.minimum(flat & 0x7FFF, _NAN_KEY)  # orders |value| as the float compare does
    n = keys.size
    k = min(topk, n)
    if k == n:
        return np.arange(n, dtype=np.int64)
    at_or_above = np.cumsum(np.bincount(keys, minlength=_NAN_KEY + 1)[::-1])  # entries with key >= NaN - i
    kth = _NAN_KEY - int(np.searchsorted(at_or_above, k))  # the k-th largest key
    above = np.flatnonzero(keys > kth)
    tied = np.flatnonzero(keys == kth)
    if above.size + tied.size == k:
        return np.sort(np.concatenate([above, tied])).astype(np.int64)
    chosen = _heap_select(keys, k) if k * 64 <= n else _introselect(keys, k)
    return np.sort(np.asarray(chosen, dtype=np.int64))


def _heap_select(keys: np.ndarray, k: int) -> list[int]:
    """The set `std::partial_sort(first, first + k, last, greater)` leaves in front (libstdc++ heap select).

    A heap of the first k entries with its least key on top; each later entry whose key is strictly greater
    than the top replaces it (`__pop_heap`). The top's key never decreases, so whole blocks of entries at
    or below it are skipped with one vectorised compare; only candidates are replayed in Python.
    """
    hk = keys[:k].tolist()
    hi = list(range(k))
    _make_heap(hk, hi, 0, k)
    n = keys.size
    start, block = k, 1024
    while start < n:
        stop = min(n, start + block)
        for pos in (np.flatnonzero(keys[start:stop] > hk[0]) + start).tolist():
            key = int(keys[pos])
            if key > hk[0]:
                _adjust_heap(hk, hi, 0, 0, k, key, pos)
        start, block = stop, block * 2
    return hi


def _make_heap(hk: list, hi: list, first: int, length: int) -> None:
    """libstdc++ `__make_heap` on hk/hi[first:first + length] with comparator `greater` on the keys."""
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(hk, hi, first, parent, length, hk[first + parent], hi[first + parent])
        if parent == 0:
            return
        parent -= 1


def _adjust_heap(hk: list, hi: list, first: int, hole: int, length: int, key: int, idx: int) -> None:
    """libstdc++ `__adjust_heap` then `__push_heap`: sink the hole to a leaf, then lift (key, idx) into it."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if hk[first + child] > hk[first + child - 1]:
            child -= 1
        hk[first + hole], hi[first + hole] = hk[first + child], hi[first + child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        hk[first + hole], hi[first + hole] = hk[first + child - 1], hi[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and hk[first + parent] > key:
        hk[first + hole], hi[first + hole] = hk[first + parent], hi[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    hk[first + hole], hi[first + hole] = key, idx


def _introselect(keys: np.ndarray, k: int) -> list[int]:
    """The set `std::nth_element(first, first + k - 1, last, greater)` leaves in front (libstdc++ introselect).

    Median-of-three pivot moved to the front, Hoare partition without bounds checks, recursion on the side
    holding the nth position, insertion sort below 4 entries, heap select once the depth budget
    2 * floor(log2 n) is spent.
    """
    a = keys.tolist()
    ix = list(range(len(a)))
    first, last, nth = 0, len(a), k - 1
    depth = 2 * (len(a).bit_length() - 1)
    while last - first > 3:
        if depth == 0:
            _make_heap(a, ix, first, nth + 1 - first)
            for pos in range(nth + 1, last):
                if a[pos] > a[first]:
                    key, idx = a[pos], ix[pos]
                    a[pos], ix[pos] = a[first], ix[first]
                    _adjust_heap(a, ix, first, 0, nth + 1 - first, key, idx)
            return ix[:k]
        depth -= 1
        cut = _partition_pivot(a, ix, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    for i in range(first + 1, last):  # insertion sort, descending, stable
        key, idx = a[i], ix[i]
        j = i
        while j > first and key > a[j - 1]:
            a[j], ix[j] = a[j - 1], ix[j - 1]
            j -= 1
        a[j], ix[j] = key, idx
    return ix[:k]


def _partition_pivot(a: list, ix: list, first: int, last: int) -> int:
    """libstdc++ `__unguarded_partition_pivot` with comparator `greater`; returns the cut."""
    mid = first + (last - first) // 2
    p, q, r = first + 1, mid, last - 1
    if a[p] > a[q]:
        median = q if a[q] > a[r] else (r if a[p] > a[r] else p)
    else:
        median = p if a[p] > a[r] else (r if a[q] > a[r] else q)
    a[first], a[median] = a[median], a[first]
    ix[first], ix[median] = ix[median], ix[first]
    pivot = a[first]
    lo, hi = first + 1, last
    while True:
        while a[lo] > pivot:
            lo += 1
        hi -= 1
        while pivot > a[hi]:
            hi -= 1
        if lo >= hi:
            return lo
        a[lo], a[hi] = a[hi], a[lo]
        ix[lo], ix[hi] = ix[hi], ix[lo]
        lo += 1


def _injective_modulus(indices: np.ndarray) -> int:
    """The largest m <= PRIME with `indices` distinct mod m, searched downward in batches of candidates."""
    top = PRIME
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
    vectorised passes), then the Newton form expanded from the innermost factor outward.
    """
    inv = _inverses()
    k = x.shape[1]
    dd = y.copy()
    for level in range(1, k):
        step = (dd[:, level:] - dd[:, level - 1:-1]) % PRIME
        dd[:, level:] = step * inv[(x[:, level:] - x[:, :-level]) % PRIME] % PRIME
    coeffs = np.zeros_like(dd)
    coeffs[:, 0] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):  # coeffs = coeffs * (X - x_i) + dd_i
        shifted = np.zeros_like(coeffs)
        shifted[:, 1:] = coeffs[:, :-1]
        coeffs = (shifted - x[:, i:i + 1] * coeffs) % PRIME
        coeffs[:, 0] = (coeffs[:, 0] + dd[:, i]) % PRIME
    return coeffs


def _evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner evaluation over GF(PRIME) of each row's polynomial at that row's points: [C, k] -> [C, k]."""
    result = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)
    for i in range(coeffs.shape[1] - 2, -1, -1):
        result = (result * x + coeffs[:, i:i + 1]) % PRIME
    return result


def _parse_proof(proof, points: int) -> tuple[int, np.ndarray] | None:
    """(modulus, int64 coefficients) of a well-formed proof over `points` points, else None."""
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        return None
    raw = bytes(proof)
    if len(raw) != 2 + 2 * points:
        return None
    words = np.frombuffer(raw, dtype=">u2").astype(np.int64)
    modulus, coeffs = int(words[0]), words[1:]
    if not points <= modulus <= PRIME or np.any(coeffs >= PRIME):
        return None
    return modulus, coeffs


def _compare(claimed: np.ndarray, actual: np.ndarray) -> ChunkCheck:
    """Exponent mismatches and mantissa errors between the proof's values and the validator's bf16 bits."""
    exp_claimed, exp_actual = (claimed >> 7) & 0xFF, (actual >> 7) & 0xFF
    match = exp_claimed == exp_actual
    errors = np.sort(np.abs((claimed & 0x7F) - (actual & 0x7F))[match])
    mismatches = int(match.size - np.count_nonzero(match))
    if errors.size == 0:
        return ChunkCheck(mismatches, NO_MATCH, NO_MATCH)
    return ChunkCheck(mismatches, float(errors.sum()) / errors.size, float(errors[errors.size // 2]))
