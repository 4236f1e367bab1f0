"""The learned eviction policy: keep the entries predicted to be reused soon, learned online.

What it is for: a deployable step from LRU towards Belady's rule (`testbed.cache.oracle`) that
learns from the past only. On a conversation trace what the oracle knows is *which* histories will
be continued; this policy estimates, per entry, the probability ``p`` that it is used again within
``horizon`` requests (`on_access` calls: the policy's clock), from features the cache keeps or the policy
keeps cheaply, each binned to a small integer (largest bins in `CAPS`):

- ``size``, ``start`` (tokens before it) and ``start + size`` in `log_bin`s (four per octave);
  ``access_count`` (creation counts one); the gap between the entry's last two accesses as
  ``bit_length`` (in requests; 0 before a second access); the request category, an index by first appearance
  (0: none);
- on a radix tree (entries with a ``parent``): its *turn*, the number of nodes above it counting
  evicted ones (a new leaf's is its parent's plus one, or more if it re-creates evicted nodes: a
  conversation's turn, which the tree's depth forgets once a history is evicted), whether it is a
  split's tail (its parent is younger than it: a walk used its head and went elsewhere) and how
  many children its parent has.

Labels come from the past as it arrives. Each access (creation or hit) of a leaf leaves it
*pending* with the binned features it has then (a node with children is not a candidate, and
labelling the shared system prompt's hits would fill the window); a hit within ``horizon`` labels
them 1. A split (`on_split`: a walk stopped inside a node, at a match, an insert or SGLang 0.5.23's
checkpoint, which cuts every finished request's leaf at its prompt's end) gives the entry's turn,
access times and pending label to the head, the part a later walk reaches, and makes the tail
pending as a tail. An evicted radix node becomes a `Ghost` under its parent, keyed by its first
token, for ``horizon`` requests; a node evicted with ghosts below it
carries them along, shifted by its size. A new leaf that starts in a ghost's place and runs
through a carried ghost's first token means a request wanted those tokens again: it labels each
such ghost still pending 1 and takes its turn. So the labels do not depend on what the policy
itself evicted. Not reused within ``horizon`` labels 0 (as does the eviction of an entry without a
parent, a block). The last ``window`` labels train a regression tree (scikit-learn's
DecisionTreeRegressor, ``max_depth``, ``min_samples_leaf``: its leaves' means are the
probabilities) every ``retrain_every`` new labels once ``min_train`` are held; its documented
arrays are walked in Python (`TreeModel`), so a key costs a few comparisons (memoised per feature
row), never a call into scikit-learn.

The key is computed when an entry is (re)offered (`testbed.cache.eviction`) and must stay
meaningful in the heap: ``last_access + scale * rate * p``, smallest evicted first (LRU in which an
entry likely to be reused counts as ``scale * p`` requests younger; ``rate``, the cache's clock
ticks per request so far, turns requests into the ticks ``last_access`` counts). Before the first model the key is
``last_access - 2**60``: exactly LRU, and below every learned key. A key is memoised per entry
until its last access or size changes, so a refit never changes keys already in the heap
(`RadixCache.check_invariants` holds).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
# scikit-learn takes seconds to import: this module is imported only when eviction=learned is
# chosen (its registry entry is lazy, testbed/cache/eviction.py), by the assembly step, before a
# run's timed parts
from sklearn.tree import DecisionTreeRegressor

from testbed.cache.eviction import EntryStats, EvictionPolicy
from testbed.cache.token_runs import TOKEN_BYTES
from testbed.errors import BadInput

Row = tuple[int, ...]  # binned features (see `LearnedEviction.features`)
#: the largest bin of each feature: size and start log bins, access count, gap bits, category
#: index, turn, split tail (0/1), the parent's children, start + size log bin
CAPS = (80, 80, 4, 17, 3, 15, 1, 7, 80)


def log_bin(n: int) -> int:
    """Four bins per octave: ``4 * bit_length`` plus the two bits below the leading one."""
    bits = n.bit_length()
    return 4 * bits + ((n << 2 >> (bits - 1)) & 3 if bits else 0)


def tree_features(entry: Any) -> tuple[int, int]:
    """Where a radix node sits: whether it is a split's tail (1 if its parent was created after
    it) and its parent's children (up to ``CAPS[7]``). Zeros for an entry without a parent."""
    parent = getattr(entry, "parent", None)
    if parent is None:
        return 0, 0
    return int(parent.created > entry.created), min(len(parent.children), CAPS[7])


