"""One timed Vidur run, started by `experiments.validation.vidur.compare` in Vidur's virtual
environment.

Imports only Vidur and the standard library (this project is not installed there), so Vidur's
interpreter runs it by its file path, not as a module of this package.

    VIDUR_VENV/bin/python experiments/validation/vidur/drive.py TIMINGS_JSON [Vidur's flags]

Runs ``vidur.simulator.Simulator`` as ``python -m vidur.main`` would, and writes TIMINGS_JSON:
the folder Vidur wrote ``request_metrics.csv`` into, Vidur's final clock, and the wall time of
setting up (the execution-time predictor trained or loaded from its cache), of the event loop alone,
and of writing the outputs.
"""

import json
import os
import sys
import time

started = time.perf_counter()
# Run by its path, this file's folder comes first on sys.path, where its neighbours (this
# package's modules) could shadow what Vidur imports: look for modules elsewhere.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(__file__)]

from vidur.config import SimulationConfig  # noqa: E402
from vidur.simulator import Simulator  # noqa: E402
from vidur.utils.random import set_seeds  # noqa: E402


def main() -> None:
    timings_path = sys.argv.pop(1)
    config = SimulationConfig.create_from_cli_args()
    set_seeds(config.seed)
    t_setup = time.perf_counter()
    simulator = Simulator(config)
    t_loop = time.perf_counter()
    loop_end = []
    write_output = simulator._write_output  # called once, right after the event loop

    def timed_write_output() -> None:
        loop_end.append(time.perf_counter())
        write_output()

    simulator._write_output = timed_write_output
    simulator.run()
    done = time.perf_counter()
    timings = {
        "output_dir": config.metrics_config.output_dir,
        "clock_s": float(simulator._time),
        "import_s": t_setup - started,
        "setup_s": t_loop - t_setup,
        "loop_s": loop_end[0] - t_loop,
        "write_s": done - loop_end[0],
        "total_s": done - started,
    }
    with open(timings_path, "w") as f:
        json.dump(timings, f, indent=2)


if __name__ == "__main__":
    main()
