"""Results in: a step's outcome applied to its requests (SGLang's
``process_batch_result_prefill`` and ``process_batch_result_decode``).

`Results` is the room of `Scheduler` (`testbed.scheduler.scheduler`) that takes a step's tokens
back: `complete` (under overlap, in the results-first order, kept until the next batch forms),
the token each request takes (a verification's through `SpecSteps.apply`), the insert after
prefill and after each chunk (``cache_unfinished_req``), and a finished request's insert and
release (``cache_finished_req``), which an abort also uses.

`_apply`'s plain-decode loop runs once per decoded token: it stays inline, its calls counted by
tests/test_loop_speed_guard.py.
"""

from __future__ import annotations

from testbed.scheduler.batch import Batch
from testbed.scheduler.request_state import Req


class Results:
    def complete(self, batch: Batch, tokens: list[int | None], now: float) -> list[Req]:
        """Report a step's outcome (the token each entry produced, or None); returns the requests
        that finished in it. With ``overlap``, when no batch has formed since ``batch`` (the
        results-first order), the outcome is kept until the next batch forms (`next_batch`),
        and the finished requests come from `take_finished` then; when one has (the serving
        loop's order), it is applied now."""
        if self.config.overlap and batch is self._newest:
            self._pending = (batch, list(tokens))
            finished = []
        else:
            finished = self._applied(batch, tokens, now)
        if self.check_invariants:
            self.cache.check_invariants(self.leases())
        return finished

    def _applied(self, batch: Batch, tokens: list[int | None], now: float) -> list[Req]:
        """Apply a step's results; it is no longer in flight."""
        self._unapplied = [b for b in self._unapplied if b is not batch]
        return self._apply(batch, tokens, now)

    def _apply(self, batch: Batch, tokens: list[int | None], now: float) -> list[Req]:
        """SGLang's ``process_batch_result_prefill/decode``."""
        finished = []
        reuse, prefill = self.reuse, batch.kind == "prefill"
        if not prefill and reuse is None and not batch.verifies:
            # A plain decode step, whose every entry makes its request's next token: the loop
            # below without the branches that cannot apply (it runs for every decoded token),
            # over its columns (a `DecodeBatch` makes no entries for them)
            reqs, gens = batch.columns()
            for req, gen, token in zip(reqs, gens, tokens):
                if req.finish_s is None and gen == req.preemptions \
                        and req.take_token(token, now):
                    self._finish(req, now)
                    finished.append(req)
            return finished
        for entry, token in zip(batch.entries, tokens):
            req = entry.req
            if req.finish_s is not None or entry.gen != req.preemptions:
                continue  # overlap: finished or retracted since; the token is dropped
            if reuse is not None and entry.context + entry.new >= req.fill_len:
                reuse.release(req)  # its prefill has read the donors
            if not entry.produces_token:
                if not self.config.overlap:
                    self._commit_chunk(req)  # (with overlap: when the next batch forms)
                continue
            if entry.draft is not None:  # a verification: its tokens, its slots cut back
                if self.spec.apply(req, entry, token, now):
                    self._finish(req, now)
                    finished.append(req)
                continue
            if req.take_token(token, now):
                self._finish(req, now)
                finished.append(req)
            elif prefill:  # cache_unfinished_req: others hit it from now on
                self._commit(req, entry.context + entry.new)
        return finished

    def _commit_chunk(self, req: Req) -> None:
        self._commit(req, req.computed)

    def _exact(self, req: Req, n: int) -> int:
        """Of the fill's first ``n`` tokens, those the exact tree may take (all without reuse)."""
        return n if self.reuse is None else self.reuse.exact_len(req, n)

    def _commit(self, req: Req, n: int) -> None:
        tokens = req.fill()[: self._exact(req, n)]
        self.cache.commit(req.lease, tokens)
        if self.reuse is not None:
            self.reuse.inserted(req, tokens)

    def _finish(self, req: Req, now: float) -> None:
        """cache_finished_req: every token with KV (all but the last output; the whole prompt of a
        prefill-only call) enters the cache; a slot taken for a step still in flight (overlap) is
        freed."""
        self._release_inserting(req, req.fill_len - 1 if req.output else req.fill_len)
        req.finish_s = now

    def _release_inserting(self, req: Req, n: int) -> None:
        """The fill's first ``n`` tokens (those with KV) enter the cache, and the lease ends."""
        with_kv = self._exact(req, n)
        released = self.cache.release(req.lease, req.fill()[:with_kv], insert=True)
        if self.reuse is not None:
            self.reuse.release(req)
            self.reuse.inserted(req, req.fill()[:with_kv])
        req.inserted = released.inserted
        req.lease = None
