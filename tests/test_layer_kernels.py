"""The decoder layer's Triton kernels — `fused_add_rmsnorm`, `silu_and_mul`, `rope_store_kv` —
against their torch references, and the references against the model's own torch code
(`testbed.engine.model`: RMSNorm, the MLP's ``F.silu(gate) * up``, `apply_rope`).

Runs in the interpreter (``TRITON_INTERPRET=1``, set before triton is imported: see
``tests/kernel_modules.py``) on tiny shapes, or with it off on CUDA with bf16 added.

Tolerances (absolute and relative, against the reference on the same inputs in the same dtype):
- ``rope_store_kv``: none, bitwise equal in every dtype (the same products and sums, each rounded
  to the dtype as torch rounds them; no fused multiply-add).
- ``residual_out`` of ``fused_add_rmsnorm``: bitwise equal (one add, rounded as torch rounds it).
- ``out`` of ``fused_add_rmsnorm`` and ``silu_and_mul``: fp32 1e-6 (observed <= 4 units in the last
  place: the norm's sum of squares in another order, ``exp`` from numpy or the GPU, not torch);
  fp16 2e-3 and bf16 1.6e-2, two units of the dtype (a value one fp32 unit off can round the
  other way, and the weight's product rounds after it), and at most 1% of the elements differ
  at all (rounding in another order than torch's, e.g. the weight product in fp32, would fail).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit kernel is defined

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from radix_kernels import reference as ref  # noqa: E402
from testbed.engine.model import RMSNorm, apply_rope, rope_tables  # noqa: E402
from tests.kernel_modules import load_kernel_modules, run_in_fresh_process  # noqa: E402

KERNELS, DEVICE, SKIP_REASON, FRESH_PROCESS = load_kernel_modules(
    ("norm", "activation", "rope_store"))
needs_triton = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-5


@pytest.mark.skipif(not FRESH_PROCESS, reason="the kernel grid runs in this process")
def test_layer_kernel_grid_in_fresh_process():
    """When triton was imported before TRITON_INTERPRET=1, run this file where it is set first."""
    run_in_fresh_process(__file__)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE or "cpu", dtype)


def close_to_reference(actual, expected):
    """Within the dtype's tolerance, and (16-bit) at most 1% of the elements differ at all."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[actual.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    if actual.dtype != torch.float32:
        assert (actual != expected).float().mean().item() <= 0.01


def tables(positions, head_dim, dtype):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cos, sin = rope_tables(torch.tensor(positions), inv_freq, dtype)
    return cos.to(DEVICE or "cpu"), sin.to(DEVICE or "cpu")


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_reference_norm_is_the_models_rmsnorm_of_the_sum(dtype):
    x, res = randn(5, 96, dtype=dtype, seed=1), randn(5, 96, dtype=dtype, seed=2)
    norm = RMSNorm(96, EPS, dtype=dtype, device=x.device)
    with torch.no_grad():
        norm.weight.copy_(randn(96, dtype=dtype, seed=3))
        out, res_out = ref.fused_add_rmsnorm(x, res, norm.weight, EPS)
        assert torch.equal(res_out, x + res) and torch.equal(out, norm(x + res))
        out, res_out = ref.fused_add_rmsnorm(x, None, norm.weight, EPS)
        assert res_out is x and torch.equal(out, norm(x))


def test_reference_silu_and_mul_is_the_mlps_activation():
    gate_up = randn(3, 2 * 40, dtype=torch.float16, seed=4, scale=3.0)
    gate, up = gate_up.split(40, dim=-1)
    assert torch.equal(ref.silu_and_mul(gate_up), F.silu(gate) * up)


