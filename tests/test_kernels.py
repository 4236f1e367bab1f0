"""Triton kernels of `radix_kernels` against their torch references, and the references against a
naive per-token loop.

Triton decides interpreter vs compiled when a ``@triton.jit`` function is *defined* (it reads
``TRITON_INTERPRET`` then, through ``triton.knobs.runtime.interpret``), not when a kernel is
launched; and ``import triton`` itself defines ``triton.language``'s jit helpers (``tl.max``,
``tl.zeros``, ...), which interpreted kernels call. So the variable must be set before triton is
first imported: here, at the top. If an earlier test module imported triton without it, the
kernel tests here skip and ``test_kernel_grid_in_fresh_process`` runs this file in a subprocess
(setting ``TRITON_INTERPRET=1`` in ``tests/conftest.py`` avoids that). A kernel module imported
earlier in the other mode is reloaded. ``TRITON_INTERPRET=0 pytest tests/test_kernels.py`` on a
GPU machine runs the same grid compiled, on CUDA, with bf16 added.

Tolerances (absolute and relative, against an fp32 reference on the same inputs):
- fp32: 1e-4. Kernels accumulate in fp32 with exact (non-TF32) dots; observed errors ~1e-6 come
  from summation order alone.
- fp16: 2e-3. Inputs are identical; the kernel rounds softmax weights to fp16 before P@V and
  rounds the output to fp16 (unit roundoff 2^-11 ~ 4.9e-4 on values of order 1).
- bf16 (GPU only; the interpreter's bf16 dot is wrong): 2e-2 (unit roundoff 2^-8 ~ 3.9e-3).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit kernel is defined

import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import radix_kernels  # noqa: E402
from radix_kernels import reference as ref  # noqa: E402
from tests.kernel_modules import load_kernel_modules, run_in_fresh_process  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


KERNELS, DEVICE, SKIP_REASON, FRESH_PROCESS = load_kernel_modules(
    ("store", "extend", "decode", "merge"))
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.mark.skipif(not FRESH_PROCESS, reason="the kernel grid runs in this process")
def test_kernel_grid_in_fresh_process():
    """When triton was imported before TRITON_INTERPRET=1, run this file where it is set first."""
    run_in_fresh_process(__file__)


# --------------------------------------------------------------------------- batch building


def make_batch(prefix, new, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
               seed=0, device="cpu"):
    """Random buffers and a batch whose requests own shuffled, non-contiguous slots.

    Returns dict: q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices (int32), and ``slots``: the
    per-request slot lists (for the naive loop).
    """
    g = torch.Generator().manual_seed(seed)
    total_kv = sum(prefix) + sum(new)
    num_slots = total_kv + 7                                   # some slots unused
    perm = (torch.randperm(num_slots, generator=g) + 1).tolist()  # slot 0 is padding
    slots, pos = [], 0
    for p, n in zip(prefix, new):
        slots.append(perm[pos:pos + p + n])
        pos += p + n
    k_buf = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=g)
    v_buf = torch.randn(num_slots + 1, num_kv_heads, head_dim, generator=g)
    q = torch.randn(sum(new), num_heads, head_dim, generator=g)
    qo = [0]
    kv = [0]
    for p, n in zip(prefix, new):
        qo.append(qo[-1] + n)
        kv.append(kv[-1] + p + n)
    flat = [s for req in slots for s in req]
    i32 = dict(dtype=torch.int32, device=device)
    return dict(q=q.to(device, dtype), k_buf=k_buf.to(device, dtype), v_buf=v_buf.to(device, dtype),
                qo_indptr=torch.tensor(qo, **i32), kv_indptr=torch.tensor(kv, **i32),
                kv_indices=torch.tensor(flat, **i32), slots=slots)


def naive_attention(q, k_buf, v_buf, prefix, new, slots, sm_scale):
    """Per request, token and head: softmax over the visible keys in float64, in plain loops."""
    num_heads = q.shape[1]
    group = num_heads // k_buf.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.zeros(q.shape[:2], dtype=torch.float64)
    t = 0
    for p, n, req_slots in zip(prefix, new, slots):
        for j in range(n):
            visible = req_slots[:p + j + 1]                   # positions 0 .. prefix + j
            for h in range(num_heads):
                qv = q[t, h].double()
                scores = [float(qv @ k_buf[s, h // group].double()) * sm_scale for s in visible]
                m = max(scores)
                w = [math.exp(x - m) for x in scores]
                total = sum(w)
                out[t, h] = sum(wi * v_buf[s, h // group].double()
                                for wi, s in zip(w, visible)) / total
                lse[t, h] = m + math.log(total)
            t += 1
    return out, lse


def close(actual, expected, tol):
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


# The ragged batch of the grid: prefix 0, a single new token, a run of new tokens longer than one
# 16-row block, KV spanning several 16-key blocks. Prefix 17: the last row of the first 16-row
# block sees exactly one key (position 32) of a further 16-key block, so a KV loop that stops one
# position early fails.
PREFIX, NEW = [0, 7, 17], [5, 1, 17]
GQA = [(4, 4), (4, 2), (4, 1)]  # (num_heads, num_kv_heads)


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_reference_extend_matches_naive_loop(num_heads, num_kv_heads):
    """The reference is causal lower-right, GQA head h -> kv head h // group, LSE natural log."""
    b = make_batch(PREFIX, NEW, num_heads, num_kv_heads, seed=1)
    scale = 0.3
    o, lse = ref.extend_attention(b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"],
                                  b["kv_indptr"], b["kv_indices"], scale, return_lse=True)
    no, nlse = naive_attention(b["q"], b["k_buf"], b["v_buf"], PREFIX, NEW, b["slots"], scale)
    close(o, no, 1e-5)
    close(lse, nlse, 1e-5)


