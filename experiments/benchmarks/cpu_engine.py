"""The engine's CPU kernels before and after issue 46, side by side in one process.

Two engines of the same model (``model=smollm2_135m`` by default, fp32, ``engine.device=cpu``,
one torch thread, cascade attention as the CPU's default), one with ``engine.cpu_kernels=torch``
(torch's ``linear``, decode attention on KV gathered into a padded batch: the engine before
issue 46) and one with ``engine.cpu_kernels=native`` (oneDNN linear on weights prepared once,
`testbed.engine.linear`; decode attention reading the KV pool in place,
`testbed.engine.cpu_attention`), and the native one with its attention kernel switched off
("linear only": what the linear layers alone bring). Each shape's steps run for every variant in
turn, ``--repeats`` times; the fastest repeat of each counts (the machine is shared: noise only
ever adds time). Printed in ms, with ``before / after``:

- **decode**: one step of ``--batch`` requests of ``--context`` cached tokens each, distinct KV
  (``distinct``), and the same with all requests sharing the first ``--shared`` tokens
  (``shared``: cascade reads that prefix once per step);
- **prefill**: ``--prefill`` requests of ``--prefill-len`` new tokens each, nothing cached;
- **attention alone** (one layer's decode attention, distinct KV): the engine's gather before
  (torch's fused CPU flash attention on the gathered, padded KV), torch's public SDPA on the
  same gathered KV (GQA by ``enable_gqa``), and the in-place kernel;
- **prefill attention alone** (one layer's prefill attention, ``--prefill-shapes``
  REQUESTSxNEW@PREFIX, slots shuffled over the pool): SDPA per request on gathered KV (before)
  and the in-place extend kernel.

- **linear alone** (every layer's four projections, so the weights stream from memory as in a
  step, at ``--linear-rows`` rows): oneDNN's matmul on its prepacked weights and the panel kernel
  (`testbed.engine.linear`, which runs the panels up to ``PANEL_ROWS`` rows).

"linear only" is the native engine with its attention kernels and C layer steps switched off.

    python -m experiments.benchmarks.cpu_engine [--batch 1 4 16 32] [--context 448]
        [--shared 384] [--prefill 1 4] [--prefill-len 448]
        [--prefill-shapes 16x64@448 2x512@0 4x256@256] [--linear-rows 1 4 16 32 64]
        [--repeats 5] [overrides]

Used in docs/results/cpu_engine.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from experiments.benchmarks.decode_batches import decode_batch
from testbed.config.assembly import assemble, compose_config
from testbed.calibration.grid import batch_on_slots
from testbed.engine.attention import FlatKV, PaddedKV, TorchAttention, decode, head_major_rows
from testbed.engine.cpu_attention import load_kernel
from testbed.engine.layer_kernels import TORCH_KERNELS
from testbed.engine.metadata import AttentionMetadata
from testbed.sim.step_shape import StepShape


def engine(overrides: list[str], kernels: str, slots: int):
    run = assemble(compose_config(["backend=engine", "engine.device=cpu",
                                   f"engine.cpu_kernels={kernels}", *overrides]))
    return run.build_executor(slots).runner, run.model_shape.vocab_size


def fastest(fns: dict[str, Callable[[], object]], repeats: int, inner: int = 1
            ) -> dict[str, float]:
    """ms of each function, the fastest of ``repeats`` rounds in which each runs in turn."""
    best = {k: np.inf for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t) / inner * 1e3)
    return best


def prefill_batch(n: int, length: int, vocab: int):
    slots = [np.arange(1 + i * length, 1 + (i + 1) * length) for i in range(n)]
    return batch_on_slots(StepShape(new=(length,) * n, context=(0,) * n), slots, vocab,
                          np.random.default_rng(0))


def check_same(after: torch.Tensor, before: torch.Tensor) -> None:
    """The same greedy tokens, logits within fp32 noise: thirty layers of differently ordered
    sums move SmolLM2's logits (magnitude ~30) by up to ~0.02 on random tokens."""
    if not torch.equal(after.argmax(-1), before.argmax(-1)):
        raise AssertionError("the kernels changed a greedy token")
    torch.testing.assert_close(after, before, atol=5e-2, rtol=0)


