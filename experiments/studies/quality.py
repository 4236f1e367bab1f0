"""Quality of approximate KV reuse on a real model (issue 29): SmolLM2-135M-Instruct in the engine.

The real-model counterpart of `experiments.studies.beyond_prefix`, whose engine half ran a tiny
random Llama. Every run is one ``testbed.execute.execute`` of a composed config (as the command
line runs it): ``backend=engine model=smollm2_135m`` on the CPU, fp32, greedy, ``forced=false``
(generate mode: the model writes its answer, up to 16 tokens, ``workload.max_new_tokens=16``),
LPM, 4 programs in flight (``--in-flight``: later prompts find earlier ones' chunks cached).

- ``rag_text`` and ``paraphrase_text`` (testbed/workloads/rag_text.py), each in every mode of
  `beyond_prefix.MODES`: exact prefix caching (the baseline, exact by construction: no quality
  measured); blend (``cache.reuse=blend``) at recompute ratios 0, 0.05, 0.15, 0.3, 1; semantic
  matching (``cache.match=semantic``, recompute 0.15) at thresholds 0.5 and 0.8.
- ``few_shot_text``: without a cache (``cache=none``), with exact prefix caching, with blend at 0
  and 0.15: accuracy, and how many outputs equal those of the run without a cache.

Per run: *accuracy* — the share of requests whose answer (``Request.answer``) is in the first
non-empty line of their decoded output as a whole word (`correct`); the engine's quality of each
request that reused KV against exact recomputation of its prompt (`testbed.engine.quality`:
token agreement, first divergence, Rouge-L on token ids, KL over the first 16 output positions in
float64), summarised over those requests (mean; first divergence also median; KL mean, max, min);
*same as prefix*: the share of outputs identical to the exact run's; TTFT p50 (measured CPU
time, on whatever else the machine runs); prefill tokens computed (``prompt − cached −
approx_hit``) and the share saved against exact prefix caching.

No forced pass: the workloads' forced outputs are the answers' own 1–3 tokens, too short, and in
generate mode the KL at position i compares the exact and the approximate distributions given the
same tokens (the prompt and the approximate request's own first i outputs), which is well defined.

Writes ``quality.csv`` and ``quality.png`` (accuracy, outputs identical to exact decoding and KL
against prefill tokens saved, a point per mode, a column per task) into ``--out``
(docs/results/quality/); run dirs under ``--runs``; ``--replot`` redraws the figure from the CSV.

    python -m experiments.studies.quality        # 28 minutes on 2 shared CPU cores (1 thread)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from experiments import REPO, entry  # noqa: E402
from experiments.studies.beyond_prefix import MODES, Mode, family_color, donor_shares  # noqa: E402
from testbed.config.assembly import compose_config  # noqa: E402
from testbed.execute import execute  # noqa: E402
from testbed.workloads.sharegpt import load_tokenizer  # noqa: E402

NEW_TOKENS = 16  # the answer's room, and KL's first 16 positions (testbed.engine.quality)
# plain decode (attention=torch), as the figures in docs/results/quality.md were measured: the
# CPU default now decodes in cascade, equal within fp32 rounding, which can flip a near tie
ENGINE = ["backend=engine", "model=smollm2_135m", "engine.device=cpu", "engine.dtype=float32", "cache=radix",
          "scheduler=lpm", "engine.forced=false", "save_token_ids=true", "progress=false",
          "engine.attention=torch"]
# sizes for one CPU core: 16 documents, so that later prompts find earlier ones' documents
SIZES = {
    "rag_text": ["workload.num_requests=24", "workload.corpus_docs=16"],
    "paraphrase_text": ["workload.num_originals=8", "workload.paraphrases=2",
                        "workload.corpus_docs=16"],
    "few_shot_text": ["workload.num_tasks=3", "workload.questions_per_task=8",
                      "workload.max_operand=20"],
}
FEW_SHOT_MODES = [Mode("none"), Mode("prefix"), Mode("blend r=0", reuse="blend", recompute_ratio=0),
                  Mode("blend r=0.15", reuse="blend", recompute_ratio=0.15)]


def correct(text: str, answer: str) -> bool:
    """The answer is a whole word (not next to a letter, digit or minus sign before it) of the
    first non-empty line of ``text``: "The answer is: 1987." and "A: 14" count, a later line
    (a model that goes on writing examples) does not."""
    first = next((line for line in text.splitlines() if line.strip()), "")
    return re.search(rf"(?<![\w-]){re.escape(answer)}(?!\w)", first) is not None


def serve(task: str, mode: Mode, size: list[str], runs: Path) -> tuple[dict, pd.DataFrame]:
    """One engine run of ``task`` (``size``: its workload and arrival overrides) in ``mode``: its
    summary and its requests.jsonl."""
    cache = ["cache=none"] if mode.name == "none" else mode.overrides()
    run_dir = runs / task / mode.name.replace(" ", "_")
    if run_dir.exists():
        shutil.rmtree(run_dir)
    summary = execute(compose_config(ENGINE + [f"workload={task}", *size, *cache]), run_dir)
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    return summary, pd.DataFrame([json.loads(line) for line in lines])  # answers stay text


def describe(task: str, mode: Mode, summary: dict, rows: pd.DataFrame, tok,
             exact: pd.Series | None) -> dict:
    """The study's row for one run (module docstring); ``exact``: the exact run's outputs by id."""
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in rows["output_ids"]]
    outputs = pd.Series([tuple(ids) for ids in rows["output_ids"]], index=rows["id"])
    computed = summary["prompt_tokens"] - summary["cached_tokens"] - summary["approx_hit_tokens"]
    row = {"task": task, "mode": mode.name, "requests": len(rows),
           "accuracy": float(np.mean([correct(t, a) for t, a in zip(texts, rows["answer"])])),
           "same_as_exact": float((outputs == exact.reindex(outputs.index)).mean())
           if exact is not None else 1.0,
           "prompt_tokens": summary["prompt_tokens"], "cached_tokens": summary["cached_tokens"],
           "approx_hit_tokens": summary["approx_hit_tokens"],
           "recomputed_tokens": summary["recomputed_tokens"], "prefill_computed": computed,
           "ttft_p50_s": summary["ttft_p50_s"], "wall_s": summary["wall_s"]}
    measured = rows[rows["kl_mean"].notna()] if "kl_mean" in rows else rows.iloc[:0]
    row["measured"] = len(measured)
    if len(measured):
        row |= {"token_agreement": measured["token_agreement"].mean(),
                "first_divergence_mean": measured["first_divergence"].mean(),
                "first_divergence_median": measured["first_divergence"].median(),
                "rouge_l": measured["rouge_l"].mean(), "kl_mean": measured["kl_mean"].mean(),
                "kl_max": measured["kl_mean"].max(), "kl_min": measured["kl_mean"].min()}
    return row


def study(tasks: dict[str, list[Mode]], sizes: dict[str, list[str]], runs: Path,
          in_flight: int = 4) -> pd.DataFrame:
    """Every task in each of its modes, ``in_flight`` programs at a time; the first mode of a
    task is its exact reference."""
    tok = load_tokenizer("data:smollm2_135m_instruct")
    out = []
    for task, modes in tasks.items():
        size = sizes[task] + [f"workload.max_new_tokens={NEW_TOKENS}",
                              f"arrival.max_in_flight={in_flight}"]
        if task != "few_shot_text":
            shares = donor_shares([f"workload={task}", *size])
            print(f"{task}: prompts whose most similar earlier prompt reaches the threshold: "
                  + ", ".join(f"{t:g}: {s:.1%}" for t, s in shares.items()), flush=True)
        exact = None
        for mode in modes:
            summary, rows = serve(task, mode, size, runs)
            row = describe(task, mode, summary, rows, tok, exact)
            if exact is None:
                exact = pd.Series([tuple(ids) for ids in rows["output_ids"]], index=rows["id"])
            out.append(row)
            print(f"  {task:<15} {mode.name:<15} accuracy {row['accuracy']:.3f}  same "
                  f"{row['same_as_exact']:.3f}  computed {row['prefill_computed']:>6,}  KL "
                  f"{row.get('kl_mean', float('nan')):.3g} [{row.get('kl_min', float('nan')):.2g}, "
                  f"{row.get('kl_max', float('nan')):.2g}]  agreement "
                  f"{row.get('token_agreement', float('nan')):.3f}  wall {row['wall_s']:.0f} s",
                  flush=True)
    df = pd.DataFrame(out)
    for task, g in df.groupby("task", sort=False):
        base = g.loc[g["mode"] == "prefix", "prefill_computed"].iloc[0]
        df.loc[g.index, "saved_vs_prefix"] = 1.0 - g["prefill_computed"] / base
    return df


def style(mode: str) -> dict:
    """One marker and colour per mode, the same in every panel: blend darker as r grows; prefix
    caching a ring, so that blend r=1 (the same point) shows inside it."""
    family, _, value = mode.partition(" ")
    if family == "blend":
        r = float(value.split("=")[1])
        return {"marker": "s", "s": 48, "color": plt.cm.Blues(0.35 + 0.65 * r ** 0.5)}
    if family == "semantic":
        return {"marker": "^", "s": 48, "color": "C1" if value.endswith("0.5") else "C3"}
    return {"marker": "o", "s": 150, "facecolors": "none", "linewidths": 1.5,
            "edgecolors": family_color("prefix") if family == "prefix" else "grey"}


def plot(df: pd.DataFrame, path: Path) -> None:
    """Accuracy, the share of outputs identical to exact decoding, and mean KL against the share
    of prefill tokens saved: a column per task with approximate modes (few_shot_text, whose
    accuracy is 0 in every mode, is left to the table)."""
    tasks = [t for t in dict.fromkeys(df["task"]) if t != "few_shot_text"] or list(df["task"][:1])
    fig, axes = plt.subplots(3, len(tasks), figsize=(5.6 * len(tasks), 10), squeeze=False,
                             sharex="col")
    rows = (("accuracy", "accuracy against the ground truth"),
            ("same_as_exact", "outputs identical to exact decoding"),
            ("kl_mean", "KL(exact ‖ approx), nats, first 16\npositions, mean over reusing requests"))
    for col, task in enumerate(tasks):
        g = df[df["task"] == task]
        for ax, (key, label) in zip(axes[:, col], rows):
            y = g[key].fillna(0.0) if key in g else 0 * g["accuracy"]
            for mode, xi, yi in zip(g["mode"], 100 * g["saved_vs_prefix"], y):
                ax.scatter([xi], [yi], zorder=3, label=mode, **style(mode))
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if key != "kl_mean":
                ax.set_ylim(-0.03, 1.03)
        axes[2, col].set_yscale("symlog", linthresh=1e-3)
        axes[2, col].set_xlabel("prefill tokens saved against exact prefix caching (%)")
        axes[0, col].set_title(f"workload={task}")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("Approximate KV reuse on SmolLM2-135M-Instruct: quality against compute saved\n"
                 "(prefix caching and blend r=1 are exact: KL drawn at 0)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> pd.DataFrame:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["rag_text", "paraphrase_text",
                                                    "few_shot_text"])
    ap.add_argument("--modes", nargs="+", default=None,
                    help="mode names for rag_text and paraphrase_text (default: all)")
    ap.add_argument("--size", nargs="*", default=None,
                    help="workload overrides replacing every task's default size (a smoke run)")
    ap.add_argument("--in-flight", type=int, default=4, help="programs in flight")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "quality")
    ap.add_argument("--runs", type=Path, default=REPO / "multirun" / "quality_study")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--replot", action="store_true",
                    help="only redraw quality.png from --out's quality.csv")
    args = ap.parse_args(argv)
    if args.replot:
        plot(pd.read_csv(args.out / "quality.csv"), args.out / "quality.png")
        return pd.read_csv(args.out / "quality.csv")
    torch.set_num_threads(args.threads)
    ENGINE.append(f"threads={args.threads}")  # the engine's own (testbed.config.engine_timing)
    started = time.perf_counter()
    modes = [m for m in MODES if args.modes is None or m.name in args.modes]
    tasks = {t: FEW_SHOT_MODES if t == "few_shot_text" else modes for t in args.tasks}
    sizes = {t: args.size if args.size is not None else SIZES[t] for t in args.tasks}
    df = study(tasks, sizes, args.runs, args.in_flight)
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "quality.csv", index=False)
    plot(df, args.out / "quality.png")
    cols = ["task", "mode", "accuracy", "same_as_exact", "measured", "token_agreement",
            "first_divergence_mean", "first_divergence_median", "rouge_l", "kl_mean", "kl_max",
            "kl_min", "ttft_p50_s", "prefill_computed", "saved_vs_prefix"]
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(df[[c for c in cols if c in df]].to_string(index=False))
    print(f"wrote {args.out / 'quality.csv'} and {args.out / 'quality.png'}; "
          f"wall {time.perf_counter() - started:.1f} s")
    return df


if __name__ == "__main__":
    entry(main)
