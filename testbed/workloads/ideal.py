"""The ideal hit rate (docs/design.md §3) in one pass over a token trie.

For each request in order, the hit is the longest prefix of its prompt that is a prefix of some
earlier request's prompt + output. One walk per request answers it and adds the request's own
prompt + output: walk prompt + output down a trie of every earlier sequence; the tokens matched,
capped at the prompt, are the hit; the rest becomes a new leaf. The trie keeps nothing else (no KV
slots, access times, locks or eviction order), so it costs a fraction of a cache's replay; edges
are token bytes compared in C (`testbed.cache.token_runs`). An unlimited radix cache replaying the
same requests reaches exactly these hits (a test checks it).

A new leaf's edge is a view of the request's own token arrays (`token_view`), not a copy: the trie
would otherwise hold every distinct token of the trace a second time beside the trace (about 330
MB at the Mooncake conversation simulation's peak). A leaf made of prompt and output is two
nodes, the prompt's tail and the output, which changes no match: a walk passes both or stops
inside one.
"""

from __future__ import annotations

import weakref
from typing import Iterable

import numpy as np

from testbed.cache.token_runs import TOKEN_BYTES, joined_bytes, matched_bytes, token_view
from testbed.perf import gc_paused
from testbed.workloads.request import Request


def ideal_hits(requests: Iterable[Request]) -> list[int]:
    """Per request, in order, the tokens of its prompt an unlimited cache with perfect reuse
    would hold."""
    # A node is (edge bytes, children); children map an edge's first token's bytes to its node.
    root: dict[bytes, tuple] = {}
    hits: list[int] = []
    append = hits.append
    w = TOKEN_BYTES
    with gc_paused():  # the loop runs once per request: the walk is inlined
        for r in requests:
            kb = joined_bytes(r.prompt, r.output)
            end, prompt = len(kb), len(r.prompt) * w
            kids, at = root, 0
            while at < end:
                node = kids.get(kb[at : at + w])
                if node is None:
                    break
                edge, below = node
                if kb.startswith(edge, at):
                    at += len(edge)
                    kids = below
                    continue
                k = matched_bytes(edge, kb, at, end)
                at += k
                if at < end:  # diverges inside the edge: split it; the new leaf goes beside
                    head = {bytes(edge[k : k + w]): (edge[k:], below)}
                    kids[bytes(edge[:w])] = (edge[:k], head)
                    kids = head
                break
            if at < end:  # the new leaf: views of the request's own tokens past the match
                output = token_view(r.output)
                if at < prompt:
                    below = {kb[prompt : prompt + w]: (output, {})} if len(output) else {}
                    kids[kb[at : at + w]] = (token_view(r.prompt)[at:], below)
                else:
                    kids[kb[at : at + w]] = (output[at - prompt :], {})
            append((at if at < prompt else prompt) // w)
    return hits


def ideal_hit_rate(requests: Iterable[Request]) -> float:
    """Hit rate of an unlimited cache with perfect reuse, requests taken in the given order.
    Over read-only token arrays (a kept trace's, `testbed.workloads.traces.load_trace`) the last
    rate is kept: the next call on the same arrays in the same order returns it (a sweep's jobs
    in one process count a trace's ideal once: 0.2 s a Mooncake conversation job)."""
    requests = list(requests)
    arrays = _frozen_arrays(requests)
    if arrays is not None and _KEPT and len(_KEPT[0]) == len(arrays) \
            and all(ref() is a for ref, a in zip(_KEPT[0], arrays)):
        return _KEPT[1]
    total = sum(len(r.prompt) for r in requests)
    rate = sum(ideal_hits(requests)) / total if total else 0.0
    _KEPT[:] = [] if arrays is None else [[weakref.ref(a) for a in arrays], rate]
    return rate


#: [weak references to the arrays, the rate] of the last `ideal_hit_rate` over read-only arrays:
#: a reference that still gives the same array says it is that array (a gone one's id could name
#: another), and a read-only array holds the same tokens.
_KEPT: list = []


def _frozen_arrays(requests: list[Request]) -> list[np.ndarray] | None:
    """The requests' prompt and output arrays, in order, when every one is a read-only numpy
    array over read-only memory (a view's base too); else None (nothing is kept)."""
    arrays = []
    for r in requests:
        for a in (r.prompt, r.output):
            if not isinstance(a, np.ndarray) or a.flags.writeable or (
                    isinstance(a.base, np.ndarray) and a.base.flags.writeable):
                return None
            arrays.append(a)
    return arrays
