"""Block keys of the block-hash cache (`testbed.cache.block_hash`): each full block's key chains
the previous block's key with a digest of its own tokens, so equal keys mean equal prefixes.

Keys are computed for a whole run of blocks at once: one matrix product gives every block's digest
(`block_digests`), and the chain's recurrence runs as one cumulative sum (`chain_keys`); a few
blocks take the recurrence itself in Python ints.
"""

from __future__ import annotations

import numpy as np

from testbed.cache.token_runs import TOKEN_BYTES, as_bytes

# key_i = CHAIN * key_{i-1} + digest(block i)  (mod 2^64; key_{-1} = 0). Any odd multiplier is
# invertible mod 2^64, which lets the recurrence run as one cumulative sum (`_chain`). A block's
# digest is a random odd linear form of its tokens (Σ_j R_j t_j mod 2^64: two blocks that differ
# collide with probability ~2^-58 over R, whatever their tokens), plus a constant, then mixed by
# splitmix64's finalizer so that the chain's sums see uncorrelated values. The constant keeps an
# all-zero block's digest off 0: with key_{-1} = 0, a zero digest would make a leading block of
# token 0s invisible (its key 0, and [zeros, X] keyed like [X]).
CHAIN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_OFFSET = np.uint64(0x9E3779B97F4A7C15)
NO_KEYS = np.zeros(0, np.uint64)  # the keys of no blocks
_powers = np.ones(1, np.uint64)  # CHAIN^i mod 2^64
_inverse_powers = np.ones(1, np.uint64)  # CHAIN^-i mod 2^64


def block_forms(block_size: int) -> np.ndarray:
    """The odd multipliers R_j of a block's digest (fixed: runs repeat)."""
    return np.random.default_rng(0x5EED).integers(0, 1 << 63, block_size, np.uint64) \
        * np.uint64(2) + np.uint64(1)


def block_digests(kb: bytes, block_size: int, forms: np.ndarray) -> np.ndarray:
    """Per whole block of the token bytes ``kb``: splitmix64(Σ_j R_j t_j + OFFSET) mod 2^64."""
    n = len(kb) // (block_size * TOKEN_BYTES)
    tokens = np.frombuffer(kb, np.uint32, n * block_size).reshape(n, block_size)
    z = tokens @ forms
    z += _OFFSET
    z ^= z >> _SHIFTS[0]
    z *= _MIX[0]
    z ^= z >> _SHIFTS[1]
    z *= _MIX[1]
    z ^= z >> _SHIFTS[2]
    return z


def token_block_keys(tokens: np.ndarray, block_size: int,
                     forms: np.ndarray | None = None) -> np.ndarray:
    """The chained keys of every full block of a token run, from its start (the block-hash
    cache's keys: equal for two runs exactly where their tokens up to that block's end are)."""
    forms = block_forms(block_size) if forms is None else forms
    return chain_keys(block_digests(as_bytes(tokens), block_size, forms), 0)


def chain_keys(digests: np.ndarray, prev: int) -> np.ndarray:
    """Keys of consecutive blocks with per-block ``digests`` after a block keyed ``prev``:
    key_m = C^m (C·prev + Σ_{l<=m} C^-l d_l), every product and sum mod 2^64 (uint64 wraps)."""
    global _powers, _inverse_powers
    n = len(digests)
    if n <= 16:  # a few blocks: the recurrence itself, in Python ints
        keys, key = [], prev
        for d in digests.tolist():
            key = (CHAIN * key + d) & _MASK
            keys.append(key)
        return np.array(keys, np.uint64)
    if n > len(_powers):
        size = max(n, 2 * len(_powers))
        _powers = _power_table(CHAIN, size)
        _inverse_powers = _power_table(pow(CHAIN, -1, 1 << 64), size)
    acc = np.cumsum(digests * _inverse_powers[:n], dtype=np.uint64)
    acc += np.uint64(CHAIN * prev & _MASK)
    return _powers[:n] * acc


def _power_table(base: int, n: int) -> np.ndarray:
    """base^0 .. base^(n-1) mod 2^64, doubling the filled part each step."""
    out = np.ones(n, np.uint64)
    filled = 1
    while filled < n:
        step = min(filled, n - filled)
        out[filled : filled + step] = out[:step] * np.uint64(pow(base, filled, 1 << 64))
        filled += step
    return out
