"""Every option of every config group composes, assembles (testbed/config/assembly.py) and builds
its objects: the workload's requests, the cache with its eviction policy, the cost model, the
executor and the router. ``custom`` options take a class by import path: here the package's own
classes or a small subclass, so that what is tested is the plumbing."""

from __future__ import annotations

import pytest

from testbed.config.assembly import assemble
from testbed.config.cli import CONF_DIR, group_options
from testbed.data import is_here, lookup
from testbed.router import Loads
from testbed.sim.cost_model import StepShape
from testbed.workloads import generate, save_tokens
from testbed.workloads.text import NEEDS

GROUPS = ("backend", "cache", "cost_model", "eviction", "hardware", "model", "router",
          "scheduler", "workload")
SMALL = ["workload=chat", "workload.num_sessions=2", "workload.turns=2"]

CUSTOM_CACHE = '''
from testbed.cache.radix import RadixCache

class Radix(RadixCache):
    def __init__(self, capacity_tokens=None, policy=None):
        super().__init__(capacity_tokens, policy=policy)
'''
CUSTOM = {
    "backend": ["backend.target=testbed.sim.executor.SimExecutor"],
    "cache": ["cache.target=my_cache.Radix"],
    "cost_model": ["cost_model.target=testbed.sim.cost_model.RooflineCostModel"],
    "eviction": ["eviction.target=my_policies.MostRecentlyUsed"],
    "router": ["router.target=my_policies.Rotate"],
    "scheduler": ["scheduler.target=my_policies.LongestOutputFirst"],
    "workload": ["workload.target=testbed.workloads.paper.chat", "+workload.num_sessions=2"],
}

# the text workloads (testbed/workloads/text.py, which names the data they read) at a small size
TEXT = {"sharegpt": ["workload.num_prompts=4"], "sharegpt_chat": ["workload.num_conversations=2"],
        "few_shot_text": ["workload.questions_per_task=2"], "rag_text": ["workload.num_requests=4"],
        "paraphrase_text": ["workload.num_originals=2"], "copy_text": ["workload.num_prompts=3"]}


def cases() -> list[tuple[str, str]]:
    return [(g, o) for g in GROUPS for o in group_options(g)]


def test_the_cases_cover_every_group_of_the_run_config():
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    assert groups - set(GROUPS) == {"calibration", "experiment", "hydra"}  # not run groups
    assert len(cases()) >= 50


@pytest.mark.usefixtures("examples_on_path")
@pytest.mark.parametrize("group, option", cases())
def test_every_config_option_assembles_and_builds(compose, tmp_path, monkeypatch, group, option):
    overrides = [f"{group}={option}"] + ([] if group == "workload" else SMALL)
    if option == "custom":
        overrides += CUSTOM[group]
        (tmp_path / "my_cache.py").write_text(CUSTOM_CACHE)
        monkeypatch.syspath_prepend(str(tmp_path))
    if group == "workload" and option in TEXT:  # real text: needs the data folder
        missing = [n for n in NEEDS[option] if not is_here(lookup(n))]
        if missing:
            pytest.skip(f"workload={option} needs {', '.join(missing)}: python -m testbed.data "
                        f"fetch {' '.join(missing)}")
        overrides += TEXT[option]
    if group == "workload" and option == "trace":
        save_tokens(generate({"name": "chat", "num_sessions": 2}), tmp_path / "t.jsonl")
        overrides.append(f"workload.path={tmp_path / 't.jsonl'}")
    if group == "cost_model" and option == "fitted":
        overrides.append("cost_model.path=conf/calibration/tiny_cpu.yaml")
    if group == "backend" and option == "engine":
        overrides += ["model=tiny", "device=cpu"]
    if group == "model":  # the 34B and 70B presets' weights do not fit the default A10G
        overrides.append("hardware=h100")
    if group == "scheduler" and option == "vllm":  # vLLM's scheduler runs on its block cache
        overrides.append("cache=block_hash")
    if group == "backend" and option == "server":  # assembled only: nothing is sent
        overrides.append("server.url=http://127.0.0.1:8000")
    if group == "cost_model" and option == "vidur":
        from tests.test_vidur_cost import write_profile

        shape = assemble(compose(*SMALL)).model_shape
        overrides.append(f"cost_model.profile_dir={write_profile(tmp_path / 'vidur', shape)}")
    run = assemble(compose(*overrides))
    requests = run.requests()
    assert requests
    cache = run.build_cache(4096, requests)
    assert cache.available_size == 4096
    assert run.build_cost_model().step_time(StepShape.decode((100,))) > 0
    router = run.build_router(4096)
    router.bind(2, [cache, run.build_cache(4096, requests)])
    assert 0 <= router.route(requests[0].prompt, Loads((0, 0), (0, 0)), 0.0) < 2
    if run.executor is not None:
        executor = run.build_executor(4096, requests)
        assert callable(executor.execute)
    chosen = run.config[group].get("target") or run.config[group].get("name")
    assert chosen == (CUSTOM[group][0].split("=")[1] if option == "custom" else
                      run.config[group]["name"])
