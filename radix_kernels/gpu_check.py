"""GPU check of the kernels: correctness at model shapes (fp32/fp16/bf16) and timings, as JSON.

The pytest grid (``tests/test_kernels.py``) covers tiny shapes in the interpreter; this covers
what only a GPU shows: compilation of every config, model-sized shapes (head_dim 64/128, GQA 4,
long prefixes), bf16, and speed against SDPA; the decoder layer's kernels (norm, SiLU, RoPE and
store: `gpu_check_layer`) against their torch references, timed beside them; the fused cascade
decode kernel against plain decode; the prefill kernel reading the new tokens from contiguous
tensors and through tensor descriptors; and a sweep of the prefill kernel's launch settings and
sources beside SDPA, whose best config per source the JSON reports (``extend_sweep``,
`gpu_check_extend`). Run on a CUDA machine (about a minute; ``--max-s`` bounds the sweep so the
whole run ends by then)::

    python -m radix_kernels.gpu_check --out gpu_kernels.json

``--small`` shrinks every shape so the script itself can be checked on a CPU with
``TRITON_INTERPRET=1 python -m radix_kernels.gpu_check --small --device cpu``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from . import gpu_check_layer as layer
from . import reference as ref
from .cascade import cascade_decode_attention
from .decode import decode_attention
from .gpu_check_extend import extend_sweep
from .extend import extend_attention
from .merge import merge_states
from .store import store_kv

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (name, num_heads, num_kv_heads, head_dim): Llama-3-8B, Llama-2-7B, a small GQA model
MODELS = [("llama3_8b", 32, 8, 128), ("llama2_7b", 32, 32, 128), ("gqa_d64", 16, 4, 64)]


def make_batch(prefix, new, heads, kv_heads, dim, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(prefix) + sum(new)
    slots = (torch.randperm(total + 100, generator=g)[:total] + 1).to(torch.int32)
    k_buf = torch.randn(total + 101, kv_heads, dim, generator=g).to(device, dtype)
    v_buf = torch.randn(total + 101, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(sum(new), heads, dim, generator=g).to(device, dtype)
    qo = torch.tensor([0] + new).cumsum(0).to(device, torch.int32)
    kv = torch.tensor([0] + [p + n for p, n in zip(prefix, new)]).cumsum(0).to(device, torch.int32)
    return q, k_buf, v_buf, qo, kv, slots.to(device)


def err(a, b):
    return float((a.float() - b.float()).abs().max())


def within(a, b, tol):
    """Elementwise |a - b| <= tol + tol * |b| (torch.testing.assert_close with atol = rtol)."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= tol + tol * b.abs()).all())


def check_case(name, prefix, new, model, dtype, device):
    _, heads, kv_heads, dim = model
    q, kb, vb, qo, kv, idx = make_batch(prefix, new, heads, kv_heads, dim, dtype, device)
    tol = TOL[dtype]
    out = {"case": name, "model": model[0], "dtype": str(dtype).removeprefix("torch."),
           "prefix": prefix, "new": new, "tol": tol}
    f32 = (q.float(), kb.float(), vb.float())
    o, lse = extend_attention(q, kb, vb, qo, kv, idx, return_lse=True, max_new=max(new))
    ro, rlse = ref.extend_attention(*f32, qo, kv, idx, return_lse=True)
    out["extend_err"], out["extend_lse_err"] = err(o, ro), err(lse, rlse)
    ok = within(o, ro, tol) and within(lse, rlse, tol)
    ok &= new_tokens_contiguous(out, q, kb, vb, qo, kv, idx, prefix, new, ro, tol)
    if all(n == 1 for n in new):
        for splits in (1, 8, 32):
            d = decode_attention(q, kb, vb, kv, idx, num_kv_splits=splits)
            out[f"decode_err_splits{splits}"] = e = err(d, ro)
            ok &= within(d, ro, tol)
        ok &= cascade_case(out, q, kb, vb, kv, idx, tol)
    # store: exact, into a fresh copy of the buffers
    kb2, vb2 = kb.clone(), vb.clone()
    kb3, vb3 = kb.clone(), vb.clone()
    k_new = torch.randn(len(idx), kv_heads, dim, device=device).to(dtype)
    store_kv(kb2, vb2, idx, k_new, k_new)
    ref.store_kv(kb3, vb3, idx, k_new, k_new)
    out["store_exact"] = bool(torch.equal(kb2, kb3) and torch.equal(vb2, vb3))
    # merge: a state merged with itself keeps o and adds log 2 to lse (compiles the kernel at
    # this shape; the pytest grid checks the merge against split attention)
    m, mlse = merge_states(o, lse, o, lse)
    out["merge_err"] = err(m, o)
    out["merge_lse_err"] = err(mlse, lse + math.log(2))
    ok &= out["store_exact"] and within(m, o, tol) and within(mlse, lse + math.log(2), 1e-5)
    out["ok"] = bool(ok)
    return out


