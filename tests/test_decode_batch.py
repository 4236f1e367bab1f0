"""A plain decode step as columns (`DecodeBatch`, docs/design.md §4 "A plain decode step as
columns"): its entries are the ones a `Batch` of them would hold, made only when read; the
simulator never reads them; its shape is `StepShape.decode`'s."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache import RadixCache
from testbed.scheduler.batch import Batch, BatchEntry, DecodeBatch
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.serving.serve import serve
from testbed.sim.executor import predetermined_tokens
from testbed.sim.step_shape import StepShape
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.test_sim import a10g_llama2_executor


def crowd(n: int = 5, out: int = 12) -> list[Request]:
    """Requests sharing a 20-token prefix, each with its own tail and a 12-token output."""
    return [Request(f"r{i}", toks(*range(500, 520), *range(20 * i, 20 * i + 6)),
                    np.arange(1000 + 100 * i, 1000 + 100 * i + out, dtype=np.int32))
            for i in range(n)]


def decoding(overlap: bool = False) -> tuple[Scheduler, DecodeBatch]:
    """A scheduler past its prefill, and the first decode step it forms."""
    s = Scheduler(RadixCache(1000), SchedulerConfig(name="fcfs", overlap=overlap))
    for r in crowd():
        s.submit(r, 0.0)
    prefill = s.next_batch()
    assert prefill.kind == "prefill" and prefill.size == 5
    s.complete(prefill, predetermined_tokens(prefill), 0.1)
    batch = s.next_batch()
    assert isinstance(batch, DecodeBatch)
    return s, batch


def test_a_decode_steps_entries_are_the_entries_its_columns_say_made_once():
    s, batch = decoding()
    assert "entries" not in batch.__dict__
    assert batch.size == batch.num_new_tokens == 5
    assert batch.shape() == ((1,) * 5, (26,) * 5)
    assert not batch.verifies and batch.decode_groups is None and batch.kv_copies == []
    assert "entries" not in batch.__dict__  # none of those made them
    entries = batch.entries
    assert entries == [BatchEntry(req, 26, 1, True, 0, req.lease.buffer, (), True)
                       for req in s.running]
    assert batch.entries is entries
    # the slots an entry reads are its request's: the prompt's 26 and the step's one
    for e in entries:
        assert np.array_equal(e.kv_slots(), e.req.lease.slots)


def test_a_decode_step_keeps_its_requests_when_the_running_batch_changes_in_place():
    s, batch = decoding()
    reqs = list(batch.reqs)
    s.running.remove(s.running[0])  # (retraction and preemption cut the running list in place)
    s.running += reqs[:1]
    assert batch.reqs == reqs


def test_a_decode_steps_tokens_are_the_workloads_at_each_position():
    s, batch = decoding()
    assert predetermined_tokens(batch) == [1001 + 100 * i for i in range(5)]
    # the same as the entries' own path (a `Batch` of them, as the engine's executor reads it)
    assert predetermined_tokens(Batch("decode", batch.entries)) == predetermined_tokens(batch)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_simulated_run_never_makes_a_decode_steps_entries(monkeypatch, overlap):
    from functools import cached_property

    made = []
    original = DecodeBatch.__dict__["entries"].func

    def counted(self):
        made.append(self)
        return original(self)

    counted_property = cached_property(counted)
    counted_property.__set_name__(DecodeBatch, "entries")
    monkeypatch.setattr(DecodeBatch, "entries", counted_property)
    # six requests of 26 + 25 tokens in a pool of 90, reserving 2 outputs each: they evict,
    # retract and chunk (tests/test_step_cycle.py's crowd)
    _, result = serve(crowd(6, out=25), RadixCache(90),
                      {"name": "lpm", "overlap": overlap, "clip_max_new_tokens": 2,
                       "chunked_prefill_size": 16}, a10g_llama2_executor(), observe=True)
    assert [len(r.output) for r in result.reqs] == [25] * 6
    assert sum(1 for row in result.observer.rows if row.kind == "decode") > 20
    assert sum(r.preemptions for r in result.reqs) > 0
    assert made == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**7), min_size=1, max_size=64))
def test_a_decode_shape_made_from_columns_is_the_checked_one(contexts):
    fast, checked = StepShape.of_decode(tuple(contexts)), StepShape.decode(contexts)
    assert fast == checked and hash(fast) == hash(checked)
    for name in ("num_new", "num_context", "is_decode", "kv_read_context", "new_times_context",
                 "attended_pairs", "padded_decode_area", "few_row_passes", "kind", "batch"):
        assert getattr(fast, name) == getattr(checked, name), name


def test_a_decode_shape_of_numpy_ints_or_negative_contexts_takes_the_checked_path():
    step = StepShape.of_decode(tuple(np.arange(3, dtype=np.int64)))
    assert step.context == (0, 1, 2) and all(type(c) is int for c in step.context)
    with pytest.raises(ValueError, match="context must be >= 0"):
        StepShape.of_decode((3, -1))
    with pytest.raises(ValueError, match="at least one request"):
        StepShape.of_decode(())
