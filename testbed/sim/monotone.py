"""Monotone tables from noisy measurements: fitting them once, and reading them fast.

A simulator needs step times that never drop when a step does more work, but measured kernel times
are not monotone in their shape: in Vidur's A100 profile (``data:vidur_a100_codellama34b_tp2``)
132 of 259 token counts of a layer's operators are slower than some larger count (by up to 7 %),
and all-reduces flip between a ~10 µs floor and ~60 µs stalls from one message size to the next.

`increasing` is isotonic regression (`scipy.optimize.isotonic_regression`): the non-decreasing
sequence closest to the measurements in least squares. It equals them wherever they are already in
order and replaces each run that is out of order by its mean, so it has no bias; a running maximum
(the other common clamp) lifts everything after one slow outlier (to 6.5× the measurement on
those all-reduces). Between points, `Curve` and `Surface` interpolate linearly (bilinearly),
which is exact at the points and keeps the order; beyond the last point they continue at the
slope of the largest measured points (`tail_slope`). Both read in pure Python (a bisection and a
few products), since a simulation asks hundreds of thousands of times.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import numpy as np
from scipy.optimize import isotonic_regression


def increasing(y: np.ndarray) -> np.ndarray:
    """The least-squares non-decreasing fit to ``y`` (isotonic regression)."""
    y = np.asarray(y, dtype=float)
    return isotonic_regression(y).x if y.size > 1 else y.copy()


def tail_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of ``y`` over the upper half of ``x``'s range (at least the last two
    points): the cost of one more unit at the largest measured sizes. Never negative."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.size < 2:
        return 0.0
    top = x >= x[0] + (x[-1] - x[0]) / 2
    top[-2:] = True
    xt, yt = x[top], y[top]
    dx = xt - xt.mean()
    return max(0.0, float(dx @ (yt - yt.mean()) / (dx @ dx)))


def _bracket(xs: tuple[float, ...], x: float) -> tuple[int, float]:
    """Index ``i`` and weight ``w`` with x = (1−w)·xs[i] + w·xs[i+1], for xs[0] ≤ x < xs[-1]."""
    i = bisect_right(xs, x) - 1
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class Curve:
    """A non-decreasing piecewise-linear function: ``ys[i]`` at ``xs[i]``, constant below
    ``xs[0]``, rising at ``slope`` per unit beyond ``xs[-1]``."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    slope: float

    @classmethod
    def fit(cls, x: np.ndarray, y: np.ndarray) -> Curve:
        """The isotonic fit of measurements ``y`` at increasing ``x``."""
        ys = increasing(y)
        return cls(tuple(float(v) for v in x), tuple(float(v) for v in ys), tail_slope(x, ys))

    def at(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1] + self.slope * (x - xs[-1])
        i, w = _bracket(xs, x)
        return ys[i] + (ys[i + 1] - ys[i]) * w


@dataclass(frozen=True)
class Surface:
    """A function of (row, column) non-decreasing in both: bilinear between grid points, constant
    below the first column and outside the rows' range (callers extend rows themselves), rising
    at row ``r``'s ``slopes[r]`` per unit beyond the last column (slopes non-decreasing too)."""

    rows: tuple[float, ...]
    cols: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]
    slopes: tuple[float, ...]

    @classmethod
    def fit(cls, rows: np.ndarray, cols: np.ndarray, measured: np.ndarray) -> Surface:
        """Fit a grid of measurements (NaN where a shape was not measured; each row has at least
        one): isotonic along each row, then each column, over the measured cells. A row continues
        past its last measured column at its `tail_slope`, per unit of column; a row whose
        measured span is under a quarter of the columns' range takes the slope of the nearest row
        with a long enough span, scaled by ``row / that row`` (cost per unit of row × column:
        per attended query–key pair for attention), and no row's slope is under that of the
        largest such row, scaled the same way (small rows' short ranges are launch-bound, or sit in
        the L2 cache, and rise slower than the bandwidth allows further out). A last running
        maximum along both axes guarantees the order the fills might break."""
        rows, cols = np.asarray(rows, dtype=float), np.asarray(cols, dtype=float)
        grid = np.array(measured, dtype=float)
        seen = np.isfinite(grid)
        if not seen.any(axis=1).all():
            raise ValueError("Surface.fit: every row needs a measured cell")
        for i in range(grid.shape[0]):
            grid[i, seen[i]] = increasing(grid[i, seen[i]])
        for j in range(grid.shape[1]):
            if seen[:, j].any():
                grid[seen[:, j], j] = increasing(grid[seen[:, j], j])
        slopes = np.full(len(rows), np.nan)
        min_span = (cols[-1] - cols[0]) / 4
        for i in range(len(rows)):
            c = cols[seen[i]]
            if c[-1] - c[0] >= min_span:
                slopes[i] = tail_slope(c, grid[i, seen[i]])
        known = np.flatnonzero(np.isfinite(slopes))
        for i in np.flatnonzero(~np.isfinite(slopes)):
            ref = known[np.argmin(np.abs(known - i))] if known.size else None
            slopes[i] = 0.0 if ref is None else slopes[ref] * rows[i] / rows[ref]
        if known.size:  # no row cheaper per unit of row × column than the largest measured one
            slopes = np.maximum(slopes, slopes[known[-1]] * rows / rows[known[-1]])
        slopes = increasing(slopes)
        for i in range(len(rows)):
            c, v = cols[seen[i]], grid[i, seen[i]]
            inside = np.interp(cols, c, v)
            grid[i] = np.where(cols > c[-1], v[-1] + slopes[i] * (cols - c[-1]), inside)
        grid = np.maximum.accumulate(np.maximum.accumulate(grid, axis=1), axis=0)
        return cls(tuple(map(float, rows)), tuple(map(float, cols)),
                   tuple(tuple(map(float, r)) for r in grid), tuple(map(float, slopes)))

    def _row(self, r: int, col: float) -> float:
        v, cols = self.values[r], self.cols
        if col <= cols[0]:
            return v[0]
        if col >= cols[-1]:
            return v[-1] + self.slopes[r] * (col - cols[-1])
        j, w = _bracket(cols, col)
        return v[j] + (v[j + 1] - v[j]) * w

    def at(self, row: float, col: float) -> float:
        rows = self.rows
        if row <= rows[0]:
            return self._row(0, col)
        if row >= rows[-1]:
            return self._row(len(rows) - 1, col)
        i, w = _bracket(rows, row)
        if w == 0.0:
            return self._row(i, col)
        return self._row(i, col) * (1 - w) + self._row(i + 1, col) * w
