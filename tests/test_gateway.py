"""The live router (`python -m testbed.route`, `testbed/gateway/`) in front of tiny-model
``testbed.serve`` replicas on free loopback ports: its policies are the simulator's objects and
choose per request what the simulator's router chooses on the same calls in the same order;
streams pass through; ``router=kv_events``' index equals every replica's tree after a run with
eviction; a killed replica leaves the rotation within a second, the requests it held that had
streamed nothing are served by another, one that had streamed ends with a clear error, and the
replica rejoins when it comes back. Readiness is polled, never slept for."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import numpy as np
import pytest

from testbed.api.server import start_server
from testbed.config.assembly import compose_config
from testbed.cache.events import cached_sequences, sequence_set
from testbed.execute import execute
from testbed.gateway.launch import start_router
from testbed.gateway.settings import assemble_route, replica_overrides
from testbed.router import ROUTERS
from testbed.serving.cluster import simulate_cluster
from testbed.cache import RadixCache
from testbed.workloads.request import Request
from tests.test_serve_api import wait_until
from tests.test_sim import a10g_llama2_executor

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["model=tiny", "device=cpu", "scheduler.chunked_prefill_size=64"]


@pytest.fixture(scope="module")
def replicas():
    handles = [start_server([*TINY, "cache.capacity_tokens=600"]) for _ in range(2)]
    yield handles
    for h in handles:
        h.stop()


def reset(handles) -> None:
    for h in handles:
        assert httpx.post(h.url + "/reset_prefix_cache", timeout=30).json()["success"]


def served_workload(router_url: str, out, overrides: list[str]) -> list[dict]:
    """A few-shot workload through the router, one call at a time; its requests.jsonl lines."""
    execute(compose_config(["backend=server", f"server.url={router_url}", "model=tiny",
                            "arrival.max_concurrency=1", "save_token_ids=true",
                            "progress=false", *overrides]), out)
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


FEW_SHOT = ["workload=few_shot", "workload.num_tasks=3", "workload.questions_per_task=4",
            "workload.num_shots=2", "workload.example_len=24", "workload.question_len=12",
            "workload.output_len=4"]


def test_the_routers_policy_is_the_simulators_object(replicas):
    router = start_router([h.url for h in replicas], ["router=cache_aware"])
    try:
        policy = router.app.state.proxy.router
        assert type(policy) is ROUTERS.resolve({"name": "cache_aware"}).entry
        assert policy.cache_threshold == 0.3  # the router group's defaults, as in the simulator
    finally:
        router.stop()


@pytest.mark.parametrize("name, keys", [("round_robin", {}), ("random", {}),
                                       ("least_load", {}),
                                       ("cache_aware", {"fallback": "smallest_tree"})])
def test_live_choices_equal_the_simulators_on_the_same_calls(replicas, tmp_path, name, keys):
    reset(replicas)
    router = start_router([h.url for h in replicas], [f"router={name}", "seed=3",
                                                      *(f"router.{k}={v}" for k, v in keys.items())])
    try:
        rows = served_workload(router.url, tmp_path / "live", FEW_SHOT)
        state = router.state()
        live = state["routed"]
    finally:
        router.stop()
    assert not any(r["failed"] for r in rows) and len(live) == len(rows)
    # each decision logged as made: the client's call id (X-Request-Id), replica, time received
    sent = sorted(rows, key=lambda r: r["arrival_s"])
    assert [x[0] for x in state["routing"]] == [r["id"] for r in sent]
    assert [x[1] for x in state["routing"]] == live
    assert [x[2] for x in state["routing"]] == sorted(x[2] for x in state["routing"])
    calls = [Request(r["id"], np.asarray(r["prompt_ids"], np.int32),
                     np.asarray(r["output_ids"], np.int32), arrival_s=float(i))
             for i, r in enumerate(sorted(rows, key=lambda r: r["arrival_s"]))]
    policy = ROUTERS.resolve({"name": name, **keys}).build(seed=3, max_tree_size=None)
    sim = simulate_cluster(calls, lambda: RadixCache(600), {"name": "lpm"},
                           a10g_llama2_executor(), policy, replicas=2, max_concurrency=1)
    assert sim.replica_of == live
    if name == "cache_aware":
        assert len(set(live)) == 2 and policy.decisions.get("cache", 0) > 0


def test_streams_pass_through_with_the_clients_fields(replicas):
    router = start_router([h.url for h in replicas], ["router=cache_aware"])
    try:
        body = {"prompt": list(range(1, 30)), "max_tokens": 5, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
        direct = httpx.post(replicas[0].url + "/v1/completions",
                            json={**body, "stream": False, "return_token_ids": True}).json()
        # the router asked for token ids on the client's behalf and took them out again
        assert all("token_ids" not in c for ch in chunks for c in ch["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] == 5
        assert len(direct["choices"][0]["token_ids"]) == 5
        assert router.state()["router_info"]["tree_tokens"][0] + \
            router.state()["router_info"]["tree_tokens"][1] >= 29 + 5
        bad = httpx.post(router.url + "/v1/completions", json={"prompt": [], "max_tokens": 1})
        assert bad.status_code == 400  # the replica's refusal, passed on
        assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    finally:
        router.stop()


def test_kv_events_index_equals_every_replicas_tree_after_eviction(tmp_path):
    handles = [start_server([*TINY, "cache.capacity_tokens=200"]) for _ in range(2)]
    router = start_router([h.url for h in handles], ["router=kv_events",
                                                     "route.events_wait_s=0.2"])
    try:
        chat = ["workload=chat", "workload.num_sessions=4", "workload.turns=3",
                "workload.system_prompt_len=24", "workload.min_question_len=8",
                "workload.max_question_len=24", "workload.min_output_len=4",
                "workload.max_output_len=8", "arrival.max_concurrency=2"]
        rows = served_workload(router.url, tmp_path / "run", chat)
        assert not any(r["failed"] for r in rows)
        last = [httpx.get(h.url + "/debug/state").json()["kv_events_seq"] for h in handles]
        wait_until(lambda: router.state()["events"]["seq"] == last)
        index = router.app.state.proxy.router.index
        for w, h in enumerate(handles):
            held = h.engine.inspect(lambda e: sequence_set(cached_sequences(e.scheduler.cache)))
            assert index.tree.sequences(w) == held
        assert router.state()["decisions"].get("cache", 0) > 0
        removed = sum(e["kind"] == "removed" for h in handles for e in httpx.get(
            h.url + "/kv_events", params={"since": 0, "wait_s": 0}).json()["events"])
        assert removed > 0  # the pools were too small to keep everything
    finally:
        router.stop()
        for h in handles:
            h.stop()


async def _stream(url: str, body: dict, out: dict) -> None:
    """One streamed call: the tokens received and how it ended (``error`` or None)."""
    out.update(tokens=0, error=None, status=None)
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode()
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                    continue
                for c in chunk["choices"]:
                    out["tokens"] += len(c.get("token_ids") or [])


def test_a_killed_replica_loses_no_request_that_had_not_streamed(tmp_path):
    handles = [start_server([*TINY, "cache.capacity_tokens=8000", "serve.max_queue=64"],
                            in_process=False) for _ in range(2)]
    router = start_router([h.url for h in handles], ["router=round_robin",
                                                     "route.health_interval_s=0.1"])
    b = handles[1]
    body = {"prompt": list(range(1, 20)), "max_tokens": 4, "ignore_eos": True, "stream": True,
            "return_token_ids": True}

    async def scenario() -> tuple[dict, list[dict], float]:
        first: dict = {}
        await _stream(router.url, body, first)  # to replica 0: round robin's next is 1
        long: dict = {}
        task = asyncio.create_task(_stream(router.url, {**body, "max_tokens": 3000}, long))
        while not long.get("tokens"):  # replica 1 is streaming it
            await asyncio.sleep(0.005)
        os.kill(b._proc.pid, signal.SIGSTOP)  # stalls: what it holds now streams nothing more
        stalled = [{} for _ in range(6)]
        tasks = [asyncio.create_task(_stream(router.url, body, s)) for s in stalled]
        await asyncio.sleep(0.05)  # let them reach the router and be routed (3 go to 1)
        os.kill(b._proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.gather(task, *tasks)
        return long, stalled, killed

    try:
        long, stalled, killed = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert all(s["error"] is None and s["tokens"] == 4 for s in stalled), stalled
        assert long["tokens"] > 0 and "replica 1" in long["error"] and \
            "failed after" in long["error"], long
        state = router.state()
        assert not state["replicas"][1]["up"] and state["counts"].get("retried", 0) >= 1
        assert time.monotonic() - killed < 30
        # it comes back on the same port: it rejoins, its cache new (another epoch)
        port = int(b.url.rsplit(":", 1)[1])
        old_epoch = state["replicas"][1]["epoch"]
        again = start_server([*TINY, "cache.capacity_tokens=8000"], port=port, in_process=False)
        handles[1] = again
        wait_until(lambda: router.state()["replicas"][1]["up"])
        assert router.state()["replicas"][1]["epoch"] != old_epoch
        # a replica killed while in rotation is out of it within a second
        os.kill(again._proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: not router.state()["replicas"][1]["up"], 5.0)
        assert time.monotonic() - t0 < 1.0
        ok: dict = {}
        asyncio.run(_stream(router.url, body, ok))  # served by the one left
        assert ok["error"] is None and ok["tokens"] == 4
    finally:
        router.stop()
        for h in handles:
            h.stop()


def test_route_settings_refuse_bad_values_in_one_line():
    from testbed.errors import BadInput

    def plan(*overrides):
        return assemble_route(compose_config(list(overrides), name="route"))

    assert plan("route.urls=[http://127.0.0.1:1]").replicas == 1
    with pytest.raises(BadInput, match="route.urls"):
        plan("route.urls=[nowhere]")
    with pytest.raises(BadInput, match="route.retries"):
        plan("route.retries=-1")
    with pytest.raises(BadInput, match="router=oracle"):
        plan("router=oracle")
    with pytest.raises(BadInput, match="route.health_interval_s"):
        plan("route.health_interval_s=0")
    with pytest.raises(BadInput, match=r"route.idle_health_interval_s must be a number of "
                                       r"seconds > 0, got -1"):
        plan("route.idle_health_interval_s=-1")
    assert plan("route.urls=[http://127.0.0.1:1]").settings.idle_health_interval_s == 10.0
    with pytest.raises(BadInput, match="testbed.route sees a replica's work only as it streams"):
        plan("route.urls=[http://127.0.0.1:1]", "router.load_seen=progress")
    with pytest.raises(BadInput, match="router.load_seen must be one of progress, stream"):
        plan("route.urls=[http://127.0.0.1:1]", "router.load_seen=prefill")
    assert plan("route.urls=[http://127.0.0.1:1]", "router.load_seen=stream").replicas == 1
    assert replica_overrides(["model=tiny", "router=kv_events", "route.port=9", "replicas=3",
                              "router.cache_threshold=0.2", "cache.capacity_tokens=9"]) == \
        ["model=tiny", "cache.capacity_tokens=9"]


@pytest.mark.parametrize("name", ["round_robin", "cache_aware"])
def test_the_router_fronts_any_openai_server(name, tmp_path):
    """Servers that are not testbed.serve (no epoch, no cache events): vLLM's stand-in."""
    from tests.openai_stub import MODEL, StubServer

    stubs = [StubServer().start() for _ in range(2)]
    router = start_router([s.url for s in stubs], [f"router={name}"])
    try:
        rows = served_workload(router.url, tmp_path / "run", [
            *FEW_SHOT, f"server.model={MODEL}"])
        assert not any(r["failed"] for r in rows)
        state = router.state()
        assert [r["up"] for r in state["replicas"]] == [True, True]
        assert sorted(set(state["routed"])) == [0, 1] if name == "round_robin" else \
            state["decisions"].get("cache", 0) > 0
        assert all(b.get("return_token_ids") for s in stubs for b in s.received)
        # the router reads each replica's stream to its end, so its connections are reused:
        # one for the calls, one more where a health check met a call in flight
        assert len(rows) == sum(len(s.peers) for s in stubs) == 12
        assert all(len(set(s.peers)) <= 2 for s in stubs), [s.peers for s in stubs]
    finally:
        router.stop()
        for s in stubs:
            s.stop()


