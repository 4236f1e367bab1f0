"""Attention on the CPU that reads the KV pool in place: two small C kernels, built once.

The torch backend copies every request's K and V out of the pool (two ``index_select`` per layer
and step) and attends over the copy: at 32 decoding requests of 448 tokens that is 21 MB written
and read again per layer, about half of the step. The kernels (``cpu_attention.c`` beside this
file) walk each request's slots (a `FlatKV`'s ``indptr`` / ``indices``, the Triton kernels'
view) and read each key and value row where it lies:

- ``decode_attention``: one query per request; for every sequence and KV head the dot products of
  the head group's query rows with each key (one float per key and row kept), the softmax, then
  the values weighted; the log-sum-exp comes out with the output, so cascade decoding
  (`testbed.engine.cascade`) merges it as it merges the other kernels'.
- ``extend_attention``: a prefill step's new tokens, causal from the lower right behind each
  request's cached prefix. Per request and KV head the keys are copied once into a transposed
  scratch (16 keys a vector), so eight query rows take 16 scores each in ``head_dim`` fused
  multiply-adds, then an exact softmax and the values read in place: 2-3x torch's fused SDPA on
  gathered KV at the prefill shapes of the served workloads
  (`python -m experiments.benchmarks.cpu_engine`).

Both ask for a slot's row some rows before they read it (page-1 slots of a batch interleave, and
a long-lived pool scatters them, where the hardware prefetcher does not follow). fp32 only,
head_dim a multiple of 16 up to 256, one thread (the engine's torch thread calls them; ``ctypes``
lets go of the interpreter's lock meanwhile).

The C is built with the layer kernels into one library (`testbed.engine.native_build`; its
fast-math gives the vectorized ``expf``, so no infinity is used inside: ``-FLT_MAX`` stands for
it). `load_kernel` returns the kernels, or None and why (no compiler, a failed build or smoke
test): the engine then attends through torch's gather and SDPA (``decode_kernel_error``: slower,
never wrong).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from radix_kernels import reference
from testbed.engine.native_build import load_library


class AttentionKernels:
    """The compiled kernels as functions of tensors: a decode part (``__call__``) and a prefill
    step (`extend`)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fn = lib.decode_attention
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_float] \
            + [ctypes.c_void_p] * 2
        self.extend_fn = lib.extend_attention
        self.extend_fn.restype = ctypes.c_int
        self.extend_fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 5 \
            + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_void_p]

    def __call__(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                 indptr: torch.Tensor, indices: torch.Tensor, sm_scale: float,
                 want_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``q [n, kv_heads, R, dim]`` fp32 over the slots of each sequence; ``o`` of q's shape
        and the natural-log LSE ``[n, kv_heads, R]`` (None without ``want_lse``)."""
        n, heads, rows, dim = q.shape
        if q.dtype != torch.float32 or k_buf.dtype != torch.float32:
            raise TypeError(f"decode_attention is fp32 only, got {q.dtype}")
        if indices.dtype != torch.int32 or indptr.dtype != torch.int64:
            raise TypeError(f"decode_attention reads int32 slots and an int64 indptr, got "
                            f"{indices.dtype} and {indptr.dtype}")
        q, indices, indptr = q.contiguous(), indices.contiguous(), indptr.contiguous()
        o = torch.empty_like(q)
        lse = torch.empty((n, heads, rows), dtype=torch.float32) if want_lse else None
        status = self.fn(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), indptr.data_ptr(),
                         indices.data_ptr(), n, heads, rows, dim, sm_scale, o.data_ptr(),
                         0 if lse is None else lse.data_ptr())
        if status != 0:
            raise (MemoryError("decode_attention: no scratch memory") if status == 1 else
                   ValueError(f"decode_attention takes head_dim a multiple of 16 up to 256, not "
                              f"{dim}"))
        return o, lse

    def extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
               qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, indices: torch.Tensor,
               sm_scale: float) -> torch.Tensor:
        """A prefill step's attention (`radix_kernels.reference.extend_attention`'s contract):
        ``q [T, heads, dim]`` fp32 (its tokens may be rows of a wider tensor: the fused
        projection's), request ``i``'s new tokens ``qo_indptr[i]..`` over its slots
        ``indices[kv_indptr[i]..]`` (int32; prefix, then the new tokens, already stored).
        Returns ``o [T, heads, dim]``."""
        tokens, heads, dim = q.shape
        if q.dtype != torch.float32 or k_buf.dtype != torch.float32:
            raise TypeError(f"extend_attention is fp32 only, got {q.dtype}")
        if indices.dtype != torch.int32 or kv_indptr.dtype != torch.int64 \
                or qo_indptr.dtype != torch.int64:
            raise TypeError(f"extend_attention reads int32 slots and int64 indptrs, got "
                            f"{indices.dtype}, {qo_indptr.dtype} and {kv_indptr.dtype}")
        if q.stride(2) != 1 or q.stride(1) != dim:  # a token's heads must lie side by side
            q = q.contiguous()
        indices, qo_indptr, kv_indptr = (t.contiguous() for t in (indices, qo_indptr, kv_indptr))
        o = torch.empty((tokens, heads, dim), dtype=torch.float32)
        status = self.extend_fn(q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(),
                                qo_indptr.data_ptr(), kv_indptr.data_ptr(), indices.data_ptr(),
                                len(qo_indptr) - 1, heads, k_buf.shape[1], dim, sm_scale,
                                o.data_ptr())
        if status != 0:
            raise {1: MemoryError("extend_attention: no scratch memory"),
                   2: ValueError(f"extend_attention takes head_dim a multiple of 16 up to 256, "
                                 f"not {dim}"),
                   3: ValueError("extend_attention: a request has fewer keys than new tokens")
                   }[status]
        return o


def smoke_test(kernel: AttentionKernels) -> None:
    """Decode: three sequences (5, 1 and 9 keys) over a shuffled pool, against softmax attention
    in torch; extend: three requests (with and without a cached prefix, 1 to 19 new tokens)
    against `radix_kernels.reference.extend_attention`."""
    g = torch.Generator().manual_seed(0)
    kv_heads, rows, dim, slots = 2, 3, 16, 20
    k, v = (torch.randn(slots, kv_heads, dim, generator=g) for _ in range(2))
    lens = [5, 1, 9]
    indices = torch.randperm(slots, generator=g)[:sum(lens)].int()
    indptr = torch.tensor([0, 5, 6, 15])
    q = torch.randn(len(lens), kv_heads, rows, dim, generator=g)
    o, lse = kernel(q, k, v, indptr, indices, 0.25)
    for i in range(len(lens)):
        s = indices[indptr[i]:indptr[i + 1]]
        scores = torch.einsum("hrd,lhd->hrl", q[i], k[s]) * 0.25
        want = torch.einsum("hrl,lhd->hrd", scores.softmax(-1), v[s])
        torch.testing.assert_close(o[i], want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(lse[i], scores.logsumexp(-1), atol=1e-5, rtol=1e-4)
    qo_lens, kv_lens = [3, 1, 19], [3, 6, 21]
    heads = kv_heads * rows
    q = torch.randn(sum(qo_lens), heads, dim, generator=g)
    k, v = (torch.randn(64, kv_heads, dim, generator=g) for _ in range(2))
    indices = torch.randperm(64, generator=g)[:sum(kv_lens)].int()
    qo_indptr, kv_indptr = (torch.tensor([0, *lens]).cumsum(0) for lens in (qo_lens, kv_lens))
    torch.testing.assert_close(kernel.extend(q, k, v, qo_indptr, kv_indptr, indices, 0.25),
                               reference.extend_attention(q, k, v, qo_indptr, kv_indptr, indices,
                                                          0.25), atol=1e-5, rtol=1e-4)


@lru_cache(maxsize=None)
def load_kernel() -> tuple[AttentionKernels | None, str | None]:
    """The kernels, built and smoke-tested once per process, or None and why not."""
    try:
        kernel = AttentionKernels(load_library())
        smoke_test(kernel)
    except Exception as e:  # noqa: BLE001 - any failure means: torch's gather here
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return kernel, None
