"""The fitted cost model (`FittedCostModel`) and its file: coefficients measured on one device.

``a + b·Σnew + c·Σ(new·context) + d·batch + e·Σcontext + f·batch·max(context) + g·few_row_passes
(+ (h − e)·reread)`` seconds per kind of step (decode / prefill, and where a fit measured them
speculative verification steps, ``verify``), plus, where a fit measured them,
``n<K>``: the own cost of a step of K rows (`row_weights` between the measured row counts); never
below the roofline floor (`testbed.sim.cost_model.RooflineCostModel.floor`). `save_fitted` writes
the YAML file ``python -m testbed.calibrate`` produces (coefficients and ``meta``: what they were
measured on), `load_fitted` reads and checks one (``cost_model=fitted cost_model.path=FILE``).
The forms and their terms: docs/design.md §6; how a fit is made: `testbed.sim.fit`.
"""

from __future__ import annotations

import bisect
import datetime as _dt
import math
import re
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import yaml

from testbed.errors import BadInput
from testbed.sim.step_shape import StepShape

class FloorModel(Protocol):
    """What a fitted model asks of its floor (`testbed.sim.cost_model.RooflineCostModel`)."""

    def floor(self, step: StepShape) -> float: ...

    def move_time(self, step: StepShape) -> float: ...


KINDS = ("decode", "prefill")
#: kinds a file may leave out, and the kind whose coefficients then price their steps:
#: ``verify`` (`StepShape.verify`: a speculative verification, every query's logits) came
#: later; a file without it prices verification steps as prefills of the same shape, as
#: every fit before it did (the same predictions, to the bit)
OPTIONAL_KINDS = {"verify": "prefill"}
COEFFS = ("a", "b", "c", "d", "e", "f", "g", "h")
#: coefficients a file may leave out, and the value they then take: ``f``, ``g`` and ``h`` came
#: later, and a file written before them was fitted without them (the same predictions, to the
#: bit; ``h``, a re-read token's cost, is then a first read's, ``e``)
OPTIONAL_COEFFS = {"f": 0.0, "g": 0.0, "h": "e"}
#: ``n<K>``: the cost of a step whose matmuls multiply K rows (``Σnew``: a decode batch of K
#: requests, a prefill of K new tokens), a table in place of the terms a fit with it holds at 0
#: (`testbed.sim.fit.TABLED`): a CPU BLAS changes its code path with the number of rows (on the
#: AVX-512 development machine SmolLM2's decode took 50, 53, 57, 87, 117 and 129 ms at 1, 2, 3,
#: 4, 8 and 16 requests of 64 tokens; its prefills of 4,096 tokens took 5-7.5% longer a token
#: than those of 1,024), which no line in the rows follows
ROW_KEY = re.compile(r"n([1-9][0-9]*)")


def row_weights(knots: Sequence[int], rows: int) -> list[float]:
    """Each ``n<K>``'s weight in a step of ``rows`` rows, for the measured row counts ``knots``
    (ascending): linear between the two around it; the least one's cost below it; beyond the
    largest, that one's cost per row (``rows / K``)."""
    weights = [0.0] * len(knots)
    if rows <= knots[0]:
        weights[0] = 1.0
    elif rows >= knots[-1]:
        weights[-1] = rows / knots[-1]
    else:
        i = bisect.bisect_right(knots, rows) - 1  # knots[i] <= rows < knots[i + 1]
        t = (rows - knots[i]) / (knots[i + 1] - knots[i])
        weights[i], weights[i + 1] = 1.0 - t, t
    return weights


def row_table(row: Mapping[str, float]) -> tuple[list[int], list[float]]:
    """A coefficient row's ``n<K>`` entries: the row counts, ascending, and their costs."""
    table = sorted((int(m.group(1)), v) for key, v in row.items()
                   if (m := ROW_KEY.fullmatch(key)))
    return [k for k, _ in table], [v for _, v in table]


