"""What the GPU validation runs through the engine, and what it reads off them (no torch here).

`experiments.validation.gpu_engine` runs each of `RUNS` through `testbed.execute` on the GPU;
this module holds the plan (each run's overrides: `run_overrides`) and everything computed from
the run directories and the measured copy bandwidth: each decode step beside its byte floor by
batch size, with its GPU and host time (`step_split`), the decode step of one shape
(`decode_median`), the throughput ratios (`ratios`) and issue 61's acceptance points
(`acceptance`), so that all of it is tested on a CPU (tests/test_gpu_validate.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

TOT = ["workload=tree_of_thought", "cache=radix", "scheduler=lpm", "engine.attention=triton"]
NONE = ["cache=none", "scheduler=fcfs", "engine.attention=triton"]
CASCADE = "engine.attention=cascade_triton"
SHAPE = ["workload=shared_prefix", "engine.cuda_graph_max_batch=32"]  # one batch size: 32
SMALL = ["workload=shared_prefix", "engine.attention=triton"]  # graphs up to its batch (below)
OVERLAP = "scheduler.overlap=true"
CHAT = ["workload=chat", "cache=radix", "scheduler=lpm"]
FEWSHOT = ["workload=few_shot", "cache=radix", "scheduler=lpm"]
FEWSHOT_DECODE = ["workload=few_shot", "workload.output_len=32", "cache=radix",
                  "scheduler=lpm"]  # answers of 32 tokens: decode steps for cascade to share
#: name -> overrides (besides the model's), in the order they run: the acceptance's first
RUNS: dict[str, list[str]] = {
    "tot_radix": TOT,
    "tot_none": ["workload=tree_of_thought", *NONE],
    "tot_radix_overlap": [*TOT, OVERLAP],
    "shape_plain_graph": [*SHAPE, "engine.attention=triton"],
    "shape_plain_graph_overlap": [*SHAPE, "engine.attention=triton", OVERLAP],
    "shape_cascade_graph": [*SHAPE, CASCADE],
    "tot_radix_cascade": [*TOT[:3], CASCADE],
    "chat_radix": [*CHAT, "engine.attention=triton"],
    "chat_radix_cascade": [*CHAT, CASCADE],
    "fewshot32_radix": [*FEWSHOT_DECODE, "engine.attention=triton"],
    "fewshot32_radix_cascade": [*FEWSHOT_DECODE, CASCADE],
    "small_plain_graph_b8": SMALL,
    "small_plain_graph_b16": SMALL,
    "fewshot_radix": [*FEWSHOT, "engine.attention=triton"],
    "fewshot_none": ["workload=few_shot", *NONE],
    "tot_radix_cascade_always": [*TOT[:3], CASCADE, "engine.cascade_rule=always"],
    "shape_plain_eager": [*SHAPE, "engine.attention=triton", "engine.cuda_graph=false"],
    "shape_cascade_eager": [*SHAPE, CASCADE, "engine.cuda_graph=false"],
    "tot_radix_eager": [*TOT, "engine.cuda_graph=false"],
}
#: decode batch sizes a step's figures are grouped by (issue 61: steps of 8-16 requests)
BATCH_RANGES = ((1, 7), (8, 16), (17, 32), (33, 64), (65, 512))


@dataclass(frozen=True)
class Shape:
    """The decode step shape runs' requests: ``requests`` x (``prefix`` shared + ``suffix``
    own) prompt tokens, ``new`` generated; ``problems``: tree-of-thought's."""

    requests: int = 32
    prefix: int = 2048
    suffix: int = 64
    new: int = 32
    problems: int = 12


def run_overrides(name: str, shape: Shape) -> list[str]:
    """Run ``name``'s overrides with its size: the step shapes' prompts (the ``small_*`` runs at
    their batch, 8 or 16, with 16 tokens generated), tree-of-thought's problems."""
    if name.startswith(("shape", "small")):
        requests = int(name.rsplit("_b", 1)[1]) if name.startswith("small") else shape.requests
        new = 16 if name.startswith("small") else shape.new
        extra = [f"workload.prompts_per_group={requests}", "workload.num_groups=1",
                 f"workload.system_prompt_len={shape.prefix}",
                 f"workload.question_len={shape.suffix}", f"workload.output_len={new}"]
        if name.startswith("small"):
            extra.append(f"engine.cuda_graph_max_batch={requests}")
        return [*RUNS[name], *extra]
    if name.startswith("tot"):
        return [*RUNS[name], f"workload.num_problems={shape.problems}"]
    return list(RUNS[name])


