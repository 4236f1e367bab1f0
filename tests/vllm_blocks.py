"""A brute-force model of vLLM V1's prefix caching, request by request (docs/design.md §4).

Plain lists and tuples, nothing shared with testbed/cache/block_hash.py: a block's key is the whole
token prefix it ends (no hashing, so no collisions), the free queue is one list (head first), and
every step is the rule as written. Slow and obviously right; tests compare the fast cache with it.
"""

from __future__ import annotations

from typing import Sequence


class VllmBlocks:
    """``num_blocks`` blocks of ``block_size`` tokens (None: unbounded, fresh blocks minted)."""

    def __init__(self, num_blocks: int | None, block_size: int) -> None:
        self.num_blocks, self.b = num_blocks, block_size
        self.queue: list[int] = list(range(num_blocks or 0))  # free blocks, head first
        self.key: dict[int, tuple] = {}  # block -> the token prefix it caches
        self.holders: dict[tuple, list[int]] = {}  # prefix -> blocks holding it, oldest first
        self.minted = num_blocks or 0

    def serve(self, prompt: Sequence[int], output: Sequence[int]) -> tuple[int, int]:
        """(hit tokens, evicted tokens) of one request, following the five steps of §4."""
        b, seq = self.b, tuple(prompt) + tuple(output)
        nb = -(-len(seq) // b)
        if self.num_blocks is not None and nb > self.num_blocks:
            return 0, 0  # 1. never fits: served uncached
        blocks: list[int] = []
        for i in range(max(len(prompt) - 1, 0) // b):  # 2. leading cached blocks
            held = self.holders.get(seq[: (i + 1) * b])
            if not held:
                break
            blocks.append(held[0])
        for block in blocks:  # none is held by another request in a replay
            self.queue.remove(block)
        hit, evicted = len(blocks) * b, 0
        for _ in range(nb - len(blocks)):  # 3. pop from the head, dropping keys
            if self.num_blocks is None and (not self.queue or self.queue[0] in self.key):
                block, self.minted = self.minted, self.minted + 1  # unbounded: keep what is cached
            elif self.queue:
                block = self.queue.pop(0)
            else:
                raise AssertionError("a request that fits found no free block")
            if block in self.key:
                prefix = self.key.pop(block)
                self.holders[prefix].remove(block)
                if not self.holders[prefix]:
                    del self.holders[prefix]
                evicted += b
            blocks.append(block)
        for i in range(hit // b, len(seq) // b):  # 4. register every new full block
            self.key[blocks[i]] = seq[: (i + 1) * b]
            self.holders.setdefault(seq[: (i + 1) * b], []).append(blocks[i])
        for block in reversed(blocks):  # 5. free last to first
            if block in self.key:
                self.queue.append(block)
            else:
                self.queue.insert(0, block)
        return hit, evicted
