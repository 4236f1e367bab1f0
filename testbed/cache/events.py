"""A radix cache's changes as events, for a router that keeps an exact index of what a replica
holds (``router=kv_events``; docs/design.md §4 "Routing on cache events").

`Publishing` wraps a radix cache's eviction policy. The policy is the object every change of the
tree already calls: ``on_create`` for each new leaf (an insert), ``on_evict`` after each leaf is
freed whole or cut back (``cache.evict_unit=page``). `Publishing` passes every call on to the
policy it wraps, unchanged (the eviction order stays the policy's), and records those two as
`CacheEvent`\\ s in an `EventLog`:

- ``stored``: ``tokens`` is the new leaf's whole path from the root, ``keep`` the tokens before
  the leaf; the cache now holds ``tokens``;
- ``removed``: ``tokens`` is an evicted leaf's whole path, ``keep`` its start: its tokens are
  no longer held except those another held branch shares (pages of 1: nothing that starts with
  ``tokens[:keep + 1]``; pages of P: a sibling may share up to P - 1 tokens of its first page);
- ``trimmed``: ``tokens`` is a leaf's path after its tail was cut (``keep`` = its length):
  nothing that extends ``tokens`` is held any more.

A split changes no held sequence and publishes nothing. Each event carries a sequence number
(1, 2, ... per log) and the log an ``epoch`` (random, new with every log: a restarted server's
differs), so a reader that misses an event sees the gap and re-reads the whole state
(`cached_sequences`, read between steps) instead of trusting its picture. The log keeps the last
``capacity`` events for readers that poll it (the server's ``GET /kv_events``) and calls its
listeners at once (the simulator's cluster). A path is built per event (O(depth) per leaf, not per
token); tokens are kept as the tree's bytes and listed only when sent.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from testbed.cache.eviction import EvictionPolicy, Requester
from testbed.cache.token_runs import TOKEN_DTYPE
from testbed.cache.tree_node import TreeNode
from testbed.errors import check_choice

KINDS = ("stored", "removed", "trimmed")
LOG_CAPACITY = 4096  # events a server keeps for readers that fall behind (then: a re-read)


@dataclass(frozen=True)
class CacheEvent:
    seq: int
    kind: str  # one of KINDS
    kb: bytes  # the path's tokens, as the tree keeps them
    keep: int

    @property
    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.kb, TOKEN_DTYPE)

    def as_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "kind": self.kind, "tokens": self.tokens.tolist(),
                "keep": self.keep}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CacheEvent":
        check_choice("a cache event's kind", d.get("kind"), KINDS, error=ValueError)
        return cls(int(d["seq"]), d["kind"], np.asarray(d["tokens"], TOKEN_DTYPE).tobytes(),
                   int(d["keep"]))


class EventLog:
    """Numbered events of one cache, the last ``capacity`` kept (any thread may read them)."""

    def __init__(self, capacity: int = LOG_CAPACITY, epoch: str | None = None) -> None:
        self.epoch = epoch or uuid.uuid4().hex[:12]
        self.seq = 0  # the last event's number
        self._events: deque[CacheEvent] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.listeners: list[Callable[[CacheEvent], None]] = []

    def publish(self, kind: str, kb: bytes, keep: int) -> None:
        with self._lock:
            self.seq += 1
            event = CacheEvent(self.seq, kind, kb, keep)
            self._events.append(event)
        for listen in self.listeners:
            listen(event)

    def since(self, seq: int) -> list[CacheEvent] | None:
        """The events after number ``seq``; None when some of them are no longer kept (or
        ``seq`` is ahead of the log: another epoch's number), so the reader must re-read."""
        with self._lock:
            kept = len(self._events)
            if seq > self.seq or seq < self.seq - kept:
                return None
            return list(self._events)[kept - (self.seq - seq):] if seq < self.seq else []


class Publishing(EvictionPolicy):
    """``inner``, an eviction policy, whose radix tree's inserts and evictions are also
    published to ``log`` (the module docstring)."""

    def __init__(self, inner: EvictionPolicy, log: EventLog) -> None:
        self.inner = inner
        self.log = log
        self.name = inner.name
        self.priority_drifts = inner.priority_drifts
        self.needs_history = getattr(inner, "needs_history", False)

    def __getattr__(self, name: str) -> Any:  # what else the wrapped policy offers
        return getattr(self.inner, name)

    def priority(self, entry) -> Any:
        return self.inner.priority(entry)

    def on_access(self, requester: Requester | None) -> None:
        self.inner.on_access(requester)

    def on_hit(self, entry) -> None:
        self.inner.on_hit(entry)

    def on_split(self, head, tail) -> None:
        split = getattr(self.inner, "on_split", None)
        if split is not None:
            split(head, tail)

    def on_create(self, entry: TreeNode) -> None:
        self.inner.on_create(entry)
        self.log.publish("stored", path_bytes(entry), entry.start)

    def on_evict(self, entry: TreeNode, key: Any) -> None:
        self.inner.on_evict(entry, key)
        path = path_bytes(entry)
        if entry.alive:  # cut back, still a leaf (evict_unit=page)
            self.log.publish("trimmed", path, entry.size + entry.start)
        else:  # unlinked whole; its parent link is kept
            self.log.publish("removed", path, entry.start)


def path_bytes(node: TreeNode) -> bytes:
    """The tokens from the root to the end of ``node``, as bytes."""
    parts = []
    while node.parent is not None:
        parts.append(node.kb)
        node = node.parent
    return b"".join(reversed(parts))


def cached_sequences(cache: Any) -> list[np.ndarray]:
    """The longest sequences a radix cache holds (its leaves' paths): the state a reader of its
    events re-reads after a gap. Read between steps."""
    return [np.frombuffer(path_bytes(n), TOKEN_DTYPE) for n in cache.nodes() if not n.children]


def publishing(policy: EvictionPolicy, log: EventLog | None) -> EvictionPolicy:
    """``policy`` publishing to ``log``, or ``policy`` itself without a log."""
    return policy if log is None else Publishing(policy, log)


def sequence_set(sequences: Iterable[np.ndarray]) -> set[tuple[int, ...]]:
    """Sequences as a set of token tuples (to compare two pictures of a cache)."""
    return {tuple(int(t) for t in s) for s in sequences}
