"""Per-request records and the run summary (the `summary.json` / `requests.jsonl` contract).

Definitions (docs/design.md §3): ``hit_rate`` is cached prompt tokens over all prompt tokens;
``ideal_hit_rate`` is the same ratio with unlimited cache and perfect reuse (each prompt's longest
prefix shared with any earlier request's prompt+output). Timing figures are None where the backend
has no time (replay). ``throughput_tok_s`` counts prompt plus output tokens per second of makespan.
A request is cache-cold when its ``cached_tokens`` (hit at first admission) is under half its
prompt, cache-warm otherwise; ``cold_requests`` counts the cold ones served and ``ttft_p50_cold_s``,
``ttft_p99_cold_s``, ``ttft_p99_warm_s`` split TTFT between the two (LPM starves the cold ones
under load, SGLang issue 31954). An engine run with approximate reuse carries each request's
quality against exact recomputation (``token_agreement``, ``kl_mean``, ``first_divergence``,
``rouge_l``; measured by the engine, `testbed.engine.quality`) and the summary their means; other
runs leave those fields out. A live server's run (``backend=server``) adds to each record its
inter-token gaps (``itl_s``), HTTP ``status``, ``error`` and whether the call ``failed`` (left
out of the latency figures, counted in ``failed_requests``); its ``cached_tokens`` is None where
the server reported none, and the hit rate is then over the requests whose hits are known (null
when none is: ``cached_tokens_reported`` false).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import Any, Iterable, Mapping

import numpy as np

from testbed.workloads.ideal import ideal_hit_rate  # noqa: F401 (part of this module's API)


#: the fields every record sets (`RequestRecord`); the others are rare, each backend its own few
CORE_FIELDS = ("id", "program", "arrival_s", "first_token_s", "finish_s", "prompt_tokens",
               "cached_tokens", "output_tokens", "evicted_tokens", "inserted")


@dataclass(init=False)
class RequestRecord:
    """One request's outcome. Memory: the `CORE_FIELDS` are slots; a field with a default is
    read from the class until a record is given another value, which then lives in the record's
    own ``__dict__`` (made with the first such value). A replay's record thus takes 120 bytes,
    not the 280 of 32 slots, which on a million short requests is 160 MB, the size of the tree
    (`_compact_init`)."""

    __slots__ = (*CORE_FIELDS, "__dict__")
    id: str
    program: str | None
    arrival_s: float
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    cached_tokens: int | None  # None: not known (a live server that did not report it)
    output_tokens: int
    evicted_tokens: int  # tokens evicted to make room for this request
    inserted: bool  # false when the request could not be cached
    preemptions: int = 0  # times it was retracted and re-queued (sim, engine)
    aborted: bool = False  # could never fit in the KV cache: not served (sim, engine)
    # beyond exact prefixes (cache.reuse=blend, cache.match=semantic), at first admission: prompt
    # tokens whose KV came from a non-exact match and was not recomputed, and those recomputed
    approx_hit_tokens: int = 0
    recomputed_tokens: int = 0
    prompt_ids: list[int] | None = None
    output_ids: list[int] | None = None
    # with lower cache tiers: of cached_tokens, how many were on the GPU and how many were loaded
    # back from host memory and from disk; load_s is the wait for that load (sim, engine)
    gpu_hit_tokens: int | None = None
    host_hit_tokens: int | None = None
    disk_hit_tokens: int | None = None
    load_s: float | None = None
    # engine with approximate reuse (cache.reuse=blend, cache.match=semantic): quality against
    # exact recomputation of the same prompt; None for a request that reused no KV
    token_agreement: float | None = None
    kl_mean: float | None = None
    first_divergence: int | None = None
    rouge_l: float | None = None
    quality_measured: bool = False  # the run measured quality: the four fields above are written
    answer: str | None = None  # the request's expected answer (tasks with ground truth), if any
    # a live server's call (backend=server): gaps between the chunks that carried tokens, the
    # HTTP status (None: no response), why it failed (None: it did not); None itl_s: another run
    itl_s: list[float] | None = None
    status: int | None = None
    error: str | None = None
    failed: bool = False  # no complete answer: left out of the latency figures
    # speculative decoding (sim, engine): the drafts accepted at each verification step, in
    # order; None outside a speculative run (left out of the line)
    spec_accepted: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The requests.jsonl line: every field in order, less the token ids and tier fields
        when they are None, the quality fields when the run did not measure quality,
        ``answer`` when the request has none, the server fields outside a server run and
        ``spec_accepted`` outside a speculative one."""
        row = {name: getattr(self, name) for name in _field_names(type(self))}
        del row["quality_measured"]
        if self.prompt_ids is None:
            del row["prompt_ids"], row["output_ids"]
        if self.gpu_hit_tokens is None:
            for key in TIER_FIELDS:
                del row[key]
        if not self.quality_measured:
            for key in QUALITY_FIELDS:
                del row[key]
        if self.answer is None:
            del row["answer"]
        if self.itl_s is None:
            for key in SERVER_FIELDS:
                del row[key]
        if self.spec_accepted is None:
            del row["spec_accepted"]
        return row


