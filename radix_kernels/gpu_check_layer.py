"""GPU check of the decoder layer's kernels (`fused_add_rmsnorm`, `silu_and_mul`,
`rope_store_kv`): correctness against their torch references at model shapes, and timings beside
them. Called by :mod:`radix_kernels.gpu_check`, which writes the JSON.

Each reference runs in the kernel's dtype on the same device, so the comparison is the engine's
torch path against the kernel. Exact (bitwise) where the kernels promise it: ``residual_out``,
RoPE's q and the stored k and v; within ``TOL`` (two units of the dtype; fp32 a few units in the
last place) for the norm's ``out`` and the SiLU product, whose fp32 ``rsqrt``/``exp`` and sum
order are the GPU's.
"""

from __future__ import annotations

import torch

from . import reference as ref
from .activation import silu_and_mul
from .norm import fused_add_rmsnorm
from .rope_store import rope_store_kv

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (name, hidden, intermediate, num_heads, num_kv_heads, head_dim): the HF configs' numbers
MODELS = [("llama2_7b", 4096, 11008, 32, 32, 128), ("llama3_8b", 4096, 14336, 32, 8, 128)]
TOKENS = (1, 32, 4096)
EPS = 1e-5


def shrink(model, small):
    """``--small``: the model's shape divided down so the interpreter runs it in seconds."""
    if not small:
        return model
    name, hidden, inter, heads, kv_heads, _ = model
    return name, hidden // 16, inter // 16, heads // 8, max(kv_heads // 8, 1), 32


def layer_inputs(model, tokens, dtype, device, seed=0):
    """Random inputs of the three kernels for ``tokens`` tokens of one layer of ``model``."""
    _, hidden, inter, heads, kv_heads, dim = model
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

    positions = torch.randint(0, 131072, (tokens,), generator=g).float()
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim)
    angle = (positions[:, None] * inv_freq)[:, None, :]                # [T, 1, D / 2]
    cos, sin = angle.cos(), angle.sin()
    num_slots = tokens + 100
    return {
        "x": randn(tokens, hidden), "residual": randn(tokens, hidden, scale=4.0),
        "weight": randn(hidden, scale=0.5), "gate_up": randn(tokens, 2 * inter, scale=3.0),
        "qkv": randn(tokens, (heads + 2 * kv_heads) * dim),
        "cos": torch.cat((cos, cos), -1).to(device, dtype),
        "sin": torch.cat((-sin, sin), -1).to(device, dtype),
        "slots": (torch.randperm(num_slots, generator=g)[:tokens] + 1).to(device),
        "k_buf": randn(num_slots + 1, kv_heads, dim), "v_buf": randn(num_slots + 1, kv_heads, dim),
    }


def _err(a, b):
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _within(a, b, tol):
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= tol + tol * b.abs()).all())


def _differing(a, b):
    """Fraction of elements not bitwise equal."""
    return float((a != b).float().mean()) if a.numel() else 0.0


def check_layer_case(model, tokens, dtype, device):
    """One model shape, token count and dtype: every kernel against its reference."""
    heads, kv_heads = model[3], model[4]
    i = layer_inputs(model, tokens, dtype, device)
    tol = TOL[dtype]
    out = {"case": f"layer_t{tokens}", "model": model[0], "tokens": tokens,
           "dtype": str(dtype).removeprefix("torch."), "tol": tol}
    o, r = fused_add_rmsnorm(i["x"], i["residual"], i["weight"], EPS)
    ro, rr = ref.fused_add_rmsnorm(i["x"], i["residual"], i["weight"], EPS)
    o1, _ = fused_add_rmsnorm(i["x"], None, i["weight"], EPS)        # the first layer's form
    ro1, _ = ref.fused_add_rmsnorm(i["x"], None, i["weight"], EPS)
    out["norm_residual_exact"] = bool(torch.equal(r, rr))
    out["norm_err"] = max(_err(o, ro), _err(o1, ro1))
    out["norm_differing"] = max(_differing(o, ro), _differing(o1, ro1))
    ok = out["norm_residual_exact"] and _within(o, ro, tol) and _within(o1, ro1, tol)
    s, rs = silu_and_mul(i["gate_up"]), ref.silu_and_mul(i["gate_up"])
    out["silu_err"], out["silu_differing"] = _err(s, rs), _differing(s, rs)
    ok &= _within(s, rs, tol)
    bufs = (i["k_buf"].clone(), i["v_buf"].clone())
    q = rope_store_kv(i["qkv"], i["cos"], i["sin"], i["slots"], *bufs, heads, kv_heads)
    rq = ref.rope_store_kv(i["qkv"], i["cos"], i["sin"], i["slots"], i["k_buf"], i["v_buf"],
                           heads, kv_heads)
    out["rope_exact"] = bool(torch.equal(q, rq) and torch.equal(bufs[0], i["k_buf"])
                             and torch.equal(bufs[1], i["v_buf"]))
    out["rope_err"] = _err(q, rq)
    out["ok"] = bool(ok and out["rope_exact"])
    return out


def layer_timings(device, dtype, small, bench):
    """Each kernel beside its torch reference at Llama-3-8B's shape, for every token count."""
    model = shrink(MODELS[1], small)
    heads, kv_heads = model[3], model[4]
    rows = []
    for tokens in (1, 5) if small else TOKENS:
        i = layer_inputs(model, tokens, dtype, device)
        rope_args = (i["qkv"], i["cos"], i["sin"], i["slots"], i["k_buf"], i["v_buf"], heads,
                     kv_heads)
        pairs = {
            "fused_add_rmsnorm": (
                lambda: fused_add_rmsnorm(i["x"], i["residual"], i["weight"], EPS),
                lambda: ref.fused_add_rmsnorm(i["x"], i["residual"], i["weight"], EPS)),
            "silu_and_mul": (lambda: silu_and_mul(i["gate_up"]),
                             lambda: ref.silu_and_mul(i["gate_up"])),
            "rope_store_kv": (lambda: rope_store_kv(*rope_args),
                              lambda: ref.rope_store_kv(*rope_args)),
        }
        for name, (kernel, reference) in pairs.items():
            ms, ref_ms = 1e3 * bench(kernel, device), 1e3 * bench(reference, device)
            rows.append({"kernel": name, "model": model[0], "tokens": tokens,
                         "dtype": str(dtype).removeprefix("torch."), "ms": ms, "torch_ms": ref_ms,
                         "speedup": ref_ms / ms})
    return rows
