"""Generated workloads: determinism, exact structure, round trips, and every backend's ideal."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from testbed.config.assembly import compose_config
from testbed.cache import RadixCache
from testbed.data import is_here, lookup
from testbed.backends.replay import replay
from testbed.workloads import WORKLOADS, build_workload, generate
from testbed.workloads.describe import describe
from testbed.workloads.paper import (chat, chat_tenants, few_shot, self_consistency,
                                     tree_of_thought)
from testbed.workloads.request import OutputRef, materialize
from testbed.workloads.synthetic import image_tokens, multimodal, random_tree
from testbed.workloads.text import NEEDS
from testbed.workloads.traces import load_tokens, save_tokens

REPO = Path(__file__).resolve().parents[1]
BIG_VOCAB = 2**31 - 1  # chance collisions between random spans become negligible
GENERATED = [w for w in WORKLOADS if w != "trace"]


def small_config(name: str) -> dict:
    """The workload's config file, shrunk so tests run in milliseconds."""
    if name in NEEDS:  # real text (testbed/workloads/text.py): needs the data folder
        missing = [n for n in NEEDS[name] if not is_here(lookup(n))]
        if missing:
            pytest.skip(f"workload={name} needs {', '.join(missing)}: python -m testbed.data "
                        f"fetch {' '.join(missing)}")
    cfg = compose_config([f"workload={name}"])
    params = OmegaConf.to_container(cfg.workload, resolve=True)
    shrink = {"num_tasks": 3, "questions_per_task": 4, "num_sessions": 3, "turns": 3,
              "num_questions": 3, "num_problems": 2, "depth": 3, "branching": 2,
              "num_requests": 20, "num_groups": 3, "prompts_per_group": 3, "num_images": 4,
              "num_prompts": 8, "num_conversations": 4}
    lengths = {k: max(1, v // 8) for k, v in params.items()
               if isinstance(v, int) and k.endswith("_len") and v > 8}

    def apply(p: dict) -> dict:
        return {k: shrink.get(k, lengths.get(k, v)) if not isinstance(v, dict) else v
                for k, v in p.items()}

    if name == "mixed":
        params["components"] = {c: apply(sub) for c, sub in params["components"].items()}
        return params
    return apply(params)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


@pytest.mark.parametrize("name", GENERATED)
def test_same_seed_gives_identical_workload_and_another_seed_a_different_one(name):
    a, b = generate(small_config(name), seed=5), generate(small_config(name), seed=5)
    c = generate(small_config(name), seed=6)
    assert [(r.id, r.after, r.arrival_s) for r in a] == [(r.id, r.after, r.arrival_s) for r in b]
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output)
               for x, y in zip(a, b))
    assert any(not np.array_equal(x.prompt, y.prompt) for x, y in zip(a, c))


@pytest.mark.parametrize("name", GENERATED)
def test_prompts_equal_their_segments_with_referenced_outputs_spliced_in(name):
    requests = generate(small_config(name), seed=1)
    outputs = {r.id: r.output for r in requests}
    seen = set()
    for r in requests:
        assert set(r.after) <= seen, f"{r.id} listed before a call it waits for"
        assert np.array_equal(materialize(r.segments, outputs), r.prompt)
        seen.add(r.id)


@pytest.mark.parametrize("name", GENERATED)
def test_generate_save_load_round_trip_is_identical(name, tmp_path):
    requests = build_workload(small_config(name), seed=2)
    save_tokens(requests, tmp_path / "w.jsonl")
    loaded = load_tokens(tmp_path / "w.jsonl")
    assert [(r.id, r.program, r.after, r.arrival_s) for r in loaded] == \
        [(r.id, r.program, r.after, r.arrival_s) for r in requests]
    assert all(np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output)
               for x, y in zip(loaded, requests))


@pytest.mark.parametrize("name", GENERATED)
def test_unlimited_replay_hits_the_ideal_which_a_brute_force_recount_confirms(name):
    requests = build_workload(small_config(name), seed=3)
    records = replay(requests, RadixCache(None), save_token_ids=True)
    hit = sum(r.cached_tokens for r in records)
    # Independent recount from the saved ids: longest prefix shared with any earlier sequence.
    earlier: list[np.ndarray] = []
    recount = 0
    for rec in records:
        prompt = np.asarray(rec.prompt_ids)
        recount += max((lcp(prompt, s) for s in earlier), default=0)
        earlier.append(np.concatenate([prompt, np.asarray(rec.output_ids, dtype=prompt.dtype)]))
    assert hit == recount
    assert describe(requests)["ideal_hit_rate"] == hit / sum(r.prompt_tokens for r in records)


