"""Trace formats (docs/design.md §3): token JSONL round trip, Mooncake block expansion, clear errors."""

import json

import numpy as np
import pytest

from testbed.workloads import build_workload
from testbed.workloads.synthetic import shared_prefix
from testbed.workloads.traces import TraceError, load_mooncake, load_tokens, save_tokens


def write_lines(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_generate_save_load_round_trip_is_identical(tmp_path):
    requests = shared_prefix(num_groups=2, prompts_per_group=3, system_prompt_len=20,
                             question_len=4, output_len=5, seed=7)
    save_tokens(requests, tmp_path / "t.jsonl")
    loaded = load_tokens(tmp_path / "t.jsonl")
    assert [(r.id, r.program, r.arrival_s, r.after) for r in loaded] == \
        [(r.id, r.program, r.arrival_s, r.after) for r in requests]
    for a, b in zip(loaded, requests):
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)


def test_tokens_trace_defaults_ids_to_line_order_and_arrival_to_zero(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", {"prompt": [1, 2], "output": [3], "program": "p"},
                       {"prompt": [4], "output": [], "after": ["0"], "arrival_s": 1.5,
                        "program": "p"})
    a, b = load_tokens(path)
    assert (a.id, a.arrival_s, b.id, b.after, b.arrival_s) == ("0", 0.0, "1", ["0"], 1.5)


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 1: not valid JSON"),
    ('{"output": [1]}', "line 1: missing field 'prompt'"),
    ('{"prompt": [1, -2], "output": []}', "token ids must lie in"),
    ('{"prompt": "abc", "output": []}', "field 'prompt' has the wrong type"),
    ('{"prompt": [1], "output": [], "arrival_s": -1}', "'arrival_s' must be a number >= 0"),
])
def test_malformed_token_trace_names_file_line_and_problem(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", line)
    with pytest.raises(TraceError) as err:
        load_tokens(path)
    assert str(path) in str(err.value) and message.replace("line 1", "") in str(err.value)
    if "line 1" in message:
        assert f"{path}:1" in str(err.value)


def test_missing_trace_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="workload.path: no such file"):
        load_tokens(tmp_path / "nope.jsonl")


def test_mooncake_blocks_become_512_tokens_determined_by_the_block_id(tmp_path):
    path = write_lines(tmp_path / "m.jsonl",
                       {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [5, 9]},
                       {"timestamp": 3000, "input_length": 600, "output_length": 2, "hash_ids": [5, 7]})
    a, b = load_mooncake(path)
    assert len(a.prompt) == 700 and len(b.prompt) == 600
    assert np.array_equal(a.prompt[:512], np.arange(5 * 512, 6 * 512))
    assert np.array_equal(a.prompt[512:], np.arange(9 * 512, 9 * 512 + 188))  # cut to remainder
    assert np.array_equal(a.prompt[:512], b.prompt[:512])
    assert (b.arrival_s, a.arrival_s) == (3.0, 0.0)
    # Outputs are fresh: above every block's tokens and unique across requests.
    assert a.output.min() >= 10 * 512
    assert len(set(a.output.tolist()) | set(b.output.tolist())) == 5


def test_mooncake_with_a_wrong_number_of_hash_ids_is_rejected(tmp_path):
    path = write_lines(tmp_path / "m.jsonl",
                       {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]})
    with pytest.raises(TraceError, match=r"m.jsonl:1: 2 hash_ids for input_length 1025"):
        load_mooncake(path)


def test_build_workload_orders_by_arrival_with_ties_in_file_order(tmp_path):
    path = write_lines(tmp_path / "t.jsonl",
                       {"id": "late", "prompt": [1], "output": [], "arrival_s": 2},
                       {"id": "a", "prompt": [1], "output": [], "arrival_s": 1},
                       {"id": "b", "prompt": [1], "output": [], "arrival_s": 1})
    requests = build_workload({"name": "trace", "path": str(path), "format": "tokens"})
    assert [r.id for r in requests] == ["a", "b", "late"]


def test_build_workload_rejects_unknown_names_and_formats():
    with pytest.raises(ValueError,
                       match="workload must be one of few_shot, chat, .*, mixed, trace, custom; "
                             "got .nope."):
        build_workload({"name": "nope"})
    with pytest.raises(ValueError, match="workload.format must be one of tokens, mooncake"):
        build_workload({"name": "trace", "path": "x", "format": "csv"})
    with pytest.raises(ValueError, match="workload.path must name a trace file"):
        build_workload({"name": "trace", "path": None})


def test_generator_is_deterministic_per_seed():
    a = shared_prefix(num_groups=2, prompts_per_group=2, seed=1)
    b = shared_prefix(num_groups=2, prompts_per_group=2, seed=1)
    c = shared_prefix(num_groups=2, prompts_per_group=2, seed=2)
    assert all(np.array_equal(x.prompt, y.prompt) for x, y in zip(a, b))
    assert not np.array_equal(a[0].prompt, c[0].prompt)
