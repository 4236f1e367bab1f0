"""A calibration predicts the engine run it was made for: the same torch threads and step clock in
both (`testbed.config.engine_timing`; a fit measured otherwise is refused in one line), and a run
whose steps leave the calibration grid ends with a warning naming where
(`testbed.sim.grid_reach`)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from testbed.config.assembly import assemble, compose_config
from testbed.calibrate import calibrate
from testbed.config.engine_timing import check_fit_timing, timing_settings
from testbed.errors import BadInput
from testbed.sim.grid_reach import GridReach, grid_extent
from testbed.sim.step_shape import StepShape

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_cpu_engine_defaults_to_one_thread_and_the_cpu_clock():
    assert timing_settings({}, "cpu") == (1, "cpu")
    assert timing_settings({"threads": 2}, "cpu") == (2, "wall")
    assert timing_settings({"clock": "wall"}, "cpu") == (1, "wall")
    assert timing_settings({}, "cuda") == (None, "wall")


@pytest.mark.parametrize("settings, device, message", [
    ({"threads": 0}, "cpu", "threads must be an integer >= 1 or null, got 0"),
    ({"clock": "gpu"}, "cpu",
     "clock must be one of wall, cpu or null; got 'gpu'; did you mean cpu?"),
    ({"clock": "cpu", "threads": 2}, "cpu",
     "clock=cpu times a CPU engine on one thread (process time sums every thread's); got "
     "device=cpu threads=2"),
    ({"clock": "cpu"}, "cuda",
     "clock=cpu times a CPU engine on one thread (process time sums every thread's); got "
     "device=cuda threads=None"),
])
def test_timing_settings_that_cannot_hold_are_refused_in_one_line(settings, device, message):
    with pytest.raises(BadInput) as e:
        timing_settings(settings, device)
    assert str(e.value) == message


def test_an_engine_run_takes_its_threads_and_clock_from_the_run_keys():
    run = assemble(compose_config(["backend=engine", "model=tiny", "device=cpu",
                                   "progress=false"]))
    executor = run.build_executor(64)
    assert torch.get_num_threads() == 1 and executor.clock is time.thread_time
    assemble(compose_config(["backend=engine", "model=tiny", "device=cpu", "threads=2",
                             "progress=false"])).build_executor(64)
    assert torch.get_num_threads() == 2
    with pytest.raises(BadInput, match="^clock=cpu times a CPU engine on one thread"):
        assemble(compose_config(["backend=engine", "model=tiny", "device=cpu", "threads=2",
                                 "clock=cpu"]))


def test_a_fit_measured_with_other_threads_or_clock_is_refused_naming_both():
    meta = {"device": "cpu", "threads": 2, "clock": "wall"}
    check_fit_timing(meta, {"threads": 2}, "f.yaml")  # the same: accepted
    check_fit_timing({"device": "cpu"}, {}, "f.yaml")  # written before the keys: accepted
    check_fit_timing({"device": "cuda:0", "threads": 8, "clock": "wall"}, {}, "f.yaml")
    with pytest.raises(BadInput) as e:
        check_fit_timing(meta, {}, "f.yaml")
    assert str(e.value) == ("cost_model.path=f.yaml was measured with threads=2 clock=wall, and "
                            "this run's engine would run with threads=1 clock=cpu: set "
                            "threads=2 clock=wall, or calibrate again with threads=1 clock=cpu")


def test_a_fit_measured_with_other_cpu_kernels_is_refused_naming_both():
    meta = {"device": "cpu", "threads": 1, "clock": "cpu", "cpu_kernels": "torch"}
    check_fit_timing(meta, {"engine": {"cpu_kernels": "torch"}}, "f.yaml")  # the same
    check_fit_timing({**meta, "cpu_kernels": "native"}, {}, "f.yaml")  # the default: native
    check_fit_timing({"device": "cpu", "threads": 1, "clock": "cpu"}, {}, "f.yaml")  # before
    with pytest.raises(BadInput) as e:
        check_fit_timing(meta, {}, "f.yaml")
    assert str(e.value) == ("cost_model.path=f.yaml was measured with engine.cpu_kernels=torch, "
                            "and this run's engine would run engine.cpu_kernels=native: set "
                            "engine.cpu_kernels=torch, or calibrate again with native")


def small_grid(tmp_path: Path) -> Path:
    cfg = compose_config(["model=tiny", "hardware=cpu", "progress=false", "calibrate.repeats=1",
                          "calibrate.prefill_batch=[1]", "calibrate.prefill_new=[8,32]",
                          "calibrate.prefill_context=[0,16]", "calibrate.decode_batch=[1,2]",
                          "calibrate.decode_context=[8,32]", "calibrate.decode_ragged=false",
                          "calibrate.decode_shared=false"], "calibrate")
    calibrate(cfg, tmp_path)
    return tmp_path / "cost_model.yaml"


def test_calibration_records_its_threads_clock_and_grid_and_a_run_beyond_it_is_warned(tmp_path):
    path = small_grid(tmp_path / "cal")
    meta = yaml.safe_load(path.read_text())["meta"]
    assert (meta["threads"], meta["clock"], meta["cpu_kernels"]) == (1, "cpu", "native")
    assert meta["grid"] == {"prefill": {"batch": [1, 1], "rows": [8, 32], "context": [0, 16]},
                            "decode": {"batch": [1, 2], "context": [8, 32]},
                            # conf/calibrate.yaml's verifications: 2-9 queries x 1, 2, 4
                            "verify": {"batch": [1, 4], "rows": [2, 36], "context": [8, 32]}}
    common = ["backend=sim", "model=tiny", "hardware=cpu", "cost_model=fitted",
              f"cost_model.path={path}", "workload=chat", "workload.num_sessions=2",
              "workload.turns=2", "workload.vocab_size=256", "progress=false"]
    proc = subprocess.run([sys.executable, "-m", "testbed.run", *common,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"warning: 16 of 16 steps reached shapes outside the calibration grid of "
        f"cost_model.path={path}, priced by extrapolation: decode contexts up to 1,053 (grid "
        "8-32, calibrate.decode_context); prefill batch sizes up to 2 (grid 1-1, "
        "calibrate.prefill_batch); prefill contexts up to 547 (grid 0-16, "
        "calibrate.prefill_context); prefill new tokens (rows) up to 869 (grid 8-32, "
        "calibrate.prefill_new); calibrate with a grid that covers them")
    refused = subprocess.run([sys.executable, "-m", "testbed.run", *common, "threads=2",
                              f"hydra.run.dir={tmp_path / 'two'}"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr == (
        f"error: cost_model.path={path} was measured with threads=1 clock=cpu, and this run's "
        "engine would run with threads=2 clock=wall: set threads=1 clock=cpu, or calibrate "
        "again with threads=2 clock=wall\n")


def test_grid_reach_names_each_dimension_left_and_how_far():
    grid = grid_extent([StepShape((16,), (0,)), StepShape((512,) * 2, (512,) * 2),
                        StepShape.decode((64,)), StepShape.decode((1024,) * 4)])
    assert grid == {"prefill": {"batch": [1, 2], "rows": [16, 1024], "context": [0, 512]},
                    "decode": {"batch": [1, 4], "context": [64, 1024]}}
    reach = GridReach(grid, "fit.yaml")
    for step in (StepShape.decode((100,) * 3), StepShape.decode((2000,) * 6),
                 StepShape.decode((10,)), StepShape((4,), (900,)), StepShape((3000,), (0,))):
        reach.add(step)
    assert reach.warning() == (
        "warning: 3 of 5 steps reached shapes outside the calibration grid of "
        "cost_model.path=fit.yaml, priced by extrapolation: decode batch sizes up to 6 (grid "
        "1-4, calibrate.decode_batch); decode contexts up to 2,000 (grid 64-1,024, "
        "calibrate.decode_context); prefill contexts up to 900 (grid 0-512, "
        "calibrate.prefill_context); prefill new tokens (rows) at 4 and 3,000 (grid 16-1,024, "
        "calibrate.prefill_new); calibrate with a grid that covers them")
    inside = GridReach(grid)
    inside.add(StepShape.decode((500, 20)))
    assert inside.warning() is None
