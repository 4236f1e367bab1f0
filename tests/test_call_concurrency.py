"""``arrival.max_concurrency``: at most N calls outstanding at once across programs (bench_serving's
``--max-concurrency``), in the SimPy driver; a ready call waits in a FIFO for a slot and its
record's arrival is when it got one."""

from __future__ import annotations

import pytest

from testbed.config.assembly import assemble
from testbed.errors import BadInput
from testbed.cache import RadixCache
from testbed.scheduler.batch import Batch, StepOutcome
from testbed.serving.serve import serve
from testbed.sim.executor import predetermined_tokens
from testbed.workloads.request import Request
from tests.conftest import toks


class OneSecondSteps:
    """Every step takes one second and emits the predetermined tokens."""

    def execute(self, batch: Batch) -> StepOutcome:
        return StepOutcome(duration_s=1.0, tokens=predetermined_tokens(batch))


def call(id_: str, prompt: tuple[int, ...], output_len: int, program: str | None = None,
         after: tuple[str, ...] = (), think: float = 0.0) -> Request:
    return Request(id=id_, prompt=toks(*prompt), output=toks(*range(100, 100 + output_len)),
                   program=program, after=list(after), think_time_s=think)


def times(max_concurrency: int | None) -> dict[str, tuple[float, float]]:
    requests = [call("a1", (1, 2, 3), 2, program="p"),  # prefill 0-1, decode 1-2
                call("b", (7, 8, 9), 1),  # one token: done after its prefill
                call("a2", (1, 2, 3, 4), 1, program="p", after=("a1",), think=0.5),
                call("c", (5, 6), 1)]
    _, result = serve(requests, RadixCache(10_000), {"name": "fcfs"}, OneSecondSteps(),
                      max_concurrency=max_concurrency)
    return {r.id: (r.submitted_s, r.finish_s) for r in result.reqs}


def test_one_call_at_a_time_submits_each_ready_call_when_the_last_one_finishes():
    # a1 [0, 2]; b and c wait in arrival order; a2 is ready at 2.5 and queues behind c
    assert times(1) == {"a1": (0.0, 2.0), "b": (2.0, 3.0), "c": (3.0, 4.0), "a2": (4.0, 5.0)}


def test_two_slots_and_unlimited():
    # a1 and b at 0 (one prefill step: b is done at 1, a1 decodes 1-2); c takes b's slot at 1
    # and is prefilled 2-3 (after the step formed at 1); a2, ready at 2.5 with a1's slot free
    # since 2, waits for that step: 3-4
    assert times(2) == {"a1": (0.0, 2.0), "b": (0.0, 1.0), "c": (1.0, 3.0), "a2": (2.5, 4.0)}
    assert times(None) == {"a1": (0.0, 2.0), "b": (0.0, 1.0), "c": (0.0, 1.0), "a2": (2.5, 3.5)}


def test_the_key_is_read_and_checked(compose):
    assert assemble(compose("arrival.max_concurrency=1")).max_concurrency == 1
    assert assemble(compose()).max_concurrency is None

    with pytest.raises(BadInput, match=r"^arrival.max_concurrency must be >= 1 or null, got 0$"):
        assemble(compose("arrival.max_concurrency=0"))
