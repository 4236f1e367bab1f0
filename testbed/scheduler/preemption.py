"""Priority preemption: SGLang 0.5.23's ``PrefillAdder.preempt_to_schedule`` under
``--enable-priority-scheduling`` (``scheduler.enable_priority_scheduling``, unless
``scheduler.disable_priority_preemption``).

When the running batch is full (as many requests running and admitted as
``max_running_requests`` allows) and a waiting request is next in the queue, running requests
less urgent than it by more than ``priority_preemption_threshold`` (SGLang's
``--priority-scheduling-preemption-threshold``, 10) are taken, least urgent first and, among
equals, the one that entered the queue last, until their reservations cover what the waiting
request needs beyond ``rem_total`` (its extend plus ``min(max_new, clip)``); none taken, or not
enough, and nothing is preempted. The scheduler then frees their KV past the cached prefix, as a
retraction does, and appends them to the queue after the step's admissions.

Priorities are this project's (lower is more urgent), i.e. SGLang's with
``--schedule-low-priority-values-first``. The waiting request's extend is counted from its prefix
at its last look-up (`Req.matched`: the queue's sort or its last admission attempt), as SGLang
reads ``req.prefix_len`` before it re-matches the request.
"""

from __future__ import annotations

from testbed.scheduler.adder import PrefillAdder
from testbed.scheduler.request_state import Req


def reservation(req: Req, clip: int, new_token_ratio: float) -> float:
    """What a running request holds of ``rem_total`` (`PrefillAdder.for_step`'s share)."""
    return min(req.max_new_tokens - len(req.output), clip) * new_token_ratio


def to_preempt(req: Req, running: list[Req], adder: PrefillAdder, clip: int,
               new_token_ratio: float, threshold: int) -> list[Req]:
    """The running requests to preempt so that ``req`` can be tried (empty: none can be)."""
    candidates = sorted((r for r in running if not r.finished),
                        key=lambda r: (-r.request.priority, -r.queued_s))
    short = (req.fill_len - req.matched + min(req.max_new_tokens, clip)) - adder.rem_total
    chosen: list[Req] = []
    for r in candidates:
        if r.request.priority - req.request.priority <= threshold:
            break
        chosen.append(r)
        short -= reservation(r, clip, new_token_ratio)
        if short <= 0:
            break
    return chosen if chosen and short <= 0 else []
