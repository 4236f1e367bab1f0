"""The beyond-exact-prefixes study (issue 21): cost in the simulator, quality in the engine.

Per workload (``rag``, ``paraphrase``) and mode — exact prefix caching; CacheBlend-style chunk
reuse (``cache.reuse=blend``) at recompute ratios 0, 0.05, 0.15, 0.3, 1; semantic matching
(``cache.match=semantic``, recompute ratio 0.15) at similarity thresholds 0.5 and 0.8 — two kinds
of run, each one ``testbed.execute.execute`` of a composed config (the assembly step, as the command
line runs it):

- *cost*: the simulator on Llama-3-8B / H100 (roofline, LPM, the pool one H100 leaves) at the
  workload's default size: exact hit tokens, ``approx_hit_tokens``, ``recomputed_tokens``, prefill
  tokens computed (``prompt − cached − approx_hit``), TTFT p50/p99, throughput;
- *quality*: the engine on the tiny random Llama (CPU) with a small config of the same workload,
  in forced mode (``kl_mean``: the issue's KL measure) and generate mode (``token_agreement_mean``:
  its greedy-token agreement). Exact prefix caching is exact by construction (no quality measured).

The thresholds: MinHash estimates the Jaccard similarity of token 3-gram sets. A rag prompt that
shares 3 of its 4 documents (and the system prompt) with an earlier one is about 0.5–0.6 similar,
one with all 4 documents in another order about 0.9; 0.5 (the default) thus takes donors sharing
most of the prompt, 0.8 only near-duplicates. The script prints, per workload, the share of prompts
whose most similar earlier prompt reaches each threshold, and how flat the tiny model's
next-token distributions are (why its KL is tiny and its agreement fragile). Writes
``beyond_prefix.csv`` and ``beyond_prefix.png`` (sim TTFT p50 against engine KL, one point per
mode, a panel per workload) into ``--out`` (docs/results/beyond_prefix/); the run dirs go under ``--runs`` (``python -m testbed.report`` reads them).

    python -m experiments.studies.beyond_prefix            # about 1-2 minutes on 2 CPU cores
The Hydra preset ``+experiment=beyond_prefix`` runs the simulator's blend grid as separate runs.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from experiments import REPO, entry  # noqa: E402
from testbed.config.assembly import assemble, compose_config  # noqa: E402
from testbed.cache.similarity import MinHashIndex  # noqa: E402
from testbed.engine.quality import exact_logits  # noqa: E402
from testbed.execute import execute  # noqa: E402

SIM = ["backend=sim", "model=llama3_8b", "hardware=h100", "cache=radix", "scheduler=lpm",
       "cost_model=roofline", "progress=false"]
ENGINE = ["backend=engine", "model=tiny", "cache=radix", "scheduler=lpm", "progress=false",
          "engine.attention=torch",  # plain decode, as its figures were measured (the CPU default cascades)
          "arrival.max_in_flight=4"]  # 4 programs at a time: later prompts find earlier chunks
# The engine's small workloads: the shapes of the defaults (conf/workload), scaled to a CPU.
SMALL = {
    "rag": ["workload.num_requests=32", "workload.corpus_docs=12", "workload.docs_per_prompt=4",
            "workload.doc_len=32", "workload.question_len=8", "workload.system_prompt_len=16",
            "workload.output_len=8"],
    "paraphrase": ["workload.num_originals=8", "workload.paraphrases=3",
                   "workload.prompt_len=128", "workload.output_len=8"],
}
THRESHOLDS = (0.5, 0.8)


@dataclass(frozen=True)
class Mode:
    name: str
    reuse: str = "prefix"
    match: str = "exact"
    recompute_ratio: float = 0.15
    similarity_threshold: float = 0.5

    def overrides(self) -> list[str]:
        return [f"cache.reuse={self.reuse}", f"cache.match={self.match}",
                f"cache.recompute_ratio={self.recompute_ratio}",
                f"cache.similarity_threshold={self.similarity_threshold}"]

    @property
    def approximate(self) -> bool:
        return self.reuse != "prefix" or self.match != "exact"


MODES = [Mode("prefix"),
         *(Mode(f"blend r={r:g}", reuse="blend", recompute_ratio=r)
           for r in (0, 0.05, 0.15, 0.3, 1)),
         *(Mode(f"semantic t={t:g}", match="semantic", similarity_threshold=t)
           for t in THRESHOLDS)]


def run_once(overrides: list[str], run_dir: Path) -> dict:
    """One run through the command line's path (compose, assemble, serve, write)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    return execute(compose_config(overrides), run_dir)


