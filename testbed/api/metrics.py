"""`ServerMetrics`: the figures operators read from vLLM and SGLang (``GET /metrics``), kept by
the engine's loop thread, and their Prometheus text exposition (format 0.0.4).

Names are vLLM's (``vllm/v1/metrics/loggers.py``) under the ``testbed:`` prefix, labelled with
``model_name`` as vLLM labels them, so a vLLM dashboard reads them with its prefix replaced:

- gauges ``num_requests_running`` (admitted, not finished: prefilling or decoding),
  ``num_requests_waiting`` (queued), ``kv_cache_usage_perc`` (the KV pool's share held by
  requests, 0 to 1: cached tokens no request protects count as free, as vLLM's free queue
  counts them), read after each turn of the loop;
- counters ``prefix_cache_queries_total`` and ``prefix_cache_hits_total`` (prompt tokens of the
  finished requests that were admitted, and those found cached at first admission: their ratio is
  the hit rate every backend reports), ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason}`` (stop, length, abort, error);
- histograms ``time_to_first_token_seconds`` (submission to first token),
  ``time_per_output_token_seconds`` (first token to finish over the tokens after the first) and
  ``e2e_request_latency_seconds``, on the engine's clock, with vLLM's buckets.

The counters are also in ``GET /debug/state`` (`counters`), from the same object.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

PREFIX = "testbed:"
# vLLM's buckets (vllm/v1/metrics/loggers.py, 0.8-0.11)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REASONS = ("stop", "length", "abort", "error")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative (+Inf last)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


HELP = {
    "num_requests_running": "Requests admitted and not finished (prefilling or decoding).",
    "num_requests_waiting": "Requests queued for admission.",
    "kv_cache_usage_perc": "Share of the KV pool held by requests (1 = full); cached tokens no "
                           "request protects count as free.",
    "prefix_cache_queries": "Prompt tokens of finished requests that were admitted.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache at first admission.",
    "prompt_tokens": "Prompt tokens of finished requests.",
    "generation_tokens": "Output tokens of finished requests.",
    "request_success": "Finished requests by finish reason.",
    "time_to_first_token_seconds": "Submission to first token (engine clock).",
    "time_per_output_token_seconds": "First token to finish, per output token after the first.",
    "e2e_request_latency_seconds": "Submission to finish (engine clock).",
}


class ServerMetrics:
    """Counters, gauges and histograms of one server; the loop thread writes, any thread reads
    (one lock)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.finished = dict.fromkeys(REASONS, 0)
        self.gauges = {"num_requests_running": 0, "num_requests_waiting": 0,
                       "kv_cache_usage_perc": 0.0}
        self.histograms = {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                           "time_per_output_token_seconds": Histogram(TPOT_BUCKETS),
                           "e2e_request_latency_seconds": Histogram(E2E_BUCKETS)}

    def request_finished(self, req: Any, reason: str) -> None:
        """A request ended (`testbed.scheduler.request_state.Req`; reason as its update's)."""
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.counts["prompt_tokens"] += len(req.prompt)
            self.counts["generation_tokens"] += len(req.output)
            if req.cached_tokens is not None:  # admitted: its prefix was looked up
                self.counts["prefix_cache_queries"] += len(req.prompt)
                self.counts["prefix_cache_hits"] += req.cached_tokens
            h = self.histograms
            if req.first_token_s is not None:
                h["time_to_first_token_seconds"].observe(req.first_token_s - req.submitted_s)
                if req.finish_s is not None and len(req.output) > 1:
                    h["time_per_output_token_seconds"].observe(
                        (req.finish_s - req.first_token_s) / (len(req.output) - 1))
            if req.finish_s is not None and not req.aborted:
                h["e2e_request_latency_seconds"].observe(req.finish_s - req.submitted_s)

    def engine_state(self, running: int, waiting: int, kv_usage: float) -> None:
        with self._lock:
            self.gauges.update(num_requests_running=running, num_requests_waiting=waiting,
                               kv_cache_usage_perc=kv_usage)

    def counters(self) -> dict[str, Any]:
        """The counters (``/debug/state``'s ``counters``)."""
        with self._lock:
            return {**self.counts, "request_success": dict(self.finished)}

    def exposition(self) -> str:
        """The Prometheus text of every metric."""
        with self._lock:
            label = f'model_name="{_escape(self.model_name)}"'
            lines: list[str] = []
            for name, value in self.gauges.items():
                lines += _family(name, "gauge", [(name, label, value)])
            for name, value in self.counts.items():
                lines += _family(name + "_total", "counter", [(name + "_total", label, value)])
            lines += _family("request_success_total", "counter", [
                ("request_success_total", f'{label},finished_reason="{r}"', n)
                for r, n in self.finished.items()])
            for name, h in self.histograms.items():
                samples, running = [], 0
                for le, n in zip([*map(_number, h.buckets), "+Inf"], h.counts):
                    running += n
                    samples.append((name + "_bucket", f'{label},le="{le}"', running))
                samples += [(name + "_sum", label, h.total), (name + "_count", label, h.n)]
                lines += _family(name, "histogram", samples)
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, samples: list[tuple[str, str, float]]) -> list[str]:
    # a counter's family is named with its _total, as prometheus_client writes format 0.0.4
    return [f"# HELP {PREFIX}{name} {HELP[name.removesuffix('_total')]}",
            f"# TYPE {PREFIX}{name} {kind}",
            *(f"{PREFIX}{sample}{{{labels}}} {_number(v)}" for sample, labels, v in samples)]


def _number(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
