"""The studies, benchmarks and validations, run as modules from the repository root.

    python -m experiments.studies.eviction --help
    bash experiments/studies/headline.sh

- `experiments.studies`: what prefix sharing buys, measured: eviction, tiers, routing, fairness,
  beyond exact prefixes, the quality of approximate reuse on a real model, and the RadixAttention
  headline; their figures are in docs/results/.
- `experiments.benchmarks`: how fast the caches, the loop and the engine are (``make bench``
  runs `experiments.benchmarks.speed`: replay and simulation beside their peers).
- `experiments.validation`: checks against other code: SGLang's scheduler and cache, Vidur, a
  Vidur profile, the engine against the simulator, and the GPU checks.

Reusable code lives in `testbed`; these modules print, plot and write results. `REPO` is the
repository root; `MOONCAKE_TRACE` where the data folder keeps the Mooncake conversation trace
(``python -m testbed.data fetch mooncake_conversation`` puts it there; until then it is missing).
`save_figure` writes a matplotlib figure, making its folder. `entry` runs a module's ``main`` as
every entry point does: bad input (`testbed.errors.BadInput`: a config value, a trace, a device
the machine lacks; argparse's usage errors) ends in one ``error: ...`` line and exit status 2,
not a traceback.
"""

import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

from testbed.data import local_path, lookup
from testbed.errors import BadInput

REPO = Path(__file__).resolve().parents[1]
MOONCAKE_TRACE = local_path(lookup("mooncake_conversation"))


def entry(main: Callable[..., Any], *args: Any) -> NoReturn:
    """Exit with ``main(*args)`` as the status (None: 0); on bad input (`BadInput`, or a
    ``sys.exit("message")`` of the module's own), one ``error:`` line on stderr and status 2 (a
    defect still ends in its traceback)."""
    from testbed.config.cli import one_line_usage  # Hydra's config layer: loaded only to run a main

    try:
        with one_line_usage():
            status = main(*args)
    except BadInput as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    except SystemExit as e:  # sys.exit("message"): a module's own refusal, in the same form
        if not isinstance(e.code, str):
            raise
        print(f"error: {' '.join(e.code.split())}", file=sys.stderr)
        sys.exit(2)
    sys.exit(status)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly and write it to ``path`` (its folder made if missing)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
