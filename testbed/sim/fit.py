"""Fitting the simulator's step-time model to measured steps.

The fitted form (docs/design.md §6) is ``a + b·Σnew + c·Σ(new·context) + d·batch + e·Σcontext
+ f·batch·max(context) + g·few_row_passes`` per step kind (decode, prefill; ``f``'s term is 0 in a
prefill), with non-negative coefficients: each term is a cost that can only add time.
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
With ``decode_batch_knots`` (the decode batch sizes a grid measured), a decode step's per-step,
per-request and per-row costs (``a``, ``b``, ``c``, ``d``, ``g``; see `TABLED`) give way to one
cost per measured batch size,
``n<K>``, read between them by `batch_weights`: a CPU BLAS's cost moves in steps with the number
of rows (docs/design.md §3), and the grid's sizes are where it was seen.
`nnls` is the Lawson–Hanson active-set method, small enough to keep here (a dozen unknowns).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from testbed.sim.cost_model import COEFFS, KINDS, batch_weights
from testbed.sim.step_shape import StepShape


#: the terms a decode's batch-size table stands in for: with one new token a request, Σnew is the
#: batch and the attended pairs are Σcontext plus the batch, which ``e`` and the table then hold
TABLED = ("a", "b", "c", "d", "g")


def features(step: StepShape, knots: Sequence[int] = ()) -> np.ndarray:
    """The fitted form's terms for one step, in the order of ``COEFFS``, then each knot's weight
    (`batch_weights`) where ``knots`` are given."""
    terms = [1.0, step.num_new, step.attended_pairs, step.batch,
             step.kv_read_context - step.reread, step.padded_decode_area, step.few_row_passes,
             step.reread]
    return np.array(terms + (batch_weights(knots, step.batch) if knots else []))


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
                     exclude: Iterable[str] = (), decode_batch_knots: Sequence[int] = ()
                     ) -> dict[str, dict[str, float]]:
    """Coefficients per step kind from (step, measured seconds) pairs: least squares on relative
    error by default (each row weighted by 1/measured, so short decode steps count as much as long
    prefills), or on absolute time (``relative=False``: a makespan is a sum of step times).
    Coefficients named in ``exclude`` are held at 0 (a term the measured system is known not to
    have, which the data alone would confound with another). ``decode_batch_knots``: fit decode
    steps with a cost per batch size (``n<K>``) in place of the `TABLED` terms."""
    excluded = set(exclude)
    knots = {"decode": sorted(set(decode_batch_knots)), "prefill": []}
    if any(k < 1 for k in knots["decode"]):
        raise ValueError(f"decode_batch_knots must be batch sizes >= 1, got {decode_batch_knots}")
    by_kind: dict[str, list[tuple[np.ndarray, float]]] = {kind: [] for kind in KINDS}
    for step, seconds in samples:
        by_kind[step.kind].append((features(step, knots[step.kind]), seconds))
    coeffs = {}
    for kind, rows in by_kind.items():
        if not rows:
            raise ValueError(f"no {kind} steps to fit")
        names = list(COEFFS) + [f"n{k}" for k in knots[kind]]
        held = excluded | (set(TABLED) if knots[kind] else set())
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
