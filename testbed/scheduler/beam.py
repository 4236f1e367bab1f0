"""Beam search over the shared scheduler: each beam step is a request, beams share through the cache.

A beam call (a token-trace line with ``"beam_width": W`` and ``"max_new_tokens": N``) is served as
rounds of prefill-only requests, the way vLLM's newer beam search runs on its prefix cache: a
beam's request has as prompt the call's prompt plus the beam's tokens (its parent's prompt plus
one token), computes the log-probs of the next token and finishes, so its whole sequence enters
the cache and its lease ends at once. Round 0 is the call's prompt alone; each later round has one
request per live beam, and a prefix cache hits everything but the newest token (a radix tree of
page 1; pages and blocks of 16 lose up to 15). A pruned beam has no request in the next round:
its lease has already ended, and its KV is only cached, evictable like any other.

`BeamSearch` chooses the beams by Hugging Face ``generate(num_beams=W, do_sample=False)``'s rule
(length_penalty 1.0 and early_stopping false by default), so the best sequence is HF's:

- each round, the ``K = max(2, 1 + #EOS) · W`` best (beam, token) continuations over all live
  beams by cumulative log-prob (each beam's own top-K suffice, which is all a request returns);
- of those, the ones among the first W that end (an EOS token, or the N-th token) become
  hypotheses scored ``cumulative / generated_length ** length_penalty`` (EOS counted), of which
  the best W are kept; the best W continuations that do not end are the next round's beams;
- the search stops after the N-th token, or once W hypotheses exist and the best live beam's
  score divided by its length cannot beat the worst of them (HF's heuristic for
  early_stopping false).

Scores are float32 sums, as HF's are. The driver (`testbed.serving.driver`) submits the requests
this returns, passes each finished one's top-K next-token log-probs in (``observe``), and ends the
call when ``done``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Collection

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.request import TOKEN_DTYPE, Request

_FINISHED = np.float32(-1.0e9)  # pushes continuations that end below every live one, as HF does


@dataclass
class Beam:
    tokens: tuple[int, ...]  # generated so far
    score: np.float32  # cumulative log-prob
    request: str = ""  # the request computing its next-token log-probs


@dataclass
class Candidate:
    beam: int  # index among the round's beams
    token: int
    score: np.float32  # the beam's score plus the token's log-prob


@dataclass
class BeamRequest:
    """One request of the beam tree as it ran: its round, the beam it extends, what it waits for."""

    request: Request
    parent: str | None
    round: int


@dataclass
class BeamSearch:
    """One beam call's search: its rounds of requests and its hypotheses."""

    call: Request
    prompt: np.ndarray  # the call's prompt as submitted (rebuilt from real outputs if generating)
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    beams: list[Beam] = field(default_factory=list)
    hypotheses: list[tuple[np.float32, tuple[int, ...]]] = field(default_factory=list)
    tree: list[BeamRequest] = field(default_factory=list)  # every request, in submission order
    done: bool = False
    aborted: bool = False
    _logprobs: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    _open: set[str] = field(default_factory=set)  # this round's requests not finished yet
    _round_ids: list[str] = field(default_factory=list)  # this round's requests
    _round: int = 0

    def __post_init__(self) -> None:
        width = self.call.beam_width
        if width is None or width < 1 or self.call.max_new_tokens is None \
                or self.call.max_new_tokens < 1:
            raise BadInput(f"request {self.call.id}: a beam call needs beam_width >= 1 and "
                           f"max_new_tokens >= 1, got {width} and {self.call.max_new_tokens}")

    @property
    def width(self) -> int:
        return int(self.call.beam_width)

    @property
    def max_new(self) -> int:
        return int(self.call.max_new_tokens)

    @property
    def top_k(self) -> int:
        """Continuations kept per round (and log-probs each request returns): HF's K."""
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    # ------------------------------------------------------------------ rounds of requests
    def start(self) -> list[Request]:
        """Round 0: the call's prompt alone, whose next-token log-probs start every beam."""
        self.beams = [Beam((), np.float32(0.0))]
        return self._requests(parents=[None])

    def _requests(self, parents: list[str | None]) -> list[Request]:
        after = list(self._round_ids)  # a round starts once the one before has finished
        out = []
        for i, (beam, parent) in enumerate(zip(self.beams, parents)):
            rid = f"{self.call.id}/r{self._round}b{i}"
            beam.request = rid
            prompt = np.concatenate([self.prompt, np.asarray(beam.tokens, dtype=TOKEN_DTYPE)])
            req = Request(id=rid, prompt=prompt, output=np.zeros(0, dtype=TOKEN_DTYPE),
                          arrival_s=self.call.arrival_s, program=self.call.program_id,
                          after=after, priority=self.call.priority, max_new_tokens=0,
                          top_logprobs=self.top_k)
            self.tree.append(BeamRequest(req, parent, self._round))
            out.append(req)
        self._round_ids = [r.id for r in out]
        self._open = set(self._round_ids)
        return out

    def observe(self, request_id: str, token_ids: np.ndarray, logprobs: np.ndarray) -> None:
        """The top-K next-token log-probs of ``request_id`` (highest first)."""
        self._logprobs[request_id] = (np.asarray(token_ids), np.asarray(logprobs, np.float32))

    def finished(self, request_id: str, aborted: bool = False) -> list[Request]:
        """``request_id`` finished: once its whole round has, the next round's requests (none when
        the search is over). An aborted request (it could never fit the KV pool) ends the call
        once the rest of its round has finished: ``done`` turns true exactly once."""
        self._open.discard(request_id)
        self.aborted |= aborted
        if self._open:
            return []
        if self.aborted:
            self.done = True
            return []
        return self._step()

    # ------------------------------------------------------------------ HF's selection rule
    def _step(self) -> list[Request]:
        missing = [b.request for b in self.beams if b.request not in self._logprobs]
        if missing:
            raise ValueError(f"beam call {self.call.id}: no log-probs for {missing[0]}")
        w, k = self.width, self.top_k
        cands = []
        for i, beam in enumerate(self.beams):
            ids, lps = self._logprobs.pop(beam.request)
            cands += [Candidate(i, int(t), np.float32(beam.score + lp)) for t, lp in zip(ids, lps)]
        # best first; equal scores keep the lower (beam, token), as a flat index would
        cands.sort(key=lambda c: (-float(c.score), c.beam, c.token))
        top = cands[:k]
        length = len(self.beams[0].tokens) + 1  # generated tokens once this round's is added
        ends = [c.token in self.eos_token_ids or length >= self.max_new for c in top]
        for c, end in zip(top[:w], ends[:w]):
            if end:
                self._add_hypothesis(self.beams[c.beam].tokens + (c.token,),
                                     np.float32(c.score / np.float32(length ** self.length_penalty)))
        live = sorted(range(len(top)), key=lambda j: -float(top[j].score + (_FINISHED if ends[j]
                                                                             else 0)))[:w]
        previous = self.beams
        self.beams = [Beam(previous[top[j].beam].tokens + (top[j].token,),
                           np.float32(top[j].score + (_FINISHED if ends[j] else np.float32(0))))
                      for j in live]
        if all(ends) or not self._may_improve(length):
            self.done = True
            return []
        self._round += 1
        return self._requests(parents=[previous[top[j].beam].request for j in live])

    def _add_hypothesis(self, tokens: tuple[int, ...], score: np.float32) -> None:
        self.hypotheses.append((score, tokens))
        self.hypotheses.sort(key=lambda h: -float(h[0]))  # stable: earlier ones win ties
        del self.hypotheses[self.width:]

    def _may_improve(self, length: int) -> bool:
        """HF's stopping heuristic (early_stopping false): with W hypotheses, the best live beam
        at its current length must still beat the worst of them."""
        if len(self.hypotheses) < self.width:
            return True
        best = np.float32(self.beams[0].score / np.float32(length ** self.length_penalty))
        return bool(best > self.hypotheses[-1][0])

    # ------------------------------------------------------------------ results
    def result(self) -> dict:
        """The call's line of ``beams.jsonl``: its sequences (generated tokens, best first) and
        their scores."""
        out = {"id": self.call.id, "sequences": [list(t) for _, t in self.hypotheses],
               "scores": [float(s) for s, _ in self.hypotheses]}
        if self.aborted:
            out["aborted"] = True
        return out

    @property
    def best(self) -> np.ndarray:
        """The best sequence (the call's output for calls that splice it in)."""
        tokens = self.hypotheses[0][1] if self.hypotheses else ()
        return np.asarray(tokens, dtype=TOKEN_DTYPE)


