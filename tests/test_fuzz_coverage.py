"""The fuzzer draws every key of the config space (`testbed.fuzz.coverage`): every option of every
group and every key of conf/'s run config and of docs/reference.md's tables, but for a short
list of exclusions, each with its reason. A key added to conf/ without the fuzzer drawing it
fails here, so it is fuzzed from its first day."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from testbed.config.cli import CONF_DIR
from testbed.fuzz.coverage import EXCLUDED, NOT_RUN, conf_keys, drawn_keys, reference_keys, \
    route_drawn, undrawn
from testbed.fuzz.server import router_config
from testbed.fuzz.space import after_requests, draw
from testbed.workloads.request import Request

CONF = Path(CONF_DIR)
REFERENCE = (CONF.parent / "docs" / "reference.md").read_text()
DRAWS = 3000
ROUTERS = 100  # fuzz runs' live routers (one a run)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> set[tuple[str, str]]:
    """Every key and option the fuzzer's first ``DRAWS`` configs of seed 0 draw (both steps),
    and the live routers of ``ROUTERS`` fuzz runs."""
    workdir = tmp_path_factory.mktemp("draws")
    rng = np.random.default_rng(0)
    one = [Request(id="r", prompt=np.arange(5, dtype=np.int32),
                   output=np.arange(2, dtype=np.int32))]
    keys: set[tuple[str, str]] = set()
    for i in range(DRAWS):
        overrides = draw(rng, workdir, i, vidur=True)
        overrides += after_requests(rng, overrides, one, overrides[0].partition("=")[2])
        keys |= drawn_keys(overrides, CONF)
    for seed in range(ROUTERS):
        keys |= route_drawn(router_config(seed), CONF)
    return keys


def test_every_key_of_conf_and_the_reference_is_drawn_or_excluded_with_a_reason(drawn):
    assert undrawn(drawn, CONF, REFERENCE) == set()


def test_every_exclusion_names_a_key_that_exists_and_says_why():
    keys = conf_keys(CONF)
    assert all(key in keys and reason for key, reason in EXCLUDED.items())
    assert all(reason and any(CONF.glob(f"{file}*")) for file, reason in NOT_RUN.items())


def test_a_key_added_to_conf_without_the_fuzzer_is_reported(drawn, tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    with (conf / "cache" / "radix.yaml").open("a") as f:
        f.write("fuzz_me: 3  # a new key\n")
    with (conf / "config.yaml").open("a") as f:
        f.write("brand_new:\n  knob: 1\n")
    assert undrawn(drawn, conf, REFERENCE) == {("cache/radix.yaml", "fuzz_me"),
                                               ("config.yaml", "brand_new.knob")}


def test_a_key_only_the_reference_lists_is_reported_too(drawn):
    reference = REFERENCE + "\n## Top-level keys (again)\n\n| key | default |\n| --- | --- |\n" \
                            "| `engine.warp_drive` | `false` |\n"
    assert undrawn(drawn, CONF, reference) == {("config.yaml", "engine.warp_drive")}


def test_an_override_draws_the_key_of_the_file_that_defines_it():
    assert drawn_keys(["scheduler=hrrn", "scheduler.overlap=true", "model.path=/x",
                       "engine.cpu_kernels=torch", "+workload.depth=2"], CONF) >= {
        ("scheduler/hrrn.yaml", ""), ("scheduler/_base.yaml", "overlap"),
        ("model/llama2_7b.yaml", "path"), ("config.yaml", "engine.cpu_kernels"),
        ("workload/tree_of_thought.yaml", "depth")}


def test_the_reference_lists_the_keys_conf_defines():
    assert {k for k in reference_keys(REFERENCE) if k[1]} <= conf_keys(CONF)
