"""The learned eviction policy: evict entries predicted to be reused late, learned online.

What it is for: a deployable step from LRU towards Belady's rule (`testbed.cache.oracle`) that
learns from the past only. scikit-learn's HistGradientBoostingRegressor predicts the log of an
entry's time to its next reuse (in the cache's logical clock) from features the cache keeps or the
policy keeps cheaply, each binned to a small integer (largest bins in `CAPS`):

- ``size`` and ``start`` (depth) as ``int.bit_length``;
- ``access_count`` (creation counts one);
- the gap between the entry's last two accesses as ``bit_length`` (0 before a second access);
- the request category, an index by first appearance (0: none).

Labels come from the past as it arrives. Each access (creation or hit) leaves the entry *pending*
with the binned features it has then; its next hit, ``g`` ticks later, labels them ``g`` (a hit on
the head of a split labels the entry it was cut from); an entry
evicted, or not hit within ``horizon`` ticks, is labelled ``horizon`` (censored). The last
``window`` labels are the training set; the model is refit every ``retrain_every`` new labels, and
each fit predicts the whole feature grid at once, so a key costs a dict look-up, never a call into
scikit-learn.

The key is computed when an entry is (re)offered (`testbed.cache.eviction`) and must stay
meaningful in the heap: ``last_access - scale * predicted gap``, smallest evicted first (LRU whose
clock runs faster for entries expected to be reused late). Belady's literal form, ``-(last_access +
predicted gap)`` (farthest predicted next use first), evicts the most recent entry of each
predicted class first and measured 0.089 against LRU's 0.135 on the Mooncake conversation trace
(README). Before the first model the key is ``last_access - 2**60``: exactly LRU, and below every
learned key, so entries offered before the first fit go first. A key is memoised per entry until
its last access or size changes, so a refit never changes keys already in the heap
(`RadixCache.check_invariants` holds).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

import numpy as np
# scikit-learn takes seconds to import: this module is imported only when eviction=learned is
# chosen (its registry entry is lazy, testbed/cache/eviction.py), by the assembly step, before a
# run's timed parts
from sklearn.ensemble import HistGradientBoostingRegressor
from threadpoolctl import threadpool_limits

from testbed.cache.eviction import EntryStats, EvictionPolicy

Row = tuple[int, int, int, int, int]  # binned features (see `LearnedEviction.features`)
#: the largest bin of each feature: size, start and gap bits, access count, category index
CAPS = (17, 17, 4, 17, 3)


class LearnedEviction(EvictionPolicy):
    """Farthest predicted next reuse first, from a model refit online on past reuses."""

    name = "learned"

    def __init__(self, retrain_every: int = 2500, window: int = 10000, horizon: int = 5000,
                 min_train: int = 1000, max_iter: int = 30, scale: float = 4.0,
                 seed: int = 0) -> None:
        for key, value in (("retrain_every", retrain_every), ("window", window),
                           ("horizon", horizon), ("min_train", min_train), ("max_iter", max_iter)):
            if value < 1:
                raise ValueError(f"eviction.{key} must be >= 1, got {value}")
        self.retrain_every, self.horizon = retrain_every, horizon
        if scale <= 0:
            raise ValueError(f"eviction.scale must be > 0, got {scale}")
        self.min_train, self.max_iter, self.scale, self.seed = min_train, max_iter, scale, seed
        self.now = 0  # the latest access time seen (the cache's logical clock)
        # the training window: (time the label became known, features, log1p(gap))
        self.window: deque[tuple[int, Row, float]] = deque(maxlen=window)
        self._new_labels = 0
        self.fits = 0  # models fitted so far
        self.model: Any = None
        self._predicted: dict[Row, float] = {}  # memoised gap predictions of the current model
        self._prev: dict[int, tuple[int, int]] = {}  # id -> (previous access, latest access)
        self._pending: dict[int, tuple[int, Row]] = {}  # id -> (access time, features then)
        self._expiry: deque[tuple[int, int]] = deque()  # (access time, id), oldest first
        self._keys: dict[int, tuple[int, int, float]] = {}  # id -> (last_access, size, key)
        self._categories: dict[str | None, int] = {None: 0}

    # ------------------------------------------------------------ features and keys
    def features(self, entry: EntryStats) -> Row:
        prev = self._prev.get(entry.id)
        gap = prev[1] - prev[0] if prev is not None and prev[0] >= 0 else 0
        cat = self._categories.get(entry.category)
        if cat is None:
            cat = self._categories[entry.category] = min(len(self._categories), CAPS[4])
        return (min(entry.size.bit_length(), CAPS[0]), min(entry.start.bit_length(), CAPS[1]),
                min(entry.access_count, CAPS[2]), min(gap.bit_length(), CAPS[3]), cat)

    def predicted_gap(self, entry: EntryStats) -> float:
        """The current model's gap for the entry's features (a category newer than the model's
        grid counts as category 0)."""
        row = self.features(entry)
        gap = self._predicted.get(row)
        return gap if gap is not None else self._predicted[row[:4] + (0,)]

    def priority(self, entry: EntryStats) -> Any:
        memo = self._keys.get(entry.id)
        if memo is not None and memo[0] == entry.last_access and memo[1] == entry.size:
            return memo[2]
        if self.model is None:
            key: float = entry.last_access - 2**60  # no model yet: LRU
        else:  # not -(last_access + gap): see the module docstring
            key = entry.last_access - self.scale * self.predicted_gap(entry)
        self._keys[entry.id] = (entry.last_access, entry.size, key)
        return key

    # ------------------------------------------------------------ labels from the past
    def _access(self, entry: EntryStats) -> None:
        now = self.now = max(self.now, entry.last_access)
        prev = self._prev.get(entry.id)
        self._prev[entry.id] = (prev[1] if prev is not None else -1, now)
        self._pending[entry.id] = (now, self.features(entry))
        self._expiry.append((now, entry.id))
        self._expire()

    def _label(self, row: Row, gap: int) -> None:
        self.window.append((self.now, row, math.log1p(gap)))
        self._new_labels += 1
        if self._new_labels >= self.retrain_every and len(self.window) >= self.min_train:
            self._fit()

    def _expire(self) -> None:
        """Censor the pending entries not reused within the horizon."""
        expiry, limit = self._expiry, self.now - self.horizon
        while expiry and expiry[0][0] <= limit:
            at, entry_id = expiry.popleft()
            pending = self._pending.get(entry_id)
            if pending is not None and pending[0] == at:
                del self._pending[entry_id]
                self._label(pending[1], self.horizon)

    def on_create(self, entry: EntryStats) -> None:
        self._access(entry)

    def on_hit(self, entry: EntryStats) -> None:
        pending = self._pending.pop(entry.id, None)
        if pending is None and entry.id not in self._prev:
            # the head of a split (radix tree): the reuse is of the entry it was cut from, its
            # only child, which kept the id, the pending label and the access history
            for child in getattr(entry, "children", {}).values():
                pending = self._pending.pop(child.id, None)
                if child.id in self._prev:
                    self._prev[entry.id] = self._prev[child.id]
        if pending is not None:
            self.now = max(self.now, entry.last_access)
            self._label(pending[1], min(self.now - pending[0], self.horizon))
        self._access(entry)

    def on_evict(self, entry: EntryStats, key: Any) -> None:
        if getattr(entry, "alive", False):
            return  # trimmed (evict_unit=page), not removed: it competes again, no label yet
        pending = self._pending.pop(entry.id, None)
        if pending is not None:
            self._label(pending[1], self.horizon)
        self._prev.pop(entry.id, None)
        self._keys.pop(entry.id, None)

    # ------------------------------------------------------------ training
    def _fit(self) -> None:
        self._new_labels = 0
        x = np.array([row for _, row, _ in self.window], dtype=np.int64)
        y = np.array([label for _, _, label in self.window])
        with threadpool_limits(1):  # small fits: OpenMP threads cost more than they save
            self.model = HistGradientBoostingRegressor(
                max_iter=self.max_iter, categorical_features=[4], early_stopping=False,
                random_state=self.seed).fit(x, y)
            grid = np.array(list(itertools.product(
                *(range(cap + 1) for cap in CAPS[:4]), range(max(self._categories.values()) + 1))))
            gaps = np.expm1(self.model.predict(grid))
        self._predicted = dict(zip(map(tuple, grid.tolist()), gaps.tolist()))
        self.fits += 1

