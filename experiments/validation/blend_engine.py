"""The engine's blend prefill on the CPU: its time and its first token's distance from exact.

A random Llama (fp32, torch attention, one thread) and a RAG-shaped prompt: a system prompt, four
documents, a question. Each document's KV is computed alone (positions 0 ..), then reused at its
place in the prompt through `testbed.engine.blend.blend_prefill` with ``r`` of each document's
tokens recomputed. Printed per ``r``: tokens carried through every layer, the median time of the
blend prefill (donor KV load included) and of an ordinary prefill of the whole prompt, and for the
last position's next-token distribution KL(exact || blend) and whether the argmax agrees. A random
model says nothing about real quality (its attention is diffuse, no token matters much); it shows
the mechanics and the compute saved.

    python -m experiments.validation.blend_engine [--doc-len 256] [--layers 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from testbed.engine.attention import TorchAttention
from testbed.engine.blend import blend_prefill
from testbed.engine.kv_cache import KVCache
from testbed.engine.loader import build_model, tiny_config
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.quality import kl_per_position


@dataclass(frozen=True)
class Span:  # the shape of the shared side's ReusedSpan
    dst: int
    src_slots: np.ndarray
    src_start: int
    recompute: int


@torch.inference_mode()
def prefill(model, kv, tokens, slots) -> torch.Tensor:
    t = len(tokens)
    meta = AttentionMetadata.build([t], [t], np.asarray(slots), "cpu")
    attention = TorchAttention(model.config.num_kv_heads)
    meta.plan = attention.plan(meta)
    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    return model(ids, torch.arange(t), meta, kv, attention)[0]


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc-len", type=int, default=256)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = tiny_config(num_hidden_layers=args.layers, hidden_size=256, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=32, intermediate_size=768,
                         vocab_size=1024)
    model = build_model(config, seed=0).eval()
    rng = np.random.default_rng(0)
    sys_len, q_len, d = 64, 32, args.doc_len
    prompt = rng.integers(0, 1024, sys_len + args.docs * d + q_len)
    n = len(prompt)
    starts = [sys_len + i * d for i in range(args.docs)]
    kv = KVCache.for_model(model.config, 3 * n, model.dtype, "cpu")
    exact_slots, req_slots = np.arange(1, n + 1), np.arange(2 * n + 1, 3 * n + 1)
    donor_first = n + 1
    exact = prefill(model, kv, prompt, exact_slots)
    t_exact = median_time(lambda: prefill(model, kv, prompt, exact_slots), args.repeats)
    donors = []
    for i, s in enumerate(starts):
        slots = np.arange(donor_first + i * d, donor_first + (i + 1) * d)
        prefill(model, kv, prompt[s:s + d], slots)
        donors.append(slots)
    exact_lp = torch.log_softmax(exact.float(), -1)[None]
    print(f"prompt {n} tokens ({args.docs} documents of {d}), {args.layers} layers; "
          f"ordinary prefill {t_exact * 1e3:.1f} ms")
    print("r     computed  blend_ms  vs_exact  kl_first   argmax_agrees")
    for r in (0.0, 0.05, 0.15, 0.3, 1.0):
        spans = [Span(s, slots, 0, round(r * d)) for s, slots in zip(starts, donors)]
        res = blend_prefill(model, kv, prompt, req_slots, 0, spans)
        t = median_time(lambda: blend_prefill(model, kv, prompt, req_slots, 0, spans),
                        args.repeats)
        kl = kl_per_position(exact_lp, torch.log_softmax(res.logits.float(), -1)[None]).item()
        agrees = int(res.logits.argmax()) == int(exact.argmax())
        print(f"{r:<5} {len(res.computed):>8}  {t * 1e3:8.1f}  {t / t_exact:8.2f}  {kl:9.2e}  "
              f"{agrees}")


if __name__ == "__main__":
    from experiments import entry
    entry(main)