def test_reference_decode_matches_naive_loop():
    """Decode = one new token per request attending to everything (its prefix and itself)."""
    prefix = [0, 6, 30]
    b = make_batch(prefix, [1, 1, 1], 4, 2, seed=2)
    o, lse = ref.decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                  b["kv_indices"], return_lse=True)
    no, nlse = naive_attention(b["q"], b["k_buf"], b["v_buf"], prefix, [1, 1, 1], b["slots"],
                               1 / math.sqrt(16))
    close(o, no, 1e-5)
    close(lse, nlse, 1e-5)


def test_reference_store_kv_writes_only_its_slots():
    k_buf, v_buf = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    ref.store_kv(k_buf, v_buf, torch.tensor([7, 2, 9], dtype=torch.int32), k, v)
    assert torch.equal(k_buf[[7, 2, 9]], k) and torch.equal(v_buf[[7, 2, 9]], v)
    untouched = [0, 1, 3, 4, 5, 6, 8]
    assert not k_buf[untouched].any() and not v_buf[untouched].any()


def test_reference_merge_equals_full_attention_split_in_two():
    """Attention over keys [0, c) and [c, L) merged by LSE equals attention over [0, L)."""
    kv_len, cut = [12, 30, 5], [4, 29, 1]
    b = make_batch([n - 1 for n in kv_len], [1, 1, 1], 4, 2, seed=3)
    full, full_lse = ref.decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                          b["kv_indices"], return_lse=True)
    parts = []
    for lo_hi in (lambda s, c: s[:c], lambda s, c: s[c:]):
        chunks = [lo_hi(s, c) for s, c in zip(b["slots"], cut)]
        indptr = torch.tensor([0] + torch.tensor([len(c) for c in chunks]).cumsum(0).tolist())
        parts.append(ref.decode_attention(b["q"], b["k_buf"], b["v_buf"], indptr,
                                          torch.tensor(sum(chunks, [])), return_lse=True))
    (o_a, l_a), (o_b, l_b) = parts
    o, lse = ref.merge_states(o_a, l_a, o_b, l_b)
    close(o, full, 1e-5)
    close(lse, full_lse, 1e-5)