class FittedCostModel:
    """``a + b·Σnew + c·Σ(new·context) + d·batch + e·Σcontext + f·batch·max(context)
    + g·few_row_passes + (h − e)·reread (+ n<K> by rows)`` seconds, with one coefficient set per
    kind (``decode`` when every request computes one token, else ``prefill``), never below ``floor_model.floor(step)``. ``Σcontext``
    is the KV the step reads, ``kv_read_context``: with cascade decoding a shared prefix counts
    once per group (the ``c`` term, the attended pairs, is the same math either way).
    ``batch·max(context)`` is `StepShape.padded_decode_area`: the KV a decode kernel padded to the
    batch's longest reads (the engine's ``torch`` attention), 0 in a prefill. ``few_row_passes``
    (`StepShape.few_row_passes`) is ``batch − 1`` for 2 or 3 requests, else 0: the extra weight
    passes of a CPU BLAS below 4 rows. ``n<K>`` coefficients, where present, price a step of K
    rows, ``Σnew`` (`row_weights` between them). ``h`` prices the cached tokens a decode step reads
    again (`StepShape.reread`: a prefix another request of the batch read, without cascade)
    instead of ``e``; absent, it is ``e``. The KV moves of reuse beyond exact prefixes are not in
    the fit: the floor model's `RooflineCostModel.move_time` is added."""

    def __init__(self, coeffs: Mapping[str, Mapping[str, float]],
                 floor_model: FloorModel, meta: Mapping[str, Any] | None = None) -> None:
        self.coeffs = _check_coeffs(coeffs, where="FittedCostModel")
        #: what the coefficients were measured on (the file's ``meta``: device, threads, clock,
        #: the grid's extent), as `load_fitted` read it; empty when built from coefficients
        self.meta = dict(meta or {})
        self.tables = {kind: row_table(row) for kind, row in self.coeffs.items()}
        #: whether re-read KV (`StepShape.reread`) costs other than a first read: the simulator
        #: then finds the step's shared prefixes for it (`testbed.sim.executor.SimExecutor`)
        self.prices_rereads = any(row["h"] != row["e"] for row in self.coeffs.values())
        self.floor_model = floor_model

    def kind_of(self, step: StepShape) -> str:
        """The coefficient set that prices ``step``: its kind's, or where the fit has none
        (``verify`` in a file before it), the kind `OPTIONAL_KINDS` names."""
        kind = step.kind
        return kind if kind in self.coeffs else OPTIONAL_KINDS[kind]

    def predict(self, step: StepShape) -> float:
        """The fitted form alone, without the floor."""
        kind = self.kind_of(step)
        k = self.coeffs[kind]
        knots, costs = self.tables[kind]
        table = sum(c * w for c, w in zip(costs, row_weights(knots, step.num_new))) \
            if knots else 0.0
        return (k["a"] + k["b"] * step.num_new + k["c"] * step.attended_pairs
                + k["d"] * step.batch + k["e"] * step.kv_read_context
                + k["f"] * step.padded_decode_area + k["g"] * step.few_row_passes + table
                + (k["h"] - k["e"]) * step.reread)  # a re-read token at h, not e

    def step_time(self, step: StepShape) -> float:
        return max(self.predict(step) + self.floor_model.move_time(step),
                   self.floor_model.floor(step))