class BeamCalls:
    """The beam calls of one run, by their requests' ids (what the driver asks)."""

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.searches: list[BeamSearch] = []
        self._owner: dict[str, BeamSearch] = {}

    def start(self, call: Request, prompt: np.ndarray) -> list[Request]:
        search = BeamSearch(call, prompt, self.eos_token_ids)
        self.searches.append(search)
        return self._own(search, search.start())

    def _own(self, search: BeamSearch, requests: list[Request]) -> list[Request]:
        for r in requests:
            self._owner[r.id] = search
        return requests

    def owns(self, request_id: str) -> bool:
        return request_id in self._owner

    def observe(self, request_id: str, token_ids: np.ndarray, logprobs: np.ndarray) -> None:
        self._owner[request_id].observe(request_id, token_ids, logprobs)

    def finished(self, request_id: str, aborted: bool = False) -> tuple[BeamSearch, list[Request]]:
        """The search ``request_id`` belongs to and the requests to submit next."""
        search = self._owner.pop(request_id)
        return search, self._own(search, search.finished(request_id, aborted))

    def results(self) -> list[dict]:
        return [s.result() for s in self.searches]

    def trace(self) -> list[Request]:
        """Every beam request as it ran, a program per call, each round after the previous one:
        a token trace that replay and the simulator serve (`testbed.workloads.traces.save_tokens`)."""
        return [replace(b.request, max_new_tokens=None, top_logprobs=0)  # "output": [] there
                for s in self.searches for b in s.tree]
