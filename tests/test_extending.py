"""Policies of one's own, plugged in by import path (docs/extending.md, examples/my_policies.py):
each re-implementation gives exactly its built-in's run, malformed classes are refused in one
line, and an out-of-tree policy runs in a Hydra sweep that the report plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from testbed.execute import execute
from tests.conftest import EXAMPLES, REPO

pytestmark = pytest.mark.usefixtures("examples_on_path")

# chat sessions with answers of 4-200 tokens in a KV pool that holds a fraction of them: eviction,
# queue order and routing all change what is cached
CHAT = ["workload=chat", "workload.num_sessions=24", "workload.turns=3",
        "workload.max_output_len=200"]


def requests_of(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("id", "cached_tokens", "evicted_tokens", "first_token_s",
                               "finish_s", "output_tokens")} for r in rows]


def run(compose, tmp_path, name: str, *overrides: str) -> tuple[dict, list[dict]]:
    summary = execute(compose(*overrides), tmp_path / name)
    return summary, requests_of(tmp_path / name)


@pytest.mark.parametrize("group, builtin, target, other, base", [
    ("eviction", "mru", "my_policies.MostRecentlyUsed", "lru",
     ["backend=replay", *CHAT, "cache.capacity_tokens=5000"]),
    ("eviction", "mru", "my_policies.MostRecentlyUsed", "lru",
     ["backend=sim", *CHAT, "cache.capacity_tokens=5000"]),
    ("scheduler", "lof", "my_policies.LongestOutputFirst", "fcfs",
     ["backend=sim", *CHAT, "cache.capacity_tokens=6000"]),
    ("router", "round_robin", "my_policies.Rotate", "least_load",
     ["backend=sim", *CHAT, "replicas=3"]),
])
def test_a_user_class_gives_exactly_the_run_of_its_builtin(compose, tmp_path, group, builtin,
                                                          target, other, base):
    """Every request's hit, evictions, times and output agree; another built-in of the family
    gives a different run, so the family's choice matters in this setting."""
    ours, ours_reqs = run(compose, tmp_path, "builtin", *base, f"{group}={builtin}")
    user, user_reqs = run(compose, tmp_path, "user", *base, f"{group}=custom",
                          f"{group}.target={target}")
    _, other_reqs = run(compose, tmp_path, "other", *base, f"{group}={other}")
    assert user_reqs == ours_reqs and other_reqs != ours_reqs
    assert user[group] == target and ours[group] == builtin


@pytest.mark.parametrize("release", ["0.5.23", "0.4.10"])
def test_lru_k_with_k_1_is_lru_and_with_k_2_is_not(compose, tmp_path, release):
    # the same under both releases: LRU-K counts the uses its hooks see, so 0.5.23's checkpoint
    # walks (which refresh recency right after an insert) are not uses (0.0747 against LRU's
    # 0.0656 under both; before, LRU-K(2) was LRU under 0.5.23: docs/extending.md)
    base = ["backend=replay", "workload=chat", "workload.num_sessions=40",
            "cache.capacity_tokens=16000", f"scheduler.sglang={release}"]
    lru, lru_reqs = run(compose, tmp_path, "lru", *base, "eviction=lru")
    k1, k1_reqs = run(compose, tmp_path, "k1", *base, "eviction=custom",
                      "eviction.target=my_policies.LRUK", "+eviction.k=1")
    k2, _ = run(compose, tmp_path, "k2", *base, "eviction=custom",
                "eviction.target=my_policies.LRUK", "+eviction.k=2")
    assert k1_reqs == lru_reqs and lru["evicted_tokens"] > 0
    assert (round(lru["hit_rate"], 4), round(k2["hit_rate"], 4)) == (0.0656, 0.0747)


BAD = '''
class NoEvict:
    def priority(self, entry): return entry.last_access
    def on_access(self, requester): pass
    def on_create(self, entry): pass
    def on_hit(self, entry): pass

class NoOrder:
    def __init__(self, cache): pass

class NoRoute:
    def bind(self, n, caches=()): pass
'''


