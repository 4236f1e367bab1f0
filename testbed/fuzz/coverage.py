"""Which keys of the config space the fuzzer draws, against every key conf/ and
docs/reference.md list, so that a key added without the fuzzer drawing it is noticed
(tests/test_fuzz_coverage.py; docs/design.md §5).

A key is named by the file that defines it and its dotted path there: ``("config.yaml",
"engine.cpu_kernels")``, ``("workload/rag.yaml", "doc_len")``, ``("scheduler/_base.yaml",
"overlap")``; an option of a group by its file and ``""``. A config draws a key when one of its
overrides sets it (``GROUP.KEY=...`` under the option it chose, found in that option's file or
the files its defaults list includes) and an option when it chooses it (``GROUP=OPTION``).

Some keys cannot be fuzzed, and some files of conf/ are no run's config; each is listed here
with the reason (`EXCLUDED`, `NOT_RUN`).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import yaml

Key = tuple[str, str]  # (file under conf/, dotted key; "" for the option itself)

RUN_GROUPS = ("backend", "workload", "cache", "eviction", "scheduler", "model", "hardware",
              "cost_model", "router")
# files of conf/ that are not `python -m testbed.run`'s config, and why the fuzzer leaves them
NOT_RUN = {
    "calibrate.yaml": "python -m testbed.calibrate's grid: minutes of measuring the machine",
    "describe.yaml": "python -m testbed.workloads: where it writes a workload as a trace",
    "serve.yaml": "python -m testbed.serve's own keys (host, port, queue, log level): the "
                  "fuzzer starts one server per run on a free loopback port",
    "calibration/": "fitted coefficients, data a cost model reads (the fuzzer draws both files "
                    "as cost_model.path)",
    "experiment/": "Hydra sweeps over keys the fuzzer draws one by one",
    "hydra/": "Hydra's launchers (local, Ray, Slurm): where a sweep runs, not what",
}
# keys of run configs the fuzzer does not draw, and why
EXCLUDED: dict[Key, str] = {
    ("config.yaml", "hydra.run.dir"): "an output folder (the fuzzer's is temporary)",
    ("config.yaml", "hydra.sweep.dir"): "a sweep's output folder",
    ("config.yaml", "hydra.sweep.subdir"): "a sweep's output folder",
    ("config.yaml", "hydra.job.chdir"): "the runs' working directory (a run reads relative "
                                        "paths from it)",
    ("config.yaml", "save_token_ids"): "always true: the checks read the token ids",
    ("config.yaml", "debug.check_invariants"): "always true: the cache is checked every step",
    ("eviction/learned.yaml", "model"): "a model file another run saved; the fuzzer's runs "
                                        "train their own (small min_train, retrain_every)",
    ("model/_default.yaml", "by_default"): "marks the preset chosen without model=, not a "
                                           "setting",
    ("route.yaml", "hydra.run.dir"): "an output folder (the router writes none)",
    ("route.yaml", "hydra.output_subdir"): "an output folder (the router writes none)",
    ("route.yaml", "replicas"): "the fuzzer's router fronts the fuzzer's own two servers "
                                "(route.urls), not replicas it starts",
    ("route.yaml", "route.start_timeout_s"): "waits for replicas the router starts (none here)",
    ("route.yaml", "route.urls"): "always the fuzzer's two servers",
    ("route.yaml", "route.port"): "always 0, a free port",
    ("route.yaml", "route.host"): "always loopback: the fuzzer's router must not listen beyond "
                                  "the machine",
}


def flatten(data: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of a YAML mapping's leaves (a list is a leaf)."""
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}")
    return out


def _read(conf: Path, file: str) -> dict[str, Any]:
    return yaml.safe_load((conf / file).read_text()) or {}


def own_keys(conf: Path, file: str) -> list[str]:
    data = {k: v for k, v in _read(conf, file).items() if k not in ("defaults", "name")}
    return flatten(data)


def not_run(file: str) -> bool:
    return any(file == f or (f.endswith("/") and file.startswith(f)) for f in NOT_RUN)


