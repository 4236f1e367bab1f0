"""Every entry point (``python -m testbed.X``, ``python -m experiments.X``) answers bad input with
one ``error: ...`` line on stderr and exit status 2, never a traceback (issue 60): a flag it does
not take, a path that is not there, a device the machine lacks, a config value. The modules of
``experiments`` run their ``main`` through `experiments.entry`, which this checks for each."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# (module and arguments, what the one line says)
CASES = [
    (["testbed.run", "--bogus"], "unknown flag --bogus"),
    (["testbed.data", "fetch", "nosuch"], "data:nosuch: unknown name"),
    (["testbed.report", "/no/such/dir"], "/no/such/dir is not a directory"),
    (["testbed.fuzz", "--bogus"], "unrecognized arguments: --bogus"),
    # docs/results/engine_gpu.md's "engine's part alone" on a machine without CUDA
    (["experiments.validation.gpu_engine", "--out", "{tmp}/gpu_engine.json"],
     "device=cuda: torch sees no CUDA device on this machine"),
    (["experiments.validation.gpu_report", "/no/such/dir"], "WORK is the folder gpu_validate.sh"),
    (["experiments.studies.eviction", "--trace", "/no/such.jsonl"],
     "workload.path: no such file: /no/such.jsonl"),
    (["experiments.benchmarks.speed", "--part", "nosuch"], "--part: nosuch not one of replay"),
]
# run otherwise: inside Vidur's own venv, by its path
NOT_THROUGH_ENTRY = {"experiments/validation/vidur/drive.py"}


@pytest.mark.parametrize("argv, says", CASES, ids=[" ".join(c[0][:2]) for c in CASES])
def test_bad_input_is_one_error_line_and_exit_2(argv, says, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",  # torch sees no CUDA device, GPU or not
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    proc = subprocess.run([sys.executable, "-m", *(a.format(tmp=tmp_path) for a in argv)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.splitlines()
    assert (proc.returncode, len(lines)) == (2, 1), proc.stderr
    assert lines[0].startswith("error: ") and says in lines[0], lines[0]


def test_every_experiments_main_runs_through_entry():
    """A module's ``if __name__ == "__main__":`` block calls `experiments.entry`."""
    missing = []
    for path in sorted((REPO / "experiments").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                calls = {n.func.id for n in ast.walk(node)
                         if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
                if "entry" not in calls and rel not in NOT_THROUGH_ENTRY:
                    missing.append(rel)
    assert not missing, missing