def test_reference_rope_store_kv_is_apply_rope_then_store_kv():
    t, h, kh, d = 4, 6, 2, 16
    qkv = randn(t, (h + 2 * kh) * d, dtype=torch.float16, seed=5)
    cos, sin = tables([0, 3, 900, 40000], d, torch.float16)
    slots = torch.tensor([7, 2, 9, 4], device=DEVICE or "cpu")
    got, want = [[torch.zeros(10, kh, d, dtype=torch.float16, device=DEVICE or "cpu")
                  for _ in "kv"] for _ in range(2)]
    q = ref.rope_store_kv(qkv, cos, sin, slots, *got, h, kh)
    qk = apply_rope(qkv[:, :(h + kh) * d].view(t, h + kh, d), cos, sin)
    ref.store_kv(*want, slots, qk[:, h:], qkv[:, (h + kh) * d:].view(t, kh, d))
    assert q.is_contiguous() and torch.equal(q, qk[:, :h])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --------------------------------------------------------------------------- fused_add_rmsnorm


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("hidden", [64, 576])                  # 576: SmolLM2's, not a power of 2
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first_layer"])
@pytest.mark.parametrize("block_size", [None, 128], ids=["row_in_registers", "two_passes"])
def test_fused_add_rmsnorm_matches_reference(dtype, tokens, hidden, with_residual, block_size):
    """residual_out bitwise, out within tolerance; block_size 128 walks a row in blocks (the
    path of rows over 8,192), with a partial last block at hidden 576."""
    x = randn(tokens, hidden, dtype=dtype, seed=hidden + tokens, scale=2.0)
    res = randn(tokens, hidden, dtype=dtype, seed=1, scale=3.0) if with_residual else None
    w = randn(hidden, dtype=dtype, seed=2)
    out, res_out = KERNELS["norm"].fused_add_rmsnorm(x, res, w, EPS, block_size=block_size)
    want, want_res = ref.fused_add_rmsnorm(x, res, w, EPS)
    if with_residual:
        assert torch.equal(res_out, want_res)
    else:
        assert res_out is x
    close_to_reference(out, want)


@needs_triton
@pytest.mark.parametrize("block_size", [None, 64], ids=["row_in_registers", "two_passes"])
def test_fused_add_rmsnorm_in_place_outputs_equal_fresh_ones(block_size):
    """residual_out = residual and out = x (vLLM's in-place form), from strided row views."""
    wide = randn(5, 2, 200, dtype=torch.float16, seed=3)
    x, res = wide[:, 0].clone(), wide[:, 1]                   # res: rows 400 apart
    w = randn(200, dtype=torch.float16, seed=4)
    norm = KERNELS["norm"].fused_add_rmsnorm
    fresh_out, fresh_res = norm(x, res, w, EPS, block_size=block_size)
    out, res_out = norm(x, res, w, EPS, out=x, residual_out=res, block_size=block_size)
    assert out is x and res_out is res
    assert torch.equal(x, fresh_out) and torch.equal(wide[:, 1], fresh_res)


# --------------------------------------------------------------------------- silu_and_mul


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("inter,block_size", [(40, None), (300, None), (300, 64), (1100, None)])
def test_silu_and_mul_matches_reference(dtype, tokens, inter, block_size):
    """Odd widths, several column blocks a row (300 in 64s; 1,100 in 1,024s), a row-strided
    input (a slice of a wider tensor); gates up to ~|20| reach silu's flat and linear ends."""
    wide = randn(tokens, 2 * inter + 6, dtype=dtype, seed=inter + tokens, scale=6.0)
    gate_up = wide[:, 3:3 + 2 * inter]
    out = KERNELS["activation"].silu_and_mul(gate_up, block_size=block_size)
    close_to_reference(out, ref.silu_and_mul(gate_up))


# --------------------------------------------------------------------------- rope_store_kv