def conf_keys(conf: Path) -> set[Key]:
    """Every option of every group and every key of the run config's files."""
    keys: set[Key] = set()
    for path in sorted(conf.rglob("*.yaml")):
        file = path.relative_to(conf).as_posix()
        if not_run(file):
            continue
        if "/" in file and not path.name.startswith("_"):
            keys.add((file, ""))
        keys |= {(file, k) for k in own_keys(conf, file)}
    return keys


def reference_keys(text: str) -> set[Key]:
    """The keys docs/reference.md's tables list: the top-level table's, each group's (option,
    key) rows, and the other entry points' (file, key) rows."""
    keys: set[Key] = set()
    group = None
    for line in text.splitlines():
        heading = re.match(r"^#+ (.*)$", line)
        if heading:
            found = re.match(r"^`(\w+)`$", heading.group(1).strip())
            group = found.group(1) if found else heading.group(1)
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        first, second = (re.sub(r"`", "", c) for c in cells[:2])
        if group and group.startswith("Top-level"):
            keys.add(("config.yaml", first))
        elif group in RUN_GROUPS and second != "—":
            keys.add((f"{group}/{first}.yaml", second))
        elif group in RUN_GROUPS:
            keys.add((f"{group}/{first}.yaml", ""))
        elif first.endswith(".yaml"):
            keys.add((first, second))
    return {k for k in keys if not not_run(k[0])}


@lru_cache(maxsize=None)
def _chain(conf: Path, group: str, option: str) -> tuple[str, ...]:
    """The files of ``GROUP=OPTION``, its own first, then those its defaults list includes."""
    file = f"{group}/{option}.yaml"
    if not (conf / file).is_file():
        return ()
    out = [file]
    for entry in _read(conf, file).get("defaults") or []:
        if isinstance(entry, str) and entry != "_self_":
            out += _chain(conf, group, entry)
    return tuple(out)


@lru_cache(maxsize=None)
def _keys_of(conf: Path, file: str) -> frozenset[str]:
    return frozenset(own_keys(conf, file))


@lru_cache(maxsize=None)
def default_options(conf: Path) -> dict[str, str]:
    """Each run group's option when no ``GROUP=`` is given (conf/config.yaml's defaults)."""
    out = {}
    for entry in _read(conf, "config.yaml").get("defaults") or []:
        if isinstance(entry, dict):
            out.update({k: v for k, v in entry.items() if k in RUN_GROUPS})
    return out


def drawn_keys(overrides: Iterable[str], conf: Path) -> set[Key]:
    """The keys and options one config's overrides draw (module docstring)."""
    pairs = [o.lstrip("+").partition("=")[::2] for o in overrides]
    choices = dict(default_options(conf))
    choices.update({k: v for k, v in pairs if k in RUN_GROUPS})
    top = _keys_of(conf, "config.yaml")
    out: set[Key] = {(f"{g}/{o}.yaml", "") for g, o in choices.items()}
    for key, _ in pairs:
        group, _, sub = key.partition(".")
        if key in top:
            out.add(("config.yaml", key))
        elif group in RUN_GROUPS and sub:
            where = next((f for f in _chain(conf, group, choices[group])
                          if sub in _keys_of(conf, f)), None)
            if where is not None:
                out.add((where, sub))
    return out


def route_drawn(overrides: Iterable[str], conf: Path) -> set[Key]:
    """The keys one live-router config (`testbed.fuzz.server.router_config`) draws: its
    ``route.`` keys (conf/route.yaml) and its ``router`` group's option and keys."""
    pairs = [o.partition("=")[0] for o in overrides]
    own = _keys_of(conf, "route.yaml")
    router = [o for o in overrides if o.startswith("router")]
    return {("route.yaml", k) for k in pairs if k in own} | \
        {k for k in drawn_keys(router, conf) if k[0].startswith("router/")}


def undrawn(drawn: set[Key], conf: Path, reference: str) -> set[Key]:
    """The keys conf/ or the reference lists that no draw set and no exclusion explains."""
    return (conf_keys(conf) | reference_keys(reference)) - drawn - set(EXCLUDED)
