"""The config space the fuzzer draws from: the whole of conf/ (docs/design.md §5), at small
sizes, with KV capacities from below one request to unlimited.

- backends: replay, the simulator (its cost models, hardware presets, host block, replicas and
  routers), the engine on the tiny model in at least a quarter of the configs (every ``engine.``
  key, `testbed.fuzz.engine_space`), and ``backend=server`` against the fuzzer's own
  ``testbed.serve`` (`testbed.fuzz.server`); now and then a built-in executor by import path;
- every cache, eviction policy, scheduler and router with its keys (`testbed.fuzz.group_space`);
- every workload generator, text workloads on the fuzzer's tokenizer, traces of every format,
  token traces malformed half the time (`testbed.fuzz.workload_space`);
- speculative decoding on the simulator and the engine; arrival kinds, rates, closed loops and
  concurrency limits; timelines.

A draw is a list of Hydra overrides, the same a user types after ``python -m testbed.run``.
What depends on the workload's requests is drawn in a second step (`after_requests`): the
capacity, so that "below one request", "exactly the largest request" and "a few requests" mean
what they say, and the accepted drafts a ``speculative.acceptance=recorded`` run replays. Some
draws are refused by validation (a combination that cannot run together); they are kept: the
refusal must then be one line. `testbed.fuzz.coverage` checks that every key of conf/ is drawn.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from testbed.fuzz.engine_space import ENGINE_KEYS, engine_overrides, recorded_path, sim_model, \
    speculative_overrides, tiny_model
from testbed.fuzz.fixtures import Fixtures
from testbed.fuzz.group_space import Table, cache_overrides, choice, cost_model_overrides, \
    custom, eviction_overrides, hardware_overrides, host_overrides, keys_of, router_overrides, \
    scheduler_overrides, vllm_overrides
from testbed.fuzz.server import ROUTER_URL, URL
from testbed.fuzz.workload_space import TEXT, workload_overrides, write_token_trace  # noqa: F401
from testbed.workloads.request import Request

BACKENDS = {"replay": 0.25, "sim": 0.38, "engine": 0.3, "server": 0.07}
SERVER_KEYS: Table = (("model", ["null", "tiny"], 0.3), ("timeout_s", [600.0, "null"], 0.2),
                      ("connect_timeout_s", [10.0, 2.0], 0.2),
                      ("prefill_only", ["zero", "one_token"], 0.4))
# the engine's keys backend=server sends with every call
SENT: Table = tuple(k for k in ENGINE_KEYS if k[0] in ("forced", "temperature", "top_p"))
# the cascade's keys, drawn where the simulator prices an attention drawn for it
CASCADE_KEYS: Table = (("cascade_min_saved", [0, 16], 0.5),
                       ("cascade_rule", ["auto", "always"], 0.4))
ARRIVAL_KEYS: Table = (("max_in_flight", [1, 2, 3, 4], 0.3),
                       ("max_concurrency", ["null", 1, 2, 4], 0.15))


def draw(rng: np.random.Generator, workdir: Path, index: int, fixtures: Fixtures | None = None,
         vidur: bool = False) -> list[str]:
    """One random config, without what `after_requests` adds. ``fixtures``: the files text
    workloads and ``model.path`` read (default: under ``workdir``); ``vidur``: Vidur's profile
    is in the data folder, so ``cost_model=vidur`` can be drawn."""
    fixtures = fixtures or Fixtures(workdir / "fixtures")
    backend = str(rng.choice(list(BACKENDS), p=list(BACKENDS.values())))
    out = [f"backend={backend}", f"seed={int(rng.integers(1000))}", *eviction_overrides(rng),
           *workload_overrides(rng, workdir, index, fixtures), *cache_overrides(rng, backend)]
    if backend == "replay":
        return out
    # half the block-cache configs run vLLM's scheduler instead, drawn from their own stream
    vllm = np.random.default_rng([index, 31])
    out += vllm_overrides(vllm) if "cache=block_hash" in out and vllm.random() < 0.5 \
        else scheduler_overrides(rng)
    if backend == "engine":
        out += [*tiny_model(rng, fixtures), *engine_overrides(rng)]
    elif backend == "server":
        out += server_overrides(rng, out, fixtures)
    else:
        out += sim_overrides(rng, fixtures, vidur)
        if rng.random() < 0.03:  # the simulator's executor by import path
            out[0:1] = custom(rng, "backend")
    if backend != "server" and rng.random() < 0.2:
        out = speculation(out, rng, backend, workdir, index)
    return out + arrival_overrides(rng)


def server_overrides(rng: np.random.Generator, out: list[str], fixtures: Fixtures) -> list[str]:
    """A call of the fuzzer's live server, or of its live router in front of two (a third of
    them); a text workload's prompts sent as text half the time (through the checkpoint's
    tokenizer, as the server's), another's now and then (refused: no tokenizer)."""
    url = ROUTER_URL if rng.random() < 0.3 else URL
    drawn = ["model=tiny", f"server.url={url}", *keys_of(rng, "server", SERVER_KEYS),
             *keys_of(rng, "engine", SENT)]
    text = any(o in out for o in (f"workload={w}" for w in TEXT))
    if rng.random() < (0.5 if text else 0.05):
        drawn.append("server.prompt_format=text")
        if text:
            drawn.append(f"model.path={fixtures.checkpoint}")
    return drawn


def sim_overrides(rng: np.random.Generator, fixtures: Fixtures, vidur: bool) -> list[str]:
    """The simulator's model, hardware, cost model, host block, the attention it prices, and
    replicas behind a router."""
    cost = cost_model_overrides(rng, vidur)
    out = [] if "cost_model=vidur" in cost else [*sim_model(rng, fixtures),
                                                 *hardware_overrides(rng)]
    out += [*cost, *host_overrides(rng)]
    if rng.random() < 0.2:
        out.append(f"engine.attention={choice(rng, ['cascade', 'cascade_torch', 'torch', 'null'])}")
        out += keys_of(rng, "engine", CASCADE_KEYS)
    if rng.random() < 0.2:
        out += router_overrides(rng)
    return out


def speculation(out: list[str], rng: np.random.Generator, backend: str, workdir: Path,
                index: int) -> list[str]:
    """``out`` with speculative decoding, mostly without the overlap schedule it refuses."""
    spec = speculative_overrides(rng, backend, workdir, index)
    if rng.random() < 0.9 and "scheduler=vllm" not in out:
        out = [o for o in out if not o.startswith("scheduler.overlap=")]
        out.append("scheduler.overlap=false")
    return out + spec


def arrival_overrides(rng: np.random.Generator) -> list[str]:
    kind = choice(rng, ["auto", "offline", "poisson"])
    out = [f"arrival.kind={kind}"]
    if kind == "poisson":
        out.append(f"arrival.rate={choice(rng, [1.0, 50.0, 1000.0])}")
    out += keys_of(rng, "arrival", ARRIVAL_KEYS)
    out += keys_of(rng, "", (("timeline", ["true", "false"], 0.05),))
    return out + [f"progress={'true' if rng.random() < 0.05 else 'false'}"]


def after_requests(rng: np.random.Generator, overrides: list[str], requests: list[Request],
                   backend: str) -> list[str]:
    """What is drawn once the workload's requests are known: the capacity
    (`capacity_overrides`), and for ``speculative.acceptance=recorded`` the file of accepted
    drafts it names, written here (each request's, for more steps than it can verify)."""
    for item in overrides:
        if item.startswith("speculative.acceptance_path="):
            path = Path(item.partition("=")[2])
            steps = max((len(r.prompt) + r.output_limit for r in requests), default=1) + 1
            path.write_text("".join(json.dumps(
                {"id": r.id, "spec_accepted": [int(x) for x in rng.integers(0, 5, steps)]}) + "\n"
                for r in requests))
    return capacity_overrides(rng, requests, backend)


def capacity_overrides(rng: np.random.Generator, requests: list[Request],
                       backend: str) -> list[str]:
    """``cache.capacity_tokens`` relative to the workload: below one request, about the largest
    request, a few requests, or unlimited. Null means unlimited in replay and what the workload
    could ever hold on the engine; in the simulator it is what the model leaves on the hardware
    (millions of tokens, whose bookkeeping a check after every step would walk), so there the
    unlimited case is the workload's total instead; a server's pool is its own."""
    if not requests or backend == "server":
        return []
    sizes = [len(r.prompt) + r.output_limit for r in requests]
    largest, total = max(sizes), sum(sizes)
    kind = rng.choice(["null", "below", "largest", "few", "total"], p=[0.2, 0.1, 0.3, 0.3, 0.1])
    value = {"null": None, "below": max(largest // 2, 0), "largest": largest + int(rng.integers(0, 3)),
             "few": largest * int(rng.integers(2, 5)), "total": total + 1}[kind]
    if value is None and backend in ("sim", "custom"):
        value = total + 1
    return [f"cache.capacity_tokens={'null' if value is None else value}"]


__all__ = ["BACKENDS", "after_requests", "capacity_overrides", "draw", "recorded_path",
           "write_token_trace"]
