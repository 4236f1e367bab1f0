"""What the fuzzer checks of a finished run, from its files alone (requests.jsonl, steps.jsonl,
summary.json; the run saved token ids). Leases, locks and the cache's bookkeeping are checked
during the run (``debug.check_invariants=true``: after every step and at the end).

- per request: cached ≤ prompt tokens, finish ≥ first token ≥ arrival, no more output than
  asked; a hit (exact reuse) never exceeds the longest prefix its prompt shares with another
  request's prompt + output (where else could its KV have come from);
- replay serves requests in their listed order, so there its hit rate is at most the ideal (an
  unlimited cache in that order), and equals it with an unlimited radix cache of page 1;
- the summary agrees with the records (sums and the hit rate), and KV in use never exceeds the
  KV capacity in any step;
- ``backend=server``: no call failed but by the server's refusal of it (HTTP 4xx, its one line
  saying why: a token id past its model's vocabulary in a trace); a server error or a broken
  stream is a defect. Its cache is the server's, which holds what earlier configs sent, so the
  bound on hits does not apply, and a call's ``cached_tokens`` may be unknown (None: left out
  of the sums).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.cache.tier_config import has_lower_tiers

EPS = 1e-9


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def longest_shared_prefix(prompt: list[int], others: list[list[int]]) -> int:
    """The longest prefix of ``prompt`` that any sequence of ``others`` starts with."""
    best = 0
    for seq in others:
        n = min(len(prompt), len(seq))
        i = 0
        while i < n and prompt[i] == seq[i]:
            i += 1
        best = max(best, i)
    return best


def check_run(run_dir: Path, summary: dict[str, Any]) -> list[str]:
    """Problems found in a finished run's files (empty: consistent)."""
    problems: list[str] = []
    records = read_jsonl(run_dir / "requests.jsonl")
    steps = read_jsonl(run_dir / "steps.jsonl")
    if len(records) != summary["num_requests"]:
        problems.append(f"{len(records)} records for num_requests {summary['num_requests']}")
    sequences = [r["prompt_ids"] + r["output_ids"] for r in records if "prompt_ids" in r]
    server = summary.get("backend") == "server"
    for i, r in enumerate(records):
        rid = r["id"]
        if r.get("failed") and not 400 <= (r.get("status") or 0) < 500:
            problems.append(f"request {rid}: the call failed (HTTP {r.get('status')}): "
                            f"{r.get('error')}")
        if r["cached_tokens"] is not None and not 0 <= r["cached_tokens"] <= r["prompt_tokens"]:
            problems.append(f"request {rid}: cached {r['cached_tokens']} of "
                            f"{r['prompt_tokens']} prompt tokens")
        arrival, first, finish = r.get("arrival_s"), r.get("first_token_s"), r.get("finish_s")
        if first is not None and arrival is not None and first < arrival - EPS:
            problems.append(f"request {rid}: first token {first} before arrival {arrival}")
        if finish is not None and first is not None and finish < first - EPS:
            problems.append(f"request {rid}: finish {finish} before first token {first}")
        if finish is not None and arrival is not None and finish < arrival - EPS:
            problems.append(f"request {rid}: finish {finish} before arrival {arrival}")
        if "prompt_ids" in r and r["cached_tokens"] and not server:
            others = sequences[:i] + sequences[i + 1:]
            bound = longest_shared_prefix(r["prompt_ids"], others)
            if r["cached_tokens"] > bound:
                problems.append(f"request {rid}: {r['cached_tokens']} cached tokens, but no "
                                f"other request shares more than {bound} of its prompt")
    prompt = sum(r["prompt_tokens"] for r in records)
    known = [r for r in records if r["cached_tokens"] is not None]  # a server may not report
    cached, known_prompt = (sum(r[k] for r in known) for k in ("cached_tokens", "prompt_tokens"))
    if server and summary["cached_tokens"] is None:
        return problems + capacity_problems(steps, summary)
    if cached != summary["cached_tokens"] or prompt != summary["prompt_tokens"]:
        problems.append(f"summary cached/prompt {summary['cached_tokens']}/"
                        f"{summary['prompt_tokens']} != records' {cached}/{prompt}")
    if known_prompt and abs(summary["hit_rate"] - cached / known_prompt) > EPS:
        problems.append(f"hit_rate {summary['hit_rate']} != {cached}/{known_prompt}")
    ideal = summary.get("ideal_hit_rate")
    if summary.get("backend") == "replay" and ideal is not None \
            and summary["hit_rate"] > ideal + EPS:
        problems.append(f"replay hit_rate {summary['hit_rate']} above ideal {ideal}")
    return problems + capacity_problems(steps, summary)


def capacity_problems(steps: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    capacity = summary.get("kv_capacity_tokens")
    used = [s["kv_used_tokens"] for s in steps if s.get("kv_used_tokens") is not None]
    if capacity is not None and used and max(used) > capacity:
        return [f"KV in use {max(used)} > capacity {capacity} in a step"]
    return []


# summary keys that measure the machine, not the run (wall-clock timings)
WALL_CLOCK = {"wall_s", "timing"}
# on the engine, time itself is measured: its timings differ between identical runs
ENGINE_TIMED = ("_s", "throughput", "tpot", "ttft", "itl", "e2e", "busy", "imbalance")


def schedule_follows_the_clock(config: dict[str, Any]) -> bool:
    """Whether an engine run's schedule depends on measured step times: arrivals or think times
    in (virtual) seconds, load-backs timed against steps, or LPM's aging by waiting time. The
    engine's virtual time advances by what each step measured, so such runs interleave
    differently from one run to the next; offline runs without them do not."""
    arrival = (config.get("arrival") or {}).get("kind", "auto")
    workload = config.get("workload") or {}
    timed_arrivals = arrival not in ("offline", "auto") or (
        arrival == "auto" and workload.get("name") == "trace")
    think = any(isinstance(v, dict) and v.get("think_time_s") for v in
                [workload, *(workload.get("components") or {}).values()])
    cache = config.get("cache") or {}
    tiers = has_lower_tiers(cache)
    aging = bool((config.get("scheduler") or {}).get("lpm_aging"))
    return timed_arrivals or think or tiers or aging


def comparable(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary without what legitimately differs between two runs of one config: wall-clock
    fields; on the engine its timed fields, and where its schedule follows the clock
    (`schedule_follows_the_clock`) everything but what the workload fixes; of a server's run
    only what the workload fixes (its cache holds the first run's prompts in the second)."""
    if summary.get("backend") == "server":  # timed on the wall clock, a cache shared by runs
        return {k: summary.get(k) for k in ("num_requests", "backend", "workload",
                                            "prompt_tokens")}
    if summary.get("backend") == "engine":
        if schedule_follows_the_clock(summary.get("config") or {}):
            return {k: summary.get(k) for k in ("num_requests", "backend", "workload")}
        return {k: v for k, v in summary.items() if k not in WALL_CLOCK and k != "config"
                and not any(t in k for t in ENGINE_TIMED)}
    return {k: v for k, v in summary.items() if k not in WALL_CLOCK}
