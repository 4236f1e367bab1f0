"""Speculative decode steps in the shared scheduler (docs/design.md §4, "Speculative decoding").

`SpecSteps` drafts for a decode step (each running request's drafter proposal, at most
``num_tokens`` and never more than its output has room for after the step's bonus token), says
what KV room the drafts take, and applies a verification's result: the verified tokens are taken
one by one (a stop token or the length limit ends the request there), the request keeps KV for
its last token and the accepted drafts, and the slots of the rejected drafts (and of accepted
ones past a finish) go back to the pool at once. Only verified tokens ever reach the cache: the
scheduler inserts a request's output at its finish, and a lease is truncated before anything
is committed. It also counts what a run's summary reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.ngram import NO_DRAFT
from testbed.scheduler.request_state import Req
from testbed.scheduler.speculative import SpeculativeConfig


def exact_accepted(draft: np.ndarray, truth: np.ndarray) -> int:
    """Leading drafts equal to ``truth`` (the tokens that really follow)."""
    n = min(len(draft), len(truth))
    differs = np.flatnonzero(np.asarray(draft[:n]) != np.asarray(truth[:n]))
    return int(differs[0]) if len(differs) else n


def branches_of(entry: BatchEntry) -> list[np.ndarray]:
    """The entry's drafts as branches (one for a chain)."""
    if entry.branches is None:
        return [entry.draft]
    return np.split(entry.draft, np.cumsum(entry.branches)[:-1])


def replayed_tokens(entry: BatchEntry, accepted: int | None = None) -> tuple[int, ...]:
    """A verification entry's tokens when its request replays the workload's output: the next
    ``accepted + 1`` output tokens (never past the output's end); ``accepted`` None: the most
    drafts of one branch equal to those output tokens (what verifying against the output
    accepts)."""
    output = entry.req.request.output
    first = entry.output_index
    if accepted is None:
        accepted = max(exact_accepted(b, output[first : first + len(b)])
                       for b in branches_of(entry))
    end = min(first + accepted + 1, len(output), entry.req.max_new_tokens)
    return tuple(int(t) for t in output[first:end])


@dataclass
class SpecStats:
    """A run's speculative figures: verification entries (one request in one step), drafts
    proposed, drafts accepted, tokens produced, KV slots of rejected drafts freed."""

    verifications: int = 0
    drafted: int = 0
    accepted: int = 0
    produced: int = 0
    freed_slots: int = 0
    other_branch: int = 0  # a token tree: verifications accepted along a branch but the first

    def summary(self) -> dict[str, float | int | None]:
        return {"spec_verifications": self.verifications, "spec_drafted": self.drafted,
                "spec_accepted": self.accepted, "spec_freed_slots": self.freed_slots,
                "spec_accept_rate": self.accepted / self.drafted if self.drafted else None,
                # tokens per request per verification step (1 without any accepted draft)
                "spec_mean_accepted_length":
                    self.produced / self.verifications if self.verifications else None,
                "spec_other_branch": self.other_branch}


class SpecSteps:
    def __init__(self, config: SpeculativeConfig, cache: PrefixCache,
                 keep_blocks: bool = False) -> None:
        self.config = config
        self.cache = cache
        # vLLM's scheduler (`testbed.scheduler.vllm`): a request keeps the blocks of its
        # rejected drafts (``BlockHashCache.rewind``) instead of freeing them at once
        self.keep_blocks = keep_blocks
        self.drafter = config.drafter()
        self.branches = config.tree_drafter()
        self.stats = SpecStats()

    def drafts(self, reqs: Sequence[Req]) -> list[tuple[np.ndarray, tuple[int, ...] | None]]:
        """Each request's drafts for the next step: what the drafter proposes from its whole
        context, at most ``num_tokens`` a branch and at most its remaining output less one (the
        bonus); with ``tree_width`` > 1 the branches one after another and their lengths."""
        out = []
        width = self.config.tree_width
        for req in reqs:
            room = min(self.config.num_tokens, req.remaining_new_tokens - 1)
            if room < 1:
                out.append((NO_DRAFT, None))
            elif width == 1:
                out.append((self.drafter(req.fill(), room), None))
            else:
                branches = self.branches(req.fill(), room, width)
                flat = np.concatenate(branches) if branches else NO_DRAFT
                out.append((flat, tuple(len(b) for b in branches) if branches else None))
        return out

    def cost(self, reqs: Sequence[Req], drafts: Sequence[tuple[np.ndarray, Any]]) -> int:
        """KV capacity a verification step of ``reqs`` takes (last token and drafts each)."""
        return sum(self.cache.extension_cost(r.lease, 1 + len(d))
                   for r, (d, _) in zip(reqs, drafts))

    def apply(self, req: Req, entry: BatchEntry, tokens: Sequence[int], now: float) -> bool:
        """A verification's result for ``req`` (``entry``: formed with ``context`` tokens of KV
        and ``draft``): ``tokens`` are the accepted drafts then the bonus token. Returns whether
        the request finished; unfinished, its lease is cut to its KV (``context`` plus the last
        token plus the accepted drafts it took) and the rest freed. Of a tree, the branch whose
        drafts the tokens begin with is the accepted one (branches differ in their first
        token); its slots follow the last token's in the lease from then on."""
        context, draft = entry.context, entry.draft
        path = path_of(entry, tokens)
        if not 1 <= len(tokens) <= len(path) + 1:
            raise ValueError(f"request {req.id}: {len(tokens)} verified tokens for "
                             f"{len(path)} drafts on its path")
        s = self.stats
        s.verifications += 1
        s.drafted += len(draft)
        taken, done = 0, False
        for token in tokens:
            taken += 1
            if req.take_token(token, now):
                done = True
                break
        s.produced += taken
        s.accepted += taken - 1
        if req.spec_accepted is None:
            req.spec_accepted = []
        req.spec_accepted.append(taken - 1)  # what `testbed.sim.acceptance` replays
        s.freed_slots += len(draft) + 1 - taken
        if entry.branches is not None:  # the accepted branch's slots right after the root
            self.stats.other_branch += bool(taken > 1 and path[0] != 0)
            keep = np.concatenate([np.arange(context + 1), context + 1 + path[: taken - 1]])
            self.cache.keep(req.lease, keep.astype(np.int64))
        req.computed = context + taken
        if not done and self.keep_blocks:
            self.cache.rewind(req.lease, req.computed)
        elif not done:  # (a finished request's release frees every slot past its inserted tokens)
            self.cache.truncate(req.lease, req.computed)
        return done


def path_of(entry: BatchEntry, tokens: Sequence[int]) -> np.ndarray:
    """Indices into ``entry.draft`` of the branch the verified ``tokens`` follow (a chain: all
    of it). With a tree, the branch whose first draft is the first token, if it was accepted;
    else the longest branch, first of equals (none of its drafts is kept when the bonus
    replaced the first; the simulator's ``geometric`` acceptance, whose tokens are the
    workload's, accepts along it)."""
    if entry.branches is None:
        return np.arange(len(entry.draft))
    starts = np.cumsum((0,) + entry.branches[:-1])
    chosen = int(np.argmax(entry.branches))
    if len(tokens) > 1:
        for b, start in enumerate(starts):
            if int(entry.draft[start]) == int(tokens[0]):
                chosen = b
                break
    return starts[chosen] + np.arange(entry.branches[chosen])