def byte_floor_s(weight_bytes: int, kv_tokens: int, kv_bytes_per_token: int,
                 bandwidth: float) -> float:
    """A step that reads every matmul weight (the LM head's included, not the embedding table:
    a gather of a few rows) and ``kv_tokens`` tokens of KV once, at ``bandwidth``: no decode
    step can take less (norm weights and activations left out make it lower still)."""
    return (weight_bytes + kv_tokens * kv_bytes_per_token) / bandwidth


@dataclass(frozen=True)
class Floor:
    """What a step's byte floor needs: the weights read, the KV bytes a token, the bandwidth
    measured (device-to-device copy: read plus written)."""

    weight_bytes: int
    kv_bytes_per_token: int
    bandwidth: float

    def of(self, kv_tokens: int) -> float:
        return byte_floor_s(self.weight_bytes, kv_tokens, self.kv_bytes_per_token,
                            self.bandwidth)


def step_split(steps: list[dict], floor: Floor | None = None) -> dict[str, dict]:
    """A run's decode steps by batch size (`BATCH_RANGES`): medians of each step's share of the
    timeline (``duration_s``), its GPU time (``gpu_s``, CUDA events), its host time
    (``host_s``: forming, launching, reading back, applying) and, given ``floor``, of its
    duration over its byte floor (every request's whole KV, ``context_tokens + new_tokens``:
    plain decode's reads)."""
    out = {}
    for low, high in BATCH_RANGES:
        chosen = [s for s in steps if s["kind"] == "decode" and low <= s["batch_size"] <= high]
        if not chosen:
            continue
        row = {"steps": len(chosen)} | {k: statistics.median(s[k] for s in chosen)
                                        for k in ("duration_s", "gpu_s", "host_s")}
        if floor is not None:
            row["over_floor"] = statistics.median(
                s["duration_s"] / floor.of(s["context_tokens"] + s["new_tokens"])
                for s in chosen)
        out[f"batch_{low}_{high}"] = row
    return out


def decode_median(steps: list[dict], batch: int) -> dict[str, Any]:
    """Medians over the decode steps of ``batch`` requests: the step's share of the timeline,
    its GPU and its host time; and how many there were."""
    chosen = [s for s in steps if s["kind"] == "decode" and s["batch_size"] == batch]
    if not chosen:
        return {"decode_step_s": None, "decode_steps_at_batch": 0}
    return {"decode_step_s": statistics.median(s["duration_s"] for s in chosen),
            "decode_gpu_s": statistics.median(s["gpu_s"] for s in chosen),
            "decode_host_s": statistics.median(s["host_s"] for s in chosen),
            "decode_steps_at_batch": len(chosen)}


def shape_floor_tokens(name: str, shape: Shape, requests: int) -> int:
    """KV tokens the median decode step of a shape run reads: every request its whole context
    (plain), or the shared prefix once and each request's own tokens (cascade)."""
    context = shape.prefix + shape.suffix + (16 if name.startswith("small") else shape.new) // 2
    if "cascade" in name:
        return shape.prefix + requests * (context - shape.prefix)
    return requests * context


def ratios(out: dict[str, dict]) -> dict[str, float | None]:
    """Throughput ratios between runs (on the run's timeline; ``_wall``: requests over the
    run's wall seconds), and decode step ratios of the 32-request shape."""
    def ratio(a: str, b: str, key: str = "throughput_req_s") -> float | None:
        x, y = (out.get(a) or {}).get(key), (out.get(b) or {}).get(key)
        return x / y if x and y else None

    found = {
        "tot_radix_over_none": ratio("tot_radix", "tot_none"),
        "tot_overlap_over_plain": ratio("tot_radix_overlap", "tot_radix"),
        "tot_overlap_over_plain_wall": ratio("tot_radix_overlap", "tot_radix",
                                             "wall_throughput_req_s"),
        "tot_radix_cascade_over_none": ratio("tot_radix_cascade", "tot_none"),
        "tot_cascade_over_plain": ratio("tot_radix_cascade", "tot_radix"),
        "tot_cascade_always_over_plain": ratio("tot_radix_cascade_always", "tot_radix"),
        "chat_cascade_over_plain": ratio("chat_radix_cascade", "chat_radix"),
        "fewshot32_cascade_over_plain": ratio("fewshot32_radix_cascade", "fewshot32_radix"),
        "tot_graph_over_eager": ratio("tot_radix", "tot_radix_eager"),
        "fewshot_radix_over_none": ratio("fewshot_radix", "fewshot_none"),
        "cascade_over_plain_step": ratio("shape_cascade_graph", "shape_plain_graph",
                                         "decode_step_s"),
        "overlap_over_plain_step": ratio("shape_plain_graph_overlap", "shape_plain_graph",
                                         "decode_step_s"),
    }
    return found