def row(label: str, ms: dict[str, float], before: str, after: str) -> None:
    cells = "  ".join(f"{k} {v:8.2f}" for k, v in ms.items())
    print(f"{label:<28} {cells}   before/after {ms[before] / ms[after]:5.2f}x", flush=True)


def attention_alone(runner, batch: int, context: int, repeats: int) -> dict[str, float]:
    """One layer's decode attention over ``batch`` distinct sequences of ``context + 1`` keys:
    the gather (before), public SDPA on the gathered KV, and the in-place kernel."""
    c = runner.model.config
    k_buf, v_buf = runner.kv_cache.k[0], runner.kv_cache.v[0]
    torch.manual_seed(0)
    length = context + 1
    slots = torch.randperm(runner.num_slots)[:batch * length].add_(1).view(batch, length).int()
    k_buf.normal_(), v_buf.normal_()
    q = torch.randn(batch, c.num_heads, c.head_dim)
    scale = c.head_dim ** -0.5
    gather = TorchAttention(c.num_kv_heads)
    mask = torch.ones(batch, 1, 1, length, dtype=torch.bool)
    padded = PaddedKV(kv_rows=head_major_rows(slots, c.num_kv_heads), mask=mask,
                      bias=torch.zeros(mask.shape))
    kernel, _ = load_kernel()
    native = TorchAttention(c.num_kv_heads, kernel=kernel)
    flat = FlatKV(torch.arange(0, batch * length + 1, length), slots.view(-1), 1)
    shape = (batch, c.num_kv_heads, length, c.head_dim)

    def sdpa():
        kp = k_buf.view(-1, c.head_dim).index_select(0, padded.kv_rows).view(shape)
        vp = v_buf.view(-1, c.head_dim).index_select(0, padded.kv_rows).view(shape)
        return F.scaled_dot_product_attention(q[:, :, None], kp, vp, scale=scale,
                                              enable_gqa=True)

    fns = {"gather": lambda: decode(gather, q, k_buf, v_buf, padded, scale),
           "sdpa": sdpa}
    if kernel is not None:
        fns["in_place"] = lambda: decode(native, q, k_buf, v_buf, flat, scale)
        torch.testing.assert_close(fns["in_place"](), fns["gather"](), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sdpa()[:, :, 0], fns["gather"](), atol=1e-5, rtol=1e-4)
    return fastest(fns, repeats, inner=5)


def prefill_attention_alone(runner, shape: str, repeats: int) -> dict[str, float]:
    """One layer's prefill attention of ``shape`` (REQUESTSxNEW@PREFIX) over slots shuffled
    across the pool: per-request SDPA on gathered KV (before) and the in-place kernel."""
    count, rest = shape.split("x")
    new, prefix = map(int, rest.split("@"))
    n = int(count)
    c = runner.model.config
    k_buf, v_buf = runner.kv_cache.k[0], runner.kv_cache.v[0]
    torch.manual_seed(0)
    k_buf.normal_(), v_buf.normal_()
    slots = (torch.randperm(runner.num_slots)[:n * (new + prefix)] + 1).int().numpy()
    q = torch.randn(n * new, c.num_heads, c.head_dim)
    scale = c.head_dim ** -0.5
    kernel, _ = load_kernel()
    fns = {}
    for name, backend in (("sdpa", TorchAttention(c.num_kv_heads)),
                          ("in_place", TorchAttention(c.num_kv_heads, kernel=kernel))):
        if name == "in_place" and kernel is None:
            continue
        meta = AttentionMetadata.build(np.full(n, new), np.full(n, new + prefix), slots, "cpu")
        meta.plan = backend.plan(meta)
        fns[name] = (lambda b, m: lambda: b.forward(q, k_buf, v_buf, m, scale))(backend, meta)
    if "in_place" in fns:
        torch.testing.assert_close(fns["in_place"](), fns["sdpa"](), atol=1e-5, rtol=1e-4)
    return fastest(fns, repeats)


