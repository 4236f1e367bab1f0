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
`save_figure` writes a matplotlib figure, making its folder.
"""

from pathlib import Path

from testbed.data import local_path, lookup

REPO = Path(__file__).resolve().parents[1]
MOONCAKE_TRACE = local_path(lookup("mooncake_conversation"))


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly and write it to ``path`` (its folder made if missing)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
