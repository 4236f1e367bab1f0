"""Decode attention on the CPU that reads the KV pool in place: a small C kernel, built once.

The torch backend's decode copies every request's K and V out of the pool into a padded batch,
per layer and step (`TorchAttention.decode_part`: two ``index_select``), then attends over the
copy: at 32 requests of 448 tokens that is 21 MB written and read again per layer, about half
of the step. This kernel walks each sequence's slots (a `FlatKV`'s ``indptr`` / ``indices``,
the Triton decode kernel's view) and reads each key and value row where it lies: for every
sequence and KV head, the dot products of the head's query rows with each key (the scores kept,
one float per key and row), the softmax, then the values weighted; the log-sum-exp comes out
with the output, so cascade decoding (`testbed.engine.cascade`) merges it as it merges the
other kernels'. fp32 only, head_dim a multiple of 16 up to 256; one thread (the engine's torch
thread calls it; ``ctypes`` lets go of the interpreter's lock meanwhile).

It is plain C (no torch headers: it builds in about a second), compiled with the system's C
compiler for this CPU (``-O3 -march=native``; fast-math for the vectorized ``expf``, so no
infinity is used inside: ``-FLT_MAX`` stands for it) into
``$XDG_CACHE_HOME/radix-testbed/kernels`` (``~/.cache`` when unset) under a name that hashes
its source, flags, compiler and host, and called through ``ctypes`` with the tensors'
addresses. `load_kernel` returns it, or None and why (no compiler, a failed build or smoke
test): the engine then decodes through torch's gather (``decode_kernel_error``: slower, never
wrong).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = r"""
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 16 floats, loaded and stored unaligned; the compiler maps it to the CPU's vectors */
typedef float v16 __attribute__((vector_size(64), aligned(4), may_alias));

static inline float hsum(v16 x) {
    float s = 0.0f;
    for (int l = 0; l < 16; l++) s += x[l];
    return s;
}

/* One sequence: its keys' rows k[slot] (all kv heads, kh * nv * 16 floats, contiguous) read
   once for every head's r query rows; then the values' rows likewise. nv (head_dim / 16) is a
   constant where inlined, so each row is a few whole-vector operations. */
static inline __attribute__((always_inline)) void sequence(
        const float *q, const float *k, const float *v, const int32_t *slots, int64_t len,
        int64_t kh, int64_t r, const int nv, float scale, float *scores, v16 *acc, float *o,
        float *lse) {
    const int64_t rows = kh * r, width = kh * nv;  /* query rows; vectors in a slot's row */
    for (int64_t j = 0; j < len; j++) {
        const v16 *kr = (const v16 *)(k + (int64_t)slots[j] * width * 16);
        for (int64_t h = 0; h < kh; h++) {
            for (int64_t a = 0; a < r; a++) {
                const v16 *qa = (const v16 *)(q + (h * r + a) * nv * 16);
                v16 dot = qa[0] * kr[h * nv];
                for (int x = 1; x < nv; x++) dot += qa[x] * kr[h * nv + x];
                scores[(h * r + a) * len + j] = hsum(dot) * scale;
            }
        }
    }
    for (int64_t a = 0; a < rows; a++) {
        float *sa = scores + a * len, m = -FLT_MAX, sum = 0.0f;
        for (int64_t j = 0; j < len; j++) m = sa[j] > m ? sa[j] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t j = 0; j < len; j++) { sa[j] = expf(sa[j] - m); sum += sa[j]; }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        #pragma omp simd
        for (int64_t j = 0; j < len; j++) sa[j] *= inv;
        if (lse) lse[a] = len > 0 ? m + logf(sum) : -FLT_MAX;
    }
    memset(acc, 0, sizeof(v16) * rows * nv);
    for (int64_t j = 0; j < len; j++) {
        const v16 *vr = (const v16 *)(v + (int64_t)slots[j] * width * 16);
        for (int64_t h = 0; h < kh; h++) {
            for (int64_t a = 0; a < r; a++) {
                const float p = scores[(h * r + a) * len + j];
                v16 *acc_a = acc + (h * r + a) * nv;
                for (int x = 0; x < nv; x++) acc_a[x] += p * vr[h * nv + x];
            }
        }
    }
    memcpy(o, acc, sizeof(v16) * rows * nv);
}

