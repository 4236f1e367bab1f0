"""Where a sweep's jobs run (conf/hydra/launcher/, docs/sweeps.md): a 4-run sweep through the Ray
launcher, on a local Ray instance this module starts and stops, gives exactly the runs of Hydra's
basic launcher and a 4-row report; each launcher config composes and builds its launcher without
submitting anything (no SLURM cluster needed)."""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from testbed.config.cli import CONF_DIR
from testbed.fuzz.checks import WALL_CLOCK

REPO = Path(__file__).resolve().parents[1]
GRID = ["cache=none,radix", "scheduler=fcfs,lpm"]
SMALL = ["workload=tree_of_thought", "workload.num_problems=2", "progress=false"]
RUNS = {("none", "fcfs"), ("none", "lpm"), ("radix", "fcfs"), ("radix", "lpm")}

# A private Ray instance for the module, in a process of its own (the test process never imports
# ray): it prints the head's address once ray.init has returned, i.e. once the instance accepts
# drivers, and stops it when its stdin closes, which also happens if the test process dies.
# Two CPUs (two jobs at once), no dashboard, Ray's smallest object store (jobs pass no data).
# Ray (2.60 here) authenticates drivers by a token; this instance's is made here and given to the
# head and the sweep in their environment, so nothing is read from or written to ~/.ray.
HEAD = """
import sys, ray
context = ray.init(address="local", num_cpus=2, include_dashboard=False,
                   object_store_memory=75 * 2**20)
print("ray-head-address", context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""
MARK = b"ray-head-address "
START_S = 180  # deadlines, not waits: generous enough for a busy 2-core machine
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """Starts the head process; ``ray_head()`` waits until it names its address, and returns it
    (so that a test can do other work while Ray starts)."""
    log = tmp_path_factory.mktemp("ray") / "head.log"
    with open(log, "w") as err:
        head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, env={**os.environ, **AUTH})
    deadline = time.monotonic() + START_S

    def address() -> str:
        seen = b""  # read unbuffered, so that select sees every byte not yet read
        while b"\n" not in seen.partition(MARK)[2]:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([head.stdout], [], [], max(left, 0))
            chunk = os.read(head.stdout.fileno(), 4096) if ready else b""
            if not chunk:  # deadline passed, or the process ended without an address
                pytest.fail(f"no Ray instance (exit {head.poll()}): {log.read_text()[-2000:]}")
            seen += chunk
        return seen.partition(MARK)[2].split(b"\n")[0].decode()

    try:
        yield address
    finally:
        head.stdin.close()  # the head process shuts Ray down and exits
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()  # Ray's own processes share its fate (Ray's reaper)
            head.wait()
        head.stdout.close()


def sweep(out: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "testbed.run", "-m", *GRID, *SMALL,
                             *overrides, f"hydra.sweep.dir={out}"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **AUTH})


def finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    return out + err


def run_dirs(sweep_dir: Path) -> dict[tuple[str, str], Path]:
    """The sweep's runs by (cache, scheduler), read from each run's own summary."""
    runs = {}
    for summary in sorted(sweep_dir.glob("*/summary.json")):
        s = json.loads(summary.read_text())
        runs[s["cache"], s["scheduler"]] = summary.parent
    return runs


def test_ray_sweep_gives_the_basic_launchers_runs(tmp_path, ray_head):
    # the basic launcher's sweep runs in a process of its own while Ray starts and runs its jobs
    basic = sweep(tmp_path / "basic", "hydra/launcher=basic")
    ray = sweep(tmp_path / "ray", "hydra/launcher=ray",
                f"hydra.launcher.ray.init.address={ray_head()}")
    ray_log, _ = finish(ray), finish(basic)
    assert "Ray Launcher is launching 4 jobs" in ray_log
    assert "validated against ConfigStore schema" not in ray_log  # testbed/run.py's filter

    by_ray, by_basic = run_dirs(tmp_path / "ray"), run_dirs(tmp_path / "basic")
    assert set(by_ray) == set(by_basic) == RUNS
    assert sorted(p.name for p in by_ray.values()) == ["0", "1", "2", "3"]
    assert not list((tmp_path / "ray").glob("*/failed.json"))
    for run in RUNS:
        mine, theirs = (json.loads((d / "summary.json").read_text())
                        for d in (by_ray[run], by_basic[run]))
        assert {k: v for k, v in mine.items() if k not in WALL_CLOCK} == \
            {k: v for k, v in theirs.items() if k not in WALL_CLOCK}, run
        assert (by_ray[run] / "requests.jsonl").read_bytes() == \
            (by_basic[run] / "requests.jsonl").read_bytes(), run
        assert re.search(rf"done: .*cache={run[0]} scheduler={run[1]} .* · {by_ray[run]}",
                         ray_log), run  # each job's line reaches the sweep's output

    report = subprocess.run([sys.executable, "-m", "testbed.report", str(tmp_path / "ray")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr
    table = pd.read_csv(tmp_path / "ray" / "results.csv")
    assert len(table) == 4 and (table["status"] == "ok").all()
    assert set(zip(table["cache"], table["scheduler"])) == RUNS


LAUNCHERS = {
    # option: (the launcher class, settings of ours it must carry)
    "local": ("hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
              {"n_jobs": -1}),
    "slurm": ("hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher",
              {"cpus_per_task": 1, "mem_gb": 4, "timeout_min": 60, "array_parallelism": 64}),
    "ray": ("hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher",
            {"ray": {"init": {"address": None, "num_cpus": None, "object_store_memory": None,
                              "include_dashboard": False}, "remote": {"num_cpus": 1}}}),
}


def test_every_launcher_option_is_tested():
    assert sorted(p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")) == \
        sorted(LAUNCHERS)


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/ray' is validated")  # see ray.yaml
@pytest.mark.parametrize("option", sorted(LAUNCHERS))
def test_launcher_config_composes_and_builds(option):
    """Composed as `-m hydra/launcher=OPTION` composes it; the launcher object is built (which
    only stores its settings: nothing is started or submitted)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    target, ours = LAUNCHERS[option]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"hydra/launcher={option}",
                                           "hydra.sweep.dir=/shared/sweep"],
                      return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launcher["_target_"] == target
    assert {k: launcher[k] for k in ours} == ours
    if option == "slurm":
        assert launcher["submitit_folder"] == "/shared/sweep/.submitit/%j"
    built = instantiate(cfg.hydra.launcher)
    assert f"{type(built).__module__}.{type(built).__name__}" == target