def cost(workload: str, mode: Mode, runs: Path) -> dict:
    s = run_once(SIM + [f"workload={workload}"] + mode.overrides(), runs / "sim" / workload /
                 mode.name.replace(" ", "_"))
    return {"prompt_tokens": s["prompt_tokens"], "cached_tokens": s["cached_tokens"],
            "approx_hit_tokens": s["approx_hit_tokens"],
            "recomputed_tokens": s["recomputed_tokens"],
            "prefill_computed": s["prompt_tokens"] - s["cached_tokens"] - s["approx_hit_tokens"],
            "evicted_tokens": s["evicted_tokens"], "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p99_s": s["ttft_p99_s"], "throughput_tok_s": s["throughput_tok_s"],
            "throughput_req_s": s["throughput_req_s"], "makespan_s": s["makespan_s"]}


def quality(workload: str, mode: Mode, runs: Path) -> dict:
    """Forced mode's KL and generate mode's agreement (and the other two for completeness)."""
    out: dict = {}
    for forced in (True, False):
        tag = "forced" if forced else "generate"
        s = run_once(ENGINE + [f"workload={workload}", f"engine.forced={str(forced).lower()}"]
                     + SMALL[workload] + mode.overrides(),
                     runs / "engine" / workload / f"{mode.name.replace(' ', '_')}_{tag}")
        if forced:
            out |= {"engine_prompt_tokens": s["prompt_tokens"],
                    "engine_cached_tokens": s["cached_tokens"],
                    "engine_approx_hit_tokens": s["approx_hit_tokens"],
                    "engine_recomputed_tokens": s["recomputed_tokens"],
                    "kl_mean": s.get("kl_mean"),
                    "token_agreement_forced": s.get("token_agreement_mean")}
        else:
            out |= {"token_agreement_mean": s.get("token_agreement_mean"),
                    "kl_mean_generate": s.get("kl_mean")}
    return out


def donor_shares(overrides: list[str]) -> dict[float, float]:
    """Share of the composed config's prompts whose most similar earlier prompt, by the cache's
    MinHash estimate, reaches each threshold."""
    requests = assemble(compose_config(overrides)).requests()
    index, best = MinHashIndex(), []
    for r in requests:
        found = index.best(r.prompt, 0.0)
        best.append(found[0][0] if found else 0.0)
        index.add(r.id, r.prompt)
    best_arr = np.asarray(best)
    return {t: float((best_arr >= t).mean()) for t in THRESHOLDS}


def model_spread(workload: str) -> dict[str, float]:
    """How flat the engine's model's next-token distributions are on the small workload's first
    prompt (exact forward): mean entropy against the uniform one's, mean top-1 probability,
    median gap between the two most likely tokens. Flat distributions make KL tiny and argmax
    agreement fragile (README: what the tiny model can tell)."""
    run = assemble(compose_config(ENGINE + [f"workload={workload}"] + SMALL[workload]))
    prompt = run.requests()[0].prompt
    model = run.build_executor(len(prompt) + 1).model
    logp = torch.log_softmax(exact_logits(model, prompt).float(), -1)
    p = logp.exp()
    top2 = p.topk(2, -1).values
    return {"entropy": float(-(p * logp).sum(-1).mean()), "uniform": float(np.log(p.shape[-1])),
            "top1": float(top2[:, 0].mean()), "gap": float((top2[:, 0] - top2[:, 1]).median())}


def family_color(mode: str) -> str:
    return {"prefix": "black", "blend": "C0", "semantic": "C1"}[mode.split()[0]]


def _label_groups(xs: list[float], ys: list[float], names: list[str], close: float
                  ) -> list[tuple[float, float, str]]:
    """Points at the same KL (to 0.1 %, or within 1e-7: rounding around 0) and within ``close``
    in TTFT share one label (e.g. blend modes that reused nothing), so labels do not print over
    each other."""
    groups: list[tuple[float, float, list[str]]] = []
    for x, y, n in zip(xs, ys, names):
        for gx, gy, members in groups:
            if abs(gx - x) <= max(1e-3 * abs(x), 1e-7) and abs(gy - y) <= close:
                members.append(n)
                break
        else:
            groups.append((x, y, [n]))
    return [(x, y, _join(m)) for x, y, m in groups]


