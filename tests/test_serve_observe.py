"""What ``testbed.serve`` shows of itself besides answers: ``GET /metrics`` parses with
Prometheus' own text parser and its counters equal ``/debug/state``'s and the answers' usage;
``GET /kv_events`` numbers the cache's changes so that an index fed by them equals the cache
after a run with eviction, as does the snapshot; a reader from another epoch or too far behind
is told to re-read. The tiny random Llama on a free loopback port."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testbed.api.events_routes import leaf_paths
from testbed.api.server import start_server
from testbed.cache.events import CacheEvent, cached_sequences, sequence_set
from testbed.router import KvIndex

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["model=tiny", "device=cpu", "cache.capacity_tokens=160",
        "scheduler.chunked_prefill_size=32"]
rng = np.random.default_rng(59)
SYSTEM = rng.integers(0, 256, 24).tolist()


@pytest.fixture(scope="module")
def served():
    """A server that ran prompts sharing a prefix, more than its pool holds (evictions)."""
    handle = start_server(TINY)
    usages = []
    for i in range(12):
        prompt = SYSTEM + rng.integers(0, 256, 20 + i).tolist()
        r = httpx.post(handle.url + "/v1/completions",
                       json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    yield handle, usages
    handle.stop()


def families(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family, sample: str, **labels) -> float:
    return next(s.value for s in family.samples
                if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_parse_and_their_counters_equal_debug_state(served):
    handle, usages = served
    state = httpx.get(handle.url + "/debug/state", timeout=30).json()
    f = families(handle.url)
    counters = state["counters"]
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
                 "generation_tokens"):
        assert value(f[f"testbed:{name}"], f"testbed:{name}_total") == counters[name], name
    assert counters["prefix_cache_hits"] == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                for u in usages) > 0
    assert counters["prefix_cache_queries"] == sum(u["prompt_tokens"] for u in usages)
    assert value(f["testbed:request_success"], "testbed:request_success_total",
                 finished_reason="length") == counters["request_success"]["length"] == 12
    assert f["testbed:time_to_first_token_seconds"].type == "histogram"
    assert value(f["testbed:time_to_first_token_seconds"],
                 "testbed:time_to_first_token_seconds_count") == 12
    assert value(f["testbed:num_requests_running"], "testbed:num_requests_running",
                 model_name="tiny") == 0
    assert 0 <= value(f["testbed:kv_cache_usage_perc"], "testbed:kv_cache_usage_perc") <= 1


def test_events_rebuild_the_cache_exactly_after_evictions(served):
    handle, _ = served
    got = httpx.get(handle.url + "/kv_events", params={"since": 0, "wait_s": 0}, timeout=30)
    assert got.status_code == 200, got.text
    body = got.json()
    events = [CacheEvent.from_dict(e) for e in body["events"]]
    assert [e.seq for e in events] == list(range(1, body["seq"] + 1))
    assert any(e.kind == "removed" for e in events)  # the pool was too small to keep all
    index = KvIndex(1)
    assert index.apply(0, events)
    held = handle.engine.inspect(lambda e: sequence_set(cached_sequences(e.scheduler.cache)))
    assert index.tree.sequences(0) == held
    snap = httpx.get(handle.url + "/kv_events/snapshot", timeout=30).json()
    assert snap["seq"] == body["seq"] and snap["epoch"] == body["epoch"]
    assert sequence_set(leaf_paths(snap["nodes"])) == held
    health = httpx.get(handle.url + "/health", timeout=30).json()
    assert health["epoch"] == body["epoch"]


def test_a_reader_of_another_epoch_must_re_read(served):
    handle, _ = served
    r = httpx.get(handle.url + "/kv_events", params={"since": 0, "epoch": "other"}, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "resync"
    r = httpx.get(handle.url + "/kv_events", params={"since": 10**9}, timeout=30)
    assert r.status_code == 409
    r = httpx.get(handle.url + "/kv_events", params={"since": 0, "wait_s": 99}, timeout=30)
    assert r.status_code == 400 and "wait_s" in r.json()["error"]["message"]


def test_a_long_poll_answers_empty_when_nothing_happens(served):
    handle, _ = served
    seq = httpx.get(handle.url + "/kv_events/snapshot", timeout=30).json()["seq"]
    r = httpx.get(handle.url + "/kv_events", params={"since": seq, "wait_s": 0.05}, timeout=30)
    assert r.status_code == 200 and r.json()["events"] == []


def test_a_block_hash_server_publishes_no_events():
    handle = start_server(["model=tiny", "device=cpu", "cache=block_hash",
                           "cache.capacity_tokens=256"])
    try:
        r = httpx.get(handle.url + "/kv_events", timeout=30)
        assert r.status_code == 404 and "block_hash" in r.json()["error"]["message"]
        assert httpx.get(handle.url + "/health", timeout=30).json()["epoch"] is None
        assert "testbed:prefix_cache_hits_total" in httpx.get(handle.url + "/metrics").text
    finally:
        handle.stop()
