"""The load test of the server (`experiments.benchmarks.serve_load`), small: 4 clients, 32
requests, a quarter going away (half mid-stream, half not streaming, as soon as the server read
their body) and a quarter malformed (every kind once): none lost or answered twice, every
malformed one a JSON 4xx, the server answering no 5xx (its own counts: a client that left cannot
see its answer) and 499 to each non-streaming client that left, /health never failing, no lease
or lock left and the cache's invariants holding after every step and at the end. The server is
in this process on a free loopback port, polled until ready and, at the end, until idle."""

from __future__ import annotations

import pytest

from experiments.benchmarks.serve_load import MALFORMED, failures, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_small_load_with_both_kinds_of_disconnect_loses_nothing_and_leaks_no_lock():
    summary, _ = run(clients=4, requests=32, disconnect=0.25, malformed=0.25, seed=1,
                     overrides=["debug.check_invariants=true"], in_process=True)
    assert failures(summary) == []
    assert (summary["requests"], summary["malformed"], summary["disconnects"],
            summary["gone"]) == (32, 8, 4, 4)
    assert summary["malformed"] == len(MALFORMED)  # each kind once
    assert summary["completed"] == summary["well_formed"] == 16
    assert (summary["answered_499"], summary["answered_5xx"], summary["unanswered"]) == (4, 0, 0)
    # every request the server took for a client that left was cut off, none finished
    assert summary["aborted_by_server"] == summary["submitted"] - summary["well_formed"] >= 4
    assert summary["lost"] == summary["duplicated_ids"] == 0
    assert (summary["leases_at_end"], summary["locked_tokens_at_end"]) == (0, 0)
