"""SGLang's non-overlap event loop around its own scheduling objects: what every release does.

`Loop` replays ``Scheduler.event_loop_normal`` (no overlap, one GPU, page size 1,
non-disaggregated; no mixed chunk, LoRA, HiCache, speculative decoding, grammar, priority
scheduling, prefill delayer or dynamic chunking: the default server's settings) around the
release's ``SchedulePolicy``, ``PrefillAdder`` and ``RadixCache`` as `wheel.load` loads them
(0.5.23's also with the real ``PrefillBudget`` and ``mem_cache/common.py``: ``match_kv_cache``,
``checkpoint_kv_cache``, ``release_kv_cache``, ``evict_from_tree_cache``). What cannot be
isolated is re-implemented, each function citing the one it mirrors: the ``Scheduler``
(threads, ZMQ, the TP worker: ``get_next_batch_to_run``, ``get_new_batch_prefill``,
``update_running_batch``), ``ScheduleBatch``'s scheduling bookkeeping (`Batch`: ``filter_batch``,
``merge_batch``, ``prepare_for_extend``, ``prepare_for_decode``, ``retract_decode``), the result
processing (``process_batch_result_prefill/decode``) and, in `stand_ins`, ``Req`` and the pools.
The steps both releases take alike are `Loop`'s; where they differ, `release_loops` says how.
The server arguments that matter: ``max_running_requests`` (0.5.23: also
``pp_max_micro_batch_size`` and the req-to-token pool's rows), ``max_prefill_tokens``,
``chunked_prefill_size``, ``schedule_policy``, ``schedule_conservativeness`` 1.0 and the
new-token-ratio and retraction constants (0.4.10's ``global_config``; 0.5.23's environment
defaults: ``SGLANG_INIT_NEW_TOKEN_RATIO`` 0.7, ``..._MIN_NEW_TOKEN_RATIO_FACTOR`` 0.14,
``..._NEW_TOKEN_RATIO_DECAY_STEPS`` 600, ``SGLANG_RETRACT_DECODE_STEPS`` 20,
``SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION`` 4096).
"""

from __future__ import annotations

from types import SimpleNamespace

from experiments.validation.sglang.stand_ins import ForcedReq


class Batch:
    """What the loop keeps of a ``ScheduleBatch``: its requests, mode and two flags."""

    def __init__(self, kind: str, reqs: list, chunked_req=None) -> None:
        self.kind, self.reqs, self.chunked_req = kind, reqs, chunked_req
        self.batch_is_full = False

    def filter_batch(self, exclude=()) -> None:
        """ScheduleBatch.filter_batch: keep the unfinished requests not excluded, in order."""
        self.reqs = [r for r in self.reqs if not r.finished() and r not in exclude]


