"""The hierarchical (GPU / host / disk) radix cache: write policies on hand-built sequences, where
every token's KV is (checked by replaying the transfer log on shadow memories), locks, equivalence
with the plain radix cache, replay records, and load-back in the simulator."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from testbed.cache.radix import RadixCache
from testbed.cache.tiers import TieredRadixCache, make_tiered_cache
from testbed.results.metrics import add_tier_fields, ideal_hit_rate, summarize
from testbed.backends.replay import replay
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.sim.executor import StepOutcome, predetermined_tokens
from testbed.serving.serve import records_of, serve
from testbed.sim.specs import hardware_spec, model_spec
from testbed.sim.transfer import LINKS, LoadPlanner, make_planner, tier_link
from testbed.workloads.request import Request
from tests.conftest import toks


def req(i, prompt, output=()):
    return Request(str(i), toks(*prompt), toks(*output))


def serve_one(cache, i, prompt, output=()):
    (record,) = replay([req(i, prompt, output)], cache)
    cache.check_invariants()
    return record


def node_of(cache, *ids):
    """The node holding exactly ``ids`` as its path (found without touching anything)."""
    node, at, key = cache.root, 0, list(ids)
    while at < len(key):
        node = next(c for c in node.children.values() if c.key[0] == key[at])
        at += len(node.key)
    assert at == len(key), f"no node ends at {ids}"
    return node


def where(cache, *ids):
    return cache.tiers_of(node_of(cache, *ids))


# ---------------------------------------------------------------------------- write policies
def test_write_back_demotes_on_eviction_loads_back_on_a_hit_and_drops_when_the_host_is_full():
    cache = TieredRadixCache(6, host_tokens=8, write_policy="write_back")
    serve_one(cache, 0, [1, 2, 3, 4])
    assert where(cache, 1, 2, 3, 4) == ["gpu"] and cache.written[1] == 0  # no copy until evicted
    rec = serve_one(cache, 1, [5, 6, 7, 8])
    assert rec.evicted_tokens == 4 and where(cache, 1, 2, 3, 4) == ["host"]
    rec = serve_one(cache, 2, [1, 2, 3, 4, 9])  # the host copy is loaded back: no recompute
    assert (rec.cached_tokens, rec.gpu_hit_tokens, rec.host_hit_tokens) == (4, 0, 4)
    assert where(cache, 1, 2, 3, 4) == ["gpu", "host"] and where(cache, 5, 6, 7, 8) == ["host"]
    # [5..8] loads while locked, so the host (full: [1..4] backs a GPU node, [5..8] is locked)
    # cannot take the leaf [9]: it is dropped; [1..4] then leaves the GPU, its host copy stays.
    rec = serve_one(cache, 3, [5, 6, 7, 8])
    assert (rec.cached_tokens, rec.host_hit_tokens) == (4, 4)
    assert where(cache, 1, 2, 3, 4) == ["host"] and where(cache, 5, 6, 7, 8) == ["gpu", "host"]
    assert cache.dropped == 1 and len(node_of(cache, 1, 2, 3, 4).children) == 0
    assert cache.loaded[1] == 8


def test_write_through_copies_at_insert_so_eviction_only_frees_the_gpu():
    cache = TieredRadixCache(6, host_tokens=8, write_policy="write_through")
    serve_one(cache, 0, [1, 2, 3, 4])
    assert where(cache, 1, 2, 3, 4) == ["gpu", "host"] and cache.written[1] == 4
    serve_one(cache, 1, [5, 6, 7, 8])
    assert where(cache, 1, 2, 3, 4) == ["host"] and cache.written[1] == 8  # no write on eviction
    serve_one(cache, 2, [9, 10, 11, 12])  # its backup needs host room: the LRU host node goes
    assert cache.dropped == 4 and cache.match(toks(1, 2, 3, 4)) == 0
    assert where(cache, 5, 6, 7, 8) == ["host"] and where(cache, 9, 10, 11, 12) == ["gpu", "host"]
    rec = serve_one(cache, 3, [5, 6, 7, 8, 13])
    assert (rec.cached_tokens, rec.host_hit_tokens) == (4, 4)


def test_write_through_selective_copies_after_n_hits_and_drops_what_was_never_copied():
    cache = TieredRadixCache(6, host_tokens=8, write_policy="write_through_selective",
                             write_threshold=1)
    serve_one(cache, 0, [1, 2, 3, 4])
    assert where(cache, 1, 2, 3, 4) == ["gpu"]
    serve_one(cache, 1, [1, 2, 3, 4, 5])  # the first hit reaches the threshold
    assert where(cache, 1, 2, 3, 4) == ["gpu", "host"] and where(cache, 1, 2, 3, 4, 5) == ["gpu"]
    serve_one(cache, 2, [6, 7, 8, 9])
    assert cache.dropped == 1 and where(cache, 1, 2, 3, 4) == ["host"]  # [5] had no copy
    rec = serve_one(cache, 3, [1, 2, 3, 4, 5])
    assert (rec.cached_tokens, rec.host_hit_tokens) == (4, 4)


def test_a_disk_tier_takes_what_the_host_evicts_and_loads_back_from_disk():
    cache = TieredRadixCache(4, host_tokens=4, disk_tokens=8, write_policy="write_back")
    for i, seq in enumerate(([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])):
        serve_one(cache, i, seq)
    assert (where(cache, 1, 2, 3, 4), where(cache, 5, 6, 7, 8), where(cache, 9, 10, 11, 12)) == \
        (["disk"], ["host"], ["gpu"])
    rec = serve_one(cache, 3, [1, 2, 3, 4])
    assert (rec.cached_tokens, rec.gpu_hit_tokens, rec.disk_hit_tokens) == (4, 0, 4)
    assert (where(cache, 1, 2, 3, 4), where(cache, 5, 6, 7, 8), where(cache, 9, 10, 11, 12)) == \
        (["gpu", "disk"], ["disk"], ["host"])
    assert cache.tier_summary()["loaded_tokens_disk"] == 4 and cache.dropped == 0


def test_a_node_that_no_tier_can_keep_leaves_with_its_subtree():
    cache = TieredRadixCache(6, host_tokens=3, write_policy="write_back")
    serve_one(cache, 0, [1, 2, 3, 4, 5])
    serve_one(cache, 1, [1, 2, 3, 4, 5, 6])
    # [6] goes to the host; [1..5] (5 tokens) cannot: dropped, taking [6] along.
    rec = serve_one(cache, 2, [7, 8])
    assert rec.evicted_tokens == 6 and cache.dropped == 6
    assert [n.key.tolist() for n in cache.nodes()] == [[7, 8]]
    assert cache.tiers[1].pool.num_free == 3


def test_a_split_node_splits_its_copies():
    cache = TieredRadixCache(4, host_tokens=8, write_policy="write_back")
    serve_one(cache, 0, [1, 2, 3, 4])
    serve_one(cache, 1, [5, 6, 7, 8])
    assert cache.match(toks(1, 2, 9)) == 2  # a match inside the host-only node splits it
    assert where(cache, 1, 2) == ["host"] and where(cache, 1, 2, 3, 4) == ["host"]
    cache.check_invariants()


# ---------------------------------------------------------------------------- locks and loads
def test_a_locked_lower_node_keeps_its_copy_under_pressure_and_then_loads():
    cache = TieredRadixCache(6, host_tokens=4, write_policy="write_back")
    serve_one(cache, 0, [1, 2, 3, 4])
    serve_one(cache, 1, [5, 6, 7, 8])  # [1..4] on the host, [5..8] on the GPU
    lease = cache.acquire(toks(1, 2, 3, 4, 9))
    assert (lease.hit, lease.lower) == (0, 4)
    # Another request pushes [5..8] out of the GPU: the host is full of the locked [1..4], so
    # [5..8] is dropped rather than the locked node.
    other = cache.acquire(toks(20, 21, 22))
    assert cache.extend(other, 3) == 4 and cache.dropped == 4
    cache.check_invariants([lease, other])
    assert where(cache, 1, 2, 3, 4) == ["host"]
    cache.release(other, toks(20, 21, 22))  # cached on the GPU; the load evicts (drops) it
    assert cache.load_back(lease) == 3 and (lease.hit, lease.cached, lease.lower) == (4, 4, 0)
    assert lease.loaded == {"host": 4} and cache.dropped == 7
    cache.check_invariants([lease])
    assert cache.extend(lease, 1) == 0
    cache.release(lease, toks(1, 2, 3, 4, 9))
    cache.check_invariants()
    assert cache.protected_size == 0 and where(cache, 1, 2, 3, 4) == ["gpu", "host"]


class Never:
    """A planner that always prefers recomputing."""

    def worth_loading(self, start, loaded):
        return False


def test_a_run_recomputed_instead_of_loaded_is_adopted_by_its_lower_nodes():
    cache = TieredRadixCache(6, host_tokens=8, write_policy="write_back", planner=Never())
    serve_one(cache, 0, [1, 2, 3, 4])
    serve_one(cache, 1, [5, 6, 7, 8])
    rec = serve_one(cache, 2, [1, 2, 3, 4, 9])
    assert (rec.cached_tokens, rec.host_hit_tokens) == (0, 0)  # recomputed
    assert where(cache, 1, 2, 3, 4) == ["gpu", "host"]  # the fresh KV was adopted, no duplicate
    assert cache.loaded[1] == 0


# ---------------------------------------------------------------------------- the data path
class Shadow:
    """Memories of every tier, slot -> the token path whose KV it holds, moved by the cache's
    transfer log exactly as the engine moves real KV."""

    def __init__(self, cache: TieredRadixCache) -> None:
        self.cache = cache
        self.mem: list[dict[int, tuple]] = [{} for _ in range(cache.ntiers)]

    def sync(self) -> None:
        for t in self.cache.drain_transfers():
            values = [self.mem[t.src][int(s)] for s in t.src_slots]
            self.mem[t.dst].update(zip(t.dst_slots.tolist(), values))

    def check_tree(self) -> None:
        for node in self.cache.nodes():
            path, x = [], node
            while x is not self.cache.root:
                path[:0] = x.key.tolist()
                x = x.parent
            want = [tuple(path[: node.start + j + 1]) for j in range(len(node.key))]
            held = [(0, node.slots)] if len(node.slots) else []
            held += [(t, c) for t, c in enumerate(node.tier.copies) if c is not None]
            for t, slots in held:
                assert [self.mem[t].get(int(s)) for s in slots] == want, \
                    f"tier {t} does not hold the KV of {node!r}"


CONFIGS = [dict(host_tokens=12), dict(disk_tokens=12), dict(host_tokens=6, disk_tokens=20),
           dict(host_tokens=30, disk_tokens=4)]


@pytest.mark.parametrize("policy, tiers, page", [
    (p, t, pg) for p, t, pg in itertools.product(
        ("write_through", "write_through_selective", "write_back"), CONFIGS, (1, 2))])
def test_every_tokens_kv_is_where_the_tree_says_under_random_requests(policy, tiers, page):
    rng = np.random.default_rng(zlib.crc32(repr((policy, page, tiers)).encode()))
    cache = TieredRadixCache(16, page_size=page, write_policy=policy, write_threshold=1,
                             record_transfers=True, **tiers)
    shadow = Shadow(cache)
    for i in range(250):
        seq = rng.integers(0, 3, rng.integers(1, 14)).astype(np.int32)
        prompt_len = int(rng.integers(1, len(seq) + 1))
        lease = cache.acquire(seq[:prompt_len])
        if lease.lower:
            cache.load_back(lease)
        assert cache.extend(lease, len(seq) - lease.hit) is not None
        cache.check_invariants([lease])
        shadow.sync()  # the copies land before the step that reads them
        slots = lease.slots
        assert [shadow.mem[0].get(int(s)) for s in slots[: lease.hit]] == \
            [tuple(seq[: j + 1].tolist()) for j in range(lease.hit)], "a hit reads wrong KV"
        shadow.mem[0].update((int(s), tuple(seq[: j + 1].tolist()))
                             for j, s in enumerate(slots) if j >= lease.hit)  # computed now
        cache.release(lease, seq)
        shadow.sync()
        cache.check_invariants()
        shadow.check_tree()
    assert cache.protected_size == 0


# ---------------------------------------------------------------------------- against RadixCache
def random_requests(seed: int, n: int = 300) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(str(i), rng.integers(0, 3, rng.integers(1, 14)).astype(np.int32),
                    rng.integers(0, 3, rng.integers(0, 4)).astype(np.int32)) for i in range(n)]


@pytest.mark.parametrize("page", [1, 2])
def test_a_tier_that_never_receives_anything_leaves_the_radix_cache_exactly_as_it_was(page):
    requests = random_requests(page)
    want = replay(requests, RadixCache(20, page_size=page))
    cache = TieredRadixCache(20, page_size=page, host_tokens=50,
                             write_policy="write_through_selective", write_threshold=10**9)
    got = replay(requests, cache)
    assert [(r.cached_tokens, r.evicted_tokens, r.inserted) for r in got] == \
        [(r.cached_tokens, r.evicted_tokens, r.inserted) for r in want]
    assert cache.written == [0, 0]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_lower_tier_that_never_fills_reaches_the_ideal_hit_rate(policy):
    requests = random_requests(3)
    records = replay(requests, TieredRadixCache(16, host_tokens=10_000, write_policy=policy))
    hit = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    assert hit == pytest.approx(ideal_hit_rate(requests), abs=1e-12)
    assert all(r.gpu_hit_tokens + r.host_hit_tokens == r.cached_tokens for r in records)


def test_replay_records_and_summary_split_the_hit_rate_by_tier():
    requests = random_requests(4)
    tiered = replay(requests, TieredRadixCache(16, host_tokens=20, disk_tokens=40))
    s = summarize(tiered, ideal=0.5, wall_s=0.0)
    assert s["hit_rate"] == pytest.approx(s["hit_rate_gpu"] + s["hit_rate_host"] + s["hit_rate_disk"])
    assert s["hit_rate_host"] > 0 and s["hit_rate_disk"] > 0
    assert {"gpu_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "load_s"} <= set(tiered[0].to_json())
    plain = replay(requests, RadixCache(16))
    assert "gpu_hit_tokens" not in plain[0].to_json()
    assert not any(k.startswith("hit_rate_") for k in summarize(plain, ideal=0.5, wall_s=0.0))


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="cache.write_policy"):
        TieredRadixCache(10, host_tokens=10, write_policy="write_around")
    with pytest.raises(ValueError, match="cache.host_tokens"):
        TieredRadixCache(10, host_tokens=-1)
    with pytest.raises(ValueError, match="cache.host_eviction"):
        make_tiered_cache({"name": "radix", "host_tokens": 5, "host_eviction": "nope"}, 10)
    with pytest.raises(ValueError, match="need cache=radix"):
        make_tiered_cache({"name": "block_hash", "host_tokens": 5}, 10)
    assert make_tiered_cache({"name": "radix", "host_tokens": 0, "disk_tokens": 0}, 10) is None
    with pytest.raises(ValueError, match="cache.host_link"):
        tier_link("pcie9", "cache.host_link")


def test_planner_from_config_uses_the_hardwares_pcie_and_loads_long_runs_from_host():
    def spec(group, name):
        return yaml.safe_load((Path(__file__).parents[1] / "conf" / group / f"{name}.yaml").read_text())

    model = model_spec(spec("model", "llama3_8b"))
    h100, a100 = hardware_spec(spec("hardware", "h100")), hardware_spec(spec("hardware", "a100"))
    cfg = {"host_tokens": 10, "disk_tokens": 10}
    assert make_planner(cfg, model, h100).pcie.name == "pcie5"
    assert make_planner(cfg, model, a100).pcie.name == "pcie4"
    p = make_planner(cfg, model, h100)
    assert p.worth_loading(0, {"host": 4096}) and p.worth_loading(4096, {"disk": 4096})
    assert not p.worth_loading(0, {"disk": 1})  # an SSD read's latency beats one token's prefill
    assert make_planner(cfg | {"load_back": "always"}, model, h100).worth_loading(0, {"disk": 1})
    with pytest.raises(ValueError, match="cache.load_back"):
        make_planner(cfg | {"load_back": "never"}, model, h100)


# ---------------------------------------------------------------------------- the simulator
class FixedTime:
    def execute(self, batch):
        return StepOutcome(duration_s=0.01, tokens=predetermined_tokens(batch))


def planner(kv_bytes: int, recompute_per_token_s: float = 2.0) -> LoadPlanner:
    """Host loads at 1 token/s after 0.5 s (so waits are easy to read); recompute at the rate given."""
    slow = tier_link("pcie4", "x", {"read_bw": float(kv_bytes), "latency_s": 0.5})
    return LoadPlanner(kv_bytes, slow, LINKS["nvme_pcie4"],
                       lambda start, size: size * recompute_per_token_s)


def three_requests():
    return [Request("a", toks(*range(1, 9)), toks(100), arrival_s=0.0),
            Request("b", toks(*range(20, 28)), toks(101), arrival_s=1.0),
            Request("c", toks(*range(1, 9), 50), toks(102), arrival_s=2.0)]


def test_the_simulator_waits_for_a_load_on_the_copy_engine_before_prefilling():
    cache = TieredRadixCache(10, host_tokens=20, write_policy="write_back", planner=planner(1))
    scheduler, result = serve(three_requests(), cache, {"name": "fcfs"}, FixedTime())
    records = records_of(result.reqs)
    add_tier_fields(records, scheduler.tier_hits)
    c = records[2]
    assert (c.cached_tokens, c.host_hit_tokens) == (8, 8)
    assert c.load_s == pytest.approx(0.5 + 8.0)  # latency + 8 tokens at 1 token/s
    assert c.first_token_s == pytest.approx(2.0 + 8.5 + 0.01)  # then one prefill step
    s = summarize(records, ideal=0.0, wall_s=0.0)
    assert s["loads"] == 1 and s["load_s_total"] == pytest.approx(8.5)
    cache.check_invariants()
    assert cache.protected_size == 0 and not scheduler.has_work


def test_a_run_cheaper_to_recompute_is_not_loaded():
    cache = TieredRadixCache(10, host_tokens=20, write_policy="write_back",
                             planner=planner(1, recompute_per_token_s=0.01))
    scheduler, result = serve(three_requests(), cache, {"name": "fcfs"}, FixedTime())
    c = result.reqs[2]
    assert c.cached_tokens == 0 and c.first_token_s == pytest.approx(2.01)
    assert cache.loaded[1] == 0 and scheduler.tier_hits["c"] == (0, None, None)


def drive(s: Scheduler) -> None:
    """Run to completion with instantaneous copies, checking invariants at every step."""
    steps = 0
    while s.has_work:
        batch = s.next_batch()
        for r in s.take_loads():
            s.cache.check_invariants(s.leases())
            s.load_done(r, 0.0)
        if batch is None:
            continue
        s.cache.check_invariants(s.leases())
        s.complete(batch, predetermined_tokens(batch), now=float(steps))
        steps += 1
        assert steps < 5000


@pytest.mark.parametrize("policy, chunk", [("write_back", None), ("write_through", 5),
                                           ("write_through_selective", None)])
def test_scheduler_with_tiers_keeps_invariants_and_finishes_everything_under_pressure(policy, chunk):
    cache = TieredRadixCache(40, host_tokens=30, disk_tokens=60, write_policy=policy,
                             write_threshold=1)
    s = Scheduler(cache, SchedulerConfig(name="lpm", init_new_token_ratio=0.0,
                                         min_new_token_ratio_factor=0.0,
                                         chunked_prefill_size=chunk))
    rng = np.random.default_rng(5)
    stems = [rng.integers(0, 50, 12).astype(np.int32) for _ in range(8)]
    reqs = []
    for wave in range(3):  # the stems outgrow the GPU: later waves load them back
        reqs += [s.submit(Request(f"r{len(reqs) + i}", np.append(stem, 200 + len(reqs) + i),
                                  np.full(6, 300 + len(reqs) + i, dtype=np.int32)), 0.0)
                 for i, stem in enumerate(stems)]
        drive(s)
    assert all(r.finished and r.output == [300 + i] * 6 for i, r in enumerate(reqs))
    cache.check_invariants()
    assert cache.protected_size == 0 and cache.loaded[1] + cache.loaded[2] > 0
    assert sum(s.tier_hits[r.id][0] for r in reqs[8:]) > 0


# ---------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_engine_with_a_host_tier_still_generates_what_hf_generates_under_eviction(policy):
    """KV demoted to CPU tensors and copied back must be the KV the model computed: greedy outputs
    equal HF generate (fp32, CPU) while the GPU tier is too small to keep the shared prefixes."""
    pytest.importorskip("transformers")
    import torch

    from testbed.engine.executor import EngineExecutor
    from testbed.engine.host_kv import TieredEngineExecutor
    from testbed.engine.runner import ModelRunner
    from tests.test_engine_model import hf_greedy, hf_model, ours_from, prompts_sharing_prefixes
    from testbed.engine.loader import tiny_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = hf_model(tiny_config())
        ours = ours_from(hf)
        prompts = prompts_sharing_prefixes()
        n, capacity = 6, 80
        # three waves: the shared prefixes leave the GPU between them and are loaded back
        requests = [Request(f"r{w}{i}", np.asarray(p, dtype=np.int32), np.zeros(n, np.int32),
                            arrival_s=100.0 * w) for w in range(3) for i, p in enumerate(prompts)]
        cache = TieredRadixCache(capacity, host_tokens=400, write_policy=policy,
                                 record_transfers=True)
        executor = TieredEngineExecutor(EngineExecutor(ModelRunner(ours, num_slots=capacity)),
                                        cache)
        _, result = serve(requests, cache, {"name": "lpm"}, executor, generate=True)
        want = {i: hf_greedy(hf, p, n) for i, p in enumerate(prompts)}
        for r in result.reqs:
            assert not r.aborted and r.output == want[int(r.id[-1])], f"request {r.id}"
        assert cache.loaded[1] > 0 and executor.copied_tokens > 0  # KV did come back from the host
        cache.check_invariants()
    finally:
        torch.set_num_threads(threads)
