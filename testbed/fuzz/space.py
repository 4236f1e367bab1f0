"""The config space the fuzzer draws from: every backend, cache, eviction policy, scheduler and
its knobs, reuse and match mode, router, arrival kind and generated workload, at small sizes, with
KV capacities from below one request to unlimited.

A token trace drawn is malformed half the time (`testbed.fuzz.bad_traces`: a duplicate id, a
cycle, an ``after`` naming no call, an empty file, ...): its run must be refused in one line naming
the file.

A draw is a list of Hydra overrides, the same a user types after ``python -m testbed.run``. The
capacity is drawn in a second step, once the workload's requests are known (`capacity_overrides`),
so that "below one request", "exactly the largest request" and "a few requests" mean what they say.
Some draws are refused by validation (a combination that cannot run together); they are kept: the
refusal must then be one line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.fuzz.bad_traces import KINDS, bad_trace_path, spoil
from testbed.workloads.request import Request

BACKENDS = {"replay": 0.4, "sim": 0.52, "engine": 0.08}
EVICTIONS = ["lru", "fifo", "gdsf", "learned", "lfu", "mru", "oracle", "priority", "slru",
             "workload_aware"]
SCHEDULERS = ["fcfs", "lpm", "dfs_weight", "lof", "random"]
ROUTERS = ["round_robin", "random", "least_load", "cache_aware", "oracle", "kv_events"]


def _small(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def workload_overrides(name: str, rng: np.random.Generator, vocab: int) -> list[str]:
    """``workload=NAME`` at a size that runs in well under a second, over ``vocab`` token ids."""
    n = lambda lo, hi: _small(rng, lo, hi)  # noqa: E731
    sizes = {
        "chat": [f"num_sessions={n(1, 4)}", f"turns={n(1, 3)}", f"system_prompt_len={n(0, 24)}",
                 "min_question_len=1", f"max_question_len={n(1, 30)}", "min_output_len=1",
                 f"max_output_len={n(1, 8)}", f"think_time_s={rng.choice([0.0, 0.01])}"],
        "chat_tenants": [f"num_tenants={n(1, 3)}", f"num_sessions={n(1, 4)}",
                         f"turns={n(1, 3)}", f"system_prompt_len={n(0, 24)}",
                         "min_question_len=1", f"max_question_len={n(1, 16)}",
                         "min_output_len=1", f"max_output_len={n(1, 8)}",
                         f"think_time_s={rng.choice([0.0, 0.01])}",
                         f"zipf={rng.choice([0.0, 1.0])}"],
        "chat_long": [f"num_sessions={n(1, 3)}", f"turns={n(1, 3)}", "system_prompt_len=8",
                      "min_question_len=4", f"max_question_len={n(4, 24)}",
                      "min_output_len=4", f"max_output_len={n(4, 16)}"],
        "few_shot": [f"num_tasks={n(1, 3)}", f"questions_per_task={n(1, 5)}",
                     f"num_shots={n(0, 3)}", f"example_len={n(1, 16)}",
                     f"question_len={n(1, 12)}", f"output_len={n(1, 4)}"],
        "self_consistency": [f"num_questions={n(1, 3)}", f"num_samples={n(1, 4)}",
                             f"prefix_len={n(0, 32)}", f"question_len={n(1, 16)}",
                             f"output_len={n(1, 12)}",
                             f"fork_prefill={str(bool(rng.random() < 0.5)).lower()}"],
        "tree_of_thought": [f"num_problems={n(1, 3)}", f"depth={n(1, 3)}",
                            f"branching={n(1, 3)}", f"instruction_len={n(0, 16)}",
                            f"problem_len={n(1, 16)}", f"step_prompt_len={n(1, 8)}",
                            f"thought_len={n(1, 8)}", f"max_in_flight={n(1, 4)}",
                            f"fork_prefill={str(bool(rng.random() < 0.5)).lower()}"],
        "multimodal": [f"num_requests={n(1, 16)}", f"num_images={n(1, 4)}",
                       f"images_per_request={n(1, 2)}", f"image_len={n(1, 16)}",
                       f"system_prompt_len={n(0, 8)}", f"question_len={n(1, 8)}",
                       f"output_len={n(1, 6)}"],
        "shared_prefix": [f"num_groups={n(1, 4)}", f"prompts_per_group={n(1, 5)}",
                          f"system_prompt_len={n(0, 32)}", f"question_len={n(1, 12)}",
                          f"output_len={n(1, 8)}"],
        "random_tree": [f"num_requests={n(1, 30)}", f"root_prob={rng.choice([0.0, 0.2, 1.0])}",
                        f"max_burst={n(1, 4)}", f"root_len={n(0, 24)}",
                        f"segment_len={n(0, 8)}", f"output_len={n(0, 6)}"],
        "rag": [f"num_requests={n(1, 12)}", f"corpus_docs={n(1, 6)}",
                f"docs_per_prompt={n(1, 3)}", f"doc_len={n(1, 16)}", f"question_len={n(1, 8)}",
                f"system_prompt_len={n(0, 8)}", f"output_len={n(1, 6)}"],
        "paraphrase": [f"num_originals={n(1, 4)}", f"paraphrases={n(0, 3)}",
                       f"prompt_len={n(4, 32)}", f"edits={n(0, 4)}",
                       f"edit_kind={rng.choice(['substitute', 'insert', 'delete', 'mixed'])}",
                       f"edit_at={rng.choice(['null', '0.5', '0.0'])}",
                       f"system_prompt_len={n(0, 8)}", f"output_len={n(1, 6)}"],
    }
    if name == "mixed":
        out = [f"workload.num_programs={rng.choice(['null', str(n(1, 6))])}"]
        for part in ("few_shot", "chat", "self_consistency", "tree_of_thought"):
            out += [f"workload.components.{part}.{kv.removeprefix('workload.')}"
                    for kv in workload_overrides(part, rng, vocab)]
            out.append(f"workload.weights.{part}={rng.choice([0.0, 1.0, 2.0])}")
        return out
    size = sizes[name]
    return [f"workload.{kv}" for kv in size] + ([f"workload.vocab_size={vocab}"])


def write_token_trace(path: Path, rng: np.random.Generator, vocab: int) -> None:
    """A small token trace (`workload.format=tokens`): a random tree of continuations, some calls
    with arrival times, priorities and think times."""
    from testbed.workloads.synthetic import random_tree
    from testbed.workloads.traces import save_tokens

    requests = random_tree(num_requests=_small(rng, 1, 30), root_prob=0.2,
                           max_burst=_small(rng, 1, 4), root_len=_small(rng, 1, 24),
                           segment_len=_small(rng, 0, 8), output_len=_small(rng, 0, 6),
                           vocab_size=vocab, seed=int(rng.integers(1 << 30)))
    timed = rng.random() < 0.5
    for i, r in enumerate(requests):
        r.arrival_s = float(i * rng.uniform(0, 0.05)) if timed else 0.0
        r.priority = int(rng.integers(0, 3))
    save_tokens(requests, path)


def cache_overrides(rng: np.random.Generator, backend: str) -> list[str]:
    kind = rng.choice(["radix", "radix", "radix", "block_hash", "none"])
    out = [f"cache={kind}"]
    if kind == "radix":
        out.append(f"cache.page_size={rng.choice([1, 1, 4, 16])}")
        if rng.random() < 0.3:
            out.append(f"cache.evict_unit={rng.choice(['node', 'page'])}")
        if rng.random() < 0.3:
            out.append(f"cache.split_recency={rng.choice(['refresh', 'keep'])}")
        if rng.random() < 0.15:
            out += [f"cache.host_tokens={rng.choice([16, 64, 512])}",
                    f"cache.disk_tokens={rng.choice([0, 0, 256, 2048])}",
                    "cache.write_policy=" + str(rng.choice(
                        ["write_through", "write_through_selective", "write_back"])),
                    f"cache.load_back={rng.choice(['cost', 'always'])}"]
        if backend != "replay" and rng.random() < 0.15:
            out += [f"cache.reuse={rng.choice(['prefix', 'blend'])}",
                    f"cache.match={rng.choice(['exact', 'semantic'])}",
                    f"cache.recompute_ratio={rng.choice([0.0, 0.15, 1.0])}",
                    f"cache.chunk_boundaries={rng.choice(['segments', '4'])}"]
    elif kind == "block_hash":
        out.append(f"cache.block_size={rng.choice([4, 16])}")
    return out


def scheduler_overrides(rng: np.random.Generator) -> list[str]:
    out = [f"scheduler={rng.choice(SCHEDULERS)}"]
    for key, values, p in (
            ("overlap", ["true", "false"], 0.4),
            ("in_batch_hold", ["true", "false"], 0.2),
            ("lpm_aging", ["0.0", "10.0", "1000.0"], 0.2),
            ("chunked_prefill_size", ["16", "64", "null"], 0.3),
            ("max_prefill_tokens", ["16", "64"], 0.15),
            ("max_running_requests", ["1", "2", "8"], 0.2),
            ("retract_order", ["newest", "longest_prompt", "most_remaining"], 0.2),
            ("lpm_fallback_threshold", ["0", "2"], 0.1)):
        if rng.random() < p:
            out.append(f"scheduler.{key}={rng.choice(values)}")
    return out


def vllm_overrides(rng: np.random.Generator) -> list[str]:
    """``scheduler=vllm`` with small budgets, so that prompts are chunked and steps mixed."""
    budget = int(rng.choice([8, 16, 64, 2048]))
    out = ["scheduler=vllm", f"scheduler.max_num_batched_tokens={budget}",
           f"scheduler.max_num_seqs={min(budget, int(rng.choice([1, 2, 8, 128])))}"]
    for key, values, p in (("long_prefill_token_threshold", ["0", "4"], 0.3),
                           ("scheduler_reserve_full_isl", ["true", "false"], 0.3),
                           ("enable_chunked_prefill", ["true", "false"], 0.15)):
        if rng.random() < p:
            out.append(f"scheduler.{key}={rng.choice(values)}")
    return out


def draw(rng: np.random.Generator, workdir: Path, index: int) -> list[str]:
    """One random config, without its capacity (`capacity_overrides` adds that)."""
    backend = str(rng.choice(list(BACKENDS), p=list(BACKENDS.values())))
    out = [f"backend={backend}", f"seed={int(rng.integers(1000))}",
           f"eviction={rng.choice(EVICTIONS)}"]
    vocab = int(rng.choice([2, 5, 50, 256]))
    names = ["chat", "chat_long", "few_shot", "self_consistency", "tree_of_thought",
             "multimodal", "shared_prefix", "random_tree", "rag", "paraphrase", "mixed", "trace",
             "chat_tenants"]
    workload = str(rng.choice(names))
    if workload == "trace":
        # half the traces spoiled, in a stream of their own so that the other draws stay as
        # they were (testbed/fuzz/bad_traces.py)
        bad = np.random.default_rng([index, 44])
        kind = str(bad.choice(KINDS)) if bad.random() < 0.5 else None
        path = workdir / f"trace{index}.jsonl" if kind is None else \
            bad_trace_path(workdir, index, kind)
        write_token_trace(path, rng, vocab)
        if kind is not None:
            spoil(path, kind, bad)
        out += ["workload=trace", f"workload.path={path}", "workload.format=tokens"]
    else:
        out += [f"workload={workload}", *workload_overrides(workload, rng, vocab)]
    out += cache_overrides(rng, backend)
    if backend == "replay":
        return out
    sglang = scheduler_overrides(rng)  # drawn in any case: the stream stays as it was
    # half the block-cache configs run vLLM's scheduler instead, drawn from their own stream
    vllm = np.random.default_rng([index, 31])
    out += vllm_overrides(vllm) if "cache=block_hash" in out and vllm.random() < 0.5 else sglang
    if backend == "engine":
        out += ["model=tiny", "device=cpu"]
        if rng.random() < 0.3:
            out.append(f"attention={rng.choice(['torch', 'cascade_torch'])}")
        if rng.random() < 0.3:
            out.append("forced=false")
    else:
        out += [f"model={rng.choice(['tiny', 'llama3_8b'])}",
                f"hardware={rng.choice(['cpu', 'a10g', 'h100'])}"]
        if rng.random() < 0.2:
            out.append(f"attention={rng.choice(['cascade', 'cascade_torch'])}")
            # where groups form: the GPU presets' grid rule (the default) or every shared node,
            # drawn from a stream of its own so that the other draws stay as they were
            if np.random.default_rng([index, 61]).random() < 0.5:
                out.append("engine.cascade_rule=always")
        if rng.random() < 0.2:
            out += [f"replicas={_small(rng, 2, 4)}", f"router={rng.choice(ROUTERS)}"]
            if out[-1] == "router=kv_events" and rng.random() < 0.5:
                out.append("router.event_delay_s=0.01")  # events reach it after a step or more
    kind = rng.choice(["auto", "offline", "poisson"])
    out.append(f"arrival.kind={kind}")
    if kind == "poisson":
        out.append(f"arrival.rate={rng.choice([1.0, 50.0, 1000.0])}")
    if rng.random() < 0.3:
        out.append(f"arrival.max_in_flight={_small(rng, 1, 4)}")
    return out


def capacity_overrides(rng: np.random.Generator, requests: list[Request],
                       backend: str) -> list[str]:
    """``cache.capacity_tokens`` relative to the workload: below one request, about the largest
    request, a few requests, or unlimited. Null means unlimited in replay and what the workload
    could ever hold on the engine; in the simulator it is what the model leaves on the hardware
    (millions of tokens, whose bookkeeping a check after every step would walk), so there the
    unlimited case is the workload's total instead."""
    if not requests:
        return []
    sizes = [len(r.prompt) + r.output_limit for r in requests]
    largest, total = max(sizes), sum(sizes)
    choice = rng.choice(["null", "below", "largest", "few", "total"], p=[0.2, 0.1, 0.3, 0.3, 0.1])
    value = {"null": None, "below": max(largest // 2, 0), "largest": largest + int(rng.integers(0, 3)),
             "few": largest * int(rng.integers(2, 5)), "total": total + 1}[choice]
    if value is None and backend == "sim":
        value = total + 1
    return [f"cache.capacity_tokens={'null' if value is None else value}"]
