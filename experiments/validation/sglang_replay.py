"""(c) of `experiments.validation.sglang`: our replay backend with pages against SGLang 0.4.10's RadixCache.

One request at a time, in list order, both sides see the same requests:

- **ours**: `testbed.backends.replay.replay` over ``RadixCache(capacity, page_size=P)`` exactly as the
  backend runs it (acquire the whole prompt; evict the shortfall of the whole new pages; extend by
  the rest of prompt+output; release inserting prompt+output).
- **SGLang**: its own ``RadixCache(req_to_token_pool, token_to_kv_pool_allocator, page_size=P)``
  (imported by `sglang_wheel.load`, ``time.monotonic`` a counter) served the way its scheduler
  serves a lone request, collapsed into one allocation as our replay does (`serve_sglang`):
  ``match_prefix`` of ``Req.adjust_max_prefix_ids`` (the prompt minus its last token; page-aligned
  by ``match_prefix``), ``inc_lock_ref`` (``PrefillAdder.add_one_req``), then
  ``ScheduleBatch._evict_tree_cache_if_needed`` with the size ``alloc_paged_token_slots_extend``
  asks for (``alloc_token_slots`` at page size 1), whole new pages from `PagedSlots` (a stand-in
  for ``PagedTokenToKVPoolAllocator``: its Triton kernels need a GPU), and its own
  ``cache_finished_req``, which caches prompt+output minus the last output token (that token's KV
  is never computed), frees the unaligned tail page and the duplicate prefix.

Compared per request: the hit (cached tokens) and the tokens evicted; and the tokens left in the
tree. Three rules of SGLang differ from replay.py by design (`RULES`); our cache is also driven
with all of them switched to SGLang's, which isolates the tree code itself (LRU order included),
and with all but one, which shows what that one rule alone changes (`serve_ours`). A control runs
ours with all of SGLang's rules but FIFO eviction: where it agrees too, no eviction in the case
depended on the order (the small generator workloads mostly never use an entry after its
creation), so only the cases where it disagrees test LRU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from experiments import MOONCAKE_TRACE

# Our RadixCache and FIFO are built directly, not through testbed.config.assembly: the check drives
# the raw tree with SGLang's rules switched on one by one (page sizes, a FIFO control), not a run.
from testbed.cache.eviction import EVICTION, FIFO, Requester
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads import generate
from testbed.workloads.traces import load_trace
from testbed.workloads.request import TOKEN_DTYPE, Request

PAGE_SIZES = (1, 4, 16)
# Where SGLang's serving differs from replay.py: (rule, what SGLang does, where).
RULES = {
    "limit": ("matches the prompt minus its last token (one token is always computed, for the "
              "logits)", "Req.adjust_max_prefix_ids"),
    "kv": ("caches prompt+output minus the last output token, whose KV is never computed; the "
           "request holds that many slots", "RadixCache.cache_finished_req"),
    "evict": ("evicts the whole allocation, not the shortfall, whenever the free pages do not "
              "cover it, plus one page of headroom per request at page size > 1",
              "ScheduleBatch._evict_tree_cache_if_needed <- alloc_paged_token_slots_extend"),
}
ALL = tuple(RULES)
FIFO_CONTROL = ALL + ("fifo",)  # all SGLang's, FIFO for LRU: does the case test the order at all?
# replay.py as is; every rule SGLang's but one (what that rule alone changes); all SGLang's.
VARIANTS = ((), *(tuple(k for k in RULES if k != but) for but in RULES), ALL, FIFO_CONTROL)
# Small instances of the project's generators with odd lengths, so pages cut runs mid-way.
WORKLOADS = {
    "random_tree": dict(num_requests=150, root_prob=0.1, max_burst=4, root_len=61, segment_len=13,
                        output_len=7),
    "chat": dict(num_sessions=8, turns=4, system_prompt_len=37, min_question_len=11,
                 max_question_len=53, min_output_len=3, max_output_len=19),
    "few_shot": dict(num_tasks=4, questions_per_task=12, num_shots=3, example_len=29,
                     question_len=17, output_len=3),
}


class PagedSlots:
    """Stand-in for ``PagedTokenToKVPoolAllocator`` (``TokenToKVPoolAllocator`` at page size 1)
    without its Triton kernels, on numpy: pages ``1..num_pages`` (page 0 holds SGLang's padding
    slot), page ``p`` the slots ``p*P .. p*P+P-1``; new pages come from the front of
    ``free_pages``, freed ones go to ``release_pages`` (every page one of the given slots lies in:
    ``torch.unique(free_index // page_size)``) and are merged back, sorted, when ``free_pages``
    runs short (``merge_and_sort_free``)."""

    device = torch.device("cpu")

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free_pages = np.arange(1, num_pages + 1, dtype=np.int64)
        self.release_pages = np.zeros(0, dtype=np.int64)

    def available_size(self) -> int:
        return (len(self.free_pages) + len(self.release_pages)) * self.page_size

    def alloc_extend(self, prefix_len: int, seq_len: int) -> torch.Tensor | None:
        """``alloc_extend`` for one request whose prefix is whole pages: the slots of tokens
        ``prefix_len .. seq_len`` in ``ceil(seq_len/P) - prefix_len/P`` new pages."""
        p = self.page_size
        pages = -(-seq_len // p) - prefix_len // p
        if pages > len(self.free_pages):
            self.free_pages = np.sort(np.concatenate([self.free_pages, self.release_pages]))
            self.release_pages = self.release_pages[:0]
        if pages > len(self.free_pages):
            return None
        firsts, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        slots = (firsts[:, None] * p + np.arange(p)).reshape(-1)[: seq_len - prefix_len]
        return torch.from_numpy(slots)

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            pages = np.unique(indices.numpy() // self.page_size)
            self.release_pages = np.concatenate([pages, self.release_pages])


class OneRow:
    """Stand-in for ``ReqToTokenPool`` when one request runs at a time: row 0, reused, read as
    ``req_to_token[idx, a:b]``."""

    def __init__(self, width: int) -> None:
        self.row = torch.zeros(width, dtype=torch.int64)
        self.req_to_token = self

    def __getitem__(self, key):
        return self.row[key[1]]

    def free(self, idx: int) -> None:
        """The request is done; the row is overwritten by the next one."""


def serve_sglang(sgl, requests: list[Request], page_size: int,
                 capacity: int | None) -> tuple[list[int], list[int], int, list]:
    """SGLang's RadixCache serving ``requests`` one at a time (module docstring). Returns per
    request the hit and the tokens evicted, the tokens left in the tree and its `sglang_runs`."""
    kv_lens = [len(r.prompt) + len(r.output) - 1 for r in requests]
    pages = (sum(-(-n // page_size) + 1 for n in kv_lens) if capacity is None  # never evicts
             else capacity // page_size)
    alloc = PagedSlots(pages, page_size)
    rows = OneRow(max(kv_lens) + 1)
    tree = sgl.radix.RadixCache(req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                page_size=page_size, disable=False)
    hits, evicted = [], []
    for r, kv_len in zip(requests, kv_lens):
        if -(-kv_len // page_size) > pages:
            raise ValueError(f"{r.id} ({kv_len} tokens of KV) does not fit {pages} pages")
        prompt = r.prompt.tolist()
        match = tree.match_prefix(key=prompt[: len(prompt) - 1])  # Req.adjust_max_prefix_ids
        prefix = match.device_indices
        tree.inc_lock_ref(match.last_device_node)  # PrefillAdder.add_one_req
        n = kv_len - len(prefix)
        need = n + (page_size if page_size > 1 else 0)  # alloc_paged_token_slots_extend, bs 1
        before = tree.evictable_size()
        if alloc.available_size() < need:  # ScheduleBatch._evict_tree_cache_if_needed
            tree.evict(need)
        evicted.append(before - tree.evictable_size())
        slots = alloc.alloc_extend(len(prefix), kv_len)
        if slots is None:
            raise RuntimeError(f"{r.id}: SGLang would run out of memory allocating {n} tokens")
        rows.row[: len(prefix)] = prefix  # prepare_for_extend: the prefix, then the new slots
        rows.row[len(prefix) : kv_len] = slots
        hits.append(len(prefix))
        req = SimpleNamespace(origin_input_ids=prompt, output_ids=r.output.tolist(),
                              req_pool_idx=0, prefix_indices=prefix,
                              last_node=match.last_device_node)
        tree.cache_finished_req(req)
    return hits, evicted, tree.total_size(), sglang_runs(tree)


def sglang_runs(tree) -> list[tuple[int, int, int]]:
    """Every node of SGLang's tree as (tokens before it, its length, a hash of its tokens),
    sorted: equal for two trees holding the same runs at the same depths."""
    out, stack = [], [(child, 0) for child in tree.root_node.children.values()]
    while stack:
        node, start = stack.pop()
        out.append((start, len(node.key), hash(key_tokens(node.key).tobytes())))
        stack.extend((child, start + len(node.key)) for child in node.children.values())
    return sorted(out)


def key_tokens(key) -> np.ndarray:
    """A node key's tokens, whichever release's key it is (0.4.10: a list; 0.5.23: a RadixKey)."""
    tokens = key.token_ids[: len(key)] if hasattr(key, "token_ids") else key
    return np.asarray(tokens, dtype=TOKEN_DTYPE)


def serve_ours(requests: list[Request], page_size: int, capacity: int | None,
               rules: tuple[str, ...] = (), release: str = "0.4.10", eviction: str | None = None
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


def capacities(requests: list[Request]) -> dict[str, int | None]:
    """Unlimited; half the distinct tokens (those an unlimited cache ends with); barely more than
    the longest request. Multiples of 16, so every page size takes them whole."""
    distinct = serve_ours(requests, 1, None)[2]
    tight = -(-(max(len(r.prompt) + len(r.output) for r in requests) + 64) // 16) * 16
    return {"unlimited": None, "evict": max(tight, distinct // 2 // 16 * 16), "tight": tight}


def check_replay(sgl, quick: bool, show: int, release: str = "0.4.10",
                 serve_theirs=serve_sglang, page_sizes: tuple[int, ...] = PAGE_SIZES
                 ) -> list[dict]:
    """Rows of (c): per case, page size and capacity, the agreement of every variant; ours
    follows ``release``'s rules, SGLang's side is ``serve_theirs`` (0.4.10's `serve_sglang`,
    or `sglang_replay523.serve_sglang523`)."""
    rows = []
    for name, traces in cases(quick):
        caps = [capacities(t) for t in traces]
        for p in page_sizes:
            for level in ("unlimited", "evict", "tight"):
                row = {"case": name, "page": p, "level": level, "reqs": 0, "traces": 0,
                       "replay_ok": True,
                       "cap": caps[0][level] if len(traces) == 1 else None,
                       **{v: dict(hits=0, evicted=0, both=0, tree=[0, 0], same=0)
                          for v in VARIANTS}}
                for trace, cap in zip(traces, caps):
                    theirs = serve_theirs(sgl, trace, p, cap[level])
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
        but = "  ".join(f"{r[tuple(k for k in RULES if k != b)]['both']:>{max(len(b), 4)}}"
                        for b in RULES)
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


def print_rules(rules: dict = RULES) -> None:
    for k, (what, where) in rules.items():
        print(f"  {k}: SGLang {what} ({where})")
