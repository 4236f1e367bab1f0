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
"""

from __future__ import annotations

import numpy as np

from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.spec_steps import branches_of, replayed_tokens


class Acceptance:
    def __init__(self, kind: str = "exact", rate: float = 0.7, seed: int = 0) -> None:
        self.kind, self.rate = kind, rate
        self.rng = np.random.default_rng(seed)

    def tokens(self, entry: BatchEntry) -> tuple[int, ...]:
        """The verified tokens of ``entry``: accepted drafts, then the bonus token, as the
        workload's output has them (never past its length)."""
        if self.kind == "exact":
            return replayed_tokens(entry)
        longest = max(len(b) for b in branches_of(entry))  # a tree: along its longest branch
        accepted = 0
        while accepted < longest and self.rng.random() < self.rate:
            accepted += 1
        return replayed_tokens(entry, accepted)