def _join(names: list[str]) -> str:
    """``blend r=0``, ``blend r=1`` -> ``blend r=0, 1`` (one family name per run of members)."""
    parts: list[str] = []
    for prev, name in zip([None, *names], names):
        same = prev is not None and prev.split()[0] == name.split()[0] and "=" in name
        parts.append(name.split("=", 1)[1] if same else name)
    return ", ".join(parts)


def plot(df: pd.DataFrame, path: Path) -> None:
    workloads = list(dict.fromkeys(df["workload"]))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        g = df[df["workload"] == w]
        # exact prefix caching, and a mode in which no request reused KV, is exact: drawn at KL 0
        kl = g["kl_mean"].fillna(0.0)
        ttft = g["ttft_p50_s"]
        ax.scatter(kl, ttft, c=[family_color(m) for m in g["mode"]], zorder=3)
        close = 0.04 * (ttft.max() - ttft.min() or 1.0)
        for x, y, label in _label_groups(list(kl), list(ttft), list(g["mode"]), close):
            right = x > 0 and x == kl.max()  # the rightmost label reads leftwards
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(-5 if right else 5, -10),
                        ha="right" if right else "left", fontsize=8)
        for family in ("prefix", "blend", "semantic"):
            ax.scatter([], [], c=family_color(family), label=family)
        ax.legend(loc="lower left", fontsize=8)
        ax.set_xscale("symlog", linthresh=1e-6)
        ax.set_xlabel("engine KL(exact ‖ approx), mean per output token\n"
                      "(tiny random Llama, forced mode; nats)")
        ax.set_ylabel("simulated TTFT p50 (s), Llama-3-8B / H100")
        ax.set_title(f"workload={w}")
        ax.grid(alpha=0.3)
    fig.suptitle("KV reuse beyond exact prefixes: cost (simulator) against quality (engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["rag", "paraphrase"])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "beyond_prefix")
    ap.add_argument("--runs", type=Path, default=REPO / "multirun" / "beyond_prefix_study")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the engine (tiny shapes: more only add contention)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ENGINE.append(f"threads={args.threads}")  # the engine's own (testbed.config.engine_timing)
    started = time.perf_counter()
    rows = []
    for w in args.workloads:
        shares = donor_shares(SIM + [f"workload={w}"])  # the default size
        print(f"{w}: prompts whose most similar earlier prompt reaches the threshold: "
              + ", ".join(f"{t:g}: {s:.1%}" for t, s in shares.items()), flush=True)
        spread = model_spread(w)
        print(f"{w}: engine model's next-token entropy {spread['entropy']:.4f} nats (uniform "
              f"{spread['uniform']:.4f}), top-1 probability {spread['top1']:.4f}, median top-1 - "
              f"top-2 gap {spread['gap']:.2e}", flush=True)
        for mode in MODES:
            t0 = time.perf_counter()
            row = {"workload": w, "mode": mode.name, "reuse": mode.reuse, "match": mode.match,
                   "recompute_ratio": mode.recompute_ratio if mode.approximate else None,
                   "similarity_threshold": mode.similarity_threshold
                   if mode.match == "semantic" else None}
            row |= cost(w, mode, args.runs)
            t1 = time.perf_counter()
            row |= quality(w, mode, args.runs)
            row |= {"sim_wall_s": t1 - t0, "engine_wall_s": time.perf_counter() - t1}
            rows.append(row)
            print(f"  {mode.name:<15} computed {row['prefill_computed']:>9,}  TTFT p50 "
                  f"{row['ttft_p50_s']:.3f} s  KL {row['kl_mean'] if row['kl_mean'] is not None else '-'}"
                  f"  agreement {row['token_agreement_mean'] if row['token_agreement_mean'] is not None else '-'}",
                  flush=True)
    df = pd.DataFrame(rows)
    for w, g in df.groupby("workload", sort=False):
        base = g.loc[g["mode"] == "prefix", "prefill_computed"]
        if len(base):
            df.loc[g.index, "computed_vs_prefix"] = g["prefill_computed"] / base.iloc[0]
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "beyond_prefix.csv", index=False)
    plot(df, args.out / "beyond_prefix.png")
    cols = ["workload", "mode", "cached_tokens", "approx_hit_tokens", "recomputed_tokens",
            "prefill_computed", "computed_vs_prefix", "ttft_p50_s", "ttft_p99_s",
            "throughput_tok_s", "kl_mean", "token_agreement_mean"]
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(df[cols].to_string(index=False))
    print(f"wrote {args.out / 'beyond_prefix.csv'} and {args.out / 'beyond_prefix.png'}; "
          f"wall {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    entry(main)
