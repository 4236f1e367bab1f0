"""The one step cycle (`testbed.serving.step_cycle`) behind the SimPy driver and the server's
thread: under overlap it launches step N+1 before it reads step N's tokens back (a recording fake
device, in both loops); its two orders of driving the scheduler make the same steps; and its
timeline prices the host's work, hidden behind the device's under overlap on a concurrent
device, in plain view on a synchronous one."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from testbed.api.online import OnlineEngine, generating_request
from testbed.cache import RadixCache
from testbed.scheduler.batch import StepOutcome
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.serving.executor import Done
from testbed.serving.serve import serve
from testbed.sim.executor import SimExecutor, predetermined_tokens
from testbed.sim.overlap import HostCost, fit_host_cost
from testbed.workloads.request import Request
from tests.conftest import toks

SHARED = list(range(200, 220))  # token ids the tiny model takes too (vocabulary 256)
TIGHT = {"name": "lpm", "clip_max_new_tokens": 2, "chunked_prefill_size": 16}


def crowd(n: int = 6, out: int = 25) -> list[Request]:
    """Requests sharing a 20-token prefix with 25-token outputs: in a pool of 90 they evict,
    retract and (past 16 new tokens) chunk."""
    return [Request(f"r{i}", toks(*SHARED, *range(20 * i, 20 * i + 5)),
                    np.arange(1, out + 1, dtype=np.int32)) for i in range(n)]


class RecordingDevice:
    """A fake asynchronous device: launch hands out step numbers, result reads a step's tokens
    back; both are written to ``log`` in the order the loop calls them. Its tokens are known at
    launch from the entries' positions: the workload's, or ``tokens_of``'s."""

    asynchronous = True

    def __init__(self, tokens_of=predetermined_tokens) -> None:
        self.tokens_of = tokens_of
        self.log: list[tuple[str, int]] = []

    def launch(self, batch):
        k = sum(1 for op, _ in self.log if op == "launch")
        self.log.append(("launch", k))
        return Recorded(self, k, self.tokens_of(batch))

    def execute(self, batch):
        return self.launch(batch).result()


class Recorded:
    launch_s = 0.0

    def __init__(self, device: RecordingDevice, k: int, tokens: list) -> None:
        self.device, self.k, self.tokens = device, k, tokens

    def result(self) -> StepOutcome:
        self.device.log.append(("read", self.k))
        return StepOutcome(0.01, self.tokens)


def check_order(log: list[tuple[str, int]], overlap: bool) -> None:
    """Every step is read back once, in order, after its launch. Without overlap before the
    next launch; with it before the launch after next, and (but where no step formed until
    those results were applied) after the next launch."""
    launches = {k: i for i, (op, k) in enumerate(log) if op == "launch"}
    reads = {k: i for i, (op, k) in enumerate(log) if op == "read"}
    assert sorted(reads) == sorted(launches) == list(range(len(launches)))
    assert list(reads.values()) == sorted(reads.values())
    after_next = [k for k in reads if k + 1 in launches and launches[k + 1] < reads[k]]
    for k, at in reads.items():
        assert launches[k] < at
        if not overlap and k + 1 in launches:
            assert at < launches[k + 1]
        if overlap and k + 2 in launches:
            assert at < launches[k + 2]
    if overlap:
        assert len(after_next) >= 0.9 * (len(reads) - 1)
    else:
        assert not after_next


@pytest.mark.parametrize("overlap", [True, False])
def test_the_simpy_loop_launches_the_next_step_before_reading_a_steps_tokens(overlap):
    device = RecordingDevice()
    scheduler, result = serve(crowd(), RadixCache(90), TIGHT | {"overlap": overlap}, device,
                              check_invariants=True)
    assert scheduler.preemptions > 0
    assert all(r.output == list(range(1, 26)) for r in result.reqs)
    check_order(device.log, overlap)


def online_run(executor, overlap: bool, requests, abort: tuple[str, int] | None = None,
               capacity: int = 90):
    """`OnlineEngine`'s turns driven by hand, without its thread (deterministic): the inbox is
    taken before each turn; ``abort`` = (request id, turn) aborts one at that turn's boundary.
    Returns each client's updates."""
    scheduler = Scheduler(RadixCache(capacity), SchedulerConfig(**TIGHT, overlap=overlap),
                          eos_for_all=True, check_invariants=True)
    engine = OnlineEngine(scheduler, executor, max_live=len(requests))
    updates = {r.id: [] for r in requests}
    for r in requests:
        assert engine.submit(r, updates[r.id].append)
    turn = 0
    while engine._inbox or scheduler.has_work or engine.cycle.in_flight:
        if abort is not None and turn == abort[1]:
            engine.abort(abort[0])
        inbox, engine._inbox = list(engine._inbox), deque()
        engine._take(inbox)
        engine._step()
        turn += 1
        assert turn < 2000
    scheduler.check_drained()
    return updates


def generating(n: int = 6) -> list[Request]:
    return [generating_request(r.id, r.prompt, 25, ignore_eos=True) for r in crowd(n)]


def counting(batch) -> list[int | None]:
    """100 + the position of the output each entry produces."""
    return [100 + e.output_index if e.makes_output else None for e in batch.entries]


@pytest.mark.parametrize("overlap", [True, False])
def test_the_servers_loop_launches_the_next_step_before_reading_a_steps_tokens(overlap):
    device = RecordingDevice(counting)
    updates = online_run(device, overlap, generating())
    for rid, ups in updates.items():
        assert [t for u in ups for t in u.tokens] == list(range(100, 125))
        assert ups[-1].finish_reason == "length"
    check_order(device.log, overlap)


