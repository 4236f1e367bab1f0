"""The entry point: ``python -m testbed.run [overrides]`` (Hydra; ``-m`` sweeps).

Composes the config (``conf/``), runs it with `testbed.execute.execute` into the Hydra run
directory (``summary.json``, ``requests.jsonl``, sim and engine ``steps.jsonl``, with
``timeline=true`` ``timeline.json``) and prints the summary. Refused input (a bad config value,
a workload the backend cannot serve) stops the run with one line and exit status 2; a defect of
the testbed with ``error: internal error: ...`` and status 1; both leave ``failed.json``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from testbed.config.assembly import plain
from testbed.config.cli import check_group_choices
from testbed.errors import failure_kind
from testbed.execute import execute
from testbed.results.rundir import done_before, format_summary, write_failure


def failure_line(error: BaseException, failed: Path) -> str:
    """The one line a failed run prints: the message of refused input, or for a defect its type,
    message and where the traceback is."""
    if failure_kind(error) == "bad_input":
        return f"error: {error}"
    what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"error: internal error: {what}; traceback in {failed}"


def config_or_none(cfg: DictConfig) -> dict | None:
    """The config as plain values, None when an interpolation does not resolve."""
    try:
        return plain(cfg)
    except Exception:  # the overrides still say what ran
        return None


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """One run. In a sweep (``-m``) a run whose directory already has the ``summary.json`` of
    the same config is skipped, and a failing run is recorded in ``failed.json`` while the sweep
    goes on; a single run records a failure too and exits non-zero (module docstring)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    if sweeping and (before := done_before(run_dir, config_or_none(cfg))) is not None:
        if before:
            print(f"skip: {run_dir} already has summary.json")
            return
        print(f"rerun: {run_dir} had a summary.json of another config; replaced")
    notes: list[str] = []
    try:
        summary = execute(cfg, run_dir, notes)
    except Exception as e:  # recorded for the report; a sweep goes on with its other runs
        failed = write_failure(run_dir, e, overrides, config_or_none(cfg))
        line = failure_line(e, failed)
        if sweeping:
            print(f"{line} [{' '.join(overrides)}]; recorded in {failed}", file=sys.stderr)
            return
        print(line, file=sys.stderr)
        sys.exit(2 if failure_kind(e) == "bad_input" else 1)
    (run_dir / "failed.json").unlink(missing_ok=True)  # an earlier failure, now superseded
    if sweeping:
        span, hit = summary["makespan_s"], summary["hit_rate"]
        print(f"done: {' '.join(overrides)} · hit_rate "
              + (f"{hit:.4g}" if hit is not None else "not reported")
              + (f" · makespan_s {span:.4g}" if span is not None else "") + f" · {run_dir}")
        for line in notes:
            print(f"  {line}")
        return
    print(summary_head(summary))
    print(format_summary(summary))
    print(f"results in {run_dir}")
    for line in notes:
        print(line)


def summary_head(summary: dict) -> str:
    """The first line a single run prints: what ran."""
    head = [f"backend={summary['backend']}", f"workload={summary['workload']}",
            f"cache={summary['cache']}", f"eviction={summary['eviction']}"]
    if summary["backend"] == "server":
        head += [f"server_url={summary['server_url']}", f"server_model={summary['server_model']}"]
    elif summary["backend"] != "replay":  # the engine names the device it ran on
        where = f"device={summary['device']}" if summary.get("device") else \
            f"hardware={summary['hardware']}"
        head += [f"scheduler={summary['scheduler']}", f"model={summary['model']}", where,
                 f"kv_capacity_tokens={summary['kv_capacity_tokens']}"]
    else:
        head.append(f"capacity_tokens={summary['capacity_tokens']}")
    return " · ".join(head)


if __name__ == "__main__":
    # conf/hydra/launcher/ray.yaml has the name of the Ray plugin's own config, which Hydra then
    # merges in as a schema with a deprecation warning per job; the file does not rely on it.
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/ray' is validated against")
    check_group_choices(sys.argv[1:])
    main()