@pytest.mark.parametrize("fork", [False, True])
def test_self_consistency_ideal_hit_rate_equals_the_analytic_value(fork):
    q, n, p, l = 6, 4, 50, 13
    requests = self_consistency(num_questions=q, num_samples=n, prefix_len=p, question_len=l,
                                output_len=7, fork_prefill=fork, vocab_size=BIG_VOCAB, seed=0)
    # The first call of question 0 hits nothing; the first of every other question hits the
    # shared prefix; every later call (the samples after a fork) hits its whole prompt.
    calls = n + fork
    analytic = ((q - 1) * p + q * (calls - 1) * (p + l)) / (q * calls * (p + l))
    assert len(requests) == q * calls
    assert describe(requests)["ideal_hit_rate"] == pytest.approx(analytic, rel=1e-12)


@pytest.mark.parametrize("fork", [False, True])
@pytest.mark.parametrize("depth, branching", [(1, 3), (3, 2), (4, 3)])
def test_tree_of_thought_has_sum_of_branching_powers_calls_and_children_extend_parents(
        depth, branching, fork):
    requests = tree_of_thought(num_problems=2, depth=depth, branching=branching, instruction_len=8,
                               problem_len=4, step_prompt_len=2, thought_len=3, fork_prefill=fork,
                               seed=0)
    thoughts = [r for r in requests if len(r.output)]
    forks = [r for r in requests if not len(r.output)]
    assert len(thoughts) == 2 * sum(branching**i for i in range(depth))
    assert len(forks) == (2 * sum(branching**i for i in range(depth - 1)) if fork else 0)
    by_id = {r.id: r for r in requests}
    for r in thoughts:
        if r.after:
            parent = by_id[r.after[0]]
            if fork:  # the fork call has exactly the siblings' prompt, after the thought's parent
                assert np.array_equal(parent.prompt, r.prompt)
                parent = by_id[parent.after[0]]
            assert np.array_equal(r.prompt[: len(parent.prompt) + 3], parent.sequence())


def test_chat_turn_prompt_starts_with_previous_turn_prompt_and_output():
    requests = chat(num_sessions=3, turns=4, system_prompt_len=10, min_question_len=5,
                    max_question_len=9, min_output_len=2, max_output_len=4, think_time_s=2.5, seed=1)
    by_id = {r.id: r for r in requests}
    for r in requests:
        if r.id.endswith("turn0"):
            assert r.after == [] and r.think_time_s == 0.0
            continue
        (prev,) = r.after
        assert r.think_time_s == 2.5
        assert np.array_equal(r.prompt[: len(by_id[prev].sequence())], by_id[prev].sequence())
        assert len(r.prompt) > len(by_id[prev].sequence())
    firsts = [r.prompt[:10] for r in requests if r.id.endswith("turn0")]
    assert all(np.array_equal(firsts[0], f) for f in firsts)  # one system prompt for all


# SHA-256 over (id, program, after, think time, arrival, prompt, output, category, priority) of
# the routing study's multi-tenant chat after Poisson arrivals, recorded 2026-12-02 from
# multi_tenant_chat in experiments/routing_study.py before it moved into workload=chat_tenants.
# The last case is the study's own chat (docs/results/routing/routing.png).
CHAT_TENANTS_BEFORE_THE_MOVE = [
    (12, 16.0, 1.0, 0, 72, "5e38d0480340b368760c417480bb5ef600a3cacac250cdbe8b650989af675659"),
    (20, 4.0, 1.5, 3, 120, "59678978dc589b298e0ef96275cf87e7ec8e143619e83e454ce4ac41ae65c678"),
    (1024, 16.0, 1.0, 0, 6144, "2f5d65b22a4f8cc5ba589f59d276574507f187e6821a1aa783b03c1ebf71cf23"),
]


@pytest.mark.parametrize("sessions, rate, zipf, seed, count, digest", CHAT_TENANTS_BEFORE_THE_MOVE)
def test_chat_tenants_gives_the_requests_the_routing_study_built_itself(sessions, rate, zipf, seed,
                                                                        count, digest):
    requests = build_workload({"name": "chat_tenants", "num_sessions": sessions, "zipf": zipf},
                              seed=seed, arrival={"kind": "poisson", "rate": rate})
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.id, r.program, r.after, r.think_time_s, repr(float(r.arrival_s)),
                             r.prompt.tolist(), r.output.tolist(), r.category,
                             r.priority]).encode())
    assert len(requests) == count and h.hexdigest() == digest


def test_chat_tenants_sessions_share_their_tenants_system_prompt_only():
    requests = chat_tenants(num_tenants=4, num_sessions=200, turns=2, system_prompt_len=16,
                            min_question_len=4, max_question_len=8, min_output_len=2,
                            max_output_len=3, zipf=1.0, vocab_size=BIG_VOCAB)
    system = {}
    for r in requests:
        tenant = r.program.split("/")[0]
        assert np.array_equal(system.setdefault(tenant, r.prompt[:16]), r.prompt[:16])
    assert len(system) == 4 and lcp(system["tenant0"], system["tenant1"]) == 0
    per_tenant = [sum(r.program.startswith(f"tenant{t}/") for r in requests) for t in range(4)]
    assert per_tenant[0] > per_tenant[3]  # Zipf: the first tenant is the most popular


