"""The GPU validation's plan and its pure-Python parts, checked on the CPU: gpu_validate.sh's
steps fit its 8 minutes and bring back at most 8 files, every run composes into a config the
engine takes, and the figures read off steps.jsonl, the acceptance points and the report are
exact on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from experiments.validation import gpu_report
from experiments.validation.gpu_runs import (RUNS, Floor, Shape, acceptance, decode_median,
                                             ratios, run_overrides, shape_floor_tokens,
                                             step_split)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "experiments" / "validation" / "gpu_validate.sh"


def plan() -> dict:
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", "PY": "python"})
    assert out.returncode == 0, out.stderr
    found: dict = {"steps": []}
    for line in out.stdout.splitlines():
        kind, *rest = line.split("\t")
        if kind == "step":
            found["steps"].append((rest[0], int(rest[1]), rest[2]))
        else:
            found[kind] = rest[0]
    return found


def test_the_plan_fits_eight_minutes_and_brings_back_at_most_eight_files():
    found = plan()
    assert [name for name, _, _ in found["steps"]] == ["gpu_engine", "tests", "kernels_check",
                                                       "sim_vs_engine"]
    assert sum(cap for _, cap, _ in found["steps"]) <= int(found["deadline"]) <= 8 * 60
    assert len(found["collect"].split()) <= 8


def test_every_module_and_test_file_the_plan_names_exists():
    for _, _, command in plan()["steps"]:
        words = command.split()
        for i, word in enumerate(words):
            if word == "-m":
                assert importlib.util.find_spec(words[i + 1]) is not None, words[i + 1]
            if word.startswith("tests/"):
                assert (REPO / word.split("::")[0]).is_file(), word


def test_the_gpu_validation_points_nowhere_outside_the_repository():
    files = [SCRIPT, *(REPO / "experiments" / "validation").glob("gpu_*.py"),
             *(REPO / "radix_kernels").glob("gpu_check*.py")]
    for path in files:
        assert "../shared" not in path.read_text(), path
    makefile = (REPO / "Makefile").read_text()  # its gpu-wheels target and the note above it
    block = makefile[makefile.index("# The pure-Python packages"):makefile.index("\nclean:")]
    assert "gpu-wheels:" in block and "../shared" not in block


@pytest.mark.parametrize("name", list(RUNS))
def test_every_run_composes_into_a_config_the_engine_takes(name, compose):
    """Each run's overrides, on the CPU in place of CUDA: every key and value is checked."""
    from testbed.config.assembly import assemble

    base = ["model=llama2_7b", "backend=engine", "hardware=h200", "engine.device=cpu",
            "engine.dtype=bfloat16"]
    run = assemble(compose(*base, *run_overrides(name, Shape())))
    assert run.backend == "engine"


def test_the_step_shapes_sizes():
    shape = Shape()
    assert run_overrides("small_plain_graph_b8", shape)[-3:] == [
        "workload.question_len=64", "workload.output_len=16", "engine.cuda_graph_max_batch=8"]
    assert "workload.num_problems=12" in run_overrides("tot_radix_cascade", shape)
    # the median step of 32 x (2,048 + 64) generating 32: each request holds 2,128 tokens
    assert shape_floor_tokens("shape_plain_graph", shape, 32) == 32 * 2128
    assert shape_floor_tokens("shape_cascade_graph", shape, 32) == 2048 + 32 * 80
    assert shape_floor_tokens("small_plain_graph_b16", shape, 16) == 16 * 2120


def steps_of(*rows):
    keys = ("kind", "batch_size", "context_tokens", "new_tokens", "duration_s", "gpu_s",
            "host_s")
    return [dict(zip(keys, row)) for row in rows]


def test_decode_steps_by_batch_size_beside_their_byte_floor():
    """A floor of 1 ms of weights and 1 us a KV token: 12 requests over 988 tokens read 1,000
    tokens, 2 ms; prefills and other batch sizes kept apart."""
    floor = Floor(weight_bytes=1000, kv_bytes_per_token=1, bandwidth=1e6)
    steps = steps_of(("decode", 12, 988, 12, 0.004, 0.003, 0.001),
                     ("decode", 8, 1992, 8, 0.006, 0.005, 0.001),
                     ("prefill", 12, 0, 500, 0.5, 0.5, 0.0),
                     ("decode", 32, 968, 32, 0.002, 0.0015, 0.0005))
    split = step_split(steps, floor)
    assert split["batch_8_16"] == {"steps": 2, "duration_s": 0.005, "gpu_s": 0.004,
                                   "host_s": 0.001, "over_floor": pytest.approx(2.0)}
    assert split["batch_17_32"]["over_floor"] == pytest.approx(1.0)
    assert set(split) == {"batch_8_16", "batch_17_32"}
    assert decode_median(steps, 12) == {"decode_step_s": 0.004, "decode_gpu_s": 0.003,
                                        "decode_host_s": 0.001, "decode_steps_at_batch": 1}
    assert decode_median(steps, 5) == {"decode_step_s": None, "decode_steps_at_batch": 0}


