"""`OnlineEngine` (`testbed/api/online.py`) with a scripted executor: each request's updates carry
its tokens in order and end with its finish and usage; an abort ends a request between steps,
silently, its KV released; an inspection that finds no step boundary in time is withdrawn
(``EngineBusy``, the API's 503); a failing step ends every live request with ``error`` and the
API then answers 503 (``/health`` and new requests)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from testbed.api.app import make_app
from testbed.api.online import EngineBusy, EngineDead, OnlineEngine, generating_request
from testbed.api.protocol import ServerFacts
from testbed.cache import RadixCache
from testbed.engine.limits import ModelLimits
from testbed.scheduler.batch import StepOutcome
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from tests.conftest import toks


class Scripted:
    """The "model" writes 100, 101, 102, ... for every request; ``hold`` pauses before the step
    numbered ``hold_at`` until it is set; ``fail_at`` raises at that step."""

    def __init__(self, hold_at: int | None = None, fail_at: int | None = None) -> None:
        self.steps = 0
        self.hold_at, self.fail_at = hold_at, fail_at
        self.holding = threading.Event()
        self.hold = threading.Event()

    def execute(self, batch):
        self.steps += 1
        if self.steps == self.hold_at:
            self.holding.set()
            assert self.hold.wait(30)
        if self.steps == self.fail_at:
            raise RuntimeError("the device fell over")
        return StepOutcome(0.0, [100 + len(e.req.output)
                                 if e.produces_token and e.req.remaining_new_tokens else None
                                 for e in batch.entries])


class Client:
    """A sink collecting a request's updates; ``done`` is set by its last one."""

    def __init__(self) -> None:
        self.updates = []
        self.done = threading.Event()

    def __call__(self, update) -> None:
        self.updates.append(update)
        if update.finish_reason is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for u in self.updates for t in u.tokens]


def engine_with(executor, eos=(103,)) -> OnlineEngine:
    scheduler = Scheduler(RadixCache(200), SchedulerConfig(name="fcfs"), eos_token_ids=eos,
                          eos_for_all=True)
    return OnlineEngine(scheduler, executor, max_live=8).start()


def submit(engine, rid: str, prompt, max_tokens: int, **stops) -> Client:
    client = Client()
    assert engine.submit(generating_request(rid, toks(*prompt), max_tokens, **stops), client)
    return client


def test_updates_carry_the_tokens_in_order_and_end_with_finish_and_usage():
    engine = engine_with(Scripted())
    try:
        a = submit(engine, "a", range(10), 6)
        assert a.done.wait(30)
        b = submit(engine, "b", [*range(10), 50], 6, ignore_eos=True)
        assert b.done.wait(30)
        assert a.tokens == [100, 101, 102, 103]  # EOS 103 ends it, kept
        assert b.tokens == [100, 101, 102, 103, 104, 105]
        last_a, last_b = a.updates[-1], b.updates[-1]
        assert (last_a.finish_reason, last_a.prompt_tokens, last_a.completion_tokens,
                last_a.cached_tokens) == ("stop", 10, 4, 0)
        assert (last_b.finish_reason, last_b.completion_tokens, last_b.cached_tokens) \
            == ("length", 6, 10)  # a's prompt was cached
        assert all(u.finish_reason is None for u in a.updates[:-1])
        assert engine.live == 0
        engine.inspect(lambda e: e.scheduler.check_drained())
    finally:
        engine.stop()
    assert not engine.alive
    with pytest.raises(EngineDead):  # nothing to run it any more
        engine.inspect(lambda e: None)


def test_an_abort_ends_the_request_between_steps_silently_and_frees_its_kv():
    executor = Scripted(hold_at=3)  # prefill, one decode, then held before the third step
    engine = engine_with(executor, eos=())
    try:
        a = submit(engine, "a", range(10), 50)
        assert executor.holding.wait(30)
        engine.abort("a")
        executor.hold.set()
        state = engine.inspect(lambda e: (e.scheduler.has_work, e.counts["aborted"],
                                          e.scheduler.cache.protected_size))
        assert state == (False, 1, 0)
        # the held step ran to its end (its token sent); the abort came before the next one
        assert not a.done.is_set() and a.tokens == [100, 101, 102]
        assert engine.live == 0
        engine.inspect(lambda e: e.scheduler.check_drained())
    finally:
        engine.stop()


