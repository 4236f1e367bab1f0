"""Cascade decoding: groups from the radix tree, the merged attention equals plain decode (torch
and Triton, fp32), and the engine's greedy tokens with it equal HF generate."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from testbed.cache import RadixCache
from testbed.cache.shared_prefix import shared_prefix_groups
from testbed.engine import attention as attention_module
from testbed.engine.attention import make_attention
from testbed.engine.cascade import CascadePlan
from testbed.engine.cpu_attention import load_kernel
from testbed.engine.metadata import AttentionMetadata, to_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def toks(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def leases_on_a_tree(a_len: int):
    """Sequences q+a+x, q+a+y, q+b+z (q: 40 tokens) and r+w, cached, then a lease on each."""
    cache = RadixCache(2000)
    q, a, b = toks(1000, 40), toks(2000, a_len), toks(3000, 10)
    seqs = [np.concatenate(p) for p in ([q, a, toks(4000, 5)], [q, a, toks(5000, 5)],
                                        [q, b, toks(6000, 5)], [toks(7000, 30), toks(8000, 5)])]
    for s in seqs:
        lease = cache.acquire(s)
        cache.extend(lease, len(s) - lease.hit)
        cache.release(lease, s)
    return cache, [cache.acquire(s) for s in seqs]


def test_groups_save_the_most_reads_the_tree_allows():
    """Three requests under a 40-token prompt: one group there saves 2 x 40 reads; with a longer
    shared branch (a of 100 tokens) the pair under it saves 1 x 140 more than the trio would."""
    _, leases = leases_on_a_tree(a_len=10)
    assert shared_prefix_groups(leases) == [(40, [0, 1, 2])]
    assert shared_prefix_groups(leases, min_tokens=41) == [(50, [0, 1])]
    _, leases = leases_on_a_tree(a_len=100)
    assert shared_prefix_groups(leases) == [(140, [0, 1])]
    assert shared_prefix_groups([leases[0], None, leases[3]]) == []  # nothing shared
    assert shared_prefix_groups([leases[3], leases[3]]) == [(35, [0, 1])]


def grouped_decode_step(seed: int, groups, kv_lens, heads=4, kv_heads=2, dim=16, slots=400):
    """A decode step whose grouped requests' first ``P`` slots coincide; random q, k, v."""
    rng = np.random.default_rng(seed)
    free = list(rng.permutation(np.arange(1, slots + 1)))
    per_request = [None] * len(kv_lens)
    for shared, members in groups:
        prefix = [free.pop() for _ in range(shared)]
        for m in members:
            per_request[m] = prefix + [free.pop() for _ in range(kv_lens[m] - shared)]
    per_request = [p or [free.pop() for _ in range(n)] for p, n in zip(per_request, kv_lens)]
    kv_indices = np.concatenate(per_request).astype(np.int32)
    qo = np.ones(len(kv_lens), dtype=np.int64)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(kv_lens), heads, dim, generator=g)
    k, v = (torch.randn(len(kv_lens), kv_heads, dim, generator=g) for _ in range(2))
    bufs = [torch.randn(slots + 1, kv_heads, dim, generator=g) for _ in range(2)]
    return qo, np.asarray(kv_lens), kv_indices, q, k, v, bufs


@pytest.mark.parametrize("kernels, fused", [
    ("torch", True), ("torch", False),  # the CPU's fused kernel; the matmuls (off the CPU)
    ("in_place", True),  # the CPU's in-place decode kernel (testbed.engine.cpu_attention)
    pytest.param("triton", True, marks=pytest.mark.skipif(
        not TRITON, reason="no GPU and TRITON_INTERPRET unset"))],
    ids=["torch", "torch_matmuls", "in_place", "triton"])