def _compact_init(cls: type) -> type:
    """Give dataclass ``cls`` (made with ``init=False``) the ``__init__`` its dataclass would have,
    the same parameters in the same order, except that a field left at its default (an
    immutable: None, 0, False; an int field given 0 counts as left) is not stored, so the class's
    default is read instead."""
    params, body, defaults = [], [], {}
    for f in fields(cls):
        if f.default is MISSING:
            params.append(f.name)
            body.append(f"    self.{f.name} = {f.name}")
        else:
            defaults[f"_d_{f.name}"] = f.default
            params.append(f"{f.name}=_d_{f.name}")
            # a literal where the default is one (a global's look-up costs a record 100 ns)
            differs = (f"{f.name} is not {f.default}" if f.default is None or f.default is False
                       else f.name if type(f.default) is int and f.default == 0
                       else f"{f.name} is not _d_{f.name}")
            body.append(f"    if {differs}:\n        self.{f.name} = {f.name}")
    source = f"def __init__(self, {', '.join(params)}):\n" + "\n".join(body) + "\n"
    scope: dict[str, Any] = dict(defaults)
    exec(source, scope)  # noqa: S102 (a generated initializer, as dataclasses makes its own)
    scope["__init__"].__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = scope["__init__"]
    return cls


_compact_init(RequestRecord)


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


TIER_FIELDS = ("gpu_hit_tokens", "host_hit_tokens", "disk_hit_tokens", "load_s")
QUALITY_FIELDS = ("token_agreement", "kl_mean", "first_divergence", "rouge_l")
SERVER_FIELDS = ("itl_s", "status", "error", "failed")


def tier_fields(hit: int, loaded: Mapping[str, int] | None,
                load_s: float | None = None) -> dict[str, Any]:
    """A record's tier fields: ``hit`` prompt tokens not recomputed, ``loaded`` of them loaded
    back from each lower tier (None: all found on the GPU)."""
    loaded = loaded or {}
    host, disk = loaded.get("host", 0), loaded.get("disk", 0)
    return {"gpu_hit_tokens": hit - host - disk, "host_hit_tokens": host, "disk_hit_tokens": disk,
            "load_s": load_s}


def add_tier_fields(records: list[RequestRecord],
                    hits: Mapping[str, tuple[int, Mapping[str, int] | None, float | None]]) -> None:
    """Fill in the tier fields of served records from ``hits``: request id to (tokens hit,
    loaded per tier, load wait) at its first admission (`Scheduler.tier_hits`)."""
    for r in records:
        hit, loaded, load_s = hits.get(r.id, (r.cached_tokens, None, None))
        for key, value in tier_fields(hit, loaded, load_s).items():
            setattr(r, key, value)


def add_quality_fields(records: list[RequestRecord],
                       quality: Mapping[str, Mapping[str, float]]) -> None:
    """Mark ``records`` as of a run that measured quality and fill in ``quality``: request id to
    its `QUALITY_FIELDS` values, for the requests that reused KV; the others keep None."""
    for r in records:
        r.quality_measured = True
        for key in QUALITY_FIELDS:
            setattr(r, key, quality.get(r.id, {}).get(key))


def quality_means(measured: list[Mapping[str, float]]) -> dict[str, float | None]:
    """``token_agreement_mean``, ``kl_mean``, ``first_divergence_mean``, ``rouge_l_mean``: the
    means of the `QUALITY_FIELDS` over ``measured`` (one mapping a request; None when empty)."""
    return {key if key == "kl_mean" else f"{key}_mean":
            float(np.mean([m[key] for m in measured])) if measured else None
            for key in QUALITY_FIELDS}


def quality_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """With quality measured: `quality_means` over the requests that reused KV; nothing
    otherwise."""
    if not records or not records[0].quality_measured:
        return {}
    return quality_means([{key: getattr(r, key) for key in QUALITY_FIELDS}
                          for r in records if r.kl_mean is not None])


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _timed(records: list[RequestRecord]) -> list[RequestRecord]:
    """Requests that were served and finished: those the latency figures count."""
    return [r for r in records if r.finish_s is not None and not r.aborted and not r.failed]


def _ttfts(records: list[RequestRecord]) -> list[float]:
    """Time to first token of the timed requests that produced one."""
    return [r.first_token_s - r.arrival_s for r in _timed(records) if r.first_token_s is not None]


def _tpots(timed: list[RequestRecord]) -> list[float]:
    """Time per output token after the first, of the timed requests with more than one."""
    return [(r.finish_s - r.first_token_s) / (r.output_tokens - 1)
            for r in timed if r.first_token_s is not None and r.output_tokens > 1]