def test_few_shot_questions_of_one_task_share_exactly_the_example_block():
    requests = few_shot(num_tasks=3, questions_per_task=4, num_shots=5, example_len=6,
                        question_len=7, vocab_size=BIG_VOCAB, seed=0)
    tasks: dict[str, list[np.ndarray]] = {}
    for r in requests:
        tasks.setdefault(r.program.split("/")[0], []).append(r.prompt)
    for prompts in tasks.values():
        assert all(lcp(prompts[0], p) == 30 for p in prompts[1:])
    a, b, _ = tasks.values()
    assert lcp(a[0], b[0]) == 0


def test_multimodal_images_are_fixed_token_runs_shared_across_requests():
    requests = multimodal(num_requests=30, num_images=3, image_len=16, system_prompt_len=4,
                          question_len=3, output_len=2, seed=9)
    runs = {tuple(r.prompt[4:20].tolist()) for r in requests}
    images = {tuple(image_tokens(i, 16, 32000, 9).tolist()) for i in range(3)}
    assert runs <= images and len(runs) > 1
    assert np.array_equal(image_tokens(1, 16, 32000, 9), image_tokens(1, 16, 32000, 9))


def test_random_tree_children_continue_their_parent_and_count_is_exact():
    requests = random_tree(num_requests=57, root_prob=0.2, max_burst=3, root_len=5, segment_len=2,
                           output_len=2, seed=4)
    assert len(requests) == 57
    by_id = {r.id: r for r in requests}
    children = [r for r in requests if r.after]
    assert children
    for r in children:
        parent = by_id[r.after[0]]
        assert np.array_equal(r.prompt[: len(parent.sequence())], parent.sequence())
        assert r.program == parent.program


def test_mixed_interleaves_whole_programs_with_prefixed_unique_ids():
    cfg = small_config("mixed")
    cfg["weights"] = {"chat": 1.0, "tree_of_thought": 1.0, "few_shot": 0.0, "self_consistency": 0.0}
    requests = generate(cfg, seed=0)
    assert {r.id.split(":")[0] for r in requests} == {"chat", "tree_of_thought"}
    assert len({r.id for r in requests}) == len(requests)
    refs = [s.call for r in requests for s in r.segments if isinstance(s, OutputRef)]
    ids = {r.id for r in requests}
    assert refs and all(ref in ids for ref in refs)
    cfg["num_programs"] = 2
    assert len({r.program for r in generate(cfg, seed=0)}) == 2


def test_poisson_arrivals_are_per_program_and_increasing():
    requests = build_workload(small_config("chat"), seed=0,
                              arrival={"kind": "poisson", "rate": 4.0})
    starts = {}
    for r in requests:
        starts.setdefault(r.program, r.arrival_s)
        assert r.arrival_s == starts[r.program]
    times = list(starts.values())
    assert times[0] == 0.0 and times == sorted(times) and len(set(times)) == len(times)


def test_bad_sizes_and_arrivals_name_the_key():
    with pytest.raises(ValueError, match="workload.turns must be >= 0, got -1"):
        chat(turns=-1)
    with pytest.raises(ValueError, match=r"workload.min_output_len \(9\) must be <= workload.max_output_len"):
        chat(min_output_len=9, max_output_len=4)
    with pytest.raises(ValueError, match="arrival.rate must be > 0"):
        build_workload(small_config("chat"), arrival={"kind": "poisson", "rate": None})
    with pytest.raises(ValueError, match="arrival.kind must be one of auto, offline, poisson, trace"):
        build_workload(small_config("chat"), arrival={"kind": "bursty"})
    with pytest.raises(ValueError, match="workload.turnz is not a setting of workload=chat; allowed: name, num_sessions, turns"):
        generate({"name": "chat", "turnz": 3})


def test_describe_command_prints_the_table_and_saves_a_replayable_trace(tmp_path):
    out = tmp_path / "w.jsonl"
    proc = subprocess.run([sys.executable, "-m", "testbed.workloads", "workload=self_consistency",
                           "workload.num_questions=2", "workload.fork_prefill=false", f"save={out}"],
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for key in ["programs", "requests", "prompt_tokens", "output_tokens", "ideal_hit_rate",
                "unique_tokens", "tree_nodes", "tree_depth"]:
        assert key in proc.stdout
    assert len(load_tokens(out)) == 10
    assert list(tmp_path.iterdir()) == [out]  # no Hydra output folders left behind