def save_fitted(path: str | Path, coeffs: Mapping[str, Mapping[str, float]],
                meta: Mapping[str, Any]) -> None:
    """Write fitted coefficients as YAML: ``meta`` (at least ``model`` and ``device``; ``date``
    is filled in with today's if absent) and ``coeffs: {decode: {a..g}, prefill: {a..g}}`` (and
    ``verify: {..}`` where fitted)."""
    checked = _check_coeffs(coeffs, where=str(path))
    for key in ("model", "device"):
        if key not in meta:
            raise ValueError(f"save_fitted: meta.{key} is required")
    meta = {"date": _dt.date.today().isoformat(), **meta}
    doc = {"meta": dict(meta), "coeffs": checked}
    header = ("# Fitted step-time coefficients (testbed.sim.cost_model.FittedCostModel), seconds:\n"
              "# t = a + b*sum(new) + c*sum(attended pairs) + d*batch + e*sum(context)\n"
              "#     + f*batch*max(context) (decode only: the KV padded to the longest)\n"
              "#     + g*(batch - 1 if batch is 2 or 3, else 0) (a CPU BLAS's per-row passes)\n"
              "#     + nK for a step of K rows, sum(new), where fitted (linear between the K\n"
              "#       measured, nK*rows/K beyond the largest; the terms it stands for are 0)\n"
              "#     + (h - e)*reread (KV read again after another request read it; h = e if absent),\n"
              "# per kind: decode (one new token a request), prefill, and verify (speculative\n"
              "#   verification: every query's logits; absent, priced as prefill),\n"
              "# where\n"
              "# attended pairs = sum new*(context + (new+1)/2)\n")
    Path(path).write_text(header + yaml.safe_dump(doc, sort_keys=False))


def load_fitted(path: str | Path, floor_model: FloorModel) -> FittedCostModel:
    """A `FittedCostModel` from a file written by `save_fitted`."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"cost_model.path: no such file: {path}")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise BadInput(f"cost_model.path: {path}{line}: not valid YAML ({problem})") from None
    if not isinstance(doc, dict) or "coeffs" not in doc:
        raise BadInput(f"cost_model.path={path}: missing key 'coeffs' (expected coeffs: "
                       f"{{decode: {{a..g}}, prefill: {{a..g}}}}; f and g may be left out)")
    coeffs = _check_coeffs(doc["coeffs"], where=f"cost_model.path={path}", error=BadInput)
    meta = doc.get("meta")
    return FittedCostModel(coeffs, floor_model, meta if isinstance(meta, dict) else None)


def _check_coeffs(coeffs: Any, where: str, error: type[ValueError] = ValueError
                  ) -> dict[str, dict[str, float]]:
    """The coefficients as floats, checked; ``error``: BadInput for a user's file."""
    if not isinstance(coeffs, Mapping):
        raise error(f"{where}: coeffs must be a mapping of {', '.join(KINDS)}")
    out: dict[str, dict[str, float]] = {}
    unknown = sorted(map(str, set(coeffs) - set(KINDS) - set(OPTIONAL_KINDS)))
    if unknown:
        raise error(f"{where}: unknown coeffs kind {unknown[0]!r} (allowed: "
                    f"{', '.join(KINDS + tuple(OPTIONAL_KINDS))})")
    for kind in KINDS + tuple(k for k in OPTIONAL_KINDS if k in coeffs):
        if kind not in coeffs:
            raise error(f"{where}: missing coeffs.{kind} (need {', '.join(KINDS)})")
        row = coeffs[kind]
        if not isinstance(row, Mapping):
            raise error(f"{where}: coeffs.{kind} must map {', '.join(COEFFS)} to numbers")
        out[kind] = {}
        for c in COEFFS:
            if c not in row and c not in OPTIONAL_COEFFS:
                raise error(f"{where}: missing coeffs.{kind}.{c}")
            default = OPTIONAL_COEFFS.get(c)
            value = row.get(c, row.get(default) if isinstance(default, str) else default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise error(f"{where}: coeffs.{kind}.{c} must be a number, got {value!r}")
            if value < 0:
                raise error(f"{where}: coeffs.{kind}.{c} must be >= 0, got {value}")
            out[kind][c] = float(value)
        extra = {key for key in set(row) - set(COEFFS)
                 if not (isinstance(key, str) and ROW_KEY.fullmatch(key))}
        if extra:
            raise error(f"{where}: unknown coeffs.{kind} keys {sorted(map(str, extra))} "
                        f"(allowed: {', '.join(COEFFS)}, and n<K> for a step of K rows)")
        for key in sorted(set(row) - set(COEFFS), key=lambda k: int(k[1:])):  # n1, n2, .., n16
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise error(f"{where}: coeffs.{kind}.{key} must be a number >= 0, got {value!r}")
            out[kind][key] = float(value)
    return out
