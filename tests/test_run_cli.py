"""The command line contract: `python -m testbed.run [overrides]` writes summary.json and
requests.jsonl into the Hydra run dir; bad values fail with one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]


def run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.run", *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_replay_of_a_token_trace_writes_summary_and_requests(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"prompt": [1, 2, 3], "output": [4]}\n'
        '{"prompt": [1, 2, 3, 4, 5], "output": [6, 7]}\n'
        '{"prompt": [9, 9], "output": [1]}\n')
    out = tmp_path / "run"
    proc = run("backend=replay", "workload=trace", f"workload.path={trace}", "workload.format=tokens",
               "cache=radix", "cache.capacity_tokens=9", "save_token_ids=true",
               f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_requests"], summary["prompt_tokens"], summary["cached_tokens"]) == (3, 10, 4)
    assert summary["evicted_tokens"] == 2 and summary["ideal_hit_rate"] == 0.4
    assert summary["makespan_s"] is None
    timing = summary["timing"]
    assert list(timing) == ["load_s", "run_s", "ideal_s", "write_s"]
    assert all(v >= 0 for v in timing.values())
    assert sum(v for k, v in timing.items() if k != "write_s") <= summary["wall_s"]
    rows = pd.read_json(out / "requests.jsonl", lines=True)
    assert rows["cached_tokens"].tolist() == [0, 4, 0]
    # the leaf [6, 7], whole: SGLang 0.5.23's checkpoint split the second request's prompt
    # [1, 2, 3, 4, 5] off its output (0.4.10: the leaf [5, 6, 7], 3 tokens)
    assert rows["evicted_tokens"].tolist() == [0, 0, 2]
    assert rows["inserted"].tolist() == [True, True, True]
    assert rows["prompt_ids"][1] == [1, 2, 3, 4, 5] and rows["output_ids"][1] == [6, 7]
    assert "hit_rate" in proc.stdout


def test_default_run_prints_the_summary(tmp_path):
    proc = run("workload.num_problems=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "backend=sim" in proc.stdout and "makespan_s" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_requests"] == 2 * (15 + 7) and summary["makespan_s"] > 0


def test_bad_values_fail_with_one_line_naming_the_key(tmp_path):
    proc = run("cache.capacity_tokens=-5", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cache.capacity_tokens must be >= 0 or null, got -5"
    proc = run("workload=trace", f"workload.path={tmp_path}/missing.jsonl", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and "workload.path: no such file" in proc.stderr
    proc = run("cache=lru", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cache must be one of block_hash, custom, none, radix; got 'lru'"
    proc = run("scheduler=sjf", f"hydra.run.dir={tmp_path}")
    assert proc.stderr.strip() == \
        "error: scheduler must be one of custom, dfs_weight, fcfs, hrrn, lof, lpm, random, vllm; got 'sjf'"


def test_an_unknown_key_is_one_line_naming_its_group_the_allowed_keys_and_the_closest(tmp_path):
    """The first try gets the project's line (Hydra's would suggest appending it with +)."""
    proc = run("cache.capacity=100", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: cache.capacity is not a setting of cache=radix; allowed: name, capacity_tokens, "
        "page_size, evict_unit, split_recency, host_tokens, disk_tokens, write_policy, "
        "write_threshold, host_eviction, disk_eviction, load_back, host_link, disk_link, reuse, "
        "recompute_ratio, chunk_boundaries, match, similarity_threshold; "
        "did you mean capacity_tokens?\n")
    assert not (tmp_path / "summary.json").exists()


def test_an_unknown_top_level_key_in_a_sweep_is_refused_before_any_job(tmp_path):
    proc = run("-m", "workload=few_shot,chat", "sed=3", f"hydra.sweep.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: sed is not a setting of the config; allowed: backend, workload, cache, eviction, "
        "scheduler, model, hardware, cost_model, router, seed, replicas, arrival, server, engine, "
        "host, speculative, device, dtype, threads, clock, attention, cascade_min_saved, forced, temperature, "
        "top_p, save_token_ids, timeline, progress, debug; did you mean seed?\n")


def test_a_mistyped_option_names_the_options_and_the_closest(tmp_path):
    proc = run("workload=tree_of_thougt", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "error: workload must be one of beam_search, chat, chat_long, chat_tenants, "
        "copy_text, custom, few_shot, few_shot_text, mixed, multimodal, paraphrase, paraphrase_text, rag, "
        "rag_text, random_tree, self_consistency, shared_prefix, sharegpt, sharegpt_chat, "
        "trace, tree_of_thought; got 'tree_of_thougt'; did you mean tree_of_thought?\n")


def test_a_cuda_device_torch_cannot_see_is_refused_before_the_model_loads(tmp_path):
    """Bad input (exit 2, one line), refused in assembly: no model is built, no step taken."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # torch sees no CUDA device, GPU or not
    proc = subprocess.run([sys.executable, "-m", "testbed.run", "backend=engine", "model=tiny",
                           "device=cuda", f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: device=cuda: torch sees no CUDA device on this machine; use "
                           "device=cpu (or leave device unset: CUDA where present, else the "
                           "CPU)\n")
    assert json.loads((tmp_path / "failed.json").read_text())["kind"] == "bad_input"


def test_an_engine_run_names_the_device_it_ran_on_not_the_hardware_preset(tmp_path):
    proc = run("backend=engine", "model=tiny", "device=cpu", "workload=few_shot",
               "workload.num_tasks=1", "workload.questions_per_task=2", "progress=false",
               f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    head = proc.stdout.splitlines()[0]
    assert " · device=cpu · " in head and "hardware=" not in head
