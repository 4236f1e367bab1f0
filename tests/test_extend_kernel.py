"""The extend (prefill) kernel (`radix_kernels.extend`, the fused-attention tutorial's pattern)
against torch's SDPA: causal over the new tokens, aligned to the lower right over the cached
prefix, on a parameter grid of dtypes, GQA, tiles, where the new tokens' K/V are read from
(the pool, contiguous tensors, tensor descriptors) and pipeline depths.

In the Triton interpreter on the CPU (``TRITON_INTERPRET=1`` before triton is imported:
``tests/test_kernels.py``'s docstring), fp32 and fp16 (the interpreter's bf16 dot is wrong; bf16
is checked on a GPU: this grid compiled there, and ``radix_kernels.gpu_check``).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.kernel_modules import load_kernel_modules, run_in_fresh_process  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
KERNELS, DEVICE, SKIP_REASON, FRESH_PROCESS = load_kernel_modules(("extend",))
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# ragged: no prefix; a prefix of exactly one 16-key tile and one new token; a prefix ending one
# key into a tile and a run of new tokens over two 16-row blocks; a long prefix
PREFIX, NEW = [0, 16, 17, 40], [5, 1, 33, 20]


@pytest.mark.skipif(not FRESH_PROCESS, reason="the kernel grid runs in this process")
def test_kernel_grid_in_fresh_process():
    run_in_fresh_process(__file__)


def prefill_step(prefix, new, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """q, the pool, the indptrs and slots (each request's KV on shuffled slots), and the new
    tokens' K and V as contiguous ``[total_new, kv_heads, head_dim]`` (what the pool holds)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(prefix) + sum(new)
    perm = (torch.randperm(total + 7, generator=g) + 1).tolist()
    slots, at = [], 0
    for p, n in zip(prefix, new):
        slots.append(perm[at:at + p + n])
        at += p + n
    k_buf = torch.randn(total + 8, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    v_buf = torch.randn(total + 8, num_kv_heads, head_dim, generator=g).to(DEVICE, dtype)
    q = torch.randn(sum(new), num_heads, head_dim, generator=g).to(DEVICE, dtype)
    i64 = dict(dtype=torch.int64, device=DEVICE)
    qo = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), **i64)
    kv = torch.tensor([0] + torch.tensor([p + n for p, n in zip(prefix, new)]).cumsum(0)
                      .tolist(), **i64)
    new_slots = torch.tensor([s for p, req in zip(prefix, slots) for s in req[p:]], **i64)
    return dict(q=q, k_buf=k_buf, v_buf=v_buf, qo_indptr=qo, kv_indptr=kv,
                kv_indices=torch.tensor(sum(slots, []), **i64), slots=slots,
                k_new=k_buf[new_slots], v_new=v_buf[new_slots])


def sdpa_reference(b, prefix, new, sm_scale):
    """Per request, torch's SDPA over its KV in fp32: query ``i`` sees keys ``<= prefix + i``."""
    outs = []
    for i, (p, n) in enumerate(zip(prefix, new)):
        rows = torch.tensor(b["slots"][i], device=DEVICE)
        k = b["k_buf"][rows].float().transpose(0, 1)[None]     # [1, KH, P + n, D]
        v = b["v_buf"][rows].float().transpose(0, 1)[None]
        q = b["q"][b["qo_indptr"][i]:b["qo_indptr"][i + 1]].float().transpose(0, 1)[None]
        mask = torch.ones(n, p + n, dtype=torch.bool, device=DEVICE).tril(diagonal=p)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def extend(b, source, **kw):
    new = {"pool": {}, "contiguous": {"k_new": b["k_new"], "v_new": b["v_new"]},
           "descriptors": {"k_new": b["k_new"], "v_new": b["v_new"], "descriptors": True}}
    return KERNELS["extend"].extend_attention(
        b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"], b["kv_indptr"], b["kv_indices"], 0.25,
        **new[source], **kw)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("source", ["pool", "contiguous", "descriptors"])
def test_extend_equals_sdpa_causal_from_the_lower_right(dtype, num_heads, num_kv_heads, source):
    b = prefill_step(PREFIX, NEW, num_heads, num_kv_heads, 32, dtype, seed=num_heads)
    o = extend(b, source, block_m=16, block_n=16)
    assert o.dtype == dtype and o.shape == b["q"].shape
    torch.testing.assert_close(o.float().cpu(), sdpa_reference(b, PREFIX, NEW, 0.25).cpu(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16), (64, 64), (64, 16)])
@pytest.mark.parametrize("source", ["pool", "contiguous"])
@pytest.mark.parametrize("num_stages", [1, 3])
def test_extend_tiles_mask_only_their_diagonal(block_m, block_n, source, num_stages):
    """Tiles wider and narrower than the rows' block, one wider than a request, the tutorial's
    pipeline depths: the diagonal stage starts where the rows' block starts, rounded down to a
    key tile."""
    b = prefill_step([3, 0, 31, 64], [9, 70, 2, 40], 4, 2, 16, torch.float32, seed=4)
    o = extend(b, source, block_m=block_m, block_n=block_n, num_stages=num_stages)
    torch.testing.assert_close(o.cpu(), sdpa_reference(b, [3, 0, 31, 64], [9, 70, 2, 40],
                                                       0.25).cpu(), atol=1e-4, rtol=1e-4)


@needs_triton
def test_extend_reads_the_new_tokens_from_k_new_and_v_new_when_given():
    """With ``k_new``/``v_new`` the pool's rows of the new tokens are not read (zeroed here)."""
    b = prefill_step(PREFIX, NEW, 4, 2, 16, torch.float32, seed=7)
    want = sdpa_reference(b, PREFIX, NEW, 0.25)
    for p, req in zip(PREFIX, b["slots"]):
        b["k_buf"][req[p:]] = 0
        b["v_buf"][req[p:]] = 0
    torch.testing.assert_close(extend(b, "contiguous", block_m=16, block_n=16).cpu(), want.cpu(),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="k_new and v_new go together"):
        KERNELS["extend"].extend_attention(b["q"], b["k_buf"], b["v_buf"], b["qo_indptr"],
                                           b["kv_indptr"], b["kv_indices"], k_new=b["k_new"])
