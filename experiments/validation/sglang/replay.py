"""(c) of the SGLang check: our replay backend with pages against SGLang's own RadixCache.

One request at a time, in list order, both sides see the same requests:

- **ours**: `testbed.backends.replay.replay` over ``RadixCache(capacity, page_size=P, sglang=release)``
  exactly as the backend runs it (acquire the whole prompt; evict the shortfall of the whole new
  pages; extend by the rest of prompt+output; release inserting prompt+output);
- **SGLang**: the release's own RadixCache served the way its scheduler serves a lone request,
  collapsed into one allocation as our replay does (`tree_serving.serve` says through which
  calls), at the release's page sizes (`PAGE_SIZES`).

Cases (`cases`): small ``random_tree``, ``chat`` and ``few_shot`` workloads, random token runs
and, when `experiments.MOONCAKE_TRACE` is there, the first 2,000 requests of the Mooncake
conversation trace; each unlimited, evicting and tight (`capacities`). Compared per request: the
hit (cached tokens) and the tokens evicted; and the tokens left in the tree. Three rules of
SGLang's serving differ from replay.py by design (`RULES`: the match leaves the prompt's last
token out; the last output token is never cached; eviction asks for the whole allocation, or for
0.5.23 its shortfall, plus a page); our cache is also driven with all of them switched to
SGLang's, which isolates the tree code itself (LRU order included), and with all but one, which
shows what that one rule alone changes (`serve_ours`). A control runs ours with all of SGLang's
rules but FIFO eviction: where it agrees too, no eviction in the case depended on the order (the
small generator workloads mostly never use an entry after its creation), so only the cases where
it disagrees test LRU. Where the release has other eviction strategies its classic tree runs
alone (`STRATEGIES`), they replay random token runs with priorities too (`check_strategies`).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np

from experiments import MOONCAKE_TRACE
from experiments.validation.sglang import tree_serving
from experiments.validation.sglang.tree_serving import serve

# Our RadixCache and FIFO are built directly, not through testbed.config.assembly: the check drives
# the raw tree with SGLang's rules switched on one by one (page sizes, a FIFO control), not a run.
from testbed.cache.eviction import EVICTION, FIFO, Requester
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads import generate
from testbed.workloads.request import TOKEN_DTYPE, Request
from testbed.workloads.traces import load_trace

# Where SGLang's serving differs from replay.py, per release: (rule, what SGLang does, where).
LIMIT = ("matches the prompt minus its last token (one token is always computed, for the "
         "logits)")
KV = ("caches prompt+output minus the last output token, whose KV is never computed; the "
      "request holds that many slots")
RULES = {
    "0.4.10": {
        "limit": (LIMIT, "Req.adjust_max_prefix_ids"),
        "kv": (KV, "RadixCache.cache_finished_req"),
        "evict": ("evicts the whole allocation, not the shortfall, whenever the free pages do "
                  "not cover it, plus one page of headroom per request at page size > 1",
                  "ScheduleBatch._evict_tree_cache_if_needed <- alloc_paged_token_slots_extend"),
    },
    "0.5.23": {
        "limit": (LIMIT, "Req._compute_max_prefix_len"),
        "kv": (KV, "release_kv_cache -> RadixCache.checkpoint up to Req.owned_kv_len"),
        "evict": ("evicts the shortfall of the extend plus one page per request at page size "
                  "> 1 (at page size 1 the shortfall of the extend, as replay.py)",
                  "alloc_paged_token_slots_extend -> "
                  "BaseTokenToKVPoolAllocator.evict_to_free_tokens"),
    },
}
ALL = tree_serving.RULES
FIFO_CONTROL = ALL + ("fifo",)  # all SGLang's, FIFO for LRU: does the case test the order at all?
# replay.py as is; every rule SGLang's but one (what that rule alone changes); all SGLang's.
VARIANTS = ((), *(tuple(k for k in ALL if k != but) for but in ALL), ALL, FIFO_CONTROL)
# 0.5.23: the pages issue 32 asks for
PAGE_SIZES = {"0.4.10": (1, 4, 16), "0.5.23": (1, 16)}
# Strategies besides LRU the release's classic tree runs alone (0.5.23's T-LRU needs the unified
# tree's bookkeeping: `eviction` checks its order)
STRATEGIES = {"0.4.10": (), "0.5.23": ("lfu", "slru", "priority", "fifo", "mru", "filo")}
# Small instances of the project's generators with odd lengths, so pages cut runs mid-way.
WORKLOADS = {
    "random_tree": dict(num_requests=150, root_prob=0.1, max_burst=4, root_len=61, segment_len=13,
                        output_len=7),
    "chat": dict(num_sessions=8, turns=4, system_prompt_len=37, min_question_len=11,
                 max_question_len=53, min_output_len=3, max_output_len=19),
    "few_shot": dict(num_tasks=4, questions_per_task=12, num_shots=3, example_len=29,
                     question_len=17, output_len=3),
}


def serve_ours(requests: list[Request], page_size: int, capacity: int | None,
               rules: tuple[str, ...], release: str, eviction: str | None = None
               ) -> tuple[list[int], list[int], int, list]:
    """Our RadixCache (following ``release``'s rules, ``scheduler.sglang``) through replay.py's
    calls, with the named `RULES` switched to that SGLang release's (and FIFO eviction for
    "fifo", else the ``eviction`` policy, else LRU). With no rules it is
    `testbed.backends.replay.replay` (checked by `check_replay`)."""
    policy = FIFO() if "fifo" in rules else EVICTION.build(eviction) if eviction else None
    cache = RadixCache(capacity, page_size=page_size, policy=policy, sglang=release)
    hits, evicted = [], []
    for r in requests:
        seq = r.sequence()
        kv = seq[:-1] if "kv" in rules else seq
        if not cache.fits(len(kv)):  # replay.py serves it uncached
            hits.append(0)
            evicted.append(0)
            continue
        limit = len(r.prompt) - 1 if "limit" in rules else None
        lease = cache.acquire(r.prompt, limit=limit,
                              requester=Requester(r.id, r.priority, r.category))
        n = len(kv) - lease.hit
        out = 0
        if "evict" in rules and not cache.pool.unbounded:
            need = n + (page_size if page_size > 1 else 0)
            if cache.pool.num_free < need:  # 0.4.10 asks for all of it, 0.5.23 the shortfall
                out = cache.evict(need if release == "0.4.10" else need - cache.pool.num_free)
        more = cache.extend(lease, n)
        if more is None:
            raise RuntimeError(f"request {r.id}: no room for {len(kv)} tokens")
        cache.release(lease, kv)
        hits.append(lease.hit)
        evicted.append(out + more)
    return hits, evicted, cache.total_size, sorted((n.start, len(n.key), hash(n.key.tobytes()))
                                                   for n in cache.nodes())


def random_runs(seed: int, num: int = 100) -> list[Request]:
    """Prompts that branch off an earlier prompt+output at a random point (70%), repeat an earlier
    prompt exactly (20%) or are fresh, each with 1-19 output tokens; a vocabulary of 4, 64 or
    1000 tokens (small ones add accidental matches that cut pages mid-way)."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([4, 64, 1000]))
    out: list[Request] = []
    for i in range(num):
        u = rng.random()
        if out and u < 0.2:
            prompt = out[int(rng.integers(len(out)))].prompt
        else:
            base = out[int(rng.integers(len(out)))].sequence() if out and u < 0.9 else []
            cut = base[: int(rng.integers(0, len(base) + 1))]
            prompt = np.concatenate([cut, rng.integers(0, vocab, int(rng.integers(1, 61)))])
        output = rng.integers(0, vocab, int(rng.integers(1, 20)))
        out.append(Request(f"r{i}", prompt.astype(TOKEN_DTYPE), output.astype(TOKEN_DTYPE)))
    return out