@pytest.mark.parametrize("seed, groups, kv_lens, heads", [
    (0, [(30, [0, 2, 3])], [37, 5, 33, 60], 4),                   # one group, one alone
    (1, [(12, [0, 1]), (70, [2, 4, 5])], [13, 40, 71, 9, 90, 72], 4),  # two groups, GQA 2
    (2, [(20, [1, 2, 3, 4, 5])], [3, 21, 22, 50, 80, 21], 8),     # a wide group, GQA 4
])
def test_cascade_decode_equals_plain_decode(kernels, seed, groups, kv_lens, heads, fused,
                                            monkeypatch):
    if not fused:  # the torch backend's matmul decode (its path off the CPU, or in an old torch)
        monkeypatch.setattr(attention_module, "FUSED_CPU_DECODE", None)
    qo, kv, kv_indices, q, k, v, (kb, vb) = grouped_decode_step(seed, groups, kv_lens,
                                                                  heads=heads)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    q, k, v, kb, vb = (t.to(device) for t in (q, k, v, kb, vb))
    outs = []
    kernel = load_kernel()[0] if kernels == "in_place" else None
    name = "torch" if kernels == "in_place" else kernels
    for cascade in (False, True):
        backend = make_attention(f"cascade_{name}" if cascade else name, 2, kernel=kernel)
        meta = AttentionMetadata.build(qo, kv, kv_indices, device)
        if cascade:
            arrays, sizes = CascadePlan.host_arrays(groups, kv, meta.rows)
            meta.cascade = CascadePlan.from_device(to_device(arrays, device), sizes)
        meta.plan = backend.plan(meta)
        kb_, vb_ = kb.clone(), vb.clone()
        kb_[meta.out_slots.long()], vb_[meta.out_slots.long()] = k, v  # the layer's store step
        outs.append(backend.forward(q, kb_, vb_, meta, 0.3))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    if kernel is not None:  # and plain in-place decode equals the gathered one
        backend = make_attention("torch", 2)
        meta = AttentionMetadata.build(qo, kv, kv_indices, device)
        meta.plan = backend.plan(meta)
        kb[meta.out_slots.long()], vb[meta.out_slots.long()] = k, v
        torch.testing.assert_close(outs[0], backend.forward(q, kb, vb, meta, 0.3), atol=1e-5,
                                   rtol=1e-5)


def test_engine_and_simulator_group_with_the_same_code():
    """The runner plans, and the simulator's executor prices, the groups of one `DecodeGroups`."""
    from testbed.engine import runner
    from testbed.scheduler import decode_groups
    from testbed.sim import executor

    assert runner.DecodeGroups is executor.DecodeGroups is decode_groups.DecodeGroups
    assert executor.SimExecutor(None, attention="cascade_triton").groups is not None
    assert executor.SimExecutor(None, attention="triton").groups is None


@pytest.mark.parametrize("backend", ["sim", "engine"])
def test_cascade_min_saved_reaches_the_groups_of_either_backend(backend, compose):
    from testbed.config.assembly import assemble

    run = assemble(compose(f"backend={backend}", "model=tiny", "attention=cascade",
                           "cascade_min_saved=500"))
    executor = run.build_executor(1000)
    groups = executor.groups if backend == "sim" else executor.runner.decode_groups
    assert groups.min_saved == 500
    with pytest.raises(ValueError, match=r"^cascade_min_saved must be an integer >= 0 \(KV "
                                         r"tokens\), got -1$"):
        assemble(compose(f"backend={backend}", "cascade_min_saved=-1"))


def test_shared_reads_count_every_repeated_cached_slot_where_cascade_groups_save_one_level():
    """q+a+x, q+a+y, q+b+z, r+w decoding together: q (40 tokens) is read by three requests and
    a (10) by two, so 2 x 40 + 1 x 10 cached tokens are read again; the best disjoint cascade
    grouping saves only the 2 x 40 of q. A block-hash lease's shared blocks count the same way:
    the count reads slots, not a tree."""
    from testbed.cache import BlockHashCache
    from testbed.scheduler.decode_groups import SharedReads, saved_reads
    from tests.cascade_helpers import decode_entries as entries

    _, leases = leases_on_a_tree(a_len=10)
    reads = SharedReads()
    assert reads(entries(leases)) == 2 * 40 + 10
    assert saved_reads(shared_prefix_groups(leases)) == 2 * 40
    assert reads(entries(leases[2:])) == 0  # q+b+z and r+w share nothing
    assert reads(entries(leases[:1])) == 0  # one request reads nothing again

    cache = BlockHashCache(2000, block_size=8)
    prompt = toks(1000, 40)  # five full blocks, cached by the first request, hit by the others
    first = cache.acquire(prompt)
    cache.extend(first, 40)
    cache.release(first, prompt)
    hits = [cache.acquire(np.concatenate([prompt, toks(2000 + 100 * i, 8)])) for i in range(3)]
    assert [lease.hit for lease in hits] == [40, 40, 40]
    assert SharedReads()(entries(hits)) == 2 * 40


def test_a_group_wider_than_a_programs_query_rows_is_split_in_order():
    from testbed.engine.cascade import MAX_QUERY_ROWS, prefix_splits, split_wide

    members = list(range(70))
    assert split_wide([(30, members), (5, [70, 71])], gqa_group=1) == [
        (30, members[:MAX_QUERY_ROWS]), (30, members[MAX_QUERY_ROWS:]), (5, [70, 71])]
    assert [len(m) for _, m in split_wide([(30, members)], gqa_group=4)] == [16, 16, 16, 16, 6]
    assert [prefix_splits(n, fixed=False) for n in (1, 64, 65, 2048, 9000)] == [1, 1, 2, 32, 32]
    assert prefix_splits(10, fixed=True) == 32
