"""The steps a live server ran, recovered from the token times it streamed to ``backend=server``.

A server reports no step times over HTTP, but a streaming client sees every step end: each step
emits one token for every request it computed the last prompt token or a decode token of, and
those tokens arrive together. `recover_steps` turns a ``backend=server`` run's records (its
``requests.jsonl``: ``arrival_s``, ``first_token_s``, ``itl_s``, ``prompt_tokens``,
``cached_tokens``) into `ServerStep`s, the samples `testbed.calibrate` fits a cost model to when
given ``calibrate.server_runs``:

- *Step ends.* All requests' token times, sorted, are cut into bursts where one comes more than
  ``gap_s`` after the one before (by default 0.3 of the run's median inter-token gap). A burst is one step, which ends at its earliest token, unless
  it holds several tokens of one request: a server that falls behind its engine (or a client
  behind its sockets) delivers several steps' tokens at once. A burst holding at most ``D``
  tokens of a request is then ``D`` steps, each request's tokens in the last of them (in token
  order), and when each of those steps ended is unknown: their ends are spread evenly from the
  burst before to this one, which keeps their total time.
- *What a step computed.* A request's token ``j >= 1`` is a decode: 1 new token on top of
  ``prompt + j - 1``. Its first token (a prefill-only call's end: it records no output) ends
  its prefill: ``prompt - cached`` new tokens on top of
  ``cached``. Under a per-step token budget (vLLM's ``max_num_batched_tokens``; each decode takes
  one token of it) a prefill that does not fit its step's remainder was chunked as the server
  chunks it: from the earliest step it can have started in (one that began after it was sent,
  with the chunks up to step k leaving at least a token for k), each chunk takes all the budget
  its step has left, and the last the rest; requests are placed in the order they were sent
  (running requests go first, and a request sent earlier started earlier).
- *How long it took.* From the step before's end; from the earliest send among its requests
  when the server was idle before it (every request in it new: no decode, no earlier chunk).

A chunk that cannot be placed (a prefill larger than the budget left in every step since it was
sent: steps that emitted no token, invisible to the client) marks its step *merged*; merged
steps are left out of a fit (`usable`), and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.cache.block_keys import block_forms, token_block_keys
from testbed.errors import BadInput
from testbed.sim.step_shape import StepShape

#: ``gap_s`` by default: this fraction of the run's median inter-token gap (a step's tokens come
#: within a few ms of each other on loopback, steps are a median gap apart)
GAP_FRACTION = 0.3


@dataclass
class ServerStep:
    """One recovered step: its requests' ``new`` and ``context`` tokens (in ``ids`` order)."""

    end_s: float
    ids: list[str] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    decodes: int = 0
    busy_before: bool = False  # a request in it was running before it began
    start_s: float = 0.0
    merged: bool = False
    reread: int = 0  # decode steps: prompt KV its requests read again (`add_rereads`)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def shape(self) -> StepShape:
        return StepShape(new=tuple(self.new), context=tuple(self.context), reread=self.reread)


def read_run(run_dir: str | Path) -> pd.DataFrame:
    """A ``backend=server`` run's records, checked for what `recover_steps` reads."""
    path = Path(run_dir) / "requests.jsonl"
    if not path.is_file():
        raise BadInput(f"calibrate.server_runs: no requests.jsonl in {run_dir}")
    rows = pd.read_json(path, lines=True, dtype={"id": str})
    missing = {"arrival_s", "first_token_s", "itl_s", "prompt_tokens", "cached_tokens"} - set(rows)
    if missing:
        raise BadInput(f"calibrate.server_runs: {path} lacks {sorted(missing)}: not a "
                       f"backend=server run")
    if rows["cached_tokens"].isna().any():
        raise BadInput(f"calibrate.server_runs: {path}: the server did not report cached tokens "
                       f"(vLLM: --enable-prompt-tokens-details), so prefill sizes are unknown")
    return rows


def token_events(rows: pd.DataFrame) -> list[tuple[float, str, int]]:
    """(time, request id, output index) of every token streamed, in time order."""
    events = []
    for r in rows.itertuples():
        if getattr(r, "failed", False):
            continue
        if r.first_token_s is None or pd.isna(r.first_token_s):
            # a prefill-only call (no output recorded): its prefill ended with its stream
            finish = getattr(r, "finish_s", None)
            if finish is not None and not pd.isna(finish):
                events.append((float(finish), str(r.id), 0))
            continue
        itl = r.itl_s if isinstance(r.itl_s, list) else []
        times = r.first_token_s + np.concatenate([[0.0], np.cumsum(itl)])
        events += [(float(t), str(r.id), j) for j, t in enumerate(times)]
    return sorted(events)


def cluster(events: list[tuple[float, str, int]], gap_s: float, first_send_s: float = np.nan
            ) -> list[tuple[float, list[tuple[float, str, int]]]]:
    """Tokens grouped into steps, each with its end time (see the module docstring): a burst
    (tokens each within ``gap_s`` of the one before) holding up to ``D`` tokens of one request
    is ``D`` steps, each request's tokens in the last of them (a request with fewer tokens in the
    burst was in fewer of its steps), their ends spread evenly from the burst before
    (``first_send_s`` before the first) to the burst's first token."""
    bursts: list[list[tuple[float, str, int]]] = []
    for event in events:
        if not bursts or event[0] - bursts[-1][-1][0] > gap_s:
            bursts.append([])
        bursts[-1].append(event)
    steps: list[tuple[float, list[tuple[float, str, int]]]] = []
    previous = first_send_s
    for burst in bursts:
        by_request: dict[str, list[tuple[float, str, int]]] = {}
        for event in burst:
            by_request.setdefault(event[1], []).append(event)
        depth = max(len(tokens) for tokens in by_request.values())
        sub: list[list[tuple[float, str, int]]] = [[] for _ in range(depth)]
        for tokens in by_request.values():
            for i, event in enumerate(sorted(tokens, key=lambda e: e[2])):
                sub[depth - len(tokens) + i].append(event)
        end = burst[0][0]
        start = end if np.isnan(previous) else previous
        steps += [(start + (end - start) * (i + 1) / depth, tokens) for i, tokens in enumerate(sub)]
        previous = end
    return steps


