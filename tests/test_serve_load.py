"""The load test of the server (`experiments.benchmarks.serve_load`), small: 4 clients, 24
requests, a fifth disconnecting mid-stream and a quarter malformed (every kind): none lost or
answered twice, every malformed one 4xx, /health never failing, no lease or lock left and the
cache's invariants holding after every step and at the end."""

from __future__ import annotations

import pytest

from experiments.benchmarks.serve_load import MALFORMED, failures, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_small_load_loses_nothing_and_leaks_no_lock():
    summary, _ = run(clients=4, requests=24, disconnect=0.2, malformed=0.25, seed=1,
                     overrides=["debug.check_invariants=true"], in_process=True)
    assert failures(summary) == []
    assert (summary["requests"], summary["malformed"], summary["disconnects"]) == (24, 6, 5)
    assert summary["malformed"] == len(MALFORMED)  # each kind once
    assert summary["completed"] == summary["well_formed"] == 13
    assert summary["aborted_by_server"] == 5  # each disconnect cut its request off
    assert summary["lost"] == summary["duplicated_ids"] == 0
    assert (summary["leases_at_end"], summary["locked_tokens_at_end"]) == (0, 0)
