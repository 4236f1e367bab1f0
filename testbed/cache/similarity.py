"""A MinHash index over token n-grams: which cached sequence is most like a new prompt.

`cache.match=semantic` (docs/design.md §4) proposes a donor for a prompt from the sequences that
entered the exact tree: the one whose n-gram set has the highest estimated Jaccard similarity to
the prompt's, if it reaches ``cache.similarity_threshold``. Each sequence is summarised by
``num_hashes`` minima of multiply-shift hashes of its ``ngram``-token shingles (Broder's MinHash:
the share of equal minima estimates the Jaccard similarity). One entry per request (a later
insert of the same request, its whole sequence after its prompt, replaces it). Entries are not
removed on eviction: the caller drops one lazily when it finds nothing of it cached.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64


class MinHashIndex:
    """Sequences by key, with their MinHash signatures; `best` ranks them by similarity."""

    def __init__(self, num_hashes: int = 64, ngram: int = 3, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        # odd multipliers: multiply-shift hashing of 64-bit shingle codes
        self._a = rng.integers(1, 2**63, size=num_hashes, dtype=np.int64).astype(_U64) * _U64(2) \
            + _U64(1)
        self._b = rng.integers(0, 2**63, size=num_hashes, dtype=np.int64).astype(_U64)
        self.ngram = ngram
        self._keys: list[str] = []
        self._row: dict[str, int] = {}
        self._tokens: list[np.ndarray] = []
        self._sigs = np.zeros((0, num_hashes), dtype=_U64)

    def __len__(self) -> int:
        return len(self._keys)

    def signature(self, tokens: np.ndarray) -> np.ndarray:
        """The MinHash signature of ``tokens``' n-grams (a shorter sequence: one shingle)."""
        t = np.asarray(tokens, dtype=np.int64).astype(_U64)
        n = min(self.ngram, max(len(t), 1))
        if len(t) == 0:
            codes = np.zeros(1, dtype=_U64)
        else:
            codes = np.zeros(len(t) - n + 1, dtype=_U64)
            with np.errstate(over="ignore"):  # wrap-around is the hash
                for i in range(n):
                    codes = codes * _U64(1_000_003) + t[i : len(t) - n + 1 + i]
        with np.errstate(over="ignore"):
            hashed = self._a[:, None] * codes[None, :] + self._b[:, None]
        return (hashed >> _U64(32)).min(axis=1)

    def add(self, key: str, tokens: np.ndarray) -> None:
        """Index ``tokens`` under ``key``, replacing what ``key`` held."""
        sig = self.signature(tokens)
        if key in self._row:
            i = self._row[key]
            self._tokens[i] = np.array(tokens)
            self._sigs[i] = sig
            return
        self._row[key] = len(self._keys)
        self._keys.append(key)
        self._tokens.append(np.array(tokens))
        self._sigs = np.vstack([self._sigs, sig[None, :]])

    def remove(self, key: str) -> None:
        i = self._row.pop(key)
        del self._keys[i], self._tokens[i]
        self._sigs = np.delete(self._sigs, i, axis=0)
        self._row = {k: j for j, k in enumerate(self._keys)}

    def best(self, tokens: np.ndarray, threshold: float, exclude: str | None = None
             ) -> list[tuple[float, str, np.ndarray]]:
        """Entries at least ``threshold`` similar to ``tokens``, most similar first (ties: the
        earlier indexed), as (similarity, key, tokens); ``exclude`` is left out."""
        if not self._keys:
            return []
        sims = (self._sigs == self.signature(tokens)[None, :]).mean(axis=1)
        order = sorted(range(len(sims)), key=lambda i: (-sims[i], i))
        return [(float(sims[i]), self._keys[i], self._tokens[i]) for i in order
                if sims[i] >= threshold and self._keys[i] != exclude]
