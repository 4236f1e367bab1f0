"""What a simulated verification step accepts (``speculative.acceptance``).

The simulator emits the workload's output; for a verification entry (a request's last token and
its drafts, `testbed.scheduler.spec_steps`) it decides how many drafts are accepted, then emits
that many output tokens plus the bonus one:

- ``exact``: the drafts that equal the workload's next output tokens, up to the first that does
  not: what the engine accepts when it replays the same output (``engine.forced``), so a
  simulated run and an engine run of one trace draft, accept and cache alike.
- ``geometric``: each draft accepted with probability ``accept_rate`` until the first rejection
  (a configured distribution: for workloads whose output is not the model's, such as random
  token traces), drawn from the run's seed.
- ``recorded``: the accepted drafts a speculative run recorded (``acceptance_path``: the run's
  directory or its ``requests.jsonl``, whose ``spec_accepted`` holds each request's accepted
  drafts per verification step, docs/design.md §3), replayed request by request, step by step:
  a request's n-th verification accepts what its n-th did in that run (at most the drafts it
  has). Replaying an engine run's outputs (its ``prompt_ids`` and ``output_ids`` as a token
  trace) so, the simulator makes that run's steps and acceptances.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from testbed.errors import BadInput

from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.spec_steps import branches_of, replayed_tokens


KEY = "speculative.acceptance_path"


def load_recorded(path: str | Path) -> dict[str, list[int]]:
    """Each request's accepted drafts per verification step, from a run's ``requests.jsonl``
    (``path``: the file or the run directory holding it)."""
    path = Path(path)
    file = path / "requests.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise BadInput(f"{KEY}: no such run directory or requests.jsonl: {path}")
    recorded: dict[str, list[int]] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise BadInput(f"{KEY}: {file}:{n} is not a JSON line") from None
        if not isinstance(row, dict) or "id" not in row:
            raise BadInput(f"{KEY}: {file}:{n} has no request id")
        counts = row.get("spec_accepted")
        if counts is None:
            raise BadInput(f"{KEY}: {file}:{n} (request {row['id']}) has no spec_accepted: "
                           f"not a run with speculative decoding")
        if not isinstance(counts, list) or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
            raise BadInput(f"{KEY}: {file}:{n}: spec_accepted must be a list of integers >= 0, "
                           f"got {counts!r}")
        recorded[str(row["id"])] = counts
    if not recorded:
        raise BadInput(f"{KEY}: {file} holds no requests")
    return recorded


class Acceptance:
    def __init__(self, kind: str = "exact", rate: float = 0.7, seed: int = 0,
                 path: str | Path | None = None) -> None:
        self.kind, self.rate = kind, rate
        self.rng = np.random.default_rng(seed)
        self.path = path
        #: ``recorded``: each request's accepted drafts per step, and how many it has used
        self.recorded = load_recorded(path) if kind == "recorded" else {}
        self.used: dict[str, int] = {}

    def check_requests(self, ids: Iterable[str]) -> None:
        """``recorded``: every request of the run has a record (in one line otherwise)."""
        if self.kind != "recorded":
            return
        missing = [i for i in ids if i not in self.recorded]
        if missing:
            raise BadInput(f"{KEY}: {len(missing)} of the workload's requests are not in "
                           f"{self.path} (first: {missing[0]!r}): replay the run's own requests")

    def tokens(self, entry: BatchEntry) -> tuple[int, ...]:
        """The verified tokens of ``entry``: accepted drafts, then the bonus token, as the
        workload's output has them (never past its length)."""
        if self.kind == "exact":
            return replayed_tokens(entry)
        longest = max(len(b) for b in branches_of(entry))  # a tree: along its longest branch
        if self.kind == "recorded":
            return replayed_tokens(entry, min(self._next(entry.req.id), longest))
        accepted = 0
        while accepted < longest and self.rng.random() < self.rate:
            accepted += 1
        return replayed_tokens(entry, accepted)

    def _next(self, rid: str) -> int:
        counts = self.recorded.get(rid)
        if counts is None:
            raise BadInput(f"{KEY}: request {rid!r} is not in {self.path}")
        n = self.used.get(rid, 0)
        if n >= len(counts):
            raise BadInput(f"{KEY}: request {rid!r} verifies more often than the {len(counts)} "
                           f"steps {self.path} recorded for it (not the run's decisions: its "
                           f"outputs, speculative settings or KV room differ)")
        self.used[rid] = n + 1
        return counts[n]
