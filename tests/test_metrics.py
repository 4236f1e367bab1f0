"""The run summary's cold/warm split: TTFT of requests that found under half their prompt cached
(cold) against the others (warm), so that LPM's starving of cold requests shows in summary.json."""

from testbed.cache.radix import RadixCache
from testbed.results.metrics import RequestRecord, cold_warm_summary, is_cold, summarize
from testbed.backends.replay import replay
from testbed.workloads import Request

from tests.conftest import toks


def rec(i: int, prompt: int, cached: int, ttft: float | None, aborted: bool = False,
        arrival: float = 0.0) -> RequestRecord:
    """A served request arriving at ``arrival``, first token ``ttft`` later, done 1 s after."""
    first = None if ttft is None else arrival + ttft
    return RequestRecord(id=str(i), program=None, arrival_s=arrival, first_token_s=first,
                         finish_s=None if first is None else first + 1.0, prompt_tokens=prompt,
                         cached_tokens=cached, output_tokens=2, evicted_tokens=0, inserted=True,
                         aborted=aborted)


# 4 cold (hit < half the prompt), 3 warm, and an aborted cold one with a huge TTFT to be ignored.
COLD = [rec(0, 100, 0, 1.0), rec(1, 100, 49, 3.0, arrival=2.0), rec(2, 10, 4, 8.0),
        rec(3, 9, 4, 8.0, arrival=0.5)]
WARM = [rec(4, 100, 50, 0.25), rec(5, 10, 10, 0.5), rec(6, 9, 5, 0.5, arrival=1.0)]
ABORTED = rec(7, 100, 0, 100.0, aborted=True)


def test_a_request_is_cold_below_half_its_prompt_cached_and_warm_from_exactly_half():
    assert [is_cold(r) for r in COLD] == [True, True, True, True]
    assert [is_cold(r) for r in WARM] == [False, False, False]
    assert is_cold(rec(8, 10, 5, 1.0)) is False  # hit == prompt / 2 is warm
    assert is_cold(rec(9, 9, 4, 1.0)) is True  # 4 < 4.5


def test_cold_and_warm_ttft_percentiles_are_exact_on_hand_built_records():
    s = summarize([*COLD, *WARM, ABORTED], ideal=0.0, wall_s=0.0)
    assert s["cold_requests"] == 4
    assert s["ttft_p50_cold_s"] == 5.5  # median of 1, 3, 8, 8
    assert s["ttft_p99_cold_s"] == 8.0
    assert s["ttft_p99_warm_s"] == 0.5  # of 0.25, 0.5, 0.5
    assert s["ttft_p99_s"] == 8.0 and s["aborted_requests"] == 1


def test_the_split_uses_the_same_percentiles_as_the_overall_ttft():
    every = [*COLD, *WARM]
    assert cold_warm_summary(COLD)["ttft_p50_cold_s"] == summarize(COLD, 0.0, 0.0)["ttft_p50_s"]
    assert cold_warm_summary(every)["ttft_p99_warm_s"] == summarize(WARM, 0.0, 0.0)["ttft_p99_s"]


def test_a_group_without_requests_has_null_percentiles():
    assert cold_warm_summary(WARM) == {"cold_requests": 0, "ttft_p50_cold_s": None,
                                       "ttft_p99_cold_s": None, "ttft_p99_warm_s": 0.5}
    assert cold_warm_summary(COLD)["ttft_p99_warm_s"] is None
    assert cold_warm_summary([]) == {"cold_requests": 0, "ttft_p50_cold_s": None,
                                     "ttft_p99_cold_s": None, "ttft_p99_warm_s": None}
    assert cold_warm_summary([ABORTED])["cold_requests"] == 0


def test_replay_counts_cold_requests_but_has_no_ttft():
    requests = [Request(id=str(i), prompt=toks(1, 2, 3, 4, i + 10), output=toks(7))
                for i in range(3)]
    s = summarize(replay(requests, RadixCache(None)), ideal=0.0, wall_s=0.0)
    assert s["cold_requests"] == 1  # the first; the others hit 4 of 5 prompt tokens
    assert s["ttft_p50_s"] is None
    assert (s["ttft_p50_cold_s"], s["ttft_p99_cold_s"], s["ttft_p99_warm_s"]) == (None, None, None)


def test_a_record_stores_only_what_differs_from_the_defaults_and_reads_the_rest_from_its_class():
    import copy
    import dataclasses
    import pickle
    import sys

    plain = RequestRecord("a", None, 0.0, None, None, 5, 2, 3, 0, True)
    assert sys.getsizeof(plain) < 150  # the ten core slots and a __dict__ pointer, not 32 slots
    assert (plain.preemptions, plain.aborted, plain.prompt_ids, plain.failed) == (0, False, None,
                                                                                   False)
    preempted = RequestRecord("a", None, 0.0, None, None, 5, 2, 3, 0, True, preemptions=2)
    assert vars(preempted) == {"preemptions": 2} and vars(plain) == {}
    assert preempted != plain == copy.copy(plain)
    assert dataclasses.replace(plain, preemptions=2) == preempted
    assert pickle.loads(pickle.dumps(preempted)) == preempted
    assert RequestRecord(**dataclasses.asdict(preempted)) == preempted
    plain.prompt_ids, plain.output_ids = [1, 2], [3]  # set later: lives in the record
    assert plain.to_json()["prompt_ids"] == [1, 2] and RequestRecord.prompt_ids is None
