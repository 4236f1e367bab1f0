"""Fitting the simulator's step-time model to measured steps.

The fitted form (docs/design.md §6) is ``a + b·Σnew + c·Σ(new·context) + d·batch + e·Σcontext
+ f·batch·max(context) + g·few_row_passes`` per step kind (decode, prefill, and where measured
verify: a speculative verification, `StepShape.verify`; ``f``'s term is 0 but in a decode), with
non-negative coefficients: each term is a cost that can only add time.
``Σcontext`` is the cached KV a step reads (`StepShape.kv_read_context`: a cascade group's shared
prefix once), the same term `FittedCostModel.predict` multiplies.
The ``new·context`` term counts every query–key pair a new token attends, the causal triangle of
its own chunk included (`StepShape.attended_pairs`): without it a long prefill's quadratic
attention would have no term to land on.
The ``batch·max(context)`` term (`StepShape.padded_decode_area`) is a decode kernel that pads the
batch to its longest KV (the engine's ``torch`` attention): only a grid with decode batches of
mixed contexts (``calibrate.decode_ragged``) tells it from ``Σcontext``; on uniform batches the two
coincide (less the ``batch`` part), the coefficients are then not unique, the predictions on such
batches are.
``few_row_passes`` (`StepShape.few_row_passes`: ``batch − 1`` for a batch of 2 or 3, else 0) is
a CPU BLAS reading the weights once per row below 4 rows; only a grid with batches of 2 or 3
gives ``g`` a value (else it is 0).
``h`` prices the KV a decode step reads again (`StepShape.reread`), ``e`` the rest; only a grid
with decode batches sharing a prefix (``calibrate.decode_shared``) gives ``h`` a value of its own
(else it is ``e``: a re-read costs a first read).
With ``row_knots`` (per kind, the row counts ``Σnew`` a grid measured: a decode's batch sizes, a
prefill's new tokens), the terms a table stands for (`TABLED`) give way to one cost per measured
row count, ``n<K>``, read between them by `row_weights`: a CPU BLAS's cost moves in steps with
the number of rows (docs/design.md §3), and the grid's counts are where it was seen.
`nnls` is the Lawson–Hanson active-set method, small enough to keep here (a dozen unknowns).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from testbed.sim.cost_model import COEFFS, KINDS, OPTIONAL_KINDS, row_weights
from testbed.sim.step_shape import StepShape


#: the terms a row table stands in for, per kind: a step's fixed and per-row costs; in a decode
#: (one new token a request) the batch is the rows and the attended pairs are Σcontext plus the
#: batch, which ``e`` and the table then hold, and the per-row passes are the table's to price
TABLED = {"decode": ("a", "b", "c", "d", "g"), "prefill": ("a", "b"), "verify": ("a", "b")}


def features(step: StepShape, knots: Sequence[int] = ()) -> np.ndarray:
    """The fitted form's terms for one step, in the order of ``COEFFS``, then each knot's weight
    (`row_weights`) where ``knots`` are given."""
    terms = [1.0, step.num_new, step.attended_pairs, step.batch,
             step.kv_read_context - step.reread, step.padded_decode_area, step.few_row_passes,
             step.reread]
    return np.array(terms + (row_weights(knots, step.num_new) if knots else []))


def nnls(a: np.ndarray, y: np.ndarray, iterations: int = 200) -> np.ndarray:
    """argmin ||a·x − y|| subject to x ≥ 0 (Lawson & Hanson, 1974)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iterations):
        gradient = a.T @ (y - a @ x)
        candidates = ~passive & (gradient > 1e-12 * max(1.0, np.abs(gradient).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            blocked = passive & (z <= 0)
            step = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + step * (z - x)
            passive &= x > 1e-15
    return x


def fit_coefficients(samples: Iterable[tuple[StepShape, float]], relative: bool = True,
                     exclude: Iterable[str] = (),
                     row_knots: Mapping[str, Sequence[int]] | None = None
                     ) -> dict[str, dict[str, float]]:
    """Coefficients per step kind from (step, measured seconds) pairs: least squares on relative
    error by default (each row weighted by 1/measured, so short decode steps count as much as long
    prefills), or on absolute time (``relative=False``: a makespan is a sum of step times).
    Coefficients named in ``exclude`` are held at 0 (a term the measured system is known not to
    have, which the data alone would confound with another). ``row_knots``: per kind, the row
    counts to fit a cost of their own (``n<K>``) in place of the `TABLED` terms. Speculative
    verification steps (`StepShape.verify`), where there are any, get coefficients of their own
    (``verify``); without them the fit has none (`FittedCostModel` then prices them as
    prefills)."""
    excluded = set(exclude)
    knots = {kind: sorted(set((row_knots or {}).get(kind, ())))
             for kind in KINDS + tuple(OPTIONAL_KINDS)}
    if any(k < 1 for ks in knots.values() for k in ks):
        raise ValueError(f"row_knots must be row counts >= 1, got {row_knots}")
    by_kind: dict[str, list[tuple[np.ndarray, float]]] = {kind: [] for kind in KINDS}
    for step, seconds in samples:
        by_kind.setdefault(step.kind, []).append((features(step, knots[step.kind]), seconds))
    coeffs = {}
    for kind, rows in by_kind.items():
        if not rows:
            raise ValueError(f"no {kind} steps to fit")
        names = list(COEFFS) + [f"n{k}" for k in knots[kind]]
        held = excluded | (set(TABLED[kind]) if knots[kind] else set())
        x = np.array([r[0] for r in rows])
        x[:, np.array([name in held for name in names], dtype=bool)] = 0.0
        y = np.array([r[1] for r in rows])
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # conditioning: columns of similar size
        weights = 1.0 / np.maximum(y, 1e-9) if relative else np.ones_like(y)
        solution = nnls((x / scale) * weights[:, None], y * weights) / scale
        coeffs[kind] = {name: float(v) for name, v in zip(names, solution)}
        if not x[:, COEFFS.index("h")].any():  # no re-read measured: priced as a first read
            coeffs[kind]["h"] = coeffs[kind]["e"]
    return coeffs


def mape(predicted: Iterable[float], measured: Iterable[float]) -> float:
    """Mean absolute percentage error."""
    p, m = np.asarray(list(predicted)), np.asarray(list(measured))
    return float(np.mean(np.abs(p - m) / m)) if len(m) else float("nan")
