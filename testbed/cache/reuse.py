"""Reuse beyond exact prefixes: the records the scheduler hands to executors, and the config keys.

Exact prefix caching reuses KV only where a prompt starts with a cached sequence. Two modes reuse
more (docs/design.md §4 "Reuse beyond exact prefixes"):

- ``cache.reuse=blend`` (CacheBlend, EPIC): each chunk of a prompt (its workload segments, or
  fixed ``N``-token runs) is looked up as a *chunk*, wherever it stands in the prompt. Chunks live
  in the same `RadixCache` as exact prefixes, under the key ``[CHUNK_MARK] + chunk``, so they share
  the pool, the locks and the eviction policy; chunk token ``i``'s KV is stored rotated to
  chunk-local position ``i`` (tree position ``i + 1``: the mark takes one slot, shared by all
  chunks).
- ``cache.match=semantic``: the most similar sequence of the exact tree (`testbed.cache.similarity`)
  is aligned with the prompt; its aligned runs are reused at their donor positions.

Either way a prompt position covered by reused KV is a `ReusedSpan` entry of its prefill
`BatchEntry.reuse`: the executor copies the donor's KV into the request's slots, re-rotates the
keys from ``src_start`` to ``dst`` and recomputes ``recompute`` of the span's tokens (CacheBlend:
those whose KV deviates most). A blend request's freshly computed chunks are stored as `KVCopy`
records on the `Batch` (``Batch.kv_copies``), run after the step's forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from testbed.errors import BadInput, check_choice
from testbed.workloads.request import TOKEN_DTYPE

#: the first token of every chunk key: no vocabulary has it, so no real prompt reaches chunk nodes
CHUNK_MARK = -1

REUSE_MODES = ("prefix", "blend")
MATCH_MODES = ("exact", "semantic")
#: keys of the ``cache`` group this module reads (testbed/cache/__init__.py: run keys)
REUSE_KEYS = ("reuse", "recompute_ratio", "chunk_boundaries", "match", "similarity_threshold")


@dataclass(frozen=True)
class ReusedSpan:
    """Prompt positions ``dst .. dst+len-1`` take their KV from ``src_slots`` (one donor slot per
    token), whose keys were rotated for positions ``src_start ..`` (a chunk: chunk-local, from 0;
    a semantic donor: its positions in the donor sequence). The executor copies that KV into the
    request's slots, re-rotates the keys by ``dst - src_start`` and recomputes ``recompute`` of
    the span's tokens (its choice which: CacheBlend's highest KV deviation)."""

    dst: int
    src_slots: np.ndarray
    src_start: int
    recompute: int

    def __len__(self) -> int:
        return len(self.src_slots)

    @property
    def end(self) -> int:
        return self.dst + len(self.src_slots)

    @property
    def reused(self) -> int:
        """Tokens whose KV is taken and not recomputed."""
        return len(self.src_slots) - self.recompute

    def piece(self, lo: int, hi: int) -> "ReusedSpan | None":
        """The part of the span inside positions ``[lo, hi)`` (chunked prefill), or None. A
        piece's ``recompute`` is its share of the span's: the pieces of one span add up to it
        (cumulative ``ceil(offset · recompute / len)`` at the cuts)."""
        a, b = max(lo, self.dst) - self.dst, min(hi, self.end) - self.dst
        if a >= b:
            return None
        if a == 0 and b == len(self):
            return self
        n = len(self)
        share = math.ceil(b * self.recompute / n) - math.ceil(a * self.recompute / n)
        return ReusedSpan(self.dst + a, self.src_slots[a:b], self.src_start + a, share)


@dataclass(frozen=True)
class KVCopy:
    """Copy the KV in ``src_slots`` to ``dst_slots`` (same length), rotating keys by ``shift``
    positions (a chunk store: minus the chunk's start in the prompt, to chunk-local positions)."""

    src_slots: np.ndarray
    dst_slots: np.ndarray
    shift: int

    def __post_init__(self) -> None:
        if len(self.src_slots) != len(self.dst_slots):
            raise ValueError(f"KVCopy: {len(self.src_slots)} source slots but "
                             f"{len(self.dst_slots)} destinations")

    def __len__(self) -> int:
        return len(self.dst_slots)


def recompute_count(length: int, ratio: float) -> int:
    """Tokens of a ``length``-token span recomputed at ``ratio``: ``ceil(ratio · length)``."""
    return min(length, math.ceil(ratio * length - 1e-9))


def chunk_key(tokens: np.ndarray) -> np.ndarray:
    """The tree key of a chunk: the mark, then its tokens."""
    return np.concatenate([np.array([CHUNK_MARK], dtype=TOKEN_DTYPE),
                           np.asarray(tokens, dtype=TOKEN_DTYPE)])


@dataclass(frozen=True)
class ReuseConfig:
    """The ``cache`` group's reuse keys, validated (each bad value: one line naming the key)."""

    reuse: str = "prefix"
    recompute_ratio: float = 0.15  # CacheBlend's default share of recomputed tokens
    chunk_boundaries: str | int = "segments"
    match: str = "exact"
    similarity_threshold: float = 0.5

    @classmethod
    def from_mapping(cls, cache: Mapping[str, Any]) -> "ReuseConfig":
        values = {k: cache[k] for k in REUSE_KEYS if cache.get(k) is not None}
        config = cls(**values)
        config.validate()
        return config

    @property
    def active(self) -> bool:
        """Anything beyond exact prefix caching."""
        return self.reuse != "prefix" or self.match != "exact"

    @property
    def fixed_chunk(self) -> int | None:
        """``N`` of ``chunk_boundaries=N``; None for ``segments``."""
        return None if self.chunk_boundaries == "segments" else int(self.chunk_boundaries)

    def validate(self) -> None:
        check_choice("cache.reuse", self.reuse, REUSE_MODES)
        check_choice("cache.match", self.match, MATCH_MODES)
        for key in ("recompute_ratio", "similarity_threshold"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0.0 <= value <= 1.0:
                raise BadInput(f"cache.{key} must be a number in [0, 1], got {value!r}")
        b = self.chunk_boundaries
        if b != "segments" and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise BadInput(f"cache.chunk_boundaries must be segments or a whole number >= 1, "
                           f"got {b!r}")
        if self.reuse == "blend" and self.match == "semantic":
            raise BadInput("cache.match=semantic works with cache.reuse=prefix only (blend "
                           "and semantic spans are not combined); got cache.reuse=blend")

    def check_cache(self, cache_name: str | None, page_size: int, tiered: bool) -> None:
        """Only the radix cache at page size 1 without lower tiers reuses beyond prefixes."""
        if not self.active:
            return
        key = "cache.reuse=blend" if self.reuse != "prefix" else "cache.match=semantic"
        if cache_name != "radix":
            raise BadInput(f"{key} needs cache=radix, got cache={cache_name}")
        if page_size != 1:
            raise BadInput(f"{key} needs cache.page_size=1, got {page_size}")
        if tiered:
            raise BadInput(f"{key} does not work with lower tiers (cache.host_tokens, "
                           "cache.disk_tokens must be 0)")