def test_reference_merge_with_empty_sides():
    """lse = -inf means no keys: that side contributes nothing; both empty gives o = 0."""
    o_a, o_b = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    lse_a = torch.randn(2, 3)
    empty = torch.full((2, 3), float("-inf"))
    o, lse = ref.merge_states(o_a, lse_a, o_b, empty)
    close(o, o_a, 1e-6)
    close(lse, lse_a, 1e-6)
    o, lse = ref.merge_states(o_a, empty, o_b, empty)
    assert not o.any() and torch.isneginf(lse).all()


def test_import_needs_no_triton():
    """``import radix_kernels`` and its references work where Triton does not import."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import radix_kernels\n"
            "assert not radix_kernels.triton_available()\n"
            "assert not hasattr(radix_kernels, 'extend_attention')\n"
            "assert callable(radix_kernels.reference.extend_attention)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --------------------------------------------------------------------------- Triton kernels


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("buf_dtype", ["same", "float16"])
def test_store_kv_matches_reference(dtype, buf_dtype):
    """Exact copy (with a cast to the buffers' dtype) from a strided view of a fused K|V tensor."""
    bd = dtype if buf_dtype == "same" else torch.float16
    kv = torch.randn(5, 2, 3, 32).to(DEVICE, dtype)           # [n, 2 (k|v), kv_heads, dim]
    k, v = kv[:, 0], kv[:, 1]                                  # non-contiguous views
    slots = torch.tensor([9, 3, 12, 1, 6], dtype=torch.int64, device=DEVICE)
    got = [torch.zeros(14, 3, 32, dtype=bd, device=DEVICE) for _ in range(2)]
    want = [torch.zeros(14, 3, 32, dtype=bd, device=DEVICE) for _ in range(2)]
    KERNELS["store"].store_kv(got[0], got[1], slots, k, v)
    ref.store_kv(want[0], want[1], slots, k, v)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _extend(b, **kw):
    args = (b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"], b["kv_indptr"], b["kv_indices"])
    o, lse = KERNELS["extend"].extend_attention(*args, return_lse=True, **kw)
    fp32 = [t.float() if t.is_floating_point() else t for t in args]
    ro, rlse = ref.extend_attention(*fp32, return_lse=True)
    return o, lse, ro, rlse


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_extend_attention_grid(dtype, head_dim, num_heads, num_kv_heads):
    b = make_batch(PREFIX, NEW, num_heads, num_kv_heads, head_dim, dtype, seed=head_dim,
                   device=DEVICE)
    o, lse, ro, rlse = _extend(b, block_m=16, block_n=16)
    assert o.dtype == dtype and o.shape == b["q"].shape
    close(o, ro, TOL[dtype])
    close(lse, rlse, TOL[dtype])


@needs_triton
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64)])
def test_extend_attention_block_sizes(block_m, block_n):
    """Masking holds for other tiles, including the GPU default 64x64 (wider than a request)."""
    b = make_batch([3, 0, 31], [9, 40, 2], 4, 2, 16, seed=4, device=DEVICE)
    o, lse, ro, rlse = _extend(b, block_m=block_m, block_n=block_n)
    close(o, ro, TOL[torch.float32])
    close(lse, rlse, TOL[torch.float32])


@needs_triton
def test_extend_attention_request_without_new_tokens_and_max_new():
    """A request with no new tokens is skipped; a given max_new avoids the sync, same result."""
    b = make_batch([4, 10, 2], [3, 0, 6], 4, 2, 16, seed=5, device=DEVICE)
    o, lse, ro, rlse = _extend(b, block_m=16, block_n=16, max_new=6)
    close(o, ro, TOL[torch.float32])
    close(lse, rlse, TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_decode_attention_grid(dtype, head_dim, num_heads, num_kv_heads):
    prefix = [0, 8, 39]                                        # KV lengths 1, 9, 40
    b = make_batch(prefix, [1, 1, 1], num_heads, num_kv_heads, head_dim, dtype, seed=6,
                   device=DEVICE)
    o, lse = KERNELS["decode"].decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                                b["kv_indices"], return_lse=True,
                                                num_kv_splits=4, block_n=16)
    ro, rlse = ref.decode_attention(b["q"].float(), b["k_buf"].float(), b["v_buf"].float(),
                                    b["kv_indptr"], b["kv_indices"], return_lse=True)
    assert o.dtype == dtype and o.shape == b["q"].shape
    close(o, ro, TOL[dtype])
    close(lse, rlse, TOL[dtype])


