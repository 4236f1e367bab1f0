"""Does the testbed cache what a live vLLM caches? ``backend=server`` against vLLM 0.32 (CPU).

vLLM is installed and served as `server` says (``setup``: the venv only; ``serve``: start it and
keep it until stopped), with a block size and a number of KV blocks the testbed is then told.
Each case's workload is driven by ``backend=server`` (forced lengths: ``ignore_eos`` and
``min_tokens``; prefill-only calls as ``server.prefill_only=one_token``, since vLLM refuses
``max_tokens: 0``):

- *One call at a time* (``arrival.max_concurrency=1``): the run's calls, their prompts as sent
  and outputs as received, become a token trace in the order sent (`token_trace`), replayed with
  ``backend=replay cache=block_hash`` on the same blocks; every request's ``cached_tokens`` must
  equal vLLM's. The trace drops each call's last output token: vLLM samples it but never computes
  its KV, so a block it would fill is never hashed.
- *Closed loops* (``arrival.max_in_flight=N``): the simulator (``backend=sim scheduler=vllm
  cache=block_hash``, the fitted SmolLM2 CPU cost model) runs the calls as they ran on vLLM
  (`as_ran_trace`: the prompts sent and outputs received, with the workload's programs,
  dependencies and times) with the same arrival settings; its hit rate must be within 0.02 of
  vLLM's. It also runs the workload as generated, reported beside it: there the outputs are the
  workload's forced ids, all distinct, where vLLM's greedy outputs are equal for equal prompts
  (tree-of-thought's sibling thoughts), which a later prompt that splices them in then shares.

    python -m experiments.validation.vllm.caching [--workload sharegpt_chat ...] [--loops 4 16]
        [--block-size 32] [--blocks 512] [--out DIR] [--cache-dir DIR]
    python -m experiments.validation.vllm.caching setup   # the venv only

Writes ``vs_vllm.csv`` (one row per case) and prints the table; exits 1 when a case misses.
Results: docs/results/vs_vllm.md.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.validation.vllm.live import (DEFAULT_CACHE, Fail, Served, records,
                                                run_server, venv_python, vllm_server)

HIT_TOLERANCE = 0.02
WORKLOADS = {
    "sharegpt_chat": ["workload=sharegpt_chat", "workload.num_conversations=4",
                      "workload.max_turns=3", "workload.max_total_len=2048"],
    "few_shot_text": ["workload=few_shot_text", "workload.num_tasks=2",
                      "workload.questions_per_task=6"],
    "tree_of_thought": ["workload=tree_of_thought", "workload.num_problems=2",
                        "workload.vocab_size=49152"],
}
# The first requests of Mooncake's conversation trace (FAST'25): its prompts run to 87k tokens, past
# SmolLM2's context, so each is cut to its first MOONCAKE_PROMPT tokens (block 0, shared by all,
# and one of its own) and each output to MOONCAKE_OUTPUT tokens, for time on 2 cores.
MOONCAKE = "data:mooncake_conversation"
MOONCAKE_REQUESTS, MOONCAKE_PROMPT, MOONCAKE_OUTPUT = 16, 1024, 16
VOCAB = 49_152  # SmolLM2's
FIRST_ID = 100  # remapped ids stay above the special tokens
SIM = ["backend=sim", "scheduler=vllm", "cache=block_hash", "model=smollm2_135m", "hardware=cpu",
       "cost_model=fitted_smollm2_cpu"]


# ---------------------------------------------------------------- comparing
def token_trace(rows: pd.DataFrame) -> list[dict]:
    """The calls of a one-call-at-a-time server run as a token trace, in the order sent: each
    prompt as sent and its output as received less the last token (whose KV vLLM never
    computes: it is sampled, not fed back)."""
    lines = []
    for r in rows.sort_values("arrival_s", kind="stable").itertuples():
        if r.failed:
            raise Fail(f"request {r.id} failed ({r.error}): the trace would not be what ran")
        lines.append({"id": r.id, "prompt": list(r.prompt_ids), "output": list(r.output_ids)[:-1]})
    return lines


def remap(ids: np.ndarray, vocab: int = VOCAB) -> np.ndarray:
    """Token ids mapped into ``[FIRST_ID, vocab)`` by a fixed 64-bit mix: equal ids stay equal,
    distinct ones collide with probability about 1 / vocab per token (a whole block of 32 never)."""
    x = ids.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (FIRST_ID + x % np.uint64(vocab - FIRST_ID)).astype(np.int64)


def mooncake_trace(path: Path, requests: int = MOONCAKE_REQUESTS, prompt: int = MOONCAKE_PROMPT,
                   output: int = MOONCAKE_OUTPUT) -> list[dict]:
    """The first ``requests`` of a Mooncake trace as token-trace lines: the testbed's expansion
    of its block hashes (``workload.format=mooncake``), each prompt cut to ``prompt`` tokens and
    output to ``output``, ids remapped into SmolLM2's vocabulary; no arrival times (the
    arrival settings decide)."""
    from testbed.workloads.traces import load_mooncake
    lines = []
    for r in load_mooncake(path)[:requests]:
        lines.append({"id": r.id, "prompt": remap(r.prompt[:prompt]).tolist(),
                      "output": remap(r.output[:output]).tolist()})
    return lines


def first_wave(rows: pd.DataFrame) -> list[str]:
    """The ids of the calls a server run sent before any call finished (`as_ran_trace`)."""
    return list(rows.loc[rows["arrival_s"] < rows["finish_s"].min(), "id"])


def as_ran_trace(requests: list, rows: pd.DataFrame,
                 received: dict[str, float] | None = None) -> list[dict]:
    """The workload's calls (their ids, programs, dependencies, think and arrival times) with the
    prompts a server run sent and the outputs it received, whole: the simulator computes the
    last output token's KV no more than vLLM does (docs/design.md §4, *Results*).

    The calls sent before any call finished (the first wave: no dependency or closed loop held
    them) arrive when they were sent, not all at their workload time, and the calls after them
    no earlier than the last of them (the loop holds them longer, in the order sent): the client
    sends the first wave one call after another, about a millisecond apart, and an idle vLLM
    starts a step with the first alone (few-shot's first question then answers in 0.25 s while
    the other 15 wait 1.4 s; tree-of-thought's first problem runs a step ahead of the others to
    the end). ``received``: where a router in front logged when it received each call (call id
    -> seconds on its own clock: testbed.route's ``/debug/state`` ``routing``), the first wave
    arrives at those times instead (relative to the first it received): calls sent a
    millisecond apart may reach it in another order, and its order decides its routing."""
    ran = rows.set_index("id")
    wave = first_wave(rows)
    sent = dict(zip(rows["id"], rows["arrival_s"] - rows["arrival_s"].min()))
    if received is not None:
        missing = sorted(set(wave) - set(received))
        if missing:
            raise Fail(f"the router logged no receipt of {len(missing)} first-wave calls "
                       f"(the first: {missing[0]}): it cannot give their order")
        start = min(received[i] for i in wave)
        sent |= {i: received[i] - start for i in wave}
    last_first = max(sent[i] for i in wave)  # the loop held the others past it
    lines = []
    for r in requests:
        row = ran.loc[r.id]
        if row.failed:
            raise Fail(f"request {r.id} failed ({row.error}): the trace would not be what ran")
        arrival = max(r.arrival_s, min(sent[r.id], last_first))
        line = {"id": r.id, "prompt": list(row.prompt_ids), "output": list(row.output_ids),
                "arrival_s": arrival, "think_time_s": r.think_time_s}
        if r.program is not None:
            line["program"] = r.program
        if r.after:
            line["after"] = list(r.after)
        lines.append(line)
    return lines


def replay_overrides(trace: Path, served: Served) -> list[str]:
    return ["backend=replay", "workload=trace", f"workload.path={trace}",
            "workload.format=tokens", "cache=block_hash", f"cache.block_size={served.block_size}",
            f"cache.capacity_tokens={served.capacity_tokens}", "progress=false"]


def same_cached(server: pd.DataFrame, replayed: pd.DataFrame) -> tuple[int, str | None]:
    """How many requests have equal cached tokens, and the first that differs (None)."""
    theirs = replayed.set_index("id")[["cached_tokens"]].rename(
        columns={"cached_tokens": "cached_tokens_replay"})
    both = server.set_index("id")[["cached_tokens", "prompt_tokens"]].join(theirs, how="inner")
    equal = both["cached_tokens"] == both["cached_tokens_replay"]
    first = None
    if not equal.all():
        i = equal.idxmin()
        row = both.loc[i]
        first = (f"{i}: vLLM {row.cached_tokens}, replay {row.cached_tokens_replay} "
                 f"of {row.prompt_tokens}")
    return int(equal.sum()), first


def hit_rate(rows: pd.DataFrame) -> float:
    return float(rows["cached_tokens"].sum() / rows["prompt_tokens"].sum())


# ---------------------------------------------------------------- cases
def one_at_a_time(workload: str, words: list[str], served: Served, out: Path) -> dict:
    from testbed.config.assembly import compose_config
    from testbed.execute import execute
    server = run_server(words, served, ["arrival.max_concurrency=1"], out / "server")
    trace = out / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in token_trace(server)))
    execute(compose_config(replay_overrides(trace, served)), out / "replay")
    replayed = records(out / "replay")
    equal, first = same_cached(server, replayed)
    return {"workload": workload, "mode": "one call at a time", "requests": len(server),
            "same_cached_tokens": equal, "first_difference": first,
            "hit_rate_vllm": hit_rate(server), "hit_rate_testbed": hit_rate(replayed),
            "ok": equal == len(server) == len(replayed)}


def closed_loop(workload: str, words: list[str], served: Served, n: int, out: Path) -> dict:
    """vLLM's hit rate against the simulator's, on the workload as generated (its forced output
    ids) and on the calls as they ran on vLLM (its own output ids, the same programs)."""
    from testbed.config.assembly import assemble, compose_config
    from testbed.execute import execute
    arrival = [f"arrival.max_in_flight={n}"]
    server = run_server(words, served, arrival, out / "server")
    cache = [f"cache.block_size={served.block_size}",
             f"cache.capacity_tokens={served.capacity_tokens}", "engine.forced=true", "progress=false"]
    execute(compose_config([*SIM, *words, *arrival, *cache]), out / "sim")
    requests = assemble(compose_config([*words, "backend=replay"])).requests()
    trace = out / "as_ran.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in as_ran_trace(requests, server)))
    tokens = ["workload=trace", f"workload.path={trace}", "workload.format=tokens"]
    execute(compose_config([*SIM, *tokens, *arrival, *cache]), out / "sim_as_ran")
    generated, as_ran = hit_rate(records(out / "sim")), hit_rate(records(out / "sim_as_ran"))
    theirs = hit_rate(server)
    return {"workload": workload, "mode": f"closed loop of {n}", "requests": len(server),
            "same_cached_tokens": None, "first_difference": None, "hit_rate_vllm": theirs,
            "hit_rate_testbed": as_ran, "hit_rate_sim_generated": generated,
            "failed": int(server["failed"].sum()),
            "ok": not server["failed"].any() and abs(as_ran - theirs) <= HIT_TOLERANCE}


def mooncake_words(source: str, out: Path) -> list[str]:
    """The overrides of the Mooncake case: its token trace written under ``out``."""
    from testbed.data import resolve_trace
    from testbed.data.fetch import DataError
    try:
        path, _ = resolve_trace(source)
    except DataError as e:
        raise Fail(f"--mooncake {source}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "mooncake_tokens.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in mooncake_trace(path)))
    return ["workload=trace", f"workload.path={trace}", "workload.format=tokens"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.vllm.caching",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("what", nargs="?", choices=["run", "setup", "serve"], default="run",
                    help="setup: the venv only; serve: start vLLM and keep it until stopped")
    ap.add_argument("--workload", nargs="+", default=[*WORKLOADS, "mooncake"],
                    choices=[*WORKLOADS, "mooncake"])
    ap.add_argument("--mooncake", default=MOONCAKE, help="the Mooncake conversation trace "
                    "(data:NAME or a file; only its first lines are read)")
    ap.add_argument("--loops", nargs="*", type=int, default=[4, 16])
    ap.add_argument("--block-size", type=int, default=32, help="a multiple of 32 (vLLM's CPU)")
    ap.add_argument("--blocks", type=int, default=512, help="vLLM's KV blocks (null included)")
    ap.add_argument("--url", default=None, help="a vLLM already served (`serve`) with these "
                    "--block-size and --blocks, instead of starting one")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="vs_vllm_"))
    rows: list[dict] = []
    try:
        if args.what == "setup" and not args.url:
            print(venv_python(args.cache_dir))
            return 0
        with vllm_server(args.url, args.block_size, args.blocks, args.cache_dir,
                         out / "vllm.log") as served:
            print(f"vLLM at {served.url}: {served.blocks} blocks of {served.block_size} "
                  f"(testbed: cache.capacity_tokens={served.capacity_tokens})", file=sys.stderr,
                  flush=True)
            if args.what == "serve":
                signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
                while True:
                    time.sleep(3600)
            for w in args.workload:
                words = WORKLOADS.get(w) or mooncake_words(args.mooncake, out / w)
                rows.append(one_at_a_time(w, words, served, out / w / "one"))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
                for n in args.loops:
                    rows.append(closed_loop(w, words, served, n, out / w / f"loop{n}"))
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if rows:
            pd.DataFrame(rows).to_csv(out / "vs_vllm.csv", index=False)
    from testbed.report.markdown import markdown_table
    table = pd.DataFrame(rows)
    print(markdown_table(table.round(4), list(table.columns)))
    print(f"runs in {out}")
    return 0 if table["ok"].all() else 1


if __name__ == "__main__":
    from experiments import entry
    entry(main)
