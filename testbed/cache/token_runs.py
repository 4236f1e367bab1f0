"""Token runs as bytes: how the radix tree and the ideal-hit trie store and compare their edges.

A run of ``TOKEN_DTYPE`` tokens becomes its raw bytes (token ``i`` at bytes ``4i .. 4i+3``). Bytes
compare in C whatever their length, so an edge costs the same few hundred nanoseconds whether it
holds 4 tokens or 4,000: ``key.startswith(edge, at, end)`` asks whether a walk passes the whole
edge, and only the one edge a walk stops inside needs `matched_bytes` (a binary search of such
comparisons). A bytes object is also smaller than a numpy array of the same tokens (33 bytes of
header against ~100).
"""

from __future__ import annotations

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE  # the one token dtype (re-exported here)
TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
_DTYPE = np.dtype(TOKEN_DTYPE)  # native order: the one object every such array's dtype is


def as_bytes(tokens: np.ndarray) -> bytes:
    """The bytes of a token run (converted to ``TOKEN_DTYPE`` first if it is not already)."""
    if getattr(tokens, "dtype", None) is _DTYPE:
        return tokens.tobytes()
    return np.asarray(tokens, dtype=TOKEN_DTYPE).tobytes()


def token_view(tokens: np.ndarray) -> memoryview:
    """The bytes of a token run as a read-only view of its own memory where it is a contiguous
    ``TOKEN_DTYPE`` array (no copy: for structures that would otherwise hold a trace's tokens a
    second time), else of a copy. Compares as `as_bytes` does (``bytes.startswith`` takes it)."""
    if getattr(tokens, "dtype", None) is _DTYPE and tokens.flags.c_contiguous:
        return memoryview(tokens).cast("B").toreadonly()
    return memoryview(as_bytes(tokens))


#: `joined_bytes` of fewer tokens copies each array out (``tobytes``) rather than reading their
#: buffers in place: numpy keeps an exported buffer's description (56 bytes) on the array for the
#: rest of its life, which on a trace of short requests is a tenth of what a replay holds
SMALL_JOIN = 1024


def joined_bytes(first: np.ndarray, second: np.ndarray) -> bytes:
    """``as_bytes(first) + as_bytes(second)``: in one copy when both are contiguous token arrays
    of `SMALL_JOIN` tokens or more, else without exporting their buffers (as fast, there)."""
    if getattr(first, "dtype", None) is _DTYPE and getattr(second, "dtype", None) is _DTYPE:
        if len(first) + len(second) < SMALL_JOIN:
            return first.tobytes() + second.tobytes()
        try:
            return b"".join((first, second))
        except (BufferError, TypeError):  # not contiguous
            pass
    return as_bytes(first) + as_bytes(second)


def matched_bytes(edge: bytes, key: bytes, at: int, end: int) -> int:
    """Bytes of the longest common prefix of ``edge`` and ``key[at:end]``, in whole tokens.

    >>> a, b = as_bytes(np.arange(6)), as_bytes(np.array([9, 0, 1, 2, 7]))
    >>> matched_bytes(a, b, 4, 20) // TOKEN_BYTES, matched_bytes(a, b, 4, 12) // TOKEN_BYTES
    (3, 2)
    """
    if key.startswith(edge, at, end):
        return len(edge)
    hi = min(len(edge), end - at) // TOKEN_BYTES
    view = memoryview(edge)
    if key.startswith(view[: hi * TOKEN_BYTES], at, end):
        return hi * TOKEN_BYTES  # the key runs out inside the edge
    lo = 0  # the first lo tokens match, the first hi do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key.startswith(view[: mid * TOKEN_BYTES], at, end):
            lo = mid
        else:
            hi = mid
    return lo * TOKEN_BYTES
