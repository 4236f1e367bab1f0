"""The ideal hit rate of a kept trace is counted once a process (`testbed.workloads.ideal`):
the same read-only arrays in the same order give the kept rate, anything else is counted."""

import json

import numpy as np
import pytest

import testbed.workloads.ideal as ideal
from testbed.workloads.request import Request
from testbed.workloads.traces import load_trace


@pytest.fixture
def counted(monkeypatch):
    """The tries `ideal_hit_rate` builds, counted (the kept rate from earlier tests dropped)."""
    calls = []
    real = ideal.ideal_hits
    monkeypatch.setattr(ideal, "ideal_hits", lambda rs: calls.append(1) or real(rs))
    monkeypatch.setattr(ideal, "_KEPT", [])
    return calls


def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": [1, 2, 3, 4], "output": [5]}, {"prompt": [1, 2, 3, 9], "output": [6]},
        {"prompt": [1, 2, 7], "output": []})))
    return path


def test_a_kept_traces_ideal_is_counted_once_for_every_load_of_it(tmp_path, counted):
    path = trace(tmp_path)
    # hits 0, 3, 2 of 4 + 4 + 3 prompt tokens
    assert ideal.ideal_hit_rate(load_trace(path)) == 5 / 11
    assert ideal.ideal_hit_rate(load_trace(path)) == 5 / 11  # the next job's own copies
    assert len(counted) == 1


def test_another_order_or_subset_of_the_same_arrays_is_counted_anew(tmp_path, counted):
    requests = load_trace(trace(tmp_path))
    assert ideal.ideal_hit_rate(requests) == 5 / 11
    assert ideal.ideal_hit_rate(requests[::-1]) == 5 / 11  # 0, 2 of 4 (prompt [1,2,3,9]), 3
    assert ideal.ideal_hit_rate(requests[1:]) == 2 / 7
    assert ideal.ideal_hit_rate(requests) == 5 / 11
    assert len(counted) == 4


def test_writable_arrays_are_counted_every_time(counted):
    a = Request(id="a", prompt=np.array([1, 2], np.int32), output=np.array([3], np.int32))
    b = Request(id="b", prompt=np.array([1, 2, 3, 4], np.int32), output=np.array([], np.int32))
    assert ideal.ideal_hit_rate([a, b]) == 3 / 6
    b.prompt[2] = 8  # writable: the tokens may change between two calls
    assert ideal.ideal_hit_rate([a, b]) == 2 / 6
    assert len(counted) == 2


def test_a_read_only_view_of_writable_memory_is_counted_every_time(counted):
    base = np.array([1, 2, 3, 4], np.int32)
    view = base[:3]
    view.flags.writeable = False
    a = Request(id="a", prompt=view, output=np.array([], np.int32))
    a.output.flags.writeable = False
    ideal.ideal_hit_rate([a, a])
    base[1] = 7  # changes the read-only view's tokens
    ideal.ideal_hit_rate([a, a])
    assert len(counted) == 2


def test_a_kept_rate_is_not_returned_once_its_arrays_are_gone(counted):
    def frozen(tokens):
        array = np.array(tokens, np.int32)
        array.flags.writeable = False
        return array

    first = [Request(id="a", prompt=frozen([1, 2]), output=frozen([3]))]
    assert ideal.ideal_hit_rate(first + first) == 2 / 4
    del first  # its ids may now name other arrays
    second = [Request(id="a", prompt=frozen([1, 2]), output=frozen([3])),
              Request(id="b", prompt=frozen([5, 6]), output=frozen([]))]
    assert ideal.ideal_hit_rate(second) == 0.0
    assert len(counted) == 2