def is_cold(record: RequestRecord) -> bool:
    """Cache-cold: under half its prompt tokens hit at first admission (exactly half is warm)."""
    return 2 * record.cached_tokens < record.prompt_tokens


def cold_warm_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """TTFT of cache-cold requests against cache-warm ones; aborted requests are left out, as in
    the other latency figures, and so are requests whose hit is not known (a server's).
    Percentiles are None where a group has no TTFT (replay)."""
    served = [r for r in records if not r.aborted and not r.failed and r.cached_tokens is not None]
    cold = [r for r in served if is_cold(r)]
    warm = [r for r in served if not is_cold(r)]
    return {"cold_requests": len(cold),
            "ttft_p50_cold_s": _percentile(_ttfts(cold), 50),
            "ttft_p99_cold_s": _percentile(_ttfts(cold), 99),
            "ttft_p99_warm_s": _percentile(_ttfts(warm), 99)}


def summarize(records: list[RequestRecord], ideal: float, wall_s: float,
              preemptions: int = 0) -> dict[str, Any]:
    """The summary.json figures for one run."""
    prompt = sum(r.prompt_tokens for r in records)
    known = [r for r in records if r.cached_tokens is not None]  # all but a server's unreported
    cached = sum(r.cached_tokens for r in known) if known or not records else None
    known_prompt = sum(r.prompt_tokens for r in known)
    output = sum(r.output_tokens for r in records)
    timed = _timed(records)
    makespan = (max(r.finish_s for r in timed) - min(r.arrival_s for r in timed)) if timed else None
    ttft = _ttfts(records)
    tpot = _tpots(timed)
    e2e = [r.finish_s - r.arrival_s for r in timed if r.output_tokens]  # prefill-only calls
    # (a fork's shared-prompt prefill) produce no token: latency counts generating requests
    rate = (lambda x: x / makespan) if makespan else (lambda x: None)
    return {
        "num_requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "approx_hit_tokens": sum(r.approx_hit_tokens for r in records),
        "recomputed_tokens": sum(r.recomputed_tokens for r in records),
        "hit_rate": None if cached is None else cached / known_prompt if known_prompt else 0.0,
        "ideal_hit_rate": ideal,
        "output_tokens": output,
        "evicted_tokens": sum(r.evicted_tokens for r in records),
        "uncached_requests": sum(not r.inserted for r in records),
        "aborted_requests": sum(r.aborted for r in records),
        "preemptions": preemptions,
        "makespan_s": makespan,
        "throughput_req_s": rate(len(timed)),
        "throughput_tok_s": rate(prompt + output),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        **cold_warm_summary(records),
        "tpot_p50_s": _percentile(tpot, 50),
        "e2e_p50_s": _percentile(e2e, 50),
        "e2e_p99_s": _percentile(e2e, 99),
        "wall_s": wall_s,
    } | tier_summary(records, prompt) | quality_summary(records) | server_summary(records)


def server_summary(records: list[RequestRecord]) -> dict[str, Any]:
    """A live server's run (records with ``itl_s``): failed calls, whether the server reported
    cached tokens, inter-token latency and the tail of TPOT; nothing for other runs."""
    if not records or records[0].itl_s is None:
        return {}
    timed = _timed(records)
    itl = [gap for r in timed for gap in r.itl_s]
    tpot = _tpots(timed)
    return {"failed_requests": sum(r.failed for r in records),
            "cached_tokens_reported": any(r.cached_tokens is not None for r in records),
            "tpot_p99_s": _percentile(tpot, 99),
            "itl_p50_s": _percentile(itl, 50), "itl_p99_s": _percentile(itl, 99)}


def tier_summary(records: list[RequestRecord], prompt: int) -> dict[str, Any]:
    """With lower tiers: the hit rate split by where the hit tokens were (they add up to
    ``hit_rate``), tokens loaded back per tier and the time requests waited for loads."""
    if not records or records[0].gpu_hit_tokens is None:
        return {}
    waits = [r.load_s for r in records if r.load_s is not None]
    out: dict[str, Any] = {}
    for tier in ("gpu", "host", "disk"):
        tokens = sum(getattr(r, f"{tier}_hit_tokens") or 0 for r in records)
        out[f"hit_rate_{tier}"] = tokens / prompt if prompt else 0.0
        if tier != "gpu":
            out[f"hit_tokens_{tier}"] = tokens
    loads = sum(1 for r in records if (r.host_hit_tokens or 0) + (r.disk_hit_tokens or 0))
    out |= {"loads": loads, "load_s_total": sum(waits) if waits else None,
            "load_s_p50": _percentile(waits, 50), "load_s_p99": _percentile(waits, 99)}
    return out
