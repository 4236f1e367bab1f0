"""The engine under SGLang's overlap loop (``scheduler.overlap=true``) generates exactly the
tokens it generates without it, on programs with prefill-only fork calls and a pool tight
enough to evict and retract. Overlap only moves when a step's results are applied; if it
changed a token, a request or the KV of one, the scheduler's bookkeeping would be wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.assembly import compose_config
from testbed.execute import execute

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The command that crashed in EngineRunner.prepare (a decode step fed a fork no token), and a
# paged tree whose forks left the loop waiting forever with admissible requests queued.
SELF_CONSISTENCY = ["workload=self_consistency", "workload.num_questions=3",
                    "workload.num_samples=3", "workload.prefix_len=16", "workload.question_len=16",
                    "workload.output_len=12", "seed=36", "cache=radix",
                    "cache.capacity_tokens=255", "scheduler=lpm", "arrival.max_in_flight=3"]
TREE_PAGED = ["workload=tree_of_thought", "workload.num_problems=2", "workload.depth=3",
              "workload.instruction_len=16", "workload.problem_len=16",
              "workload.step_prompt_len=8", "workload.thought_len=24", "seed=90", "cache=radix",
              "cache.page_size=4", "cache.capacity_tokens=239", "scheduler=dfs_weight",
              "arrival.max_in_flight=5"]


def tokens(tmp_path: Path, name: str, overrides: list[str]) -> tuple[dict, dict]:
    """The run's summary and each request's (prompt ids, output ids, aborted)."""
    cfg = compose_config(["progress=false", "hardware=cpu", "backend=engine", "model=tiny",
                          "device=cpu", "save_token_ids=true", *overrides])
    out = tmp_path / name
    summary = execute(cfg, out)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return summary, {r["id"]: (r["prompt_ids"], r["output_ids"], r["aborted"]) for r in records}


@pytest.mark.parametrize("overrides", [
    SELF_CONSISTENCY,  # as the failing command ran it: forced (replayed) outputs
    [*SELF_CONSISTENCY, "forced=false"],  # the model's own greedy tokens
    [*TREE_PAGED, "forced=false"],
], ids=["self_consistency", "self_consistency_generated", "tree_of_thought_paged"])
def test_overlap_generates_the_same_tokens_as_the_plain_loop(tmp_path, overrides):
    plain_summary, plain = tokens(tmp_path, "plain", [*overrides, "scheduler.overlap=false"])
    overlap_summary, overlap = tokens(tmp_path, "overlap", [*overrides, "scheduler.overlap=true"])
    assert overlap == plain
    assert not any(aborted for _, _, aborted in plain.values())
    assert all(out for rid, (_, out, _) in plain.items() if not rid.endswith("fork"))
    assert overlap_summary["aborted_requests"] == plain_summary["aborted_requests"] == 0