def test_a_broken_event_stream_is_re_read_not_trusted():
    handle = start_server([*TINY, "cache.capacity_tokens=200"])
    router = start_router([handle.url], ["router=kv_events", "route.events_wait_s=0.1"])
    try:
        for i in range(4):
            r = httpx.post(router.url + "/v1/completions", json={
                "prompt": list(range(1, 30 + i)), "max_tokens": 3}, timeout=60)
            assert r.status_code == 200
        events = lambda: router.state()["events"]  # noqa: E731
        wait_until(lambda: events()["seq"] == [handle.engine.events.seq])
        resyncs = events()["resyncs"]
        handle.engine.events.epoch = "another"  # as after a restart: the next poll gets 409
        wait_until(lambda: events()["resyncs"] > resyncs and events()["synced"] == [True])
        index = router.app.state.proxy.router.index
        held = handle.engine.inspect(lambda e: sequence_set(cached_sequences(e.scheduler.cache)))
        assert index.epoch == ["another"] and index.tree.sequences(0) == held
        assert events()["breaks"] >= 1
    finally:
        router.stop()
        handle.stop()


def test_the_health_watch_asks_only_replicas_not_heard_from_within_its_interval():
    from testbed.gateway.replicas import Replica, Replicas

    asked: list[str] = []

    async def get(url: str, timeout_s: float) -> tuple[int, bytes]:  # /health: 200, an epoch
        asked.append(url.removesuffix("/health"))
        return 200, b'{"status": "ok", "epoch": "e"}'

    members = [Replica(i, f"http://r{i}") for i in range(3)]
    router = ROUTERS.resolve({"name": "round_robin"}).build(seed=0, max_tree_size=None)
    router.bind(3)
    replicas = Replicas(members, router, get, health_interval_s=0.25, health_timeout_s=1.0)

    async def one_round() -> list[str]:
        asked.clear()
        for r in replicas.unheard(time.monotonic()):
            await replicas.probe(r)
        return sorted(asked)

    assert asyncio.run(one_round()) == ["http://r0", "http://r1", "http://r2"]  # all out: asked
    assert all(r.up for r in members)
    now = time.monotonic()
    assert replicas.unheard(now) == []  # a good answer is a sign of life too
    members[0].seen = now  # streamed a line just now
    members[1].seen = members[2].seen = now - 0.3  # last heard from before the interval
    assert [r.index for r in replicas.unheard(now)] == [1, 2]
    assert asyncio.run(one_round()) == ["http://r1", "http://r2"]
    members[0].up = False  # out of rotation: asked whatever it streamed
    assert [r.index for r in replicas.unheard(now)] == [0]
    assert [r.health_checks for r in members] == [1, 2, 2]