def test_an_inspection_during_a_long_step_is_withdrawn_as_busy_and_never_runs(monkeypatch):
    """/debug/state used to answer a plain-text 500 once a step outlasted its 30 s wait."""
    import testbed.api.app

    executor = Scripted(hold_at=1)  # the first step runs until told to end
    engine = engine_with(executor, eos=())
    ran = []
    try:
        submit(engine, "a", range(10), 3)
        assert executor.holding.wait(30)
        with pytest.raises(EngineBusy) as busy:
            engine.inspect(ran.append, timeout=0.05)
        assert busy.value.seconds >= 0.05
        monkeypatch.setattr(testbed.api.app, "BETWEEN_STEPS_WAIT_S", 0.05)
        facts = ServerFacts("scripted", 0.0, 1.0, 16, ModelLimits(256), lambda n: True, 200)
        with TestClient(make_app(engine, facts)) as http:
            r = http.get("/debug/state")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_busy"
        executor.hold.set()
        assert engine.inspect(lambda e: e.counts["steps"]) >= 1
        assert ran == []  # withdrawn: it did not run once the step ended
    finally:
        executor.hold.set()
        engine.stop()


def test_a_failing_step_ends_live_requests_with_error_and_the_api_answers_503():
    engine = engine_with(Scripted(fail_at=1))
    a = submit(engine, "a", range(10), 5)
    assert a.done.wait(30)
    assert a.updates[-1].finish_reason == "error"
    assert "the device fell over" in a.updates[-1].error
    engine.stop()
    assert not engine.alive
    with pytest.raises(EngineDead):
        engine.submit(generating_request("b", toks(1, 2), 3), Client())
    facts = ServerFacts("scripted", 0.0, 1.0, 16, ModelLimits(256), lambda n: True, 200)
    with TestClient(make_app(engine, facts)) as http:
        health = http.get("/health")
        assert health.status_code == 503 and "the device fell over" in health.json()["error"]
        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_requests_past_max_live_are_refused():
    executor = Scripted(hold_at=1)
    scheduler = Scheduler(RadixCache(200), SchedulerConfig(name="fcfs"))
    engine = OnlineEngine(scheduler, executor, max_live=2).start()
    try:
        submit(engine, "a", [1, 2], 3)
        submit(engine, "b", [3, 4], 3)
        assert not engine.submit(generating_request("c", np.asarray([5], np.int32), 3),
                                 Client())
        executor.hold.set()
    finally:
        engine.stop()


class RecordingLoop:
    """An event loop as the engine sees one: records each ``call_soon_threadsafe`` (the
    updates it carries) and runs it at once."""

    def __init__(self) -> None:
        self.calls = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        self.calls.append([(sink.rid, u.tokens, u.finish_reason) for sink, u in args[0]])
        fn(*args)


class Named(Client):
    def __init__(self, rid: str) -> None:
        super().__init__()
        self.rid = rid


def test_a_turns_updates_reach_an_event_loop_in_one_call_and_its_steps_are_logged():
    scheduler = Scheduler(RadixCache(200), SchedulerConfig(name="fcfs"), eos_token_ids=(),
                          eos_for_all=True)
    engine = OnlineEngine(scheduler, Scripted(), max_live=8)
    loop = RecordingLoop()
    a, b = Named("a"), Named("b")
    # both held before the loop starts: they share every step
    assert engine.submit(generating_request("a", toks(*range(10)), 3), a, loop)
    assert engine.submit(generating_request("b", toks(*range(20, 26)), 3), b, loop)
    engine.start()
    try:
        assert a.done.wait(30) and b.done.wait(30)
        assert loop.calls == [[("a", (100,), None), ("b", (100,), None)],
                              [("a", (101,), None), ("b", (101,), None)],
                              [("a", (102,), "length"), ("b", (102,), "length")]]
        steps = engine.inspect(lambda e: e.steps.since(0))  # logged once the turn is done
        assert [(s.step, s.kind, s.requests, s.new_tokens, s.context_tokens) for s in steps] \
            == [(0, "prefill", 2, 16, 0), (1, "decode", 2, 2, 16), (2, "decode", 2, 2, 18)]
        assert all(s.turn_s >= s.handing_s >= 0 and s.idle_s >= 0 for s in steps)
        facts = ServerFacts("scripted", 0.0, 1.0, 16, ModelLimits(256), lambda n: True, 200)
        with TestClient(make_app(engine, facts)) as http:
            r = http.get("/debug/steps", params={"since": 1}).json()
        assert r["recorded"] == 3
        assert r["steps"] == [s.as_dict() for s in steps[1:]]
    finally:
        engine.stop()
