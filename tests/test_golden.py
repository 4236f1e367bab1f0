"""Golden digests: representative runs give byte-for-byte the summary and per-request records
they gave when these were recorded (2026-12-02, before issue 28's redesign moves any code).

Each case runs in-process through `testbed.execute.execute`; its digest is a SHA-256 over the
summary (wall-clock fields aside; on the engine, its timed fields too) and requests.jsonl, with
floats rounded to 10 significant digits so that a last-bit difference of a library does not
count. A change that moves a digest changes what the testbed computes: if that is intended,
say so in the commit and print the new digests with ``python tests/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

if __package__ in (None, ""):  # run as a script: the repo root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.fuzz.checks import ENGINE_TIMED, WALL_CLOCK  # noqa: E402

TINY = ["workload.vocab_size=256"]
CASES: dict[str, list[str]] = {
    "default_sim": [],
    "chat": ["workload=chat", "workload.num_sessions=6", "workload.turns=3",
             "workload.min_question_len=16", "workload.max_question_len=64",
             "cache.capacity_tokens=1200"],
    "chat_long": ["workload=chat_long", "workload.num_sessions=4", "workload.turns=2",
                  "cache.capacity_tokens=3000"],
    "few_shot": ["workload=few_shot", "workload.num_tasks=3", "workload.questions_per_task=6"],
    "self_consistency": ["workload=self_consistency", "workload.num_questions=4",
                         "workload.num_samples=3", "cache.capacity_tokens=2500"],
    "tree_of_thought": ["workload.num_problems=8", "scheduler=fcfs", "cache.capacity_tokens=3000"],
    "multimodal": ["workload=multimodal", "workload.num_requests=24"],
    "shared_prefix": ["workload=shared_prefix", "workload.num_groups=4",
                      "workload.prompts_per_group=4", "workload.system_prompt_len=256",
                      "workload.output_len=16"],
    "random_tree": ["workload=random_tree", "workload.num_requests=60",
                    "cache.capacity_tokens=2000"],
    "rag": ["workload=rag", "workload.num_requests=24", "workload.corpus_docs=12"],
    "paraphrase": ["workload=paraphrase", "workload.num_originals=6"],
    "mixed": ["workload=mixed", "workload.num_programs=8"],
    "mooncake_replay": ["backend=replay", "workload=trace", "workload.path={mooncake}",
                        "workload.format=mooncake", "cache.capacity_tokens=40960"],
    "block_hash_replay": ["backend=replay", "workload=random_tree", "workload.num_requests=300",
                          "cache=block_hash", "cache.block_size=16", "cache.capacity_tokens=6000"],
    "block_hash_sim": ["cache=block_hash", "workload.num_problems=8",
                       "cache.capacity_tokens=3000"],
    "tiers": ["workload=chat", "workload.num_sessions=6", "workload.turns=3",
              "cache.capacity_tokens=1024", "cache.host_tokens=4096", "cache.disk_tokens=16384"],
    "blend": ["workload=rag", "workload.num_requests=24", "workload.corpus_docs=12",
              "cache.reuse=blend"],
    # the router group's defaults until 2026-12-07 (sglang-router 0.1's thresholds), pinned
    "cluster_cache_aware": ["replicas=4", "router=cache_aware", "workload.num_problems=16",
                            "router.cache_threshold=0.5", "router.balance_abs_threshold=32",
                            "router.balance_rel_threshold=1.0001",
                            "router.eviction_interval_s=60.0"],
    # its defaults since (SGLang's gateway's today: 0.3 / 64 / 1.5 / 120 s)
    "cluster_cache_aware_defaults": ["replicas=4", "router=cache_aware",
                                     "workload.num_problems=16"],
    "engine_tiny": ["backend=engine", "model=tiny", "device=cpu", "workload.num_problems=2",
                    "workload.depth=2", *TINY],
}


def write_mooncake(path: Path) -> Path:
    """A small Mooncake-format trace: 120 requests over shared 512-token blocks."""
    lines = []
    for i in range(120):
        blocks = [b for b in range(i % 7 + 1)] + [1000 + i] * (i % 3 == 0)
        length = 512 * (len(blocks) - 1) + 100 + i % 50
        lines.append(json.dumps({"timestamp": 250 * i, "input_length": length,
                                 "output_length": 20 + i % 9, "hash_ids": blocks}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.10g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def digest(run_dir: Path) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    engine = summary.get("backend") == "engine"
    timed = (lambda k: any(t in k for t in ENGINE_TIMED)) if engine else (lambda k: False)
    summary = {k: v for k, v in summary.items() if k not in WALL_CLOCK and not timed(k)}
    records = [{k: v for k, v in json.loads(line).items() if not timed(k)}
               for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    text = json.dumps(_rounded([summary, records]), sort_keys=True)
    text = text.replace(str(run_dir.parent), "<tmp>")  # a trace's path names the temporary folder
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_case(name: str, tmp: Path) -> str:
    from hydra import compose, initialize_config_dir

    from testbed.config.cli import CONF_DIR
    from testbed.execute import execute

    mooncake = write_mooncake(tmp / "mooncake.jsonl")
    overrides = [o.format(mooncake=mooncake) for o in CASES[name]]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[*overrides, "progress=false"])
    execute(cfg, tmp / name)
    return digest(tmp / name)


def report_digest(tmp: Path) -> str:
    """A sweep's report table: three runs of one sweep (cache x scheduler) as
    `python -m testbed.report` tabulates them, wall-clock columns aside."""
    from hydra import compose, initialize_config_dir

    from testbed.config.cli import CONF_DIR
    from testbed.report import build
    from testbed.execute import execute

    sweep = tmp / "sweep"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for i, choice in enumerate(["cache=radix scheduler=lpm", "cache=radix scheduler=fcfs",
                                    "cache=none scheduler=fcfs"]):
            cfg = compose("config", overrides=[*choice.split(), "workload.num_problems=8",
                                               "progress=false"])
            execute(cfg, sweep / str(i))
    table = build(sweep, progress=False)["table"]
    table = table[[c for c in table.columns if c not in WALL_CLOCK and not c.startswith("timing")]]
    text = json.dumps(_rounded(json.loads(table.to_json(orient="records"))), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# Recorded again for issue 61 for every case but the sweep report: the summary's config gained
# engine.cascade_rule (auto) and the hardware presets' sm_count; with both left out of the
# config every case gives the digest recorded before, byte for byte (checked case by case,
# engine_tiny included: on the CPU cascade's rule groups every shared node, as before).
# engine_tiny recorded again on 2026-12-05 (issue 46, the CPU's C layer steps): the summary's
# `layer_kernels` now says `native` where it said `torch`; every other field the digest reads
# (tokens, hits, agreed counts) is the same, byte for byte (checked by diffing the two runs).
# Recorded again on 2026-12-05 (issue 47, the simulator's recorded acceptance) for every case but
# the sweep report: the config gained speculative.acceptance_path (null); with it left out of the
# summary's config every case gives the digest recorded before, byte for byte (checked case by
# case, engine_tiny included).
# Recorded again on 2026-12-05 when issues 46 and 47 merged, for every case but the sweep report:
# the config gained engine.cpu_kernels and the speculative: block; with both left out of the
# config every case gives the digest recorded for issue 45 (281bea5), byte for byte, engine_tiny
# on the native CPU kernels included (checked case by case).
# Recorded again for issue 46 (2026-12-05) for every case but the sweep report: the summary's
# config gained engine.cpu_kernels (the CPU's oneDNN linear and in-place decode kernel, native by
# default); with that key left out of the config, every digest is the one before, byte for byte
# (engine_tiny included: it ran the native kernels, same tokens, hits and agreed counts).
# Recorded again for issue 45 (2026-12-05) for every case but the sweep report: the summary's config gained
# the host: block (the simulator's price of the host's work, all 0 by default); with it left out
# of the config, every digest is the one before, byte for byte (the one step cycle changed no
# decision, token or time of these runs).
# Recorded again on 2026-12-04 (later) for every case: the summary's config gained the engine:
# block, the old top-level engine keys turned null (their aliases) and the run keys threads and
# clock came; an engine run's summary gained cuda_graph and layer_kernels. With the config and
# those fields left out, every digest is the one before, byte for byte (checked case by case
# against c1b00ef: the step room, the new eviction hooks and the timing keys changed no
# decision, hit or token of these cases).
# Recorded again on 2026-12-04 for blend, block_hash_sim, chat_long, default_sim, rag,
# random_tree, self_consistency, tiers and tree_of_thought: SGLang 0.5.23's step rules became the
# default (docs/design.md §4, "SGLang releases"); with scheduler.sglang=0.4.10 those cases give
# their earlier digests, the config's label aside.
# Every run case recorded again on 2026-12-04 (issue 49): the config gained the keys threads and
# clock; without them each digest is the one before, to the bit.
# Every run case recorded again on 2026-12-06 (issue 59): the config's server block gained
# prompt_format (tokens); with it left out of the summary's config every digest is the one
# before, byte for byte (checked case by case: kv_events' cache events, the routers' availability
# and the server's metrics changed no decision, hit or token of these runs).
# Every run case recorded again on 2026-12-06 (issue 61, merged with issue 59's): the config
# gained engine.cascade_rule and hardware.sm_count; every case's requests.jsonl, steps.jsonl and
# summary but its config are the ones before, byte for byte (engine_tiny's timed fields aside).
# Every run case recorded again on 2026-12-06 (issue 60): the config's engine block gained
# cpu_kv_cache_gib (2; the server's CPU pool, which no run case reads); with it left out of the
# summary's config every case gives the digest before, byte for byte (checked case by case).
# Every run case recorded again on 2026-12-06 (issue 59, later): the router block gained
# load_seen (null: the simulator's view as before); with it left out of the summary's config
# every case gives the digest before, byte for byte (checked case by case at 6af8c00).
# 2026-12-07: router=cache_aware's defaults became SGLang's gateway's (0.3 / 64 / 1.5 / 120 s);
# the case that ran it at the defaults before keeps its digest with the earlier ones set, and
# cluster_cache_aware_defaults records the new defaults.
# 2026-12-07 (issue 59, later): cache_aware, oracle and kv_events gained router.tie_break (index:
# the lowest, as before); the two cache_aware cases' config echoes it, and their requests.jsonl
# are the ones before, byte for byte (checked for both at 3e3eadd).
GOLDEN = {
    "blend": "63bd3db38552da2a",
    "block_hash_replay": "6e753498ce5cea7c",
    "block_hash_sim": "4774c884b020b117",
    "chat": "75402fe788c346b2",
    "chat_long": "20f87585a53b44c5",
    "cluster_cache_aware": "4134edb29f71c12e",
    "cluster_cache_aware_defaults": "80cd5345033b91ee",
    "default_sim": "20acae78aad95619",
    "engine_tiny": "5096a5cd95e73930",
    "few_shot": "e3019b6a6876951d",
    "mixed": "a7bc2135c0007d2f",
    "mooncake_replay": "8d050a9668f9e5a2",
    "multimodal": "2741e932df9656fd",
    "paraphrase": "1fbd18d5c2cd4774",
    "rag": "b3660f66e21c61f5",
    "random_tree": "4e71209929ca6591",
    "self_consistency": "476cb3ac0b309f12",
    "shared_prefix": "ef5cd6de6c8d427e",
    "tiers": "3c7b8f78ca5f6ccf",
    "tree_of_thought": "3044fc776d366162",
    "sweep_report": "6bc0e1e87893d000",
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_representative_runs_give_the_recorded_results(name, tmp_path):
    assert run_case(name, tmp_path) == GOLDEN[name]


def test_a_sweeps_report_table_is_the_recorded_one(tmp_path):
    assert report_digest(tmp_path) == GOLDEN["sweep_report"]


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for case in sorted(CASES):
            print(f'    "{case}": "{run_case(case, Path(tmp))}",')
        print(f'    "sweep_report": "{report_digest(Path(tmp))}",')
