"""The routing study's twin priced by the replicas as they served: a cost model fitted to the
steps the replicas ran in some of the study's own runs (``--served-fit FRONT ...``).

The engine's grid fit (``--fitted``) prices the engine's own CPU-clocked steps; a replica behind a
router does more on the same two cores: its HTTP threads tokenize, stream and detokenize beside
the engine loop, the router and the client take their share, and each call waits on its way in
and out. The study measures that wall time around the steps at 5-10% above their CPU time, more
where hits make calls short. The served fit prices it: `testbed.calibrate` with
``calibrate.server_runs`` (the steps recovered from the token times each replica streamed,
`testbed.calibration.server_steps`, wall clock, a call's way in included in the first step it
waited for), fitted on the calls of the fronts named, across every workload, each front's calls
split by the replica that served them (``routing.json``: a testbed.route front; smg logs no
decisions), the way `experiments.validation.vllm.latency` fits vLLM on training runs and checks
the held-out ones. The rows of those fronts are the fit's training data, which the study's
table says (``sim_priced_by``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from experiments import REPO
from experiments.studies.routing_twin import ROUTING, served_by
from testbed.errors import BadInput


def split_by_replica(run: Path, dst: Path) -> list[Path]:
    """The client records of the front run in ``run`` (``client/requests.jsonl``), one
    ``backend=server``-like folder a replica under ``dst`` (``r0``, ``r1``, ...), each call where
    the router last sent it (a retry's replica served it)."""
    routing = run / ROUTING
    if not routing.is_file():
        raise BadInput(f"--served-fit: {run} has no {ROUTING} (only a testbed.route front logs "
                       f"which replica served each call)")
    served = served_by(json.loads(routing.read_text()))
    by: dict[int, list[str]] = {}
    for line in (run / "client" / "requests.jsonl").read_text().splitlines():
        by.setdefault(served[json.loads(line)["id"]], []).append(line)
    out = []
    for w, lines in sorted(by.items()):
        d = dst / f"r{w}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "requests.jsonl").write_text("\n".join(lines) + "\n")
        out.append(d)
    return out


def fit_served(runs: list[Path], out: Path, model: str, root: Path) -> Path:
    """``testbed.calibrate`` on the replicas' calls in the front runs ``runs`` (folders under the
    study's ``root``), into ``out``; the cost model's path. Each run's calls are split into
    ``out/replicas/<the run's path under root>/r<k>``, so runs of one front in two workloads or
    two repeats never share a folder."""
    dirs = [d for run in runs
            for d in split_by_replica(run, out / "replicas" / run.relative_to(root))]
    subprocess.run([sys.executable, "-m", "testbed.calibrate", f"model={model}", "hardware=cpu",
                    f"calibrate.server_runs=[{','.join(map(str, dirs))}]",
                    f"hydra.run.dir={out}"], check=True, cwd=REPO)
    return out / "cost_model.yaml"