def _point(name: str, measured: float | None, bound: float, at_least: bool,
           source: str) -> dict[str, Any]:
    ok = None if measured is None else measured >= bound if at_least else measured <= bound
    return {"point": name, "measured": measured, "bound": f"{'>=' if at_least else '<='} "
            f"{bound:g}", "ok": ok, "from": source}


def acceptance(runs: dict, kernels: dict | None, sim: dict | None) -> list[dict[str, Any]]:
    """Issue 61's acceptance points, each with what was measured (None: not measured), its
    bound and whether it holds, from gpu_engine's runs, gpu_check's kernels and sim_vs_engine."""
    r = runs.get("ratios") or {}
    get = lambda run, key: (runs.get(run) or {}).get(key)  # noqa: E731
    small = [v for v in (get("small_plain_graph_b8", "over_floor"),
                         get("small_plain_graph_b16", "over_floor"),
                         ((get("tot_radix", "decode_split") or {}).get("batch_8_16") or {})
                         .get("over_floor")) if v is not None]
    cascade = [r.get(k) for k in ("tot_cascade_over_plain", "chat_cascade_over_plain",
                                  "fewshot32_cascade_over_plain")]
    best = ((kernels or {}).get("extend_sweep") or {}).get("best") or {}
    prefill = [b["vs_sdpa"] for b in best.values() if b.get("vs_sdpa") is not None]
    tot_sim = ((sim or {}).get("held_back") or {}).get("tree_of_thought") or {}
    abs_or_none = lambda v: None if v is None else abs(v)  # noqa: E731
    return [
        _point("tree-of-thought radix+lpm over none+fcfs", r.get("tot_radix_over_none"), 2.5,
               True, "gpu_engine ratios"),
        _point("simulator makespan error, tree-of-thought", abs_or_none(tot_sim.get("makespan")),
               0.05, False, "sim_vs_engine (radix+lpm)"),
        _point("simulator TTFT p50 error, tree-of-thought", abs_or_none(tot_sim.get("ttft_p50")),
               0.10, False, "sim_vs_engine (radix+lpm)"),
        _point("simulator TPOT p50 error, tree-of-thought", abs_or_none(tot_sim.get("tpot_p50")),
               0.10, False, "sim_vs_engine (radix+lpm)"),
        _point("decode steps of 8-16 requests over their byte floor (worst)",
               max(small) if small else None, 1.3, False, "small_plain_graph_b8/b16, tot_radix"),
        _point("32 x 2,112 plain decode step over its floor", get("shape_plain_graph",
                                                                  "over_floor"), 1.1, False,
               "shape_plain_graph"),
        _point("cascade over plain throughput, worst of tree-of-thought, chat, few-shot",
               min(cascade) if all(c is not None for c in cascade) else None, 1.0, True,
               "gpu_engine ratios"),
        _point("32 x (2,048 shared + 64 own) cascade step over its own floor",
               get("shape_cascade_graph", "over_floor"), 1.5, False, "shape_cascade_graph"),
        _point("prefill 4 x 2,048 (Llama-2-7B, bf16) over SDPA, best source",
               min(prefill) if prefill else None, 1.3, False, "kernels extend_sweep"),
        _point("prefill over SDPA reading the pool (the engine's path)",
               (best.get("pool") or {}).get("vs_sdpa"), 1.3, False, "kernels extend_sweep"),
        _point("tree-of-thought with overlap over without", r.get("tot_overlap_over_plain"),
               1.1, True, "gpu_engine ratios"),
        _point("32 x 2,112 step with overlap over its floor",
               get("shape_plain_graph_overlap", "over_floor"), 1.1, False,
               "shape_plain_graph_overlap"),
    ]
