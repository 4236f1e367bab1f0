"""Refused input raises `testbed.errors.BadInput` with one line naming the key (or the file and
line) and, where there is a fixed set, the allowed values; a violated internal invariant stays a
plain ValueError, which the entry points report as a defect (`testbed.errors.failure_kind`)."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.config.assembly import assemble
from testbed.cache.radix import RadixCache
from testbed.errors import BadInput, check_choice, did_you_mean, failure_kind
from testbed.workloads.traces import load_trace

SMALL = ["workload=chat", "workload.num_sessions=2", "workload.turns=2"]  # unless one is named

# What each case exercises once the config is assembled (``compose``: composing it fails).
STAGES = {
    "assemble": lambda run: None,
    "requests": lambda run: run.requests(),
    "cache": lambda run: run.build_cache(run.capacity_tokens, run.requests()),
    "hardware": lambda run: run.hardware,
    "model": lambda run: run.model_shape,
    "cost_model": lambda run: run.build_cost_model(),
    "router": lambda run: (run.cluster_delays(), run.build_router(1000)),
}

# (overrides, stage, the whole message)
CONFIG_CASES = [
    (["cache.capacity_tokens=-5"], "assemble",
     "cache.capacity_tokens must be >= 0 or null, got -5"),
    (["cache.page_size=0"], "cache", "cache.page_size must be >= 1, got 0"),
    (["cache.split_recency=sometimes"], "cache",
     "cache.split_recency must be one of refresh, keep; got 'sometimes'"),
    (["cache=block_hash", "+cache.host_tokens=100"], "cache",
     "cache.host_tokens / cache.disk_tokens need cache=radix, got cache=block_hash"),
    (["cache.reuse=copy"], "assemble", "cache.reuse must be one of prefix, blend; got 'copy'"),
    (["cache.recompute_ratio=2"], "assemble",
     "cache.recompute_ratio must be a number in [0, 1], got 2"),
    (["scheduler.max_prefill_tokens=0"], "assemble",
     "scheduler.max_prefill_tokens must be >= 1, got 0"),
    (["scheduler.max_prefill_tokens=many"], "assemble",
     "scheduler.max_prefill_tokens must be an integer, got 'many'"),
    (["scheduler.retract_order=oldest"], "assemble",
     "scheduler.retract_order must be one of newest, longest_prompt, most_remaining; "
     "got 'oldest'"),
    (["eviction=learned", "eviction.window=wide"], "assemble",
     "eviction.window must be an integer, got 'wide'"),
    (["eviction=workload_aware", "eviction.tau=0"], "cache", "eviction.tau must be > 0, got 0"),
    (["workload.num_sessions=two"], "assemble",
     "workload.num_sessions must be an integer, got 'two'"),
    (["workload=trace", "+workload.speed=2"], "assemble",
     "workload.speed is not a setting of workload=trace; allowed: name, path, format, "
     "tokenizer, max_in_flight"),
    (["workload=trace"], "requests",
     "workload.path must name a trace file (or data:NAME) for workload=trace"),
    (["workload=trace", "workload.path=t.jsonl", "workload.format=csv"], "requests",
     "workload.format must be one of tokens, mooncake, bailian, azure, sharegpt or null; "
     "got 'csv'"),
    (["arrival.kind=poisson"], "requests",
     "arrival.rate must be > 0 for arrival.kind=poisson, got None"),
    (["arrival.kind=poisson", "arrival.rate=fast"], "requests",
     "arrival.rate must be a number, got 'fast'"),
    (["+arrival.burst=3"], "requests",
     "arrival.burst is not a setting of arrival; allowed: kind, rate, time_scale, "
     "max_in_flight, max_concurrency"),
    (["hardware.flops=0"], "hardware", "hardware.flops must be > 0, got 0"),
    (["hardware.mem_bw=fast"], "hardware", "hardware.mem_bw must be a number, got 'fast'"),
    (["model.num_layers=0"], "model", "model.num_layers must be >= 1, got 0"),
    (["cache=custom", "cache.target=no_such_module.Cache"], "assemble",
     "cache.target=no_such_module.Cache: cannot import no_such_module (No module named "
     "'no_such_module'); is its folder on PYTHONPATH or the working directory?"),
    (["cost_model=fitted"], "cost_model",
     "cost_model.path is required with cost_model=fitted (a YAML file written by "
     "testbed.sim.cost_model.save_fitted)"),
    (["router.network_delay_s=-1"], "router", "router.network_delay_s must be >= 0, got -1.0"),
    (["router=cache_aware", "router.load=bytes"], "router",
     "router.load must be one of tokens, requests; got 'bytes'"),
    (["backend=replay", "cache.reuse=blend"], "assemble",
     "cache.reuse=blend / cache.match=semantic need backend=sim or engine (replay has no "
     "prefill steps to reuse KV in)"),
    (["seed=-1"], "assemble", "seed must be >= 0, got -1"),
    # found by the fuzzer (issue 58): refused once the workload was generated, or not at all
    (["backend=engine", "model=tiny", "speculative.method=draft", "speculative.draft_layers=2",
      "scheduler.overlap=false"], "assemble",
     "speculative.draft_layers must be in 1..1 (the model has 2 layers); got 2"),
    (["model=llama3_70b", "hardware=a10g"], "assemble",
     "model does not fit: weights 35.28 GB per GPU (llama3_70b, tp=4) > memory × mem_fraction "
     "21.73 GB (a10g: 24.15 GB × 0.9); raise model.tp or pick a larger device"),
    (["backend=engine", "model=tiny", "engine.device=cpu", "engine.attention=triton"], "assemble",
     "engine.attention=triton runs Triton kernels, which need a CUDA device, not cpu: use torch, "
     "cascade or cascade_torch there (or set TRITON_INTERPRET=1, Triton's interpreter, slow)"),
    (["seed=${oc.env:TESTBED_NO_SUCH_VARIABLE}"], "assemble",
     "seed: KeyError raised while resolving interpolation: \"Environment variable "
     "'TESTBED_NO_SUCH_VARIABLE' not found\""),
    (["workload.num_sessions_typo=3"], "compose",
     "workload.num_sessions_typo is not a setting of workload=chat; allowed: name, "
     "num_sessions, turns, system_prompt_len, min_question_len, max_question_len, "
     "min_output_len, max_output_len, think_time_s, vocab_size; did you mean num_sessions?"),
    (["workload=chat_lnog"], "compose",
     "workload must be one of beam_search, chat, chat_long, chat_tenants, copy_text, custom, "
     "few_shot, few_shot_text, mixed, multimodal, paraphrase, paraphrase_text, rag, rag_text, "
     "random_tree, self_consistency, shared_prefix, sharegpt, sharegpt_chat, trace, "
     "tree_of_thought; got 'chat_lnog'; did you mean chat_long?"),
    (["engine.cpu_kv_cache_gib=0"], "assemble",
     "engine.cpu_kv_cache_gib must be a number > 0 (GiB of KV a server's pool holds on a CPU), "
     "got 0"),
    (["engine.cpu_kv_cache_gib=lots"], "assemble",
     "engine.cpu_kv_cache_gib must be a number > 0 (GiB of KV a server's pool holds on a CPU), "
     "got 'lots'"),
    (["cache.size=100"], "compose",  # spelled nearest page_size, meant as the pool's size
     "cache.size is not a setting of cache=radix; allowed: name, capacity_tokens, page_size, "
     "evict_unit, split_recency, host_tokens, disk_tokens, write_policy, write_threshold, "
     "host_eviction, disk_eviction, load_back, host_link, disk_link, reuse, recompute_ratio, "
     "chunk_boundaries, match, similarity_threshold; did you mean capacity_tokens?"),
]


def test_a_word_for_a_key_suggests_the_key_it_means_where_that_key_is_allowed():
    """`INTENTS` first (issue 60: ``size`` suggested ``page_size``), else the nearest spelling."""
    cache = ["capacity_tokens", "page_size", "evict_unit"]
    assert did_you_mean("size", cache) == "; did you mean capacity_tokens?"
    assert did_you_mean("Cache-Size", cache) == "; did you mean capacity_tokens?"
    assert did_you_mean("page", cache) == "; did you mean page_size?"
    assert did_you_mean("memory", ["name", "memory_bytes", "mem_fraction"]) == \
        "; did you mean memory_bytes?"  # no capacity_tokens here: spelling decides
    assert did_you_mean("size", ["name", "page_size"]) == "; did you mean page_size?"
    assert did_you_mean("zzz", cache) == ""


def test_triton_attention_on_a_head_dim_its_kernels_cannot_take_is_refused_before_loading(
        compose, monkeypatch):
    """Found by the fuzzer (issue 58): the engine stopped at its first step instead."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels run here: only the shape is wrong
    with pytest.raises(BadInput) as refused:
        assemble(compose(*SMALL, "backend=engine", "model=tiny", "model.num_heads=8",
                         "model.head_dim=8", "engine.attention=cascade_triton"))
    assert str(refused.value) == (
        "engine.attention=cascade_triton runs Triton kernels, which need model.head_dim a power "
        "of two >= 16 (a tl.dot dimension), got 8: use torch or cascade_torch")