def new_tokens_contiguous(out, q, kb, vb, qo, kv, idx, prefix, new, ro, tol) -> bool:
    """The extend kernel reading the new tokens' K/V from contiguous tensors, with pointer tiles
    and with tensor descriptors (recorded as an error where this GPU or Triton has none)."""
    at = torch.cat([idx[int(kv[i]) + p:int(kv[i + 1])] for i, p in enumerate(prefix)]).long()
    ok = True
    for descriptors in (False, True):
        key = "extend_descriptors_err" if descriptors else "extend_contiguous_err"
        try:
            o = extend_attention(q, kb, vb, qo, kv, idx, max_new=max(new), k_new=kb[at],
                                 v_new=vb[at], descriptors=descriptors)
        except Exception as e:  # noqa: BLE001 - descriptors need a recent Triton
            out[key] = f"{type(e).__name__}: {str(e)[:160]}"
            ok &= descriptors  # the pointer tiles must work everywhere
            continue
        out[key] = err(o, ro)
        ok &= within(o, ro, tol)
    return ok


def cascade_case(out, q, kb, vb, kv, idx, tol) -> bool:
    """The fused cascade kernel on a decode batch whose longest half (at least two) shares the
    first of them's KV up to the shortest of them, beside plain decode over the same slots."""
    lens = (kv[1:] - kv[:-1]).tolist()
    members = sorted(range(len(lens)), key=lambda i: -lens[i])[:max(2, len(lens) // 2)]
    shared = min(lens[i] for i in members) - 1  # each keeps its own new token
    if shared < 1:
        out["cascade_err"] = None
        return True
    rows = [idx[int(kv[i]):int(kv[i + 1])] for i in range(len(lens))]
    prefix = rows[members[0]][:shared]
    for i in members:
        rows[i] = torch.cat([prefix, rows[i][shared:]])
    full = decode_attention(q, kb, vb, kv, torch.cat(rows), num_kv_splits=8)
    suffix = [r[shared:] if i in members else r for i, r in enumerate(rows)]
    i64 = dict(dtype=torch.int64, device=q.device)
    places = torch.zeros(len(lens), **i64)
    places[members] = torch.arange(len(members), **i64)
    grouped = torch.zeros(len(lens), dtype=torch.bool, device=q.device)
    grouped[members] = True
    o = cascade_decode_attention(
        q, kb, vb, torch.tensor([0] + [len(r) for r in suffix], **i64).cumsum(0),
        torch.cat(suffix), torch.tensor([0, shared], **i64), prefix,
        torch.tensor(members, **i64), places, grouped, suffix_splits=8, prefix_splits=32)
    out["cascade_err"] = err(o, full)
    return within(o, full, tol)


def bench(fn, device, warmup=10, rep=50):
    """Seconds a call of ``fn`` takes (median of CUDA-event timings; on a CPU one call)."""
    if device == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=warmup, rep=rep) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def timings(device, dtype, small):
    _, heads, kv_heads, dim = MODELS[0]
    rows = []
    scale = 16 if small else 1
    for name, prefix, new in [("prefill_4x2048", [0] * 4, [2048 // scale] * 4),
                              ("extend_4x512_on_4096", [4096 // scale] * 4, [512 // scale] * 4),
                              ("decode_64x2048", [2048 // scale] * (64 // scale),
                               [1] * (64 // scale))]:
        q, kb, vb, qo, kv, idx = make_batch(prefix, new, heads, kv_heads, dim, dtype, device)
        if new[0] == 1:
            s = bench(lambda: decode_attention(q, kb, vb, kv, idx), device)
        else:
            s = bench(lambda: extend_attention(q, kb, vb, qo, kv, idx, max_new=max(new)), device)
        pairs = sum(n * p + n * (n + 1) / 2 for p, n in zip(prefix, new))  # causal (q, k) pairs
        kv_bytes = 2 * (sum(prefix) + sum(new)) * kv_heads * dim * kb.element_size()
        row = {"case": name, "dtype": str(dtype).removeprefix("torch."), "ms": s * 1e3,
               "tflops": 4 * pairs * heads * dim / s / 1e12, "kv_gb_s": kv_bytes / s / 1e9}
        if prefix[0] == 0 and device == "cuda":  # dense baseline: SDPA on contiguous tensors
            b, n = len(new), new[0]
            qd = q.view(b, n, heads, dim).transpose(1, 2)
            kd = kb[idx.long()].view(b, n, kv_heads, dim).transpose(1, 2)
            vd = vb[idx.long()].view(b, n, kv_heads, dim).transpose(1, 2)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            row["sdpa_ms"] = 1e3 * bench(lambda: sdpa(qd, kd, vd, is_causal=True,
                                                       enable_gqa=True), device)
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_kernels.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter check)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false",
                   help="skip the sweep of extend_attention's launch settings")
    p.add_argument("--max-s", type=float, default=80.0,
                   help="the sweep stops by this many seconds into the run (default 80)")
    args = p.parse_args(argv)
    dev, small = args.device, args.small
    if dev.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device (use --device cpu --small "
              "under TRITON_INTERPRET=1 for the interpreter check)", file=sys.stderr)
        return 2
    dtypes = ["float32", "float16"] + ([] if dev == "cpu" else ["bfloat16"])
    s = 16 if small else 1
    cases = [("extend_ragged", [0, 100 // s, 1000 // s, 3000 // s],
              [512 // s, 1, 77 // s, 1024 // s]),
             ("decode_ragged", [0, 5, 700 // s, 4000 // s, 8191 // s], [1] * 5)]
    models = MODELS[:1] if small else MODELS
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else dev,
              "torch": torch.__version__, "checks": [], "timings": [], "layer_checks": [],
              "layer_timings": []}
    import triton
    result["triton"] = triton.__version__
    for dt in dtypes:
        for model in models:
            for name, prefix, new in cases:
                result["checks"].append(check_case(name, prefix, new, model, DTYPES[dt], dev))
                print(json.dumps(result["checks"][-1]), flush=True)
        for model in layer.MODELS:
            for tokens in (1, 5) if small else layer.TOKENS:
                result["layer_checks"].append(layer.check_layer_case(
                    layer.shrink(model, small), tokens, DTYPES[dt], dev))
                print(json.dumps(result["layer_checks"][-1]), flush=True)
    for dt in dtypes[1:]:
        result["timings"] += timings(dev, DTYPES[dt], small)
        print(json.dumps(result["timings"][-3:]), flush=True)
    result["layer_timings"] = layer.layer_timings(dev, DTYPES[dtypes[-1]], small, bench)
    print(json.dumps(result["layer_timings"]), flush=True)
    if args.sweep:  # what is left of --max-s; the CPU check (--small) tries both its configs
        budget = math.inf if small else args.max_s - (time.time() - t0)
        result["extend_sweep"] = extend_sweep(dev, small, budget, make_batch, bench, within,
                                              TOL, MODELS[2] if small else MODELS[1])
        print(json.dumps(result["extend_sweep"]), flush=True)
    result["all_ok"] = all(c["ok"] for c in result["checks"] + result["layer_checks"])
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"all_ok={result['all_ok']} wall_s={result['wall_s']:.1f} -> {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
