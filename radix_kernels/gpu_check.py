"""GPU check of the kernels: correctness at model shapes (fp32/fp16/bf16) and timings, as JSON.

The pytest grid (``tests/test_kernels.py``) covers tiny shapes in the interpreter; this covers
what only a GPU shows: compilation of every config, model-sized shapes (head_dim 64/128, GQA 4,
long prefixes), bf16, and speed against SDPA; the decoder layer's kernels (norm, SiLU, RoPE and
store: `gpu_check_layer`) against their torch references, timed beside them; and a sweep of the
prefill kernel's launch settings beside SDPA, whose best config the JSON reports
(``extend_sweep``). Run on a CUDA machine (about a minute; ``--max-s`` bounds the sweep so the
whole run ends by then)::

    python -m radix_kernels.gpu_check --out gpu_kernels.json

``--small`` shrinks every shape so the script itself can be checked on a CPU with
``TRITON_INTERPRET=1 python -m radix_kernels.gpu_check --small --device cpu``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time

import torch

from . import gpu_check_layer as layer
from . import reference as ref
from .decode import decode_attention
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
    if all(n == 1 for n in new):
        for splits in (1, 8, 32):
            d = decode_attention(q, kb, vb, kv, idx, num_kv_splits=splits)
            out[f"decode_err_splits{splits}"] = e = err(d, ro)
            ok &= within(d, ro, tol)
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


def sweep_configs(small):
    """extend_attention's launch settings ``(block_m, block_n, num_warps, num_stages)`` to try:
    the default first, then larger tiles first, every tile and warp count at 2 stages before any
    at 3 (compiled for sm_90, 2 and 3 stages took the same shared memory: the KV loads are
    gathers, which may not pipeline, so the stage count matters least)."""
    if small:
        return [(32, 32, 4, 2), (16, 16, 4, 2)]                # only to run the code
    tiles = list(itertools.product((128, 64), (64, 128, 32), (8, 4)))
    grid = [(*t, 2) for t in tiles] + [(*t, 3) for t in tiles]
    return [(64, 64, 4, 2)] + [c for c in grid if c != (64, 64, 4, 2)]


def extend_sweep(device, small, budget_s):
    """Prefill 4 x 2,048 at Llama-2-7B's heads in bf16 (``small``: 4 x 32, GQA d64, fp16 in the
    interpreter), beside SDPA: each launch setting that compiles, checked against the first's
    output (the default's) and timed; after the first, none is tried once ``budget_s`` seconds
    have passed (``skipped`` counts them)."""
    t0 = time.time()
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    n = 2048 // (64 if small else 1)
    model = MODELS[2] if small else MODELS[1]
    q, kb, vb, qo, kv, idx = make_batch([0] * 4, [n] * 4, *model[1:], dtype, device)
    out = {"case": f"prefill_4x{n}", "model": model[0], "dtype": str(dtype).removeprefix("torch."),
           "budget_s": None if math.isinf(budget_s) else budget_s, "configs": [], "skipped": 0}
    if device == "cuda":
        b, heads, kv_heads, dim = 4, *model[1:]
        qd = q.view(b, n, heads, dim).transpose(1, 2)
        kd = kb[idx.long()].view(b, n, kv_heads, dim).transpose(1, 2)
        vd = vb[idx.long()].view(b, n, kv_heads, dim).transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out["sdpa_ms"] = 1e3 * bench(lambda: sdpa(qd, kd, vd, is_causal=True), device)
    base = None
    for i, (bm, bn, warps, stages) in enumerate(sweep_configs(small)):
        if i > 0 and time.time() - t0 > budget_s:  # the default always runs
            out["skipped"] = len(sweep_configs(small)) - i
            break
        cfg = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}

        def run():
            return extend_attention(q, kb, vb, qo, kv, idx, max_new=n, block_m=bm, block_n=bn,
                                    num_warps=warps, num_stages=stages)
        try:
            o = run()
        except Exception as e:  # out of shared memory or registers: this config does not compile
            out["configs"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        base = o if base is None else base
        cfg["ok"] = within(o, base, TOL[dtype])
        cfg["ms"] = 1e3 * bench(run, device, warmup=5, rep=25)
        out["configs"].append(cfg)
    timed = [c for c in out["configs"] if c.get("ok")]
    if timed:
        best = min(timed, key=lambda c: c["ms"])
        out["default_ms"] = out["configs"][0].get("ms")
        out["best"] = {k: best[k] for k in ("block_m", "block_n", "num_warps", "num_stages", "ms")}
        if "sdpa_ms" in out:
            out["best"]["vs_sdpa"] = best["ms"] / out["sdpa_ms"]
    out["wall_s"] = time.time() - t0
    return out


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
        result["extend_sweep"] = extend_sweep(dev, small, budget)
        print(json.dumps(result["extend_sweep"]), flush=True)
    result["all_ok"] = all(c["ok"] for c in result["checks"] + result["layer_checks"])
    result["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"all_ok={result['all_ok']} wall_s={result['wall_s']:.1f} -> {args.out}")
    return 0 if result["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