@pytest.mark.parametrize("overrides, stage, message", CONFIG_CASES,
                         ids=[" ".join(c[0]) for c in CONFIG_CASES])
def test_a_bad_config_value_is_bad_input_naming_the_key(compose, monkeypatch, overrides, stage,
                                                        message):
    monkeypatch.delenv("TESTBED_NO_SUCH_VARIABLE", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as outside the test suite
    with pytest.raises(BadInput) as refused:
        small = [] if any(o.startswith("workload=") for o in overrides) else SMALL
        run = assemble(compose(*small, *overrides))
        STAGES[stage](run)
        pytest.fail(f"{stage} accepted {overrides}")
    assert str(refused.value) == message
    assert failure_kind(refused.value) == "bad_input"


# (format, file contents, the message after "PATH:")
TRACE_CASES = [
    ("tokens", b'{"prompt": [1, 2], "output": [3]}\nnot json\n',
     "2: not valid JSON (Expecting value)"),
    ("tokens", b'[1, 2, 3]\n', "1: expected a JSON object"),
    ("tokens", b'{"prompt": [1, -2], "output": [3]}\n', "1: prompt: token ids must lie in [0, 2^31), got -2 at position 1"),
    ("tokens", b'{"prompt": [1, 2]}\n', "1: missing field 'output' (or 'max_new_tokens')"),
    ("tokens", b'{"prompt": [1], "output": [2], "max_new_tokens": 4}\n',
     "1: give 'output' (replayed) or 'max_new_tokens' (generated by the engine), not both"),
    ("tokens", b'{"prompt": [1], "output": [2]}\n{"prompt": "\xff"}\n',
     "2: not UTF-8 text (invalid start byte at byte 12 of the line)"),
    ("mooncake", b'{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0, 1]}\n',
     "1: 2 hash_ids for input_length 10 (expected ceil(10/512))"),
    ("bailian", b'{"parent_chat_id": -1, "timestamp": 0}\n', "1: missing field 'chat_id'"),
    ("azure", b"TIMESTAMP,ContextTokens\n",
     "1: expected the header TIMESTAMP,ContextTokens,GeneratedTokens, got 'TIMESTAMP,ContextTokens'"),
    ("azure", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,ten,5\n",
     "2: ContextTokens must be a non-negative integer, got 'ten'"),
]


@pytest.mark.parametrize("fmt, contents, message", TRACE_CASES,
                         ids=[f"{c[0]}-{c[2][:30]}" for c in TRACE_CASES])
def test_a_malformed_trace_is_bad_input_naming_file_and_line(tmp_path, fmt, contents, message):
    path = tmp_path / "trace.txt"
    path.write_bytes(contents)
    with pytest.raises(BadInput) as refused:
        load_trace(path, fmt)
    assert str(refused.value) == f"{path}:{message}"


def test_a_missing_trace_file_is_bad_input_naming_workload_path(tmp_path, compose):
    missing = tmp_path / "missing.jsonl"
    run = assemble(compose("workload=trace", f"workload.path={missing}"))
    with pytest.raises(BadInput) as refused:
        run.requests()
    assert str(refused.value) == f"workload.path: no such file: {missing}"


def test_a_broken_internal_invariant_is_not_bad_input():
    cache = RadixCache(100)
    prompt = np.arange(1, 6, dtype=np.int32)
    lease = cache.acquire(prompt)
    cache.extend(lease, 3)
    with pytest.raises(ValueError, match=r"^release: 5 tokens for a lease of 3 slots$") as broken:
        cache.release(lease, prompt)
    assert not isinstance(broken.value, BadInput)
    assert failure_kind(broken.value) == "internal"


@pytest.mark.parametrize("overrides, message", [
    (["backend=replay", "replicas=2"], "replicas > 1 needs backend=sim (replay serves one cache)"),
    (["backend=engine", "model=tiny", "replicas=2"],
     "replicas=2 needs backend=sim; the engine serves one replica"),
    (["replicas=2", "cache.host_tokens=64"], "cache.host_tokens / cache.disk_tokens need replicas=1"),
    (["replicas=2", "cache.reuse=blend"],
     "cache.reuse=blend / cache.match=semantic need replicas=1"),
])
def test_replicas_that_cannot_run_are_refused_before_the_workload_is_generated(
        compose, monkeypatch, overrides, message):
    import testbed.config.builders

    def generated(*args, **kwargs):
        raise AssertionError("the workload was generated before the config was checked")

    monkeypatch.setattr(testbed.config.builders, "build_workload", generated)
    from testbed.execute import execute

    with pytest.raises(BadInput) as refused:
        execute(compose(*overrides), "/nonexistent-run-dir")
    assert str(refused.value) == message


def test_a_call_waiting_for_another_programs_call_is_refused(tmp_path, compose):
    # It used to stop the simulator with "min() arg is an empty sequence" (its program had no
    # call to start with).
    path = tmp_path / "trace.jsonl"
    path.write_text('{"id": "a", "prompt": [1, 2, 3], "output": [4]}\n'
                    '{"id": "b", "prompt": [1, 2, 3, 4, 5], "output": [6], "after": ["a"]}\n')
    run = assemble(compose("workload=trace", f"workload.path={path}", "workload.format=tokens"))
    with pytest.raises(BadInput) as refused:
        run.requests()
    assert str(refused.value) == (f"{path}:2: request b waits for a ('after') of another program "
                                  "('a', not 'b'); calls that wait for each other must share a "
                                  "'program'")


def test_every_option_of_a_few_names_is_refused_in_one_format():
    """`check_choice`, the one check of an option that takes one of a few names: the key, the
    names allowed (null last where it is allowed), the value and the closest name, if any."""
    check_choice("cache.reuse", "blend", ("prefix", "blend"))
    check_choice("clock", None, ("wall", "cpu"), null=True)
    with pytest.raises(BadInput) as refused:
        check_choice("cache.reuse", "blnd", ("prefix", "blend"))
    assert str(refused.value) == ("cache.reuse must be one of prefix, blend; got 'blnd'; "
                                  "did you mean blend?")
    with pytest.raises(BadInput) as refused:
        check_choice("clock", "gpu", ("wall", "cpu"), null=True)
    assert str(refused.value) == ("clock must be one of wall, cpu or null; got 'gpu'; "
                                  "did you mean cpu?")
    with pytest.raises(BadInput, match=r"^model.dtype_bytes must be one of 1, 2, 4; got 3$"):
        check_choice("model.dtype_bytes", 3, (1, 2, 4))
    with pytest.raises(ValueError) as defect:  # a caller's own defect stays a plain ValueError
        check_choice("linear kind", "fast", ("torch", "onednn"), error=ValueError)
    assert failure_kind(defect.value) == "internal"