def test_the_servers_loop_and_the_simpy_loop_make_the_same_steps():
    """One cycle: the same requests through either loop give the same batches."""
    sim, online = RecordingDevice(), RecordingDevice(counting)
    batches = []
    for device in (sim, online):
        seen = []
        launch = device.launch
        device.launch = lambda b, launch=launch, seen=seen: (
            seen.append((b.kind, [(e.req.id, e.context, e.new) for e in b.entries])),
            launch(b))[1]
        batches.append(seen)
    serve(crowd(), RadixCache(90), TIGHT | {"overlap": True}, sim)
    online_run(online, True, generating())
    assert batches[0] == batches[1] and len(batches[0]) > 20


def results_first(overlap: bool) -> list:
    """The scheduler in the order SGLang's tests drive it: complete, then next_batch."""
    s = Scheduler(RadixCache(90), SchedulerConfig(**TIGHT, overlap=overlap))
    for r in crowd():
        s.submit(r, 0.0)
    steps = []
    while s.has_work:
        batch = s.next_batch()
        if batch is None:
            break
        steps.append([(e.req.id, e.context, e.new) for e in batch.entries])
        s.complete(batch, predetermined_tokens(batch), 0.0)
    return steps


@pytest.mark.parametrize("overlap", [True, False])
def test_the_loops_order_and_the_results_first_order_make_the_same_steps(overlap):
    device = RecordingDevice()
    seen = []
    launch = device.launch
    device.launch = lambda b: (seen.append([(e.req.id, e.context, e.new) for e in b.entries]),
                               launch(b))[1]
    serve(crowd(), RadixCache(90), TIGHT | {"overlap": overlap}, device)
    assert seen == results_first(overlap)


# ---------------------------------------------------------------------------- the timeline
class Constant:
    """Every step costs the device ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def step_time(self, step) -> float:
        return self.seconds


def decode_run(overlap: bool, host: HostCost, device_s: float = 0.004):
    """Four requests of 8-token prompts and 20 outputs, all at t = 0: one prefill, 19 decodes."""
    requests = [Request(f"r{i}", toks(*range(10 * i, 10 * i + 8)),
                        np.arange(1, 21, dtype=np.int32)) for i in range(4)]
    executor = SimExecutor(Constant(device_s), host_cost=host)
    _, result = serve(requests, RadixCache(None), {"name": "fcfs", "overlap": overlap},
                      executor, record_steps=True)
    return result


@pytest.mark.parametrize("host_s, device_s, overlapped", [
    (0.001, 0.004, 0.001 + 20 * 0.004),  # the device bounds: one launch in plain view
    (0.006, 0.004, 20 * 0.006 + 0.004),  # the host bounds: the device waits for each launch
])
def test_overlap_hides_the_hosts_work_behind_a_concurrent_devices(host_s, device_s,
                                                                   overlapped):
    host = HostCost(prefill_s=host_s, decode_s=host_s)
    plain, over = decode_run(False, host, device_s), decode_run(True, host, device_s)
    assert len(plain.steps) == len(over.steps) == 20
    assert plain.end_s == pytest.approx(20 * (host_s + device_s))
    assert over.end_s == pytest.approx(overlapped)
    assert all(s.gpu_s == device_s and s.host_s == host_s for s in over.steps)
    assert sum(s.duration_s for s in over.steps) == pytest.approx(over.end_s)


def test_a_synchronous_device_hides_nothing_and_no_host_price_is_the_old_timeline():
    sync = HostCost(prefill_s=0.001, decode_s=0.001, concurrent=False)
    assert decode_run(True, sync).end_s == pytest.approx(decode_run(False, sync).end_s) \
        == pytest.approx(20 * 0.005)
    for overlap in (False, True):  # without host time every step ends its device time later
        steps = decode_run(overlap, HostCost()).steps
        assert [s.duration_s for s in steps] == [0.004] * 20


def test_the_host_price_is_fitted_to_the_steps_host_time_per_kind():
    priced = HostCost(prefill_s=0.002, prefill_token_s=1e-5, decode_s=0.001,
                      decode_request_s=0.0002)
    fitted = fit_host_cost(decode_run(False, priced).steps)
    assert fitted.price("decode", 4, 4) == pytest.approx(0.0018)
    assert fitted.price("prefill", 4, 32) == pytest.approx(0.002 + 32e-5)


def test_a_done_handle_takes_its_outcomes_duration_as_the_launchs_time_unless_told():
    outcome = StepOutcome(0.5, [1])
    assert Done(outcome).launch_s == 0.5 and Done(outcome, 0.0).launch_s == 0.0
    assert outcome.device_s == 0.5 and StepOutcome(0.5, [1], gpu_s=0.2).device_s == 0.2


def test_a_loop_that_can_form_no_step_with_work_left_stops_with_what_was_left(monkeypatch):
    # a scheduler defect (the fuzzer's #9064 was one): SimPy's own words named no request
    monkeypatch.setattr(Scheduler, "form", lambda self, now=0.0: None)
    with pytest.raises(RuntimeError, match=r"^the step loops stalled at t=0 s with requests "
                                           r"unfinished \(replica 0: 2 waiting, 0 running\)"):
        serve(crowd(2), RadixCache(90), {"name": "fcfs"}, SimExecutor(Constant(1.0)))
