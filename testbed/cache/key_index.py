"""Which blocks hold each cached key of the block-hash cache, the earliest first.

vLLM V1 registers a full block's key even where another block holds it already (two requests
computed the same prefix at once) and keeps both; lookups use the block registered earliest
(docs/design.md §4, "Block-hash cache"). `KeyIndex` keeps that block per key in a `KeyTable` (a
batch of lookups at a time) and the later holders, in registration order, beside it. When popped
blocks lose their keys, a key whose block left is taken over by its earliest remaining holder, or
leaves the index with its last one.
"""

from __future__ import annotations

import numpy as np

from testbed.cache.free_queue import BLOCK_DTYPE
from testbed.cache.key_table import KeyTable


class KeyIndex:
    """Key → the blocks holding it, earliest registered first."""

    def __init__(self, expected: int = 1024) -> None:
        self._first = KeyTable(expected)  # key -> the block lookups use
        self._dups: dict[int, list[int]] = {}  # key -> its later holders, in registration order

    def __len__(self) -> int:
        return len(self._first)

    @property
    def has_duplicates(self) -> bool:
        """Whether some key is held by more than one block."""
        return bool(self._dups)

    def leading(self, keys: np.ndarray) -> np.ndarray:
        """The blocks of the leading ``keys`` that are cached (stops at the first that is not)."""
        return self._first.leading(keys)

    def add(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Register ``blocks`` under ``keys``; a key already held keeps its block, and the new
        one is a later holder."""
        holders = self._first.add(keys, blocks)
        for i in (holders != blocks).nonzero()[0].tolist():  # keys cached on older blocks already
            self._dups.setdefault(int(keys[i]), []).append(int(blocks[i]))

    def remove(self, blocks: np.ndarray, keys: np.ndarray) -> None:
        """Popped ``blocks`` lose their ``keys``: where a key has later holders, the next one
        takes over or keeps it; the others leave the index."""
        if self._dups:
            blocks = self._forget_duplicates(blocks, keys)
        self._first.remove_values(blocks)

    def _forget_duplicates(self, blocks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Update the index for popped ``blocks`` whose key other blocks also hold; returns the
        popped blocks whose key leaves the index with them.

        Several holders of one key can be popped at once (a pop takes many blocks), so each key's
        popped holders are taken out of its holder list together, and the earliest holder that
        stays becomes the key's block if its old one left."""
        popped: dict[int, list[int]] = {}  # key with later holders -> its popped blocks' indices
        for i, key in enumerate(keys.tolist()):
            if key in self._dups:
                popped.setdefault(key, []).append(i)
        if not popped:
            return blocks
        gone = np.ones(len(blocks), bool)
        first = self._first.holds(blocks)
        old, heirs = [], []
        for key, idx in popped.items():
            leaving = {int(blocks[i]) for i in idx}
            stay = [b for b in self._dups[key] if b not in leaving]
            gone[idx] = False
            lead = [i for i in idx if first[i]]
            if lead and stay:  # the key's block left: its earliest remaining holder takes over
                old.append(int(blocks[lead[0]]))
                heirs.append(stay.pop(0))
            elif lead:  # every holder left: the key leaves the index with its block
                gone[lead[0]] = True
            if stay:
                self._dups[key] = stay
            else:
                del self._dups[key]
        if old:
            self._first.replace_values(np.array(old, BLOCK_DTYPE), np.array(heirs, BLOCK_DTYPE))
        return blocks[gone]

    def holders(self) -> dict[int, list[int]]:
        """Every key with its holders, the block lookups use first (for the invariant checks);
        asserts that no later-holder list is empty."""
        assert all(self._dups.values()), "an empty duplicate list"
        keys, firsts = self._first.items()
        return {k: [b, *self._dups.get(k, [])] for k, b in zip(keys.tolist(), firsts.tolist())}