def mooncake(num: int) -> list[Request] | None:
    """The first ``num`` requests of the Mooncake conversation trace (project loader, format
    ``mooncake``), or None without the file. Only those lines are loaded: output token ids are
    fresh above the blocks either way."""
    if not MOONCAKE_TRACE.exists():
        return None
    with open(MOONCAKE_TRACE) as f, tempfile.TemporaryDirectory() as tmp:
        head = Path(tmp) / MOONCAKE_TRACE.name
        head.write_text("".join(line for _, line in zip(range(num), f)))
        return load_trace(head, "mooncake")


def cases(quick: bool) -> list[tuple[str, list[list[Request]]]]:
    """(name, traces) to replay; a case's traces are summed in its row."""
    out = [(name, [generate({"name": name, **params}, seed=1)])
           for name, params in WORKLOADS.items()]
    seeds = 4 if quick else 12
    out.append((f"random_runs x{seeds}", [random_runs(s) for s in range(seeds)]))
    trace = mooncake(100 if quick else 2000)
    if trace is not None:
        out.append((f"mooncake[:{len(trace)}]", [trace]))
    return out


def capacities(requests: list[Request], release: str) -> dict[str, int | None]:
    """Unlimited; half the distinct tokens (those an unlimited cache ends with); barely more than
    the longest request. Multiples of 16, so every page size takes them whole."""
    distinct = serve_ours(requests, 1, None, (), release)[2]
    tight = -(-(max(len(r.prompt) + len(r.output) for r in requests) + 64) // 16) * 16
    return {"unlimited": None, "evict": max(tight, distinct // 2 // 16 * 16), "tight": tight}


def check_replay(sgl, quick: bool, show: int) -> list[dict]:
    """Rows of (c): per case, page size (`PAGE_SIZES`) and capacity, the agreement of every
    variant; ours follows the loaded release's rules, SGLang's side is `tree_serving.serve`."""
    release, rows = sgl.version, []
    for name, traces in cases(quick):
        caps = [capacities(t, release) for t in traces]
        for p in PAGE_SIZES[release]:
            for level in ("unlimited", "evict", "tight"):
                row = {"case": name, "page": p, "level": level, "reqs": 0, "traces": 0,
                       "replay_ok": True,
                       "cap": caps[0][level] if len(traces) == 1 else None,
                       **{v: dict(hits=0, evicted=0, both=0, tree=[0, 0], same=0)
                          for v in VARIANTS}}
                for trace, cap in zip(traces, caps):
                    theirs = serve(sgl, trace, p, cap[level])
                    records = replay(trace, RadixCache(cap[level], page_size=p, sglang=release))
                    as_is = ([r.cached_tokens for r in records],
                             [r.evicted_tokens for r in records])
                    row["reqs"] += len(trace)
                    row["traces"] += 1
                    for v in VARIANTS:
                        ours = serve_ours(trace, p, cap[level], v, release)
                        if not v:
                            row["replay_ok"] &= as_is == ours[:2]
                        tally(row[v], trace, ours, theirs)
                        if v == ALL and show > 0 and ours != theirs:
                            show -= 1
                            explain(row, trace, ours, theirs)
                rows.append(row)
    return rows


def tally(counts: dict, trace: list[Request], ours: tuple, theirs: tuple) -> None:
    hits = [a == b for a, b in zip(ours[0], theirs[0])]
    evicted = [a == b for a, b in zip(ours[1], theirs[1])]
    counts["hits"] += sum(hits)
    counts["evicted"] += sum(evicted)
    counts["both"] += sum(h and e for h, e in zip(hits, evicted))
    counts["tree"][0] += ours[2]
    counts["tree"][1] += theirs[2]
    counts["same"] += ours[3] == theirs[3]


def explain(row: dict, trace: list[Request], ours: tuple, theirs: tuple) -> None:
    i = next((i for i in range(len(trace)) if (ours[0][i], ours[1][i])
              != (theirs[0][i], theirs[1][i])), None)
    where = ("only the final tree differs" if i is None else
             f"first at request {trace[i].id}: hit {ours[0][i]}/{theirs[0][i]}, evicted "
             f"{ours[1][i]}/{theirs[1][i]} (ours/SGLang)")
    print(f"  {row['case']} P={row['page']} {row['level']}, all SGLang rules: {where}")


def print_replay(rows: list[dict]) -> None:
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}   P  {'capacity':<16} reqs | replay.py as is: hits=  evicted=  "
          f"{'tree o/s':<17} | all SGLang's but: limit  kv  evict | all SGLang's: hits=  "
          f"evicted=  FIFO both=  tree o/s")
    for r in rows:
        cap = r["level"] if r["cap"] is None else f"{r['level']}={r['cap']}"
        a, s = r[()], r[ALL]
        but = "  ".join(f"{r[tuple(k for k in ALL if k != b)]['both']:>{max(len(b), 4)}}"
                        for b in ALL)
        print(f"{r['case']:<{width}}  {r['page']:>2}  {cap:<16} {r['reqs']:>4} | {a['hits']:>21}"
              f"  {a['evicted']:>8}  {'%d/%d' % tuple(a['tree']):<17} | {'':>17}{but} | "
              f"{s['hits']:>18}  {s['evicted']:>8}  {r[FIFO_CONTROL]['both']:>10}  "
              f"{'%d/%d' % tuple(s['tree'])}"
              f"{'' if r['replay_ok'] else '  (serve_ours without rules != replay.py!)'}")


def summary(rows: list[dict]) -> str:
    reqs = sum(r["reqs"] for r in rows)

    def agree(v) -> str:
        both = sum(r[v]["both"] for r in rows)
        same = sum(r[v]["same"] for r in rows)
        return f"{both}/{reqs} requests, the same final tree in {same}/{traces}"
    traces = sum(r["traces"] for r in rows)
    ordered = [r for r in rows if r[FIFO_CONTROL]["both"] < r["reqs"]]
    return (f"(c) replay with pages, hit and eviction agreeing: replay.py as is {agree(())}; "
            f"with SGLang's three rules {agree(ALL)} (all of the {len(ordered)}/{len(rows)} cases "
            f"where FIFO would disagree: {sum(r[ALL]['both'] for r in ordered)}/"
            f"{sum(r['reqs'] for r in ordered)} requests)")


def per_page(rows: list[dict]) -> str:
    """Per page size, with SGLang's three rules: requests replayed, identical (hit and evicted
    tokens), differing; final trees the same."""
    out = []
    for p in dict.fromkeys(r["page"] for r in rows):
        mine = [r for r in rows if r["page"] == p]
        reqs = sum(r["reqs"] for r in mine)
        same = sum(r[ALL]["both"] for r in mine)
        trees = sum(r[ALL]["same"] for r in mine)
        out.append(f"page {p}: {reqs} requests replayed, {same} identical, {reqs - same} "
                   f"differing, the same final tree in {trees}/{sum(r['traces'] for r in mine)}")
    return "; ".join(out)


def all_agree(rows: list[dict]) -> bool:
    """Whether, with SGLang's three rules, every request's hit and eviction and every final
    tree agree, and our rule-less driver is replay.py."""
    return all(r[ALL]["both"] == r["reqs"] and r[ALL]["same"] == r["traces"] and r["replay_ok"]
               for r in rows)


def check_strategies(sgl, quick: bool) -> dict[str, list[int]]:
    """Replay under every strategy in `STRATEGIES`, with SGLang's three rules: random token runs
    (`random_runs`, each request a random priority 0-2: lower more urgent ours, negated for
    SGLang) at the evicting and tight capacities, at the release's page sizes. Per strategy:
    [requests agreeing (hit and evicted tokens), requests, final trees the same, trees]."""
    release = sgl.version
    rng = np.random.default_rng(0)
    traces = [[dataclasses.replace(r, priority=int(rng.integers(0, 3)))
               for r in random_runs(seed)] for seed in range(1 if quick else 4)]
    out = {}
    for strategy in STRATEGIES[release]:
        counts = out[strategy] = [0, 0, 0, 0]
        for trace in traces:
            caps = capacities(trace, release)
            for page in PAGE_SIZES[release]:
                for level in ("evict", "tight"):
                    theirs = serve(sgl, trace, page, caps[level], eviction=strategy)
                    ours = serve_ours(trace, page, caps[level], ALL, release, strategy)
                    counts[0] += sum(o == t for o, t in zip(zip(*ours[:2]), zip(*theirs[:2])))
                    counts[1] += len(trace)
                    counts[2] += ours[3] == theirs[3]
                    counts[3] += 1
    return out


def report(sgl, quick: bool, show: int) -> tuple[bool, str]:
    """Run and print (c) for the loaded release; returns whether all agree and the summary."""
    release, pages = sgl.version, [str(p) for p in PAGE_SIZES[sgl.version]]
    print(f"\n(c) replay with pages {', '.join(pages[:-1])} and {pages[-1]}, one request at a "
          f"time ({'quick' if quick else 'full'}), ours with scheduler.sglang={release}: hits=, "
          "evicted=: requests whose hit, tokens evicted agree; both=: requests where both agree; "
          f"tree o/s: tokens left in the tree, ours/SGLang. SGLang {release}'s rules that "
          "replay.py does not follow:")
    for k, (what, where) in RULES[release].items():
        print(f"  {k}: SGLang {what} ({where})")
    rows = check_replay(sgl, quick, show)
    print()
    print_replay(rows)
    lines = [summary(rows), per_page(rows)]
    strategies = check_strategies(sgl, quick)
    agree = all_agree(rows) and all(c[0] == c[1] and c[2] == c[3] for c in strategies.values())
    if strategies:
        line = ", ".join(f"{s} {c[0]}/{c[1]} ({c[2]}/{c[3]} trees)" for s, c in strategies.items())
        print(f"other strategies, random token runs with priorities, pages {' and '.join(pages)}, "
              f"evicting and tight capacities, with {release}'s three rules: requests agreeing "
              f"{line}")
        lines.append(f"(c) other strategies: {line}")
    return agree, "\n           ".join(lines)