@needs_triton
@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 1), (32, 2)])
def test_decode_attention_splits(num_kv_splits, num_heads, num_kv_heads):
    """Empty splits (KV shorter than the split count) merge away; GQA group 16 fills BLOCK_H."""
    prefix = [0, 2, 37]
    b = make_batch(prefix, [1, 1, 1], num_heads, num_kv_heads, 16, seed=7, device=DEVICE)
    o = KERNELS["decode"].decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                           b["kv_indices"], 0.2, num_kv_splits=num_kv_splits,
                                           block_n=16)
    ro = ref.decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"], b["kv_indices"],
                              0.2)
    close(o, ro, TOL[torch.float32])


@needs_triton
def test_decode_equals_extend_with_one_new_token():
    b = make_batch([5, 0, 20], [1, 1, 1], 4, 2, 32, seed=8, device=DEVICE)
    d = KERNELS["decode"].decode_attention(b["q"], b["k_buf"], b["v_buf"], b["kv_indptr"],
                                           b["kv_indices"], block_n=16)
    e = KERNELS["extend"].extend_attention(b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"],
                                           b["kv_indptr"], b["kv_indices"], block_m=16,
                                           block_n=16)
    close(d, e, TOL[torch.float32])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_merge_states_matches_reference(dtype):
    g = torch.Generator().manual_seed(9)
    o_a, o_b = (torch.randn(4, 3, 32, generator=g).to(DEVICE, dtype) for _ in range(2))
    lse_a, lse_b = (torch.randn(4, 3, generator=g).to(DEVICE) * 3 for _ in range(2))
    lse_b[0] = float("-inf")                                  # one side empty
    lse_a[1] = lse_b[1] = float("-inf")                       # both empty
    o, lse = KERNELS["merge"].merge_states(o_a, lse_a, o_b, lse_b)
    ro, rlse = ref.merge_states(o_a.float(), lse_a, o_b.float(), lse_b)
    assert o.dtype == dtype
    close(o, ro, TOL[dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse))
    finite = ~torch.isneginf(rlse)
    close(lse[finite], rlse[finite], 1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_with_places_gathers_side_a_and_keeps_side_b_where_told(dtype):
    """Cascade's merge: token i takes side a from row places[i] of 2 rows where keep[i], and
    is side b bit for bit elsewhere."""
    g = torch.Generator().manual_seed(3)
    o_a = torch.randn(2, 3, 32, generator=g).to(DEVICE, dtype)
    o_b = torch.randn(5, 3, 32, generator=g).to(DEVICE, dtype)
    lse_a = (torch.randn(2, 3, generator=g) * 3).to(DEVICE)
    lse_b = (torch.randn(5, 3, generator=g) * 3).to(DEVICE)
    places = torch.tensor([1, 0, 0, 1, 0], device=DEVICE)
    keep = torch.tensor([True, True, False, True, False], device=DEVICE)
    o, lse = KERNELS["merge"].merge_states(o_a, lse_a, o_b, lse_b, places, keep)
    ro, rlse = ref.merge_states(o_a.float(), lse_a, o_b.float(), lse_b, places, keep)
    close(o, ro, TOL[dtype])
    close(lse, rlse, 1e-5)
    assert torch.equal(o[~keep], o_b[~keep]) and torch.equal(lse[~keep], lse_b[~keep])


@needs_triton
def test_rejects_dims_that_cannot_compile():
    b = make_batch([2], [2], 4, 2, 16, seed=10, device=DEVICE)
    with pytest.raises(ValueError, match="block_m"):
        KERNELS["extend"].extend_attention(b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"],
                                           b["kv_indptr"], b["kv_indices"], block_m=8)
    with pytest.raises(ValueError, match="head_dim"):
        q = torch.randn(2, 4, 8, device=DEVICE)
        kv = torch.randn(5, 2, 8, device=DEVICE)
        KERNELS["extend"].extend_attention(q, kv, kv, b["qo_indptr"], b["kv_indptr"],
                                           b["kv_indices"])