def cli(*overrides: str, path: str, sweep: bool = False, cwd=REPO) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (path, os.environ.get("PYTHONPATH")) if p)}
    flags = ["-m"] if sweep else []
    return subprocess.run([sys.executable, "-m", "testbed.run", *flags, "progress=false",
                           *overrides], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("overrides, message", [
    (["backend=replay", "eviction=custom", "eviction.target=bad.NoEvict"],
     "error: eviction=bad.NoEvict: class does not implement on_evict(), which an eviction "
     "policy must have (priority, on_access, on_create, on_hit, on_evict)"),
    (["scheduler=custom", "scheduler.target=bad.NoOrder"],
     "error: scheduler=bad.NoOrder: class does not implement order(), which a queue policy "
     "must have (order)"),
    (["replicas=2", "router=custom", "router.target=bad.NoRoute"],
     "error: router=bad.NoRoute: class does not implement route(), which a router "
     "(testbed.router.Router) must have (bind, route, on_complete, info)"),
    (["eviction=custom", "eviction.target=bad.Missing"], "error: eviction.target=bad.Missing: "
     "module bad has no Missing"),
    (["eviction=custom", "eviction.target=nowhere.LRU"], "error: eviction.target=nowhere.LRU: "
     "cannot import nowhere (No module named 'nowhere'); is its folder on PYTHONPATH or the "
     "working directory?"),
    (["eviction=custom"], "error: eviction=custom needs eviction.target=module.Name, a class on "
     "PYTHONPATH implementing an eviction policy (docs/extending.md)"),
])
def test_a_malformed_or_missing_class_is_refused_in_one_line(tmp_path, overrides, message):
    (tmp_path / "bad.py").write_text(BAD)
    out = cli(*overrides, f"hydra.run.dir={tmp_path / 'run'}", path=str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip() == message


@pytest.mark.parametrize("backend", ["sim", "engine"])
def test_a_cache_class_that_takes_no_capacity_tokens_is_refused_before_it_runs_unlimited(
        compose, backend):
    """``NoCache(capacity=...)`` names its size otherwise: built from the run it got none, and
    an unlimited cache over the engine's pool of 33 slots handed out slot 91 (issue 58)."""
    from testbed.config.assembly import assemble

    with pytest.raises(ValueError, match=r"^cache=testbed.cache.NoCache takes no "
                                         r"capacity_tokens: the run gives every cache its KV "
                                         r"pool's size under that name \(docs/extending.md\)$"):
        assemble(compose(f"backend={backend}", "model=tiny", "cache=custom",
                         "cache.target=testbed.cache.NoCache", "cache.capacity_tokens=33"))


def test_a_setting_the_user_class_does_not_take_is_refused_with_those_it_does(compose):
    from testbed.config.assembly import assemble

    with pytest.raises(ValueError, match=r"^eviction.j is not a setting of "
                                         r"eviction=my_policies.LRUK; allowed: name, target, k$"):
        assemble(compose("eviction=custom", "eviction.target=my_policies.LRUK", "+eviction.j=2"))


def test_a_queue_policy_that_loses_requests_is_stopped(compose, tmp_path, monkeypatch):
    (tmp_path / "lossy.py").write_text(
        "class DropFirst:\n    def __init__(self, cache): pass\n"
        "    def order(self, waiting, now): return waiting[1:]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"scheduler=lossy.DropFirst: order\(\) must return the "
                                         r"waiting requests reordered \(\d+ waiting, \d+ returned\)"):
        execute(compose("workload=chat", "workload.num_sessions=4", "scheduler=custom",
                        "scheduler.target=lossy.DropFirst"), tmp_path / "run")


def test_an_out_of_tree_policy_runs_in_a_sweep_and_the_report_plots_it(tmp_path):
    sweep = tmp_path / "sweep"
    out = cli("backend=replay", "workload=chat", "workload.num_sessions=30",
              "cache.capacity_tokens=3000,6000", "eviction=custom",
              "eviction.target=my_policies.LRUK", "+eviction.k=1,2",
              f"hydra.sweep.dir={sweep}", path=str(EXAMPLES), sweep=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("done: ") == 4
    report = subprocess.run([sys.executable, "-m", "testbed.report", str(sweep)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert report.returncode == 0, report.stderr
    table = pd.read_csv(sweep / "results.csv")
    assert sorted(table["variant"]) == ["k=1", "k=1", "k=2", "k=2"]
    assert set(table["eviction"]) == {"my_policies.LRUK"}
    assert "k=2" in (sweep / "report.md").read_text()
    assert (sweep / "figures" / "hit_rate_vs_capacity.png").is_file()


def test_a_group_file_of_ones_own_is_an_option_once_its_folder_is_on_the_search_path(compose,
                                                                                     capsys):
    from testbed.config.assembly import assemble
    from testbed.config.cli import check_group_choices

    search = f"hydra.searchpath=[file://{EXAMPLES / 'conf'}]"
    check_group_choices([search, "eviction=lru,lru_k,mru"])  # accepted: no exit
    run = assemble(compose(search, "eviction=lru_k", "eviction.k=3"))
    assert run.eviction.label == "my_policies.LRUK" and run.eviction.build().k == 3
    with pytest.raises(SystemExit):
        check_group_choices(["eviction=lru_k"])
    assert "eviction must be one of custom, fifo" in capsys.readouterr().err
