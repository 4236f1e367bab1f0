"""The fused cascade decode kernel (`radix_kernels.cascade`, two launches) against its torch
reference and against plain decode over each request's whole KV, on a parameter grid.

Run in the Triton interpreter on the CPU (``TRITON_INTERPRET=1`` set before triton is
imported, as in ``tests/test_kernels.py``, whose docstring explains why and states the
tolerances); compiled on a GPU with bf16 added.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402

from radix_kernels import reference as ref  # noqa: E402
from tests.kernel_modules import load_kernel_modules, run_in_fresh_process  # noqa: E402

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
KERNELS, DEVICE, SKIP_REASON, FRESH_PROCESS = load_kernel_modules(("cascade",))
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.skipif(not FRESH_PROCESS, reason="the kernel grid runs in this process")
def test_kernel_grid_in_fresh_process():
    run_in_fresh_process(__file__)


def cascade_step(groups, own, width, num_heads, num_kv_heads, head_dim, dtype, seed,
                 padded_groups=0):
    """A decode step: ``groups`` ``[(prefix length, members)]``, request ``i`` with ``own[i]``
    tokens of its own (its new one included) after its group's prefix (all of its KV when in
    no group); member places padded to ``width`` (a narrower group repeats its first member)
    and ``padded_groups`` groups of one key (the padding slot 0) added, as a CUDA graph pads.
    Returns the kernel's arguments and each request's whole KV (for plain decode)."""
    g = torch.Generator().manual_seed(seed)
    need = sum(p for p, _ in groups) + sum(own) + 1
    free = (torch.randperm(need + 5, generator=g) + 1).tolist()
    batch = len(own)
    prefix_of = [[] for _ in range(batch)]
    prefix_lens, prefix_idx, gather = [], [], []
    places, grouped = [0] * batch, [False] * batch
    for gi, (length, members) in enumerate(groups):
        slots = [free.pop() for _ in range(length)]
        prefix_lens.append(length)
        prefix_idx += slots
        gather += members + [members[0]] * (width - len(members))
        for w, m in enumerate(members):
            prefix_of[m], places[m], grouped[m] = slots, gi * width + w, True
    for _ in range(padded_groups):
        prefix_lens.append(1)
        prefix_idx.append(0)
        gather += [0] * width
    suffix = [[free.pop() for _ in range(n)] for n in own]
    k_buf = torch.randn(need + 6, num_kv_heads, head_dim, generator=g)
    v_buf = torch.randn(need + 6, num_kv_heads, head_dim, generator=g)
    q = torch.randn(batch, num_heads, head_dim, generator=g)
    i64 = dict(dtype=torch.int64, device=DEVICE)

    def indptr(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), **i64)

    args = [t.to(DEVICE, dtype) for t in (q, k_buf, v_buf)] + [
        indptr([len(s) for s in suffix]), torch.tensor(sum(suffix, []), **i64),
        indptr(prefix_lens), torch.tensor(prefix_idx, **i64), torch.tensor(gather, **i64),
        torch.tensor(places, **i64), torch.tensor(grouped, dtype=torch.bool, device=DEVICE)]
    whole = [p + s for p, s in zip(prefix_of, suffix)]
    return args, (indptr([len(w) for w in whole]), torch.tensor(sum(whole, []), **i64))


def fp32(args):
    return [a.float() if a.is_floating_point() else a for a in args]


# (groups, own tokens per request, width): one group and a request alone; two groups, one
# narrower than the width; every request in one group; nobody grouped but one pair
CASES = [
    ([(30, [0, 2, 3])], [7, 5, 3, 30], 3),
    ([(12, [0, 1]), (70, [2, 4, 5])], [1, 28, 1, 9, 20, 2], 3),
    ([(40, [0, 1, 2, 3])], [1, 2, 3, 4], 4),
    ([(17, [3, 1])], [9, 1, 33, 2, 40], 2),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_cascade_kernel_equals_its_reference_and_plain_decode(dtype, num_heads, num_kv_heads,
                                                              case):
    groups, own, width = CASES[case]
    args, whole = cascade_step(groups, own, width, num_heads, num_kv_heads, 16, dtype, seed=case)
    o, lse = KERNELS["cascade"].cascade_decode_attention(*args, 0.3, suffix_splits=3,
                                                         prefix_splits=2, return_lse=True,
                                                         block_n=16)
    ro, rlse = ref.cascade_decode_attention(*fp32(args), 0.3, return_lse=True)
    po, plse = ref.decode_attention(*fp32(args[:3]), *whole, 0.3, return_lse=True)
    assert o.dtype == dtype and o.shape == args[0].shape
    for got, want in ((o, ro), (lse, rlse), (o, po), (lse, plse)):
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype],
                                   rtol=TOL[dtype])


@needs_triton
@pytest.mark.parametrize("suffix_splits, prefix_splits", [(1, 1), (8, 32), (5, 3)])
def test_cascade_kernel_with_empty_chunks_and_padded_groups_as_a_graph_pads_them(
        suffix_splits, prefix_splits):
    """More chunks than keys (empty chunks merge away) and two padded groups reading the
    padding slot, whose results no request reads; GQA 4 fills 8 rows a member."""
    args, whole = cascade_step([(20, [1, 2]), (3, [0, 4])], [2, 6, 1, 40, 1], 2, 8, 2, 16,
                               torch.float32, seed=9, padded_groups=2)
    o = KERNELS["cascade"].cascade_decode_attention(*args, suffix_splits=suffix_splits,
                                                    prefix_splits=prefix_splits, block_n=16)
    po = ref.decode_attention(*args[:3], *whole)
    torch.testing.assert_close(o.cpu(), po.cpu(), atol=1e-4, rtol=1e-4)


@needs_triton
def test_cascade_kernel_refuses_arguments_that_do_not_describe_a_plan():
    args, _ = cascade_step([(5, [0, 1])], [1, 1], 2, 4, 2, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="gather must hold W member places for each of the 0"):
        KERNELS["cascade"].cascade_decode_attention(*args[:5], args[5][:1], *args[6:])
    with pytest.raises(ValueError, match="places and grouped"):
        KERNELS["cascade"].cascade_decode_attention(*args[:8], args[8][:1], args[9])