class Loop:
    """``Scheduler.event_loop_normal`` over SGLang's SchedulePolicy, PrefillAdder and RadixCache:
    the steps both releases take alike; a subclass per release supplies the rest."""

    filter_running_first = False  # drop the running batch's finished requests before a prefill
    ratio_budget_pad = 0  # added to the output budget the ratio after a retraction divides by
    chunk_counter = ""  # the Req field counting a chunked request's middle chunks in flight

    def __init__(self, sgl: SimpleNamespace, policy: str, capacity: int, max_running: int,
                 max_prefill_tokens: int, chunked_prefill_size: int | None, width: int) -> None:
        self.sgl, self.capacity = sgl, capacity
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.build(policy, width)  # alloc, rows, tree_cache, policy
        init, min_factor, decay_steps, self.retract_steps = self.ratio_settings()
        self.init_ratio = min(init, 1.0)  # Scheduler.__init__, schedule_conservativeness 1.0
        self.min_ratio = min(self.init_ratio * min_factor, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / decay_steps
        self.new_token_ratio = self.init_ratio
        self.processed_tokens = 0
        self.waiting: list[ForcedReq] = []
        self.running = Batch("decode", [])
        self.chunked_req: ForcedReq | None = None
        self.last_batch: Batch | None = None
        self.steps: list[tuple[str, frozenset]] = []
        self.retractions = 0
        self.stuck = False

    def run(self, max_steps: int = 200_000) -> None:
        """Scheduler.event_loop_normal until nothing is left (or nothing can run)."""
        idle = 0
        while len(self.steps) < max_steps:
            batch = self.next_batch()
            if batch is None:
                self.check_memory()  # self_check_during_idle
                self.new_token_ratio = self.init_ratio
                self.last_batch = None
                if not (self.waiting or self.running.reqs or self.chunked_req):
                    return
                idle += 1
                if idle > 3:
                    self.stuck = True
                    return
                continue
            idle = 0
            self.steps.append((batch.kind, frozenset(r.rid for r in batch.reqs)))
            if batch.kind == "prefill":
                self.process_prefill(batch)
            else:
                self.process_decode(batch)
            self.last_batch = batch
        self.stuck = True

    def check_memory(self) -> None:
        """Scheduler.check_memory: when idle, every KV slot is free or cached and unlocked, and no
        request holds a row."""
        free, cached = self.alloc.available_size(), self.tree_cache.evictable_size()
        if free + cached != self.capacity or self.rows_held():
            raise RuntimeError(f"SGLang loop leaked memory: {free=} + {cached=} != {self.capacity}")

    def next_batch(self) -> Batch | None:
        """Scheduler.get_next_batch_to_run: cache the chunked request's progress, merge the last
        prefill batch into the running one, prefill if possible, otherwise decode."""
        exclude = []
        if self.chunked_req is not None:
            exclude.append(self.chunked_req)
            self.cache_chunked(self.chunked_req)
        last, running = self.last_batch, self.running
        if last is not None and last.kind == "prefill":
            if last.chunked_req is not None:
                exclude.append(last.chunked_req)
            last_bs = len(last.reqs)
            last.filter_batch(exclude)
            if len(last.reqs) < last_bs:
                running.batch_is_full = False
            if last.reqs and last is not running:
                if not running.reqs:
                    running = last  # the prefill batch object becomes the running batch
                else:
                    running.reqs.extend(last.reqs)  # ScheduleBatch.merge_batch
        if self.filter_running_first:
            running_bs = len(running.reqs)
            running.filter_batch()
            if len(running.reqs) < running_bs:
                running.batch_is_full = False
        self.running = running
        batch = self.new_prefill()
        if batch is not None:
            return batch
        if self.running.reqs:
            decode = self.update_running(self.running)
            return decode if decode.reqs else None
        return None

    def prefill_batch(self, adder) -> Batch | None:
        """The end of get_new_batch_prefill: the adder's requests leave the queue, a request it
        chunked becomes the chunked request, and the batch is prepared for extend."""
        if not adder.can_run_list:
            return None
        admitted = set(adder.can_run_list)
        self.waiting = [r for r in self.waiting if r not in admitted]
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None:  # one more middle chunk in flight
            c = self.chunked_req
            setattr(c, self.chunk_counter, getattr(c, self.chunk_counter) + 1)
        batch = Batch("prefill", adder.can_run_list, self.chunked_req)
        self.prepare_for_extend(batch)
        return batch

    def update_running(self, batch: Batch) -> Batch:
        """Scheduler.update_running_batch: drop finished requests, retract while the step does
        not fit (ScheduleBatch.check_decode_mem), else decay the ratio; prepare_for_decode."""
        initial_bs = len(batch.reqs)
        batch.filter_batch()
        if not batch.reqs:
            batch.batch_is_full = False
            return batch
        if not self.decode_fits(len(batch.reqs)):
            retracted = self.retract_decode(batch)
            self.retractions += len(retracted)
            for req in retracted:  # _add_request_to_queue(is_retracted=True): to the back
                req.arrival_processed_tokens = self.processed_tokens  # (read by 0.5.23 only)
                self.waiting.append(req)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        if len(batch.reqs) < initial_bs:
            batch.batch_is_full = False
        if not batch.reqs:
            return batch
        batch.kind = "decode"
        self.prepare_for_decode(batch)
        return batch

    def retract_decode(self, batch: Batch) -> list[ForcedReq]:
        """ScheduleBatch.retract_decode: retract the requests with the fewest outputs (then the
        longest prompt) until the rest's next step fits, each releasing its KV and evicting for
        ``retract_decode_steps`` tokens per request left; the ratio then follows what is left."""
        order = sorted(range(len(batch.reqs)), reverse=True,
                       key=lambda i: (len(batch.reqs[i].output_ids),
                                      -len(batch.reqs[i].origin_input_ids)))
        retracted, first = [], True
        while first or self.must_retract(len(order)):
            if len(order) == 1:
                self.check_last_request()
                break
            first = False
            req = batch.reqs[order.pop()]
            self.release_retracted(req, len(order) * self.retract_steps)
            req.reset_for_retract()
            retracted.append(req)
        batch.reqs = [batch.reqs[i] for i in order]  # filter_batch(keep_indices=...) reorders
        decoded = sum(len(r.output_ids) for r in batch.reqs)
        budget = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
        self.new_token_ratio = min(1.0, (decoded + self.retract_steps * len(batch.reqs))
                                   / (budget + self.ratio_budget_pad))
        return retracted

    def process_prefill(self, batch: Batch) -> None:
        """process_batch_result_prefill: a request whose fill is done takes its token and is
        cached (finished) or its progress cached (unfinished); a middle chunk only counts down."""
        for req in batch.reqs:
            chunks = getattr(req, self.chunk_counter)
            if chunks > 0:
                setattr(req, self.chunk_counter, chunks - 1)
                continue
            req.output_ids.append(req.next_token())
            req.finish_by_length()
            if req.finished():
                self.cache_finished(req)
            else:
                self.cache_unfinished(req)

    def process_decode(self, batch: Batch) -> None:
        """process_batch_result_decode: one token each; finished requests are cached."""
        for req in batch.reqs:
            req.output_ids.append(req.next_token())
            req.finish_by_length()
            if req.finished():
                self.cache_finished(req)
