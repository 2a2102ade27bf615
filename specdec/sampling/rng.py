"""Counter-based randomness: every random number is a pure function of (seed, stream, position).

Philox4x64-10 (numpy's `np.random.Philox`) is keyed on (seed, stream) and its counter is the
absolute token position, so a retried or duplicated Verify, a resumed session, or a draft replayed
on another replica draws exactly the same numbers; nothing is carried between calls.

Layout: key = seed + (stream << 64) (two 64-bit words); counter = position << 64, i.e. the position
sits in the second 64-bit counter word. Each position therefore owns 2**64 Philox blocks and a
vocabulary-sized draw at one position can never run into the next position's numbers.

Separate streams keep the draft's sample, the acceptance test and the recovered/bonus sample of the
same position independent, as the correctness proof of rejection sampling requires (Leviathan et
al. 2023, Appendix A.1; Chen et al. 2023, Theorem 1).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_TWO_POW_MINUS_53 = 2.0**-53


class Stream(enum.IntEnum):
    DRAFT = 1  # the draft's own sample of its proposal
    ACCEPT = 2  # the acceptance test of a drafted token
    RESAMPLE = 3  # recovered and bonus tokens, and plain decoding (so a bonus == a plain decode)
    GUMBEL = 4  # Gumbel noise shared by draft and target in GUMBEL mode


def _philox(seed: int, position: int, stream: int) -> np.random.Philox:
    return np.random.Philox(key=seed + (int(stream) << 64), counter=position << 64)


def _to_unit(raw: np.ndarray) -> np.ndarray:
    """uint64 -> float64 in [0, 1): the top 53 bits, so every value is exactly representable."""
    return (raw >> np.uint64(11)).astype(np.float64) * _TWO_POW_MINUS_53


def uniform(seed: int, position: int, stream: Stream) -> float:
    """One float64 in [0, 1) for (seed, position, stream): first word of the position's block."""
    return float(_to_unit(_philox(seed, position, stream).random_raw(1))[0])


def uniforms(seed: int | np.ndarray, positions, stream: Stream) -> np.ndarray:
    """`uniform` for many positions (and optionally one seed per position) at once.

    positions: [n] ints; seed: an int or [n] ints. Returns float64 [n], bit-identical to calling
    `uniform` n times (tests/test_sampling_rng.py checks it). Building one numpy Philox object per
    number costs ~15 us, so this evaluates the same Philox4x64-10 function vectorised over counters.
    """
    positions = np.asarray(positions, dtype=np.uint64).reshape(-1)
    seeds = np.broadcast_to(np.asarray(seed, dtype=np.uint64), positions.shape)
    zeros = np.zeros_like(positions)
    # numpy increments the counter before producing a block, hence low counter word 1.
    counter = (np.ones_like(positions), positions, zeros, zeros.copy())
    word0 = _philox4x64_10(counter, (seeds, np.uint64(int(stream))))[0]
    return _to_unit(word0)


def bernoulli(prob: float, seed: int, position: int, stream: Stream) -> bool:
    """True with probability `prob` (clipped to [0, 1]): uniform < prob."""
    return uniform(seed, position, stream) < prob


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise for one position, float64 [vocab_size]; the same for draft and target.

    u is taken at the centre of its 2**-53 cell, so it lies in (0, 1) and the noise is finite.
    """
    raw = _philox(seed, position, Stream.GUMBEL).random_raw(vocab_size)
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * _TWO_POW_MINUS_53
    return torch.from_numpy(-np.log(-np.log(u)))


def gumbel_argmax(probs: torch.Tensor, seed: int, position: int) -> int:  # probs: [vocab]
    """argmax(log probs + g): an exact sample from probs (Gumbel-max trick); zero-mass tokens get
    -inf and can never win."""
    scores = torch.log(probs.detach().to("cpu", torch.float64))
    return int(torch.argmax(scores + gumbel_noise(seed, position, probs.shape[-1])))


def sample_from_probs(probs: torch.Tensor, seed: int, position: int, stream: Stream) -> int:
    """Inverse-CDF sample from non-negative weights probs [vocab] (need not sum to 1)."""
    u = torch.tensor([uniform(seed, position, stream)], dtype=torch.float64)
    return int(inverse_cdf(probs[None, :], u)[0])


def sample_rows(probs: torch.Tensor, seeds, positions, stream: Stream) -> torch.Tensor:
    """`sample_from_probs` for each row of probs [n, vocab] at once; returns int64 [n] (CPU)."""
    u = torch.from_numpy(uniforms(np.asarray(seeds), positions, stream))
    return inverse_cdf(probs, u).cpu()


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse CDF in float64. probs: [n, vocab] non-negative weights, u: [n] in [0, 1).

    Returns int64 [n] on probs' device (only u travels, not the vocabulary-sized rows). The first
    token whose cumulative mass exceeds u * total has positive mass whenever u * total < total;
    should rounding ever make them equal, the index would fall past the end or on a trailing
    zero-mass token, so that case takes the last token with positive mass.
    """
    weights = probs.detach().to(torch.float64)
    u = u.to(weights.device, torch.float64)
    cdf = torch.cumsum(weights, dim=-1)  # [n, vocab]
    total = cdf[:, -1]
    if not bool((total > 0).all()):
        raise ValueError("cannot sample from a distribution with no positive mass")
    index = torch.searchsorted(cdf, (u * total)[:, None], right=True)[:, 0]
    vocab_size = weights.shape[-1]
    index = index.clamp(max=vocab_size - 1)
    positive = weights > 0
    landed_on_zero = ~positive.gather(-1, index[:, None])[:, 0]
    if bool(landed_on_zero.any()):
        last_positive = vocab_size - 1 - positive.flip(-1).to(torch.int8).argmax(-1)
        index = torch.where(landed_on_zero, last_positive, index)
    return index


# Philox4x64-10 (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), the function
# numpy's Philox bit generator computes, evaluated on many counters at once.
_PHILOX_M = (np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157))
_PHILOX_W = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


def _mulhilo(a: np.uint64, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of the 128-bit product a * b, from 32-bit partial products."""
    a_lo, a_hi = a & _LOW32, a >> _SHIFT32
    b_lo, b_hi = b & _LOW32, b >> _SHIFT32
    lo_lo, lo_hi, hi_lo, hi_hi = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    middle = (lo_lo >> _SHIFT32) + (lo_hi & _LOW32) + (hi_lo & _LOW32)
    high = hi_hi + (lo_hi >> _SHIFT32) + (hi_lo >> _SHIFT32) + (middle >> _SHIFT32)
    return high, a * b


def _philox4x64_10(counter: tuple, key: tuple) -> tuple:
    """counter: four uint64 [n] words, key: two uint64 words ([n] or scalar). Returns four [n]."""
    c0, c1, c2, c3 = counter
    k0, k1 = (np.array(k, dtype=np.uint64) for k in key)
    with np.errstate(over="ignore"):  # wrap-around modulo 2**64 is the algorithm
        for round_index in range(10):
            if round_index:
                k0 = k0 + np.uint64(_PHILOX_W[0])
                k1 = k1 + np.uint64(_PHILOX_W[1])
            hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
            hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3