/* q [n, kh, r, d], k and v [slots, kh, d], o [n, kh, r, d], lse [n, kh, r] (or NULL), all
   fp32 and contiguous; sequence i reads slots indices[indptr[i] .. indptr[i + 1] - 1] (the
   slot table's int32 ids; indptr int64); d a multiple of 16 up to 256.
   Returns 0; 1 when scratch memory could not be had, 2 for a head_dim it does not take. */
int decode_attention(const float *q, const float *k, const float *v, const int64_t *indptr,
                     const int32_t *indices, int64_t n, int64_t kh, int64_t r, int64_t d,
                     float scale, float *o, float *lse) {
    if (d % 16 != 0 || d > 256) return 2;
    const int nv = (int)(d / 16);
    int64_t longest = 1;
    for (int64_t i = 0; i < n; i++)
        if (indptr[i + 1] - indptr[i] > longest) longest = indptr[i + 1] - indptr[i];
    float *scores = malloc(sizeof(float) * (size_t)(kh * r * longest));
    v16 *acc = malloc(sizeof(v16) * (size_t)(kh * r * nv));
    if (!scores || !acc) { free(scores); free(acc); return 1; }
    for (int64_t i = 0; i < n; i++) {
        const int64_t start = indptr[i], len = indptr[i + 1] - start;
        const float *qi = q + i * kh * r * d;
        float *oi = o + i * kh * r * d, *li = lse ? lse + i * kh * r : NULL;
        switch (nv) {  /* the common head_dims with their sizes known */
            case 4: sequence(qi, k, v, indices + start, len, kh, r, 4, scale, scores, acc, oi, li);
                    break;
            case 8: sequence(qi, k, v, indices + start, len, kh, r, 8, scale, scores, acc, oi, li);
                    break;
            default: sequence(qi, k, v, indices + start, len, kh, r, nv, scale, scores, acc, oi,
                              li);
        }
    }
    free(scores); free(acc);
    return 0;
}
"""

FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC")
# Linked in a second step, without -ffast-math: with it GCC (before 13) links crtfastmath.o into
# the library, whose constructor turns on flush-to-zero for the whole process when ctypes loads it
# (every float op in the process then loses subnormals: torch's, numpy's, the simulator's).
LINK_FLAGS = ("-shared",)
BUILD_TIMEOUT_S = 120


def kernel_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "radix-testbed" / "kernels"


def compiler() -> str:
    found = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC) on the PATH")
    return found


def build(directory: Path | None = None) -> Path:
    """The kernel's shared library, compiled once per source, flags, compiler and machine
    (written under a temporary name, then renamed: concurrent builds do not collide)."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, *LINK_FLAGS, cc, *version, platform.machine(),
                                    platform.node()]).encode()).hexdigest()[:16]
    directory = directory or kernel_dir()
    target = directory / f"decode_attention-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, obj, lib = (Path(tmp) / name for name in ("decode_attention.c", "k.o", "lib.so"))
        src.write_text(SOURCE)
        for command in ([cc, *FLAGS, "-c", str(src), "-o", str(obj)],
                        [cc, *LINK_FLAGS, str(obj), "-o", str(lib), "-lm"]):
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{Path(cc).name} failed: {done.stderr.strip()[:300]}")
        os.replace(lib, target)
    return target


class DecodeKernel:
    """The compiled kernel as a function of tensors."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        self.fn = lib.decode_attention
        self.fn.restype = ctypes.c_int
        self.fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_float] \
            + [ctypes.c_void_p] * 2

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


def smoke_test(kernel: DecodeKernel) -> None:
    """Three sequences (5, 1 and 9 keys) over a shuffled pool, against softmax attention in
    torch."""
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


@lru_cache(maxsize=None)
def load_kernel() -> tuple[DecodeKernel | None, str | None]:
    """The kernel, built and smoke-tested once per process, or None and why not."""
    try:
        kernel = DecodeKernel(build())
        smoke_test(kernel)
    except Exception as e:  # noqa: BLE001 - any failure means: torch's gather here
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return kernel, None