def default_gap_s(rows: pd.DataFrame) -> float:
    """`GAP_FRACTION` of the run's median inter-token gap."""
    gaps = [g for itl in rows["itl_s"] if isinstance(itl, list) for g in itl]
    return GAP_FRACTION * float(np.median(gaps)) if gaps else 0.0


def recover_steps(rows: pd.DataFrame, token_budget: int | None,
                  gap_s: float | None = None, share_unit: int | None = None
                  ) -> list[ServerStep]:
    """The steps of one run (see the module docstring); ``token_budget`` None: unchunked;
    ``gap_s`` None: `default_gap_s`; ``share_unit``: the cache's block (page) size, to count
    each decode step's re-read KV in (`add_rereads`; None: not counted)."""
    if gap_s is None:
        gap_s = default_gap_s(rows)
    by_id = rows.assign(id=rows["id"].astype(str)).set_index("id")
    clustered = cluster(token_events(rows), gap_s, float(rows["arrival_s"].min()))
    steps = []
    for end_s, tokens in clustered:
        step = ServerStep(end_s=end_s)
        for _, rid, j in tokens:
            if j >= 1:
                r = by_id.loc[rid]
                step.ids.append(rid)
                step.new.append(1)
                step.context.append(int(r.prompt_tokens) + j - 1)
                step.decodes += 1
        steps.append(step)
    budget = token_budget or np.inf
    left = [budget - s.decodes for s in steps]
    # a busy step began when the one before ended; the first, at the first send
    begins = np.array([float(rows["arrival_s"].min())] + [s.end_s for s in steps[:-1]])
    firsts = [(float(by_id.loc[rid].arrival_s), rid, k)
              for k, (_, tokens) in enumerate(clustered)
              for _, rid, j in tokens if j == 0]
    for sent_s, rid, k in sorted(firsts):  # first come, first budgeted
        r = by_id.loc[rid]
        _place_prefill(steps, left, begins, k, rid, int(r.prompt_tokens), int(r.cached_tokens),
                       sent_s)
    for k, step in enumerate(steps):
        previous = steps[k - 1].end_s if k else -np.inf
        if step.busy_before or step.decodes:
            step.start_s = previous
        else:
            sent = min(float(by_id.loc[rid].arrival_s) for rid in step.ids)
            step.start_s = max(previous, sent)
        if not np.isfinite(step.start_s):
            step.start_s = min(float(by_id.loc[rid].arrival_s) for rid in step.ids)
    if share_unit is not None:
        add_rereads(steps, rows, share_unit)
    return steps


def _place_prefill(steps: list[ServerStep], left: list[float], begins: np.ndarray, k: int,
                   rid: str, prompt: int, cached: int, sent_s: float) -> None:
    """The prefill ending in step ``k``, chunked as a budgeted server chunks it: from the step it
    started in, each chunk takes all the budget its step has left, the last (in ``k``) the rest.
    It started as early as it can have: in a step that began after it was sent, and late enough
    that those chunks leave something for ``k``."""
    remaining = prompt - cached
    chunks, taken, i = [], 0, k - 1
    while i >= 0 and begins[i] >= sent_s and taken + max(int(left[i]), 0) < remaining:
        if left[i] >= 1:
            chunks.append((i, int(left[i])))
            taken += int(left[i])
        i -= 1
    last = remaining - taken
    if last > left[k]:  # steps that emitted nothing, or an overfull step
        steps[k].merged = True
    context = prompt
    for i, take in [(k, last), *chunks]:  # k first: its chunk is the prompt's last
        context -= take
        steps[i].ids.append(rid)
        steps[i].new.append(take)
        steps[i].context.append(context)
        left[i] -= take
        if i != k:
            for later in range(i + 1, k + 1):
                steps[later].busy_before = True


def add_rereads(steps: list[ServerStep], rows: pd.DataFrame, block_size: int) -> None:
    """Each decode step's `ServerStep.reread`: of its requests' full prompt blocks, every block
    once per request after the first whose prompt holds the same tokens up to it, times
    ``block_size`` (`testbed.scheduler.decode_groups.SharedReads`, which counts shared slots,
    read off the tokens: a server says nothing of its slots). A prompt block the server cached
    is one block whoever hits it; two requests that computed the same block in one step hold
    two, which this counts as one (rare: a prefix the second request did not find cached).
    Needs the records' ``prompt_ids`` (``save_token_ids=true``); without them every step keeps
    0."""
    if "prompt_ids" not in rows:
        return
    forms = block_forms(block_size)
    keys = {str(rid): token_block_keys(np.asarray(ids), block_size, forms).tolist()
            for rid, ids in zip(rows["id"], rows["prompt_ids"]) if isinstance(ids, list)}
    for step in steps:
        if len(step.ids) < 2 or any(n != 1 for n in step.new):
            continue
        held = [k for rid in step.ids for k in keys.get(rid, ())]
        step.reread = block_size * (len(held) - len(set(held)))


def usable(steps: list[ServerStep]) -> list[ServerStep]:
    """The steps a fit can use: placed exactly (not merged), with a positive duration."""
    return [s for s in steps if not s.merged and s.new and s.duration_s > 0]
