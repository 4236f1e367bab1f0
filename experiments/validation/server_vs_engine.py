"""Does a live server cache what the offline engine caches? `backend=server` against `testbed.serve`.

For each case (a model and a workload), the same workload runs twice with the same model, cache,
scheduler and KV pool: offline (``backend=engine``, in this process) and over HTTP
(``backend=server`` against ``python -m testbed.serve`` in a subprocess on a free loopback port).
Both generate (``forced=false``: the model's greedy tokens, EOS ends a call, later prompts splice
in the real outputs), so both sides run the very same token sequences when they agree.

- *One call at a time* (``arrival.max_concurrency=1``): every request's cached tokens and output
  ids must be equal, request for request.
- *In flight* (``arrival.max_in_flight=N``, programs at once): timing now differs (virtual time
  against wall-clock time, HTTP in between), so which calls share a batch differs; the two hit
  rates must agree within 0.02.

Both sides run torch on one thread (the server does so on a CPU), so their matmuls round alike.

    python -m experiments.validation.server_vs_engine [--model tiny|smollm2_135m ...]
        [--workload tree_of_thought sharegpt_chat] [--in-flight 8] [--out DIR]

Writes ``server_vs_engine.csv`` (one row per case and mode) and prints the table; exits 1 when a
case misses its target. With ``model=tiny`` (a random model without a tokenizer) only generated
token workloads run: the text workloads' token ids come from SmolLM2's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.api.server import start_server
from testbed.config.assembly import compose_config
from testbed.execute import execute
from testbed.report.markdown import markdown_table

# per model: its overrides, a KV pool both sides share, and each workload's size
MODELS = {
    "tiny": ["model=tiny", "cache.capacity_tokens=6000"],
    "smollm2_135m": ["model=smollm2_135m", "cache.capacity_tokens=20000"],
}
WORKLOADS = {
    "tree_of_thought": ["workload=tree_of_thought", "workload.num_problems=2"],
    "sharegpt_chat": ["workload=sharegpt_chat", "workload.num_conversations=3",
                      "workload.max_turns=3"],
}
TEXT = {"sharegpt_chat"}  # need the model's tokenizer (not model=tiny)
HIT_TOLERANCE = 0.02


@dataclass
class Case:
    model: str
    workload: str
    mode: str  # "one call at a time" | "N programs in flight"
    arrival: list[str]
    extra: tuple[str, ...] = ()  # e.g. a smaller workload (the tests)

    def overrides(self, vocab: int | None) -> list[str]:
        words = [*MODELS[self.model], *WORKLOADS[self.workload], *self.arrival, *self.extra,
                 "engine.forced=false", "progress=false", "engine.device=cpu"]
        if vocab is not None and self.workload not in TEXT:  # as the engine fits it offline
            words.append(f"workload.vocab_size={vocab}")
        return words


def records(run_dir: Path) -> pd.DataFrame:
    return pd.read_json(run_dir / "requests.jsonl", lines=True, dtype={"id": str}).set_index("id")


def run_offline(case: Case, out: Path) -> tuple[dict, pd.DataFrame, int | None]:
    summary = execute(compose_config([*case.overrides(None), "backend=engine",
                                      "save_token_ids=true"]), out)
    config = json.loads((out / "summary.json").read_text())["config"]
    vocab = config["workload"].get("vocab_size")
    return summary, records(out), vocab


def run_server(case: Case, url: str, vocab: int | None, out: Path) -> tuple[dict, pd.DataFrame]:
    summary = execute(compose_config([*case.overrides(vocab), "backend=server",
                                      f"server.url={url}", "save_token_ids=true"]), out)
    return summary, records(out)


def compare(case: Case, offline: tuple[dict, pd.DataFrame], served: tuple[dict, pd.DataFrame]
            ) -> dict:
    (eng, eng_rec), (srv, srv_rec) = offline, served
    both = eng_rec.add_suffix("_engine").join(srv_rec.add_suffix("_server"), how="inner")
    same_cached = int((both["cached_tokens_engine"] == both["cached_tokens_server"]).sum())
    same_output = int((both["output_ids_engine"] == both["output_ids_server"]).sum())
    exact = case.mode == "one call at a time"
    row = {"model": case.model, "workload": case.workload, "mode": case.mode,
           "requests": len(eng_rec), "matched": len(both), "failed": srv.get("failed_requests"),
           "same_cached_tokens": same_cached, "same_output_ids": same_output,
           "hit_rate_engine": eng["hit_rate"], "hit_rate_server": srv["hit_rate"],
           "ideal_engine": eng["ideal_hit_rate"], "ideal_server": srv["ideal_hit_rate"],
           "makespan_engine_s": eng["makespan_s"], "makespan_server_s": srv["makespan_s"]}
    hit_ok = srv["hit_rate"] is not None and abs(srv["hit_rate"] - eng["hit_rate"]) \
        <= HIT_TOLERANCE
    row["ok"] = bool(len(both) == len(eng_rec) == len(srv_rec) and not srv.get("failed_requests")
                     and (same_cached == len(both) if exact else hit_ok))
    return row


def run_case(case: Case, out: Path) -> dict:
    """Offline first (its fitted vocabulary tells the server run's), then the server."""
    offline = run_offline(case, out / "engine")
    *_, vocab = offline
    handle = start_server([*MODELS[case.model], "engine.device=cpu"], in_process=False, timeout_s=600)
    try:
        served = run_server(case, handle.url, vocab, out / "server")
    finally:
        handle.stop()
    return compare(case, offline[:2], served)


def cases(models: list[str], workloads: list[str], in_flight: int) -> list[Case]:
    modes = [("one call at a time", ["arrival.max_concurrency=1"]),
             (f"{in_flight} programs in flight", [f"arrival.max_in_flight={in_flight}"])]
    return [Case(m, w, mode, arrival) for m in models for w in workloads
            if not (m == "tiny" and w in TEXT) for mode, arrival in modes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.server_vs_engine",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", nargs="+", default=["tiny", "smollm2_135m"], choices=list(MODELS))
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--out", default=None, help="where to keep the runs (default: a temp dir)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)  # as the server's process does on a CPU (testbed/api/server.py)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="server_vs_engine_"))
    rows = []
    for i, case in enumerate(cases(args.model, args.workload, args.in_flight)):
        print(f"[{i + 1}] {case.model} · {case.workload} · {case.mode}", file=sys.stderr)
        rows.append(run_case(case, out / f"case_{i}"))
        print(json.dumps(rows[-1]), file=sys.stderr)
    table = pd.DataFrame(rows)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "server_vs_engine.csv", index=False)
    print(markdown_table(table.round(4), list(table.columns)))
    print(f"runs in {out}")
    return 0 if table["ok"].all() else 1


if __name__ == "__main__":
    from experiments import entry
    entry(main)