class Ghost(NamedTuple):
    """An evicted radix node, remembered for ``horizon`` accesses under its place in the tree."""

    offset: int  # tokens from the start of the place (an evicted ancestor's) to the node
    token: bytes  # its first token
    id: int
    turn: int
    evicted: int  # when (the policy's clock)


class TreeModel:
    """A fitted regression tree as plain lists: `predict` walks it in Python (microseconds).
    `save` and `load` keep it as JSON (the lists; ``eviction.model``)."""

    FIELDS = ("left", "right", "feature", "threshold", "value")

    def __init__(self, fitted: DecisionTreeRegressor | None = None) -> None:
        if fitted is None:
            return  # `load` fills it
        tree = fitted.tree_
        self.left = tree.children_left.tolist()
        self.right = tree.children_right.tolist()
        self.feature = tree.feature.tolist()
        self.threshold = tree.threshold.tolist()
        self.value = tree.value[:, 0, 0].tolist()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({f: getattr(self, f) for f in self.FIELDS}))

    @classmethod
    def load(cls, path: str | Path) -> "TreeModel":
        try:
            data = json.loads(Path(path).read_text())
            model = cls()
            for f in cls.FIELDS:
                setattr(model, f, list(data[f]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise BadInput(f"eviction.model={path}: not a saved learned model ({e})") from None
        return model

    def predict(self, row: Row) -> float:
        node, left = 0, self.left
        while left[node] != -1:  # -1: a leaf (scikit-learn's TREE_LEAF)
            node = left[node] if row[self.feature[node]] <= self.threshold[node] \
                else self.right[node]
        return self.value[node]


class LearnedEviction(EvictionPolicy):
    """Likely-reused entries kept longer, by a reuse probability refit online on past reuses."""

    name = "learned"

    def __init__(self, retrain_every: int = 500, window: int = 20000, horizon: int = 1000,
                 min_train: int = 1000, max_depth: int = 6, min_samples_leaf: int = 50,
                 scale: float = 5000.0, seed: int = 0, model: str | None = None,
                 refit: bool = True) -> None:
        for key, value in (("retrain_every", retrain_every), ("window", window),
                           ("horizon", horizon), ("min_train", min_train),
                           ("max_depth", max_depth), ("min_samples_leaf", min_samples_leaf)):
            if value < 1:
                raise BadInput(f"eviction.{key} must be >= 1, got {value}")
        if scale <= 0:
            raise BadInput(f"eviction.scale must be > 0, got {scale}")
        self.retrain_every, self.horizon, self.min_train = retrain_every, horizon, min_train
        self.max_depth, self.min_samples_leaf = max_depth, min_samples_leaf
        self.scale, self.seed = scale, seed
        # Time is counted in requests (`on_access` calls): the cache's logical clock ticks once
        # per node a walk touches, and SGLang 0.5.23's checkpoint walks a request's path twice
        # more than 0.4.10's insert did (2.5x the ticks a request on the Mooncake conversation
        # trace), which shrank a horizon in ticks to 2/5 of its reach
        self.now = 0  # requests begun so far
        self.ticks = 0  # the latest access time seen (the cache's clock): keys mix it with p
        # the training window: (time the label became known, features, 1 reused / 0 not)
        self.window: deque[tuple[int, Row, int]] = deque(maxlen=window)
        self._new_labels = 0
        self.fits = 0  # models fitted so far
        # a model trained elsewhere (`TreeModel.save`, e.g. on another trace): used from the
        # first request; ``refit`` false keeps it (judged on a trace it was not trained on)
        self.model: TreeModel | None = TreeModel.load(model) if model else None
        self.refit = refit
        self._predicted: dict[Row, float] = {}  # memoised probabilities of the current model
        self._prev: dict[int, tuple[int, int]] = {}  # id -> (previous access, latest access)
        self._pending: dict[int, tuple[int, Row]] = {}  # id -> (access time, features then)
        self._expiry: deque[tuple[int, int]] = deque()  # (access time, id), oldest first
        # evicted radix nodes by the place a new leaf would take, (parent id, first token); a
        # node evicted with ghosts below it carries them, so a conversation re-created from
        # higher up still labels its evicted leaf and keeps its turn
        self._ghosts: dict[tuple[int, bytes], list[Ghost]] = {}
        # parent id -> its ghosts' keys (a dict: insertion order, for labels in a fixed order)
        self._ghosts_under: dict[int, dict[tuple[int, bytes], None]] = {}
        self._buried: deque[tuple[int, tuple[int, bytes]]] = deque()  # (time, key), oldest first
        self._turn: dict[int, int] = {}  # id -> its turn: nodes above it, evicted ones included
        self._keys: dict[int, tuple[int, int, float]] = {}  # id -> (last_access, size, key)
        self._categories: dict[str | None, int] = {None: 0}

    # ------------------------------------------------------------ features and keys
    def features(self, entry: EntryStats) -> Row:
        prev = self._prev.get(entry.id)
        gap = prev[1] - prev[0] if prev is not None and prev[0] >= 0 else 0
        cat = self._categories.get(entry.category)
        if cat is None:
            cat = self._categories[entry.category] = min(len(self._categories), CAPS[4])
        return (min(log_bin(entry.size), CAPS[0]), min(log_bin(entry.start), CAPS[1]),
                min(entry.access_count, CAPS[2]), min(gap.bit_length(), CAPS[3]), cat,
                min(self._turn.get(entry.id, 0), CAPS[5]), *tree_features(entry),
                min(log_bin(entry.start + entry.size), CAPS[8]))

    def reuse_probability(self, entry: EntryStats) -> float:
        """The current model's probability that the entry is used again within the horizon."""
        row = self.features(entry)
        p = self._predicted.get(row)
        if p is None:
            p = self._predicted[row] = self.model.predict(row)
        return p

    def priority(self, entry: EntryStats) -> Any:
        memo = self._keys.get(entry.id)
        if memo is not None and memo[0] == entry.last_access and memo[1] == entry.size:
            return memo[2]
        self.ticks = max(self.ticks, entry.last_access)
        if self.model is None:
            key: float = entry.last_access - 2**60  # no model yet: LRU
        else:  # scale requests of recency, as clock ticks at the rate seen so far
            rate = self.ticks / max(self.now, 1)
            key = entry.last_access + self.scale * rate * self.reuse_probability(entry)
        self._keys[entry.id] = (entry.last_access, entry.size, key)
        return key

    # ------------------------------------------------------------ labels from the past
    def on_access(self, requester: Any) -> None:
        self.now += 1  # a request begins: the policy's clock

    def _tick(self, entry: EntryStats) -> None:
        self.ticks = max(self.ticks, entry.last_access)

    def _access(self, entry: EntryStats) -> None:
        now = self.now
        prev = self._prev.get(entry.id)
        self._prev[entry.id] = (prev[1] if prev is not None else -1, now)
        self._expire()
        if getattr(entry, "children", None):
            # a node on a longer path: not a candidate now, and its reuse says little about
            # candidates' (the shared system prompt alone would fill half the window)
            self._pending.pop(entry.id, None)
            return
        self._pending[entry.id] = (now, self.features(entry))
        self._expiry.append((now, entry.id))

    def _label(self, row: Row, reused: int) -> None:
        self.window.append((self.now, row, reused))
        self._new_labels += 1
        if (self.refit and self._new_labels >= self.retrain_every
                and len(self.window) >= self.min_train):
            self._fit()

    def _reused(self, entry_id: int) -> None:
        pending = self._pending.pop(entry_id, None)
        if pending is not None:
            self._label(pending[1], 1)

    def _expire(self) -> None:
        """Label 0 the pending entries (and ghosts) not reused within the horizon."""
        expiry, limit = self._expiry, self.now - self.horizon
        while expiry and expiry[0][0] <= limit:
            at, entry_id = expiry.popleft()
            pending = self._pending.get(entry_id)
            if pending is not None and pending[0] == at:
                del self._pending[entry_id]  # (a ghost of it, if any, now labels nothing)
                self._label(pending[1], 0)

    def on_create(self, entry: EntryStats) -> None:
        parent = getattr(entry, "parent", None)
        if parent is not None:
            self._tick(entry)
            self._expire()  # (a ghost older than the horizon is labelled 0 first)
            turn = self._turn.get(parent.id, 0) + 1
            kb = entry.kb
            for ghost in self._unbury((parent.id, kb[:TOKEN_BYTES])):
                if kb[ghost.offset * TOKEN_BYTES : (ghost.offset + 1) * TOKEN_BYTES] == ghost.token:
                    self._reused(ghost.id)  # an evicted entry's tokens were wanted again
                    turn = max(turn, ghost.turn + 1)
            self._turn[entry.id] = turn
        self._access(entry)

    def on_hit(self, entry: EntryStats) -> None:
        self._tick(entry)
        self._expire()
        if entry.id not in self._pending and entry.id not in self._prev:
            # the head of a split the policy was not told of (a tree without `on_split`): the
            # reuse is of the entry it was cut from, its only child, which kept the id
            for child in list(getattr(entry, "children", {}).values()):
                self._reused(child.id)
                self._turn[entry.id] = self._turn.get(child.id, 0)
                if child.id in self._prev:
                    self._prev[entry.id] = self._prev[child.id]
                    self._access(child)  # the tail, passed by the walk: pending as a tail now
        self._reused(entry.id)
        self._access(entry)

    def on_split(self, head: EntryStats, tail: EntryStats) -> None:
        """A radix node was cut (a walk stopped inside it: a match, an insert, 0.5.23's
        checkpoint at a prompt's end). The entry's history goes to the head, the part a walk
        reached (a continued conversation re-reads the prompt, not the output): its turn, its
        access times and its pending label (the horizon restarting now); the tail, if the entry
        was pending, becomes pending as a tail, with its own features."""
        self._tick(tail)
        if tail.id in self._turn:
            self._turn[head.id] = self._turn[tail.id]
        prev = self._prev.get(tail.id)
        if prev is not None:
            self._prev[head.id] = prev
        pending = self._pending.pop(tail.id, None)
        if pending is not None:
            self._pending[head.id] = (self.now, pending[1])
            self._expiry.append((self.now, head.id))
            self._pending[tail.id] = (self.now, self.features(tail))
            self._expiry.append((self.now, tail.id))

    def on_evict(self, entry: EntryStats, key: Any) -> None:
        if getattr(entry, "alive", False):
            return  # trimmed (evict_unit=page), not removed: it competes again, no label yet
        parent = getattr(entry, "parent", None)
        if parent is not None:
            self._bury(entry, parent)
        else:
            pending = self._pending.pop(entry.id, None)
            if pending is not None:
                self._label(pending[1], 0)
        self._prev.pop(entry.id, None)
        self._keys.pop(entry.id, None)
        self._turn.pop(entry.id, None)

    def _bury(self, entry: Any, parent: Any) -> None:
        """Leave a ghost of evicted radix node ``entry`` under its parent, carrying the ghosts
        below it (shifted by its size); forget ghosts older than the horizon."""
        now, first = self.now, entry.kb[:TOKEN_BYTES]
        records = [Ghost(0, first, entry.id, self._turn.get(entry.id, 0), now)]
        for key in list(self._ghosts_under.get(entry.id, ())):
            records.extend(g._replace(offset=entry.size + g.offset) for g in self._unbury(key))
        key = (parent.id, first)
        self._ghosts.setdefault(key, []).extend(records)
        self._ghosts_under.setdefault(parent.id, {})[key] = None
        buried, limit = self._buried, now - self.horizon
        buried.append((now, key))
        while buried and buried[0][0] <= limit:
            key = buried.popleft()[1]
            old = self._ghosts.get(key)
            if old is not None:
                old[:] = [g for g in old if g.evicted > limit]
                if not old:
                    self._unbury(key)

    def _unbury(self, key: tuple[int, bytes]) -> list[Ghost]:
        """Remove and return the ghosts under ``key`` (parent id, first token)."""
        under = self._ghosts_under.get(key[0])
        if under is not None:
            under.pop(key, None)
            if not under:
                del self._ghosts_under[key[0]]
        return self._ghosts.pop(key, [])

    # ------------------------------------------------------------ training
    def _fit(self) -> None:
        self._new_labels = 0
        x = np.array([row for _, row, _ in self.window], dtype=np.int64)
        y = np.array([label for _, _, label in self.window], dtype=np.float64)
        self.model = TreeModel(DecisionTreeRegressor(
            max_depth=self.max_depth, min_samples_leaf=self.min_samples_leaf,
            random_state=self.seed).fit(x, y))
        self._predicted = {}
        self.fits += 1
