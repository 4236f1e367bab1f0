"""N-gram prompt lookup, the drafter of ``speculative.method=ngram`` (vLLM's ``ngram`` method).

The request's own context (prompt and output so far) is searched for an earlier occurrence of
its last ``n`` tokens, ``n`` from ``max_n`` down to ``min_n``: the first ``n`` that occurs
earlier wins, and of its occurrences the earliest; the (at most ``k``) tokens that followed it
are the drafts. Nothing matches: no drafts. Pure: the same context gives the same drafts.
"""

from __future__ import annotations

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE

NO_DRAFT = np.zeros(0, dtype=TOKEN_DTYPE)


def ngram_draft(context: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """At most ``k`` drafted tokens after ``context`` (module docstring)."""
    context = np.asarray(context)
    size = len(context)
    if k < 1 or size < min_n + 1:
        return NO_DRAFT
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = context[size - n:]
        # windows starting at 0 .. size-n-1 (the suffix itself excluded): each has a follower
        windows = np.lib.stride_tricks.sliding_window_view(context[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[0]) + n
            return np.asarray(context[start : start + k], dtype=TOKEN_DTYPE)
    return NO_DRAFT


def ngram_branches(context: np.ndarray, k: int, min_n: int, max_n: int,
                   width: int) -> list[np.ndarray]:
    """At most ``width`` drafts of at most ``k`` tokens each, the branches of a token tree under
    the request's last token: the continuations of the suffix's earlier occurrences, longest
    suffix first and earliest occurrence first within one length (as `ngram_draft`, whose draft
    is the first branch), kept only when their first token differs from every branch taken
    before (branches share nothing but the root)."""
    context = np.asarray(context)
    size = len(context)
    out: list[np.ndarray] = []
    if k < 1 or size < min_n + 1:
        return out
    firsts: set[int] = set()
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(context[: size - 1], n)
        for hit in np.flatnonzero((windows == context[size - n:]).all(axis=1)):
            start = int(hit) + n
            if int(context[start]) not in firsts:
                firsts.add(int(context[start]))
                out.append(np.asarray(context[start : start + k], dtype=TOKEN_DTYPE))
                if len(out) == width:
                    return out
    return out