POSITIONS = [0, 1, 131071, 17, 100000, 4095, 7]               # large ones: angles of 1e5 rad
SLOTS = [12, 3, 30, 1, 22, 8, 17]                             # not in order, slot 0 unused


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 4, 16), (4, 1, 64), (9, 3, 64), (8, 2, 128)])
def test_rope_store_kv_is_bitwise_the_reference_and_apply_rope(dtype, tokens, num_heads,
                                                               num_kv_heads, head_dim):
    """q, the stored k and v equal the reference and the model's apply_rope bit for bit; the
    input is a column slice of a wider projection; other buffer rows stay untouched."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(tokens, width + 32, dtype=dtype, seed=head_dim + tokens)[:, 16:16 + width]
    cos, sin = tables(POSITIONS[:tokens], head_dim, dtype)
    slots = torch.tensor(SLOTS[:tokens], device=qkv.device)
    bufs = [randn(32, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (7, 8)]
    want_bufs = [b.clone() for b in bufs]
    q = KERNELS["rope_store"].rope_store_kv(qkv, cos, sin, slots, *bufs, num_heads, num_kv_heads)
    want = ref.rope_store_kv(qkv, cos, sin, slots, *want_bufs, num_heads, num_kv_heads)
    assert q.is_contiguous() and q.dtype == dtype and torch.equal(q, want)
    assert torch.equal(bufs[0], want_bufs[0]) and torch.equal(bufs[1], want_bufs[1])
    qk = apply_rope(qkv[:, :(num_heads + num_kv_heads) * head_dim]
                    .reshape(tokens, -1, head_dim), cos, sin)
    assert torch.equal(q, qk[:, :num_heads]) and torch.equal(bufs[0][slots], qk[:, num_heads:])


@needs_triton
def test_rope_store_kv_takes_any_strides_and_casts_to_the_buffers_dtype():
    """Column stride 2 in qkv, tables sliced from wider ones, int32 slots, fp16 buffers under
    fp32 activations (the stored values are the fp32 results cast)."""
    t, h, kh, d = 3, 4, 2, 32
    qkv = randn(t, 2 * (h + 2 * kh) * d, seed=9)[:, ::2]
    cos, sin = tables([5, 70000, 2], d, torch.float32)
    cos = torch.cat((cos, cos), -1)[..., :d]                  # row stride 2 * d
    sin = torch.cat((sin, sin), -1)[..., :d]
    slots = torch.tensor([4, 0, 6], dtype=torch.int32, device=qkv.device)
    bufs = [torch.zeros(8, kh, d, dtype=torch.float16, device=qkv.device) for _ in "kv"]
    want_bufs = [b.clone() for b in bufs]
    q = KERNELS["rope_store"].rope_store_kv(qkv, cos, sin, slots, *bufs, h, kh)
    want = ref.rope_store_kv(qkv, cos, sin, slots, *want_bufs, h, kh)
    assert torch.equal(q, want) and q.dtype == torch.float32
    assert torch.equal(bufs[0], want_bufs[0]) and torch.equal(bufs[1], want_bufs[1])


# --------------------------------------------------------------------------- argument checks


@needs_triton
@pytest.mark.parametrize("call,match", [
    (lambda k: k["norm"].fused_add_rmsnorm(randn(2, 3, 8), None, randn(8), EPS), "tokens, hidden"),
    (lambda k: k["norm"].fused_add_rmsnorm(randn(2, 8), randn(2, 9), randn(8), EPS), "residual"),
    (lambda k: k["norm"].fused_add_rmsnorm(randn(2, 8), None, randn(8, dtype=torch.float16),
                                           EPS), "weight"),
    (lambda k: k["norm"].fused_add_rmsnorm(randn(2, 8), None, randn(8), EPS,
                                           out=randn(2, 8, dtype=torch.float16)), "out must"),
    (lambda k: k["activation"].silu_and_mul(randn(2, 7)), "2 \\* intermediate"),
    (lambda k: k["rope_store"].rope_store_kv(randn(2, 70), *tables([0, 1], 16, torch.float32),
                                             torch.tensor([1, 2]), randn(4, 1, 16),
                                             randn(4, 1, 16), 2, 1), "qkv must"),
    (lambda k: k["rope_store"].rope_store_kv(randn(2, 64), *tables([0, 1], 16, torch.float16),
                                             torch.tensor([1, 2]), randn(4, 1, 16),
                                             randn(4, 1, 16), 2, 1), "cos must"),
    (lambda k: k["rope_store"].rope_store_kv(randn(2, 64), *tables([0, 1], 16, torch.float32),
                                             torch.tensor([1, 2, 3]), randn(4, 1, 16),
                                             randn(4, 1, 16), 2, 1), "out_slots"),
    (lambda k: k["rope_store"].rope_store_kv(randn(2, 64), *tables([0, 1], 16, torch.float32),
                                             torch.tensor([1, 2]), randn(4, 2, 16),
                                             randn(4, 2, 16), 2, 1), "k_buf"),
])
def test_bad_arguments_raise_value_errors_saying_what_is_allowed(call, match):
    with pytest.raises(ValueError, match=match):
        call(KERNELS)