def test_an_idle_replica_held_open_is_asked_only_every_idle_interval():
    from testbed.gateway.replicas import Replica, Replicas

    async def get(url: str, timeout_s: float) -> tuple[int, bytes]:
        return 200, b"{}"

    members = [Replica(i, f"http://r{i}", up=True) for i in range(4)]
    router = ROUTERS.resolve({"name": "round_robin"}).build(seed=0, max_tree_size=None)
    router.bind(4)
    replicas = Replicas(members, router, get, health_interval_s=0.25, health_timeout_s=1.0,
                        idle_health_interval_s=10.0)
    now = time.monotonic()
    for r in members:
        r.seen = now - 1.0  # silent for a second
    members[0].held = True  # idle, its connection held open: not asked
    members[1].held, members[1].requests = True, 2  # held, but silent with calls out: a stall?
    members[3].requests = 1  # not held, busy and silent
    assert [r.index for r in replicas.unheard(now)] == [1, 2, 3]
    members[0].seen = now - 10.0  # idle and held, unheard for the idle interval: asked
    assert [r.index for r in replicas.unheard(now)] == [0, 1, 2, 3]


def test_a_held_connection_closed_by_the_replica_makes_the_router_ask_at_once():
    # A plain TCP server stands for the replica's socket; the health checks are answered by a
    # stub: 200 while the replica lives, a refused connection once it is gone.
    import aiohttp

    from testbed.gateway.replicas import Replica, Replicas

    asked: list[float] = []
    alive = [True]

    async def get(url: str, timeout_s: float) -> tuple[int, bytes]:
        asked.append(time.monotonic())
        if not alive[0]:
            raise aiohttp.ClientConnectionError("refused")
        return 200, b'{"status": "ok", "epoch": "e"}'

    async def until(condition, timeout_s: float = 5.0) -> float:
        t0 = time.monotonic()
        while not condition():
            assert time.monotonic() - t0 < timeout_s
            await asyncio.sleep(0.002)
        return time.monotonic() - t0

    async def scenario() -> None:
        conns: list[asyncio.StreamWriter] = []
        server = await asyncio.start_server(lambda r, w: conns.append(w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        replica = Replica(0, f"http://127.0.0.1:{port}", up=True, epoch="e")
        router = ROUTERS.resolve({"name": "round_robin"}).build(seed=0, max_tree_size=None)
        router.bind(1)
        replicas = Replicas([replica], router, get, health_interval_s=0.05,
                            health_timeout_s=1.0, idle_health_interval_s=60.0)
        hold = asyncio.create_task(replicas.hold(replica))
        try:
            await until(lambda: replica.held and len(conns) == 1)
            assert asked == [] and replica.holds == 1
            conns[0].close()  # a server closing an idle connection: asked at once, still up
            await until(lambda: len(asked) == 1, 1.0)
            assert replica.up
            await until(lambda: replica.held and len(conns) == 2)  # held again
            alive[0] = False  # the process exits: its sockets close with it
            server.close()
            conns[1].close()
            took = await until(lambda: not replica.up, 1.0)
            assert took < 1.0 and "refused" in replica.last_error and len(asked) == 2
            assert not replica.held and replica.holds == 2
        finally:
            hold.cancel()
            await asyncio.gather(hold, return_exceptions=True)
            server.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_idle_replica_killed_leaves_the_rotation_within_a_second_without_health_rounds():
    # The watch's rounds every 30 s cannot see it: the connection the router holds open does.
    handle = start_server([*TINY, "cache.capacity_tokens=2000"], in_process=False)
    router = start_router([handle.url], ["router=round_robin", "route.health_interval_s=30",
                                         "route.idle_health_interval_s=30"])
    try:
        wait_until(lambda: router.state()["replicas"][0]["held"])
        checks = router.state()["replicas"][0]["health_checks"]
        os.kill(handle._proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_until(lambda: not router.state()["replicas"][0]["up"], 5.0)
        assert time.monotonic() - t0 < 1.0
        state = router.state()["replicas"][0]
        assert state["health_checks"] == checks + 1 and not state["held"]
    finally:
        router.stop()
        handle.stop()


def test_a_replica_streaming_through_the_router_is_not_asked_for_its_health(replicas):
    # Two replicas (600 tokens of KV each), one of them streaming a long answer (0.8 s here):
    # the router's watch (every 0.05 s) keeps asking the idle one and stops asking the one it
    # hears from (`Replica.health_checks`).
    # (the idle one at the same interval: held open, it would be asked only every 10 s)
    router = start_router([h.url for h in replicas], ["router=round_robin",
                                                      "route.health_interval_s=0.05",
                                                      "route.idle_health_interval_s=0.05"])
    body = {"prompt": list(range(1, 20)), "max_tokens": 560, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    try:
        assert [r["up"] for r in router.state()["replicas"]] == [True, True]
        out: dict = {}

        async def stream_and_count() -> list[int]:
            task = asyncio.create_task(_stream(router.url, body, out))
            while not out.get("tokens"):
                await asyncio.sleep(0.005)
            before = [r["health_checks"] for r in router.state()["replicas"]]
            await task
            return [r["health_checks"] - b for r, b in zip(router.state()["replicas"], before)]

        asked = asyncio.run(asyncio.wait_for(stream_and_count(), 120))
        assert out["error"] is None and out["tokens"] == 560
        busy = 0 if router.state()["replicas"][0]["routed"] == 1 else 1
        # (a pause of more than 0.05 s between two lines of the stream earns the busy one a
        # check: a loaded machine may make a few)
        assert asked[1 - busy] >= 3 and 3 * asked[busy] <= asked[1 - busy], asked
    finally:
        router.stop()
