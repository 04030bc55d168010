"""Replayable sampling: every completion token is a pure function of the policy's logits and the assigned seed.

A worker samples token t at completion position i of a sample with seed s as

    t = argmax_j ( z_j + g(s, i, j) )     over the tokens j kept by top-k / top-p,

where z = logits / temperature and g(s, i, j) is standard Gumbel noise computed from a counter-based integer
hash of (s, i, j). Gumbel-max is exact sampling from softmax(z) over the kept tokens, so the distribution the
learner trains on is unchanged. Because g is a pure function of three integers, any validator on any hardware
recomputes it and replays the choice: the token must be the argmax of its own logits plus the same noise, up
to the rounding difference between the two engines' logits (`gpu_workers.checks.check_sampling`). A worker
can no longer pick, steer, cherry-pick or copy its tokens: only where two noisy scores tie to within that
difference does it have a choice, and the validator counts those choices.

The hash: the seed's two 32-bit halves, the position and the token id go through the murmur3 32-bit finaliser
(`_fmix32`); the top 23 bits of the result give u = (k + 1/2) / 2^23 in (0, 1), exact in float32, and
g = -log(-log(u)). All integer arithmetic is done in int64 tensors whose values stay below 2^53 (32-bit
products are formed from 16-bit halves), so it is exact on every device with no overflow; the two logs are
float32 library calls whose results may differ by an ulp across devices, far below any engine's logit error.
`torch.Generator` streams are not used: their CPU and CUDA outputs differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
_SEED_HI_SALT = 0x5BD1E995
_POSITION_MUL = 0x9E3779B1
_POSITION_SALT = 0x68E31DA4
_TOKEN_MUL = 0x85EBCA77
_SECOND_SALT = 0x27D4EB2F


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 `h` holding uint32 values, with every intermediate below 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """The murmur3 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: Sequence[int], positions: Sequence[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uint32 keys per (seed, position) row, as int64 tensors [B]."""
    import torch

    seeds = [int(s) & 0xFFFFFFFFFFFFFFFF for s in seeds]
    lo = torch.tensor([s & MASK32 for s in seeds], dtype=torch.int64, device=device)
    hi = torch.tensor([s >> 32 for s in seeds], dtype=torch.int64, device=device)
    pos = torch.tensor([int(p) & MASK32 for p in positions], dtype=torch.int64, device=device)
    key = _fmix32(lo ^ _fmix32(hi ^ _SEED_HI_SALT))
    key = _fmix32(key ^ _mul32(pos, _POSITION_MUL) ^ _POSITION_SALT)
    return key, _fmix32(key ^ _SECOND_SALT)


def _token_hash(key: torch.Tensor, second: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The 23-bit integers k(s, i, j) behind the noise, elementwise over broadcastable int64 tensors."""
    h = _fmix32(key ^ _mul32(tokens, _TOKEN_MUL))
    return _fmix32((h + second) & MASK32) >> 9


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    import torch

    u = (bits.to(torch.float32) + 0.5) * (2.0**-23)  # in [2^-24, 1 - 2^-24], exact in float32
    return -torch.log(-torch.log(u))


GUMBEL_MAX = -math.log(-math.log1p(-(2.0**-24)))
"""The largest noise value (u = 1 - 2^-24): a token whose processed logit is more than this (plus the least
noise of the top token) below the top token can never win, so only the tokens above that bound are hashed."""
_BOUND_SLACK = 1e-3  # float32 logs of different libraries differ by an ulp; the pruning bound gives them room


def uniform_bits(seeds: Sequence[int], positions: Sequence[int], vocab: int, device=None) -> torch.Tensor:
    """k(s, i, j) for every token: int64 [B, vocab] (row b: seeds[b], positions[b])."""
    import torch

    if len(seeds) != len(positions):
        raise ValueError(f"uniform_bits: {len(seeds)} seeds but {len(positions)} positions")
    key, second = _row_keys(seeds, positions, device)
    return _token_hash(key[:, None], second[:, None], torch.arange(vocab, dtype=torch.int64, device=device)[None])


def gumbel_noise(seeds: Sequence[int], positions: Sequence[int], vocab: int, device=None) -> torch.Tensor:
    """Standard Gumbel noise g(s, i, j) as float32 [B, vocab] for rows (seeds[b], positions[b])."""
    return _gumbel(uniform_bits(seeds, positions, vocab, device))


def noise_at(seeds: Sequence[int], positions: Sequence[int], tokens: torch.Tensor) -> torch.Tensor:
    """g(seeds[b], positions[b], tokens[b]) as float32 [B]."""
    import torch

    key, second = _row_keys(seeds, positions, tokens.device)
    return _gumbel(_token_hash(key, second, tokens.to(torch.int64)))


def noisy_max(
    processed_logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `processed_logits` [B, vocab] (float32 logits / temperature, -inf outside the kept tokens):
    the token with the highest z + g and that score, (int64 [B], float32 [B]).

    Exact, and cheap for real policies: the top token's score bounds the winner's from below, and noise never
    exceeds GUMBEL_MAX, so only tokens within GUMBEL_MAX + a little of that score are hashed (a flat
    distribution hashes the whole row).
    """
    import torch

    z = processed_logits.float()
    b = z.shape[0]
    if b == 0:
        return torch.zeros(0, dtype=torch.int64, device=z.device), torch.zeros(0, device=z.device)
    key, second = _row_keys(seeds, positions, z.device)
    rows = torch.arange(b, device=z.device)
    top = z.argmax(dim=-1)
    floor = z[rows, top] + _gumbel(_token_hash(key, second, top)) - GUMBEL_MAX - _BOUND_SLACK
    candidates = z >= floor[:, None]
    if int(candidates.sum()) > z.numel() // 4:  # a flat row: hashing everything is cheaper than gathering
        tokens = torch.arange(z.shape[1], dtype=torch.int64, device=z.device)[None]
        best, choice = (z + _gumbel(_token_hash(key[:, None], second[:, None], tokens))).max(dim=-1)
        return choice, best
    cand_rows, cand_tokens = torch.nonzero(candidates, as_tuple=True)
    scores = z[cand_rows, cand_tokens] + _gumbel(_token_hash(key[cand_rows], second[cand_rows], cand_tokens))
    best = torch.full((b,), -math.inf, device=z.device)
    best = best.scatter_reduce(0, cand_rows, scores, reduce="amax")
    # lowest token id among exact ties, whichever device or order the candidates came in
    winners = torch.where(scores == best[cand_rows], cand_tokens, torch.full_like(cand_tokens, z.shape[1]))
    choice = torch.full((b,), z.shape[1], dtype=torch.int64, device=z.device)
    choice = choice.scatter_reduce(0, cand_rows, winners, reduce="amin")
    return choice, best
