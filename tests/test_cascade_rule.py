"""Cascade's one rule (`testbed.scheduler.cascade_rule`): which shared tree nodes are read once,
decided the same way for the engine and the simulator; a node that does not pay is read in each
request's own pass; greedy tokens stay those of plain decoding."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import RadixCache
from testbed.cache.shared_prefix import shared_prefix_groups
from testbed.errors import BadInput
from testbed.scheduler.cascade_rule import (CascadeRule, plain_tiles, prefix_pass_tiles,
                                            sharing_pays)
from testbed.scheduler.decode_groups import DecodeGroups
from testbed.workloads.request import Request
from tests.cascade_helpers import decode_entries, leases_of

LLAMA2_H100 = CascadeRule(slots=132, kv_heads=32, gqa_group=1)  # Llama-2-7B: 32 KV heads, MHA
LLAMA3_H100 = CascadeRule(slots=132, kv_heads=8, gqa_group=4)  # Llama-3-8B: 8 KV heads, GQA 4


def test_vllm_thresholds_turn_cascade_off_below_256_shared_tokens_or_8_sharers():
    assert sharing_pays(8, 256, LLAMA2_H100) and sharing_pays(32, 2048, LLAMA2_H100)
    assert not sharing_pays(7, 2048, LLAMA2_H100)
    assert not sharing_pays(32, 255, LLAMA2_H100)


def test_the_prefix_pass_waves_against_the_members_reading_it_spread_over_the_device():
    """32 x 2,048 on Llama-2-7B: 1,024 programs (32 KV heads x 32 chunks) in 8 waves of one tile
    and a merge each, 16 tile-times, against 32 x 32 x 32 tiles over 132 SMs (248.2)."""
    assert prefix_pass_tiles(32, 2048, LLAMA2_H100) == 16
    assert plain_tiles(32, 2048, LLAMA2_H100) == pytest.approx(32 * 32 * 32 / 132)
    # Llama-3-8B's 8 KV heads read a fifth of the bytes: 8 sharers of 256 tokens fill 32 of 132
    # SMs for 2 tile-times where their own passes take 8 x 8 x 4 / 132 = 1.94; 512 tokens pay
    assert prefix_pass_tiles(8, 256, LLAMA3_H100) == 2
    assert plain_tiles(8, 256, LLAMA3_H100) == pytest.approx(256 / 132)
    assert not sharing_pays(8, 256, LLAMA3_H100)
    assert sharing_pays(8, 512, LLAMA3_H100)  # 2 against 3.88
    # a group wider than a program's 64 query rows runs in parts, each reading the prefix once:
    # 96 sharers x GQA 4 are 6 parts, 6 x 8 x 32 = 1,536 programs in 12 waves
    assert prefix_pass_tiles(96, 4096, LLAMA3_H100) == 12 * (2 + 1)


def test_without_a_grid_every_shared_node_pays_as_before():
    """The CPU (no SMs) and ``engine.cascade_rule=always``: every node two requests share."""
    cpu = CascadeRule.build("auto", None, num_heads=4, kv_heads=2)
    always = CascadeRule.build("always", 132, num_heads=32, kv_heads=32)
    for rule in (cpu, always, CascadeRule()):
        assert rule.every_node and rule.pays() is None
        assert sharing_pays(2, 1, rule) and not sharing_pays(1, 4096, rule)
    assert CascadeRule.build("auto", 132, num_heads=32, kv_heads=8) == LLAMA3_H100
    with pytest.raises(BadInput, match=r"^engine.cascade_rule must be one of auto, always; "
                                       r"got 'never'$"):
        CascadeRule.build("never", 132, 32, 8)


def toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def a_step_with_nodes_that_pay_and_nodes_that_do_not():
    """16 requests under a 1,024-token prompt X (8 of them under a further 512 tokens of Y) and 8
    under a 200-token prompt Z, each with 10 tokens of its own."""
    x, y, z = toks(10_000, 1024), toks(20_000, 512), toks(30_000, 200)
    prompts = [np.concatenate([x, y if i < 8 else toks(40_000 + 100 * i, 0), toks(i * 100, 10)])
               for i in range(16)] + [np.concatenate([z, toks(50_000 + 100 * i, 10)])
                                      for i in range(8)]
    return decode_entries(leases_of(prompts))


def test_a_node_that_does_not_pay_leaves_its_requests_to_its_children_or_their_own_pass():
    """The trio under q (40 tokens) does not pay where only pairs do: the pair under q+a (50)
    is grouped instead, and q+b+z reads q in its own pass."""
    q, a, b = toks(1000, 40), toks(2000, 10), toks(3000, 10)
    leases = leases_of([np.concatenate(p) for p in ([q, a, toks(4000, 5)], [q, a, toks(5000, 5)],
                                                    [q, b, toks(6000, 5)])])
    assert shared_prefix_groups(leases) == [(40, [0, 1, 2])]
    assert shared_prefix_groups(leases, pays=lambda sharers, shared: sharers < 3) == [(50, [0, 1])]
    assert shared_prefix_groups(leases, pays=lambda sharers, shared: False) == []


def test_decode_groups_form_only_where_sharing_pays_on_the_device():
    """Llama-2-7B on an H100: the 16 under X are grouped (their 8 under X+Y go with them: 15 x
    1,024 saved beats 7 x 1,536), the 8 under Z's 200 tokens are not (below 256); with
    ``always`` they are."""
    entries = a_step_with_nodes_that_pay_and_nodes_that_do_not()
    assert DecodeGroups(rule=LLAMA2_H100)(entries) == [(1024, list(range(16)))]
    assert DecodeGroups()(entries) == [(1024, list(range(16))), (200, list(range(16, 24)))]


def test_engine_and_simulator_form_the_same_groups_from_the_same_batch(compose, monkeypatch):
    """The run's scheduler groups (`Assembly.decode_groups`) and each executor's own, for the
    simulator on an H200 preset and the engine on a device of as many SMs, are the same
    groups of one step: one rule, one call."""
    from testbed.config.assembly import assemble
    from testbed.engine import cascade

    monkeypatch.setattr(cascade, "device_slots", lambda device: 132)  # the engine's GPU
    entries = a_step_with_nodes_that_pay_and_nodes_that_do_not()
    found = {}
    for backend in ("sim", "engine"):
        run = assemble(compose(f"backend={backend}", "model=tiny", "hardware=h200",
                               "engine.device=cpu", "engine.attention=cascade"))
        executor = run.build_executor(30_000)
        own = executor.groups if backend == "sim" else executor.runner.decode_groups
        assert run.cascade_rule == own.rule == CascadeRule(slots=132, kv_heads=2, gqa_group=2)
        found[backend] = run.decode_groups()(entries)
        assert own(entries) == found[backend]
    # the tiny model's 2 KV heads read little: 16 x 1,024 pays (2 tile-times against 3.9), the
    # 8 under X+Y alone would not, the 8 under Z (200 tokens) would not
    assert found["sim"] == found["engine"] == [(1024, list(range(16)))]


def test_engine_greedy_tokens_with_the_rule_equal_plain_decoding():
    """Generated greedily on the engine (tiny random model, CPU): cascade under a rule where the
    trio sharing a 40-token prompt pays and the pair sharing 12 tokens does not gives plain
    decoding's tokens, and only the trio is ever grouped."""
    from testbed.engine.executor import EngineExecutor
    from testbed.engine.loader import build_model, tiny_config
    from testbed.engine.runner import ModelRunner
    from testbed.serving.serve import serve

    rng = np.random.default_rng(3)
    system, short = rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 12).tolist()
    prompts = [system + rng.integers(0, 256, 9).tolist(), short + rng.integers(0, 256, 7).tolist(),
               system + rng.integers(0, 256, 5).tolist(), short + rng.integers(0, 256, 3).tolist(),
               system + rng.integers(0, 256, 14).tolist()]
    model = build_model(tiny_config(), seed=0)
    # one slot: the trio's prefix pass (2 programs of one tile, each merged: 4 tile-times) beats
    # its 3 x 2 tiles; pairs fall below min_sharers
    rule = CascadeRule(slots=1, kv_heads=2, gqa_group=2, min_shared=8, min_sharers=3)
    outputs, seen = {}, []
    for attention in ("torch", "cascade_torch"):
        requests = [Request(f"r{i}", np.asarray(p, dtype=np.int32), np.zeros(6, dtype=np.int32))
                    for i, p in enumerate(prompts)]
        runner = ModelRunner(model, 400, attention=attention, cascade_rule=rule)
        groups = DecodeGroups(rule=rule)
        record = lambda entries: seen.append(groups(entries)) or seen[-1]  # noqa: E731
        runner.decode_groups = record
        _, result = serve(requests, RadixCache(400), {"name": "lpm"}, EngineExecutor(runner),
                          generate=True)
        outputs[attention] = [r.output for r in result.reqs]
    assert outputs["cascade_torch"] == outputs["torch"]
    formed = [g for step in seen for g in step]
    assert formed and all(len(members) == 3 and shared >= 40 for shared, members in formed)
