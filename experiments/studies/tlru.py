"""T-LRU against LRU on multi-turn conversations: hit rate and the requests over a prefill budget.

T-LRU (``eviction=tlru``, SGLang 0.5.23's ``TLRUStrategy``) evicts first what lies past
``history + next_prompt_estimate - threshold`` tokens of a conversation: with a TTFT budget of
``threshold`` recomputed tokens, those tokens cannot keep the next turn within it. It trades hit
rate for the tail: the measure is the share of requests whose uncached prompt exceeds ``threshold``
(``over``), beside the hit rate. Each workload is replayed one request at a time
(`testbed.backends.replay`) through the radix cache with LRU and with T-LRU at each threshold, with
the next-prompt estimate set to the workload's median new tokens per request (what an unlimited
cache leaves uncached), at cache capacities that are shares of the tokens the workload caches in
all.

Workloads: the Mooncake conversation trace (``data:mooncake_conversation`` from the data folder,
``python -m testbed.data fetch mooncake_conversation``; else skipped, said so) and multi-turn ShareGPT (``workload=sharegpt_chat``, 400
conversations; needs the ShareGPT file and tokenizer in the data folder).

    python -m experiments.studies.tlru [--thresholds 256 1024 4096] [--shares 0.05 0.1 0.2]
        [--figures docs/results/tlru]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
import numpy as np

from experiments import MOONCAKE_TRACE, entry, save_figure
from testbed.config.assembly import assemble, compose_config
from testbed.backends.replay import replay

def mooncake_overrides() -> list[str] | None:
    """The conversation trace as workload overrides, when the data folder has it."""
    if MOONCAKE_TRACE.exists():
        return ["workload=trace", "workload.path=data:mooncake_conversation",
                "workload.format=mooncake"]
    print("mooncake: skipped (not in the data folder; python -m testbed.data fetch "
          "mooncake_conversation)")
    return None


def run(requests, overrides: list[str], eviction: list[str], capacity: int | None):
    a = assemble(compose_config([*overrides, "backend=replay", "cache=radix", *eviction]))
    return replay(requests, a.build_cache(capacity, requests))


def study(name: str, overrides: list[str], thresholds: list[int], shares: list[float]
          ) -> list[dict]:
    """One workload's table (printed); returns its rows."""
    requests = assemble(compose_config([*overrides, "backend=replay"])).requests()
    prompt = np.array([len(r.prompt) for r in requests])
    ideal = run(requests, overrides, ["eviction=lru"], None)
    new = prompt - np.array([r.cached_tokens for r in ideal])
    estimate = int(np.median(new))
    total = sum(len(r.prompt) + len(r.output) for r in requests)
    print(f"\n{name}: {len(requests)} requests, {prompt.sum()} prompt tokens, ideal hit rate "
          f"{1 - new.sum() / prompt.sum():.4f}; next_prompt_estimate = median new tokens = "
          f"{estimate}")
    print(f"{'capacity':>10} {'eviction':<28} {'hit':>7} " +
          " ".join(f"{'over ' + str(t):>10}" for t in thresholds))
    rows = []
    for share in shares:
        capacity = int(total * share)
        settings = [("lru", ["eviction=lru"])] + [
            (f"tlru threshold={t}", ["eviction=tlru", f"eviction.threshold={t}",
                                     f"eviction.next_prompt_estimate={estimate}"])
            for t in thresholds]
        for label, eviction in settings:
            records = run(requests, overrides, eviction, capacity)
            missed = prompt - np.array([r.cached_tokens for r in records])
            rows.append({"share": share, "eviction": label,
                         "hit": 1 - missed.sum() / prompt.sum(),
                         **{t: (missed > t).mean() for t in thresholds}})
            print(f"{capacity:>10} {label:<28} {rows[-1]['hit']:7.4f} " +
                  " ".join(f"{rows[-1][t]:10.4f}" for t in thresholds))
    return rows


def plot(name: str, rows: list[dict], thresholds: list[int], path: Path) -> None:
    """Hit rate, and the share of requests over each threshold, against capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + len(thresholds), figsize=(4.2 * (1 + len(thresholds)), 3.6))
    for label in dict.fromkeys(r["eviction"] for r in rows):
        mine = [r for r in rows if r["eviction"] == label]
        shares = [r["share"] for r in mine]
        axes[0].plot(shares, [r["hit"] for r in mine], marker="o", label=label)
        for ax, t in zip(axes[1:], thresholds):
            ax.plot(shares, [r[t] for r in mine], marker="o", label=label)
    axes[0].set_title(f"{name}: hit rate")
    for ax, t in zip(axes[1:], thresholds):
        ax.set_title(f"requests with > {t} tokens uncached")
    for ax in axes:
        ax.set_xlabel("cache capacity (share of all tokens)")
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--thresholds", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.05, 0.1, 0.2],
                    help="cache capacities as shares of all prompt and output tokens")
    ap.add_argument("--conversations", type=int, default=400, help="sharegpt_chat's")
    ap.add_argument("--figures", type=Path, help="a folder for mooncake.png and sharegpt_chat.png")
    args = ap.parse_args()
    start = time.time()
    workloads = {"sharegpt_chat": ["workload=sharegpt_chat",
                                   f"workload.num_conversations={args.conversations}"]}
    mooncake = mooncake_overrides()
    if mooncake:
        workloads = {"mooncake": mooncake, **workloads}
    for name, overrides in workloads.items():
        rows = study(name, overrides, args.thresholds, args.shares)
        if args.figures:
            plot(name, rows, args.thresholds, args.figures / f"{name}.png")
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    entry(main)
