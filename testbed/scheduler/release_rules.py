"""`ReleaseRules`: where SGLang 0.4.10's and 0.5.23's step rules differ (``scheduler.sglang``).

Each flag names the 0.5.23 function whose rule it switches on; with all of them off the
scheduler follows 0.4.10 rule for rule (docs/design.md §4, "SGLang releases"; one hand-made step
test per flag in tests/test_sglang523_steps.py). The queue policies' own differences (the
look-up of the whole fill, the waiting-prefix refresh) are in `testbed.scheduler.policy`.

Where each flag is read: the admission checks and chunk sizes in `testbed.scheduler.adder`;
``full_needs_work`` and ``other_stops_first`` in `testbed.scheduler.admission`;
``skip_finishing_decode`` in `testbed.scheduler.decode_step`; ``evict_shortfall`` and
``retract_until_step_fits`` in `testbed.scheduler.retraction`; ``filter_finished_first`` in
`testbed.scheduler.scheduler` (the step's forming).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class ReleaseRules:
    # PrefillAdder.add_one_req: the admission check reserves min(max_new - outputs, clip) (a
    # retracted request's outputs are not reserved again), where 0.4.10 reserves
    # min(max_new, clip).
    reserve_outputs_left: bool
    # PrefillAdder._update_prefill_budget -> PrefillBudget.reserve: every admission (whole,
    # chunk or continued chunk) takes one page more from both KV budgets, and add_one_req's
    # check counts it (``per_req_token_overhead``: the paged allocator may need it).
    page_per_request: bool
    # add_one_req checks the KV budget once, with the prefix locked (_lock_node); 0.4.10 checks
    # before locking and again after, with the input cap between them.
    check_once_locked: bool
    # _select_prefill_admission: ``extend >= rem_input`` refuses a request (after the first)
    # only when chunking is off.
    input_cap_unchunked_only: bool
    # _select_prefill_admission: a chunk ends on a page boundary (prefix + chunk), within the
    # chunk budget; 0.4.10 cuts ``rem_chunk - page_size + 1`` tokens.
    chunk_on_page_boundary: bool
    # add_chunked_req -> PrefillBudget.available_chunk_tokens: a continued chunk is at most the
    # KV left (rem_total), unless none is left.
    chunk_within_kv: bool
    # get_next_batch_to_run: ``running_batch.filter_batch()`` drops finished requests before
    # the prefill is formed (0.4.10: only update_running_batch does).
    filter_finished_first: bool
    # _get_new_batch_prefill_raw: an empty running batch is never full, and NO_TOKEN marks it
    # full only when a request was admitted or the running batch is not empty.
    full_needs_work: bool
    # _get_new_batch_prefill_raw: admission stops before a request when budget_state() says
    # OTHER (a continued chunk may have used the step's budgets).
    other_stops_first: bool
    # BaseTokenToKVPoolAllocator.evict_to_free_tokens: evict the shortfall, where 0.4.10 asks
    # the tree for the whole allocation.
    evict_shortfall: bool
    # ScheduleBatch.retract_decode: retract until the rest's next step fits
    # (check_decode_mem), where 0.4.10 goes on until ``retract_decode_steps`` tokens each are
    # free; NewTokenRatioTracker.estimate_new_token_ratio_after_retract divides by budget + 1.
    retract_until_step_fits: bool
    # Scheduler.event_loop_overlap (enable_skip_finishing_decode) -> update_running_batch,
    # _reqs_finishing_inflight: under overlap a request whose in-flight token is its last by
    # length is not decoded again; when the step does not fit while such requests exist, no
    # decode step is formed (their results free KV) instead of retracting.
    skip_finishing_decode: bool

    @classmethod
    def of(cls, release: str) -> "ReleaseRules":
        """The rules of SGLang ``release`` ("0.5.23": every flag; "0.4.10": none)."""
        return cls(**{f.name: release != "0.4.10" for f in fields(cls)})