def made_up_runs() -> dict:
    runs = {"tot_radix": {"throughput_req_s": 100.0,
                          "decode_split": {"batch_8_16": {"over_floor": 1.25}}},
            "tot_none": {"throughput_req_s": 40.0},
            "tot_radix_overlap": {"throughput_req_s": 105.0},
            "tot_radix_cascade": {"throughput_req_s": 101.0},
            "chat_radix": {"throughput_req_s": 10.0},
            "chat_radix_cascade": {"throughput_req_s": 9.0},
            "fewshot32_radix": {"throughput_req_s": 30.0},
            "fewshot32_radix_cascade": {"throughput_req_s": 33.0},
            "shape_plain_graph": {"decode_step_s": 0.012, "over_floor": 1.07},
            "shape_cascade_graph": {"decode_step_s": 0.006, "over_floor": 1.6},
            "small_plain_graph_b8": {"over_floor": 1.2}}
    runs["ratios"] = ratios(runs)
    return runs


def test_acceptance_points_measured_against_their_bounds():
    kernels = {"extend_sweep": {"best": {"pool": {"vs_sdpa": 1.6}, "contiguous": {"vs_sdpa": 1.2},
                                         "descriptors": {"vs_sdpa": 1.4}}}}
    sim = {"held_back": {"tree_of_thought": {"makespan": -0.03, "ttft_p50": 0.2,
                                             "tpot_p50": 0.05}}}
    points = {p["point"]: (p["measured"], p["ok"]) for p in
              acceptance(made_up_runs(), kernels, sim)}
    assert points["tree-of-thought radix+lpm over none+fcfs"] == (2.5, True)
    assert points["simulator makespan error, tree-of-thought"] == (0.03, True)
    assert points["simulator TTFT p50 error, tree-of-thought"] == (0.2, False)
    assert points["decode steps of 8-16 requests over their byte floor (worst)"] == (1.25, True)
    assert points["cascade over plain throughput, worst of tree-of-thought, chat, few-shot"] \
        == (0.9, False)
    assert points["32 x (2,048 shared + 64 own) cascade step over its own floor"] == (1.6, False)
    assert points["prefill 4 x 2,048 (Llama-2-7B, bf16) over SDPA, best source"] == (1.2, True)
    assert points["prefill over SDPA reading the pool (the engine's path)"] == (1.6, False)
    assert points["tree-of-thought with overlap over without"] == (pytest.approx(1.05), False)
    assert points["32 x 2,112 step with overlap over its floor"] == (None, None)


def test_the_report_gathers_the_work_folder(tmp_path):
    (tmp_path / "steps.tsv").write_text("gpu_engine\t0\t190\nkernels_check\tskipped\t0\n")
    (tmp_path / "gpu_engine.json").write_text(json.dumps({"runs": made_up_runs()}))
    (tmp_path / "kernel_tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_kernels" name="test_a"><failure/></testcase>'
        '<testcase classname="tests.test_kernels" name="test_b"/></testsuite></testsuites>')
    assert gpu_report.main([str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "gpu_validate.json").read_text())
    assert doc["steps"] == {"gpu_engine": {"exit_code": "0", "seconds": 190},
                            "kernels_check": {"exit_code": "skipped", "seconds": 0}}
    assert doc["kernel_tests"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                   "failed": ["tests.test_kernels::test_a"]}
    assert doc["kernels.json"] is None and len(doc["acceptance"]) == 12
    printed = gpu_report.lines(doc)
    assert "tot_radix_over_none: 2.500" in printed
    assert "[ok] tree-of-thought radix+lpm over none+fcfs: 2.500 (>= 2.5; gpu_engine ratios)" \
        in printed
    assert any(line.startswith("[not measured] prefill") for line in printed)


def test_tier_copies_are_set_beside_the_link():
    from experiments.validation.gpu_tiers import copy_report

    assert copy_report(1000, 2048, 0.004, 1e9) == {
        "tokens": 1000, "bytes": 2_048_000, "seconds": 0.004, "bytes_per_s": 512_000_000.0,
        "efficiency": 0.512}