def linear_alone(runner, rows: int, repeats: int) -> dict[str, float]:
    """Every layer's projections at ``rows`` rows: oneDNN's prepacked matmul and the panels."""
    layers = [m for layer in runner.model.layers
              for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                        layer.mlp.down_proj)]
    torch.manual_seed(0)
    inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1]) for m in layers}
    onednn = torch.ops.mkldnn._linear_pointwise

    def dnn():
        for m in layers:
            onednn(inputs[m.weight.shape[1]], m.packed, m.bias, "none", [], "")

    def panels():
        for m in layers:
            m.panel_forward(inputs[m.weight.shape[1]])

    fns = {"onednn": dnn}
    if all(getattr(m, "panels", None) is not None for m in layers):
        fns["panels"] = panels
        m = layers[0]
        x = inputs[m.weight.shape[1]]
        torch.testing.assert_close(m.panel_forward(x), onednn(x, m.packed, m.bias, "none", [], ""),
                                   atol=1e-4, rtol=1e-4)
    return fastest(fns, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.benchmarks.cpu_engine",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16, 32])
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--shared", type=int, default=384)
    ap.add_argument("--prefill", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--prefill-len", type=int, default=448)
    ap.add_argument("--prefill-shapes", nargs="+", default=["16x64@448", "2x512@0", "4x256@256"],
                    help="REQUESTSxNEW@PREFIX for the prefill attention alone")
    ap.add_argument("--linear-rows", nargs="+", type=int, default=[1, 4, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("overrides", nargs="*", default=["model=smollm2_135m"])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # as testbed.serve on a CPU, and vLLM's CPU backend here
    slots = max(max(args.batch) * (args.context + 1), max(args.prefill) * args.prefill_len,
                *(int(a) * sum(map(int, b.split("@")))
                  for a, b in (s.split("x") for s in args.prefill_shapes))) + 1
    before, vocab = engine(args.overrides, "torch", slots)
    after, _ = engine(args.overrides, "native", slots)
    print(f"linear: before {before.linear}, after {after.linear} {after.linear_error or ''}; "
          f"attention kernels: {after.decode_kernel_error or 'in place'}; layer steps: "
          f"{after.kernels.name} {after.kernels_error or ''}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} thread")
    kernel = after.attention.kernel

    layer_steps = after.kernels

    def linear_only(batch):
        # its attention plans then gather, as before, and the layer steps are torch's
        after.attention.kernel, after.kernels = None, TORCH_KERNELS
        try:
            return after.run(batch)
        finally:
            after.attention.kernel, after.kernels = kernel, layer_steps

    variants = lambda b: {"before": lambda: before.run(b),  # noqa: E731
                          "linear_only": lambda: linear_only(b), "after": lambda: after.run(b)}
    print("ms per step (fastest of --repeats)")
    for shared in (0, args.shared):
        for n in args.batch:
            if shared and n == 1:
                continue
            b = decode_batch(n, args.context, shared, vocab)
            check_same(after.run(b), before.run(b))
            row(f"decode {n:>2} x {args.context} " + ("shared" if shared else "distinct"),
                fastest(variants(b), args.repeats), "before", "after")
    for n in args.prefill:
        b = prefill_batch(n, args.prefill_len, vocab)
        row(f"prefill {n} x {args.prefill_len}", fastest(variants(b), args.repeats),
            "before", "after")
    print("one layer's decode attention, ms (distinct KV)")
    for n in args.batch:
        ms = attention_alone(after, n, args.context, args.repeats)
        row(f"attention {n:>2} x {args.context}", ms, "gather", "in_place" if "in_place" in ms
            else "gather")
    print("one layer's prefill attention, ms (slots shuffled)")
    for shape in args.prefill_shapes:
        ms = prefill_attention_alone(after, shape, args.repeats)
        row(f"prefill attention {shape}", ms, "sdpa", "in_place" if "in_place" in ms else "sdpa")
    print("every layer's projections, ms")
    for rows in args.linear_rows:
        ms = linear_alone(after, rows, args.repeats)
        row(f"linear {rows:>2} rows", ms, "onednn", "panels" if "panels" in ms else "onednn")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
