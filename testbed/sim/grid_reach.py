"""Where a simulated run's steps went beyond the grid its fitted cost model was measured on.

``python -m testbed.calibrate`` writes the grid's extent into the fitted file (``meta.grid``:
per step kind the least and largest batch, rows ``Σnew`` and per-request context it measured,
`grid_extent`). A simulated run with that file counts, as its executor prices each step
(`GridReach`), the steps whose shape lies outside it, and the largest (or least) values they
reached; the run then ends with one warning naming them (`GridReach.warning`): those steps were
priced by extrapolation (a row table's last cost per row, the linear terms past the contexts
measured), which the calibration never checked.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from testbed.sim.fitted import OPTIONAL_KINDS
from testbed.sim.step_shape import StepShape

#: per step kind, what is measured of a step and how it is named in a warning
DIMENSIONS = {"batch": "batch sizes", "rows": "new tokens (rows)", "context": "contexts"}
#: the calibrate key that sets each dimension's values, per kind
GRID_KEYS = {("prefill", "batch"): "prefill_batch", ("prefill", "rows"): "prefill_new",
             ("prefill", "context"): "prefill_context", ("decode", "batch"): "decode_batch",
             ("decode", "rows"): "decode_batch", ("decode", "context"): "decode_context",
             ("verify", "batch"): "verify_batch", ("verify", "rows"): "verify_new",
             ("verify", "context"): "decode_context"}


def measures(step: StepShape) -> dict[str, int]:
    """A step's batch, rows (``Σnew``; a decode's are its batch) and longest per-request
    context."""
    out = {"batch": step.batch, "context": max(step.context, default=0)}
    if not step.is_decode:
        out["rows"] = step.num_new
    return out


def grid_extent(steps: Iterable[StepShape]) -> dict[str, dict[str, list[int]]]:
    """Per step kind, each dimension's [least, largest] over the measured ``steps``."""
    out: dict[str, dict[str, list[int]]] = {}
    for step in steps:
        kind = out.setdefault(step.kind, {})
        for dim, value in measures(step).items():
            lo, hi = kind.get(dim, [value, value])
            kind[dim] = [min(lo, value), max(hi, value)]
    return out


class GridReach:
    """The steps a run priced outside ``grid`` (`grid_extent`'s form), and how far they went."""

    def __init__(self, grid: Mapping[str, Mapping[str, Any]], path: Any = None) -> None:
        self.grid = grid
        self.path = path
        self.steps = 0
        self.outside = 0
        self.beyond: dict[tuple[str, str], tuple[int, int]] = {}  # (kind, dim) -> (least, most)

    def add(self, step: StepShape) -> None:
        self.steps += 1
        kind = step.kind  # a fit without verify steps priced them as prefills: against those
        if kind not in self.grid:
            kind = OPTIONAL_KINDS.get(kind, kind)
        extent = self.grid.get(kind)
        if not extent:
            return
        out = False
        for dim, value in measures(step).items():
            lo, hi = extent.get(dim, (value, value))
            if dim == "context":  # a shorter context than measured costs less by each term
                lo = value
            if value < lo or value > hi:
                out = True
                least, most = self.beyond.get((kind, dim), (value, value))
                self.beyond[(kind, dim)] = (min(least, value), max(most, value))
        self.outside += out

    def warning(self) -> str | None:
        """One line naming the dimensions the run's steps left the grid in, or None."""
        if not self.outside:
            return None
        parts = []
        for (kind, dim), (least, most) in sorted(self.beyond.items()):
            lo, hi = self.grid[kind][dim]
            reached = f"{most:,}" if most > hi else f"{least:,}"
            side = "up to" if most > hi else "down to"
            if least < lo and most > hi:
                reached, side = f"{least:,} and {most:,}", "at"
            parts.append(f"{kind} {DIMENSIONS[dim]} {side} {reached} (grid {lo:,}-{hi:,}, "
                         f"calibrate.{GRID_KEYS[(kind, dim)]})")
        where = f" of cost_model.path={self.path}" if self.path else ""
        return (f"warning: {self.outside:,} of {self.steps:,} steps reached shapes outside the "
                f"calibration grid{where}, priced by extrapolation: {'; '.join(parts)}; "
                f"calibrate with a grid that covers them")
