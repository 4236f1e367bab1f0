"""``backend=server``: the workload sent to a live OpenAI-compatible server (here the test stub,
tests/openai_stub.py) and recorded as the other backends record (docs/design.md §3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.errors import BadInput
from testbed.execute import execute
from testbed.remote.backend import NOT_REPORTED
from testbed.workloads.ideal import ideal_hits
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.openai_stub import EOS, MODEL, StubServer, free_port, output_ids

REPO = Path(__file__).resolve().parents[1]

# a1 -> a2 (splices in a1's output, 0.05 s later) in program p; b alone; c generated (8 tokens)
TRACE = [
    {"id": "a1", "prompt": [1, 2, 3, 4], "output": [7, 7, 7], "program": "p"},
    {"id": "b", "prompt": [1, 2, 9], "output": [5, 5]},
    {"id": "a2", "prompt": [1, 2, 3, 4, {"output": "a1"}, 6], "output": [8, 8], "program": "p",
     "after": ["a1"], "think_time_s": 0.05},
    {"id": "c", "prompt": [1, 2, 3, 4, 5], "max_new_tokens": 8},
]


@pytest.fixture(scope="module")
def server():
    stub = StubServer().start()
    yield stub
    stub.stop()


@pytest.fixture
def stub(server):
    return server.reset()


def run(compose, tmp_path, stub, *overrides, trace=TRACE, notes=None):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in trace))
    cfg = compose("backend=server", f"server.url={stub.url}", "workload=trace",
                  f"workload.path={path}", "workload.format=tokens", "save_token_ids=true",
                  "arrival.max_concurrency=1", *overrides)
    out = tmp_path / "run"
    summary = execute(cfg, out, notes)
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return summary, {r["id"]: r for r in rows}, [r["id"] for r in rows]


def test_prompts_splice_in_the_outputs_the_server_returned(compose, tmp_path, stub):
    summary, rows, order = run(compose, tmp_path, stub)
    received = [b["prompt"] for b in stub.received]
    a1_out = output_ids([1, 2, 3, 4], 3)
    # one call at a time, in arrival order; a2 waits for a1 (and its think time) behind b and c
    assert received == [[1, 2, 3, 4], [1, 2, 9], [1, 2, 3, 4, 5], [1, 2, 3, 4, *a1_out, 6]]
    assert order == ["a1", "b", "c", "a2"]
    assert rows["a2"]["prompt_ids"] == [1, 2, 3, 4, *a1_out, 6]
    assert rows["a1"]["output_ids"] == a1_out
    assert rows["a2"]["arrival_s"] >= rows["a1"]["finish_s"] + 0.05
    # the server's cached tokens, call by call, and the ideal hit rate of what ran
    assert [rows[i]["cached_tokens"] for i in order] == stub.cached == [0, 2, 4, 7]
    assert summary["cached_tokens"] == 13 and summary["prompt_tokens"] == 4 + 3 + 5 + 8
    assert summary["hit_rate"] == summary["ideal_hit_rate"] == 13 / 20
    assert (summary["backend"], summary["cache"], summary["eviction"]) == ("server",) * 3
    assert (summary["server_url"], summary["server_model"]) == (stub.url, MODEL)


def test_calls_one_at_a_time_share_one_connection(compose, tmp_path, stub):
    """Each call reads its stream to the end after ``[DONE]``, which hands its connection back
    to the pool for the next (closed with bytes unread, httpx drops it: a connection a call)."""
    run(compose, tmp_path, stub)
    assert len(stub.peers) == 4 and len(set(stub.peers)) == 1


def test_forced_lengths_ask_for_exactly_the_workloads_output(compose, tmp_path, stub):
    run(compose, tmp_path, stub)
    sent = {tuple(b["prompt"][:5]): b for b in stub.received}
    a1, c = stub.received[0], stub.received[2]
    assert (a1["max_tokens"], a1["ignore_eos"], a1["min_tokens"]) == (3, True, 3)
    assert "ignore_eos" not in c and "min_tokens" not in c and c["max_tokens"] == 8  # generated
    assert all(b["stream"] and b["return_token_ids"] and b["model"] == MODEL
               and b["stream_options"] == {"include_usage": True}
               and (b["temperature"], b["top_p"]) == (0.0, 1.0) for b in sent.values())


def test_generation_stops_at_eos_and_later_prompts_carry_what_was_generated(compose, tmp_path,
                                                                          stub):
    stub.reset(eos_after=2)
    summary, rows, _ = run(compose, tmp_path, stub, "forced=false", "temperature=0.5")
    a1 = stub.received[0]
    assert a1["max_tokens"] == 3 and "ignore_eos" not in a1 and a1["temperature"] == 0.5
    a1_out = [output_ids([1, 2, 3, 4], 3)[0], EOS]
    assert rows["a1"]["output_ids"] == a1_out and rows["a1"]["output_tokens"] == 2
    assert stub.received[3]["prompt"] == [1, 2, 3, 4, *a1_out, 6]
    assert summary["forced"] is False


def test_records_time_every_token(compose, tmp_path, stub):
    summary, rows, _ = run(compose, tmp_path, stub)
    for r in rows.values():
        assert r["status"] == 200 and r["error"] is None and r["failed"] is False
        assert len(r["itl_s"]) == r["output_tokens"] - 1
        assert r["arrival_s"] <= r["first_token_s"] <= r["finish_s"]
    assert summary["failed_requests"] == 0 and summary["cached_tokens_reported"] is True
    for key in ("ttft_p50_s", "tpot_p50_s", "tpot_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s",
                "makespan_s", "throughput_tok_s"):
        assert summary[key] > 0, key


def test_a_failed_call_is_recorded_and_the_run_goes_on(compose, tmp_path, stub):
    stub.reset(fail={0: (500, "boom"), 1: (400, "prompt too long")})
    notes: list[str] = []
    summary, rows, _ = run(compose, tmp_path, stub, notes=notes)
    assert (rows["a1"]["status"], rows["a1"]["error"], rows["a1"]["failed"]) == (500, "boom", True)
    assert (rows["b"]["status"], rows["b"]["error"]) == (400, "prompt too long")
    assert rows["a1"]["cached_tokens"] is None and rows["a1"]["output_tokens"] == 0
    # a2 still ran, splicing in a1's workload output in place of the answer it never got
    assert stub.received[3]["prompt"] == [1, 2, 3, 4, 7, 7, 7, 6]
    assert rows["a2"]["failed"] is False and summary["failed_requests"] == 2
    assert summary["num_requests"] == 4 and summary["hit_rate"] == 4 / 13  # c and a2 only
    assert notes[0].startswith("2 of 4 requests failed") and "HTTP 500: boom" in notes[0]


def test_a_run_whose_every_call_failed_stops_in_one_line_naming_the_first(compose, tmp_path,
                                                                          stub):
    """It used to end with exit 0 and a summary of nothing (issue 44: 30/30 calls refused)."""
    stub.reset(fail={i: (400, "token id 25968 at position 3 is outside the model's\nvocabulary")
                     for i in range(4)})
    with pytest.raises(BadInput) as refused:
        run(compose, tmp_path, stub)
    assert str(refused.value) == (
        f"all 4 calls to the server at {stub.url} failed, so the run measured nothing; the "
        "first, a1: HTTP 400: token id 25968 at position 3 is outside the model's vocabulary")


def test_a_generated_workload_keeps_its_token_ids_in_the_models_vocabulary(compose, tmp_path,
                                                                           stub):
    """As on the engine (`testbed.config.assembly.fit_vocabulary`): model=tiny names a server of 256
    tokens, so tree-of-thought draws its ids from those, not from its 32,000."""
    from testbed.config.assembly import assemble

    cfg = compose("backend=server", f"server.url={stub.url}", "model=tiny",
                  "workload=tree_of_thought", "workload.num_problems=1")
    run = assemble(cfg)
    assert run.notes == ["note: workload.vocab_size 32000 > model vocabulary 256; using 256"]
    requests = run.requests()
    assert max(int(r.sequence().max()) for r in requests) < 256
    execute(cfg, tmp_path)
    assert max(stub.received[0]["prompt"]) < 256  # the first call splices in no server output


def test_a_broken_stream_fails_that_call_only(compose, tmp_path, stub):
    stub.reset(break_after={0: 1})
    _, rows, _ = run(compose, tmp_path, stub)
    assert rows["a1"]["failed"] and rows["a1"]["error"].startswith("the stream broke: ")
    assert rows["a1"]["status"] == 200 and rows["a1"]["output_ids"] == output_ids([1, 2, 3, 4], 1)
    assert not any(rows[i]["failed"] for i in ("b", "c", "a2"))


def test_a_call_past_its_timeout_fails(compose, tmp_path, stub):
    stub.reset(delay_s={1: 0.5})
    _, rows, _ = run(compose, tmp_path, stub, "server.timeout_s=0.1")
    assert rows["b"]["failed"] and rows["b"]["error"] == "timed out after 0.1 s (server.timeout_s)"
    assert not rows["c"]["failed"]


def test_unreported_cached_tokens_give_a_null_hit_rate_and_a_note(compose, tmp_path, stub):
    stub.reset(report_cached=False)
    notes: list[str] = []
    summary, rows, _ = run(compose, tmp_path, stub, notes=notes)
    assert all(r["cached_tokens"] is None for r in rows.values())
    assert summary["hit_rate"] is None and summary["cached_tokens"] is None
    assert summary["cached_tokens_reported"] is False
    assert notes == [f"note: {NOT_REPORTED}"]
    assert "--enable-prompt-tokens-details" in NOT_REPORTED and "--enable-cache-report" in NOT_REPORTED


def test_without_output_ids_only_workloads_that_splice_no_outputs_run(compose, tmp_path, stub):
    stub.reset(send_token_ids=False)
    with pytest.raises(BadInput, match=r"sends no output token ids .* request a2's prompt"):
        run(compose, tmp_path, stub)
    stub.reset(send_token_ids=False)
    summary, rows, _ = run(compose, tmp_path, stub, trace=TRACE[:2])
    assert rows["a1"]["output_tokens"] == 3 and rows["a1"]["output_ids"] == []
    assert summary["hit_rate"] == 2 / 7


PREFILL_TRACE = [{"id": "fork", "prompt": [1, 2, 3, 4, 5], "output": []},
                 {"id": "x", "prompt": [1, 2, 3, 4, 5, 6], "output": [9, 9]}]


def test_a_prefill_only_call_asks_for_zero_tokens_by_default(compose, tmp_path, stub):
    _, rows, _ = run(compose, tmp_path, stub, trace=PREFILL_TRACE)
    assert [b["max_tokens"] for b in stub.received] == [0, 2]
    assert rows["fork"]["output_ids"] == [] and not rows["fork"]["failed"]
    stub.reset(refuse_zero=True)  # as vLLM: that call fails, the run goes on
    summary, rows, _ = run(compose, tmp_path, stub, trace=PREFILL_TRACE)
    assert rows["fork"]["failed"] and "at least 1" in rows["fork"]["error"]
    assert summary["failed_requests"] == 1


def test_a_prefill_only_call_sent_as_one_token_records_none(compose, tmp_path, stub):
    stub.reset(refuse_zero=True)
    summary, rows, _ = run(compose, tmp_path, stub, "server.prefill_only=one_token",
                           trace=PREFILL_TRACE)
    fork, x = stub.received
    assert (fork["max_tokens"], fork["ignore_eos"], fork["min_tokens"]) == (1, True, 1)
    assert x["max_tokens"] == 2  # only output length 0 changes
    assert rows["fork"]["output_ids"] == [] and rows["fork"]["output_tokens"] == 0
    assert rows["fork"]["first_token_s"] is None and not rows["fork"]["failed"]
    assert rows["x"]["cached_tokens"] == 5 and summary["failed_requests"] == 0


def test_the_server_keys_are_checked_before_anything_runs(compose):
    from testbed.config.assembly import assemble
    with pytest.raises(BadInput, match=r"^backend=server needs the server's address: "
                                       r"server.url=http://HOST:PORT$"):
        assemble(compose("backend=server"))
    with pytest.raises(BadInput, match=r"^server.url must be a URL like http://HOST:PORT"):
        assemble(compose("backend=server", "server.url=localhost:8000"))
    with pytest.raises(BadInput, match=r"^server.timeout_s must be > 0 \(seconds\) or null"):
        assemble(compose("backend=server", "server.url=http://h:1", "server.timeout_s=0"))
    with pytest.raises(BadInput, match=r"^server.prefill_only must be one of zero, one_token"):
        assemble(compose("backend=server", "server.url=http://h:1", "server.prefill_only=2"))
    with pytest.raises(BadInput, match=r"^cache.reuse .* do not apply to backend=server"):
        assemble(compose("backend=server", "server.url=http://h:1", "cache.reuse=blend"))


def test_a_refused_connection_stops_the_run_in_one_line_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run([sys.executable, "-m", "testbed.run", "backend=server",
                           f"server.url={url}", "workload.num_problems=1",
                           f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: cannot reach the server at {url}: ")


def test_the_client_reaches_the_ideal_on_a_generated_workload(compose, tmp_path, stub):
    cfg = compose("backend=server", f"server.url={stub.url}", "workload.num_problems=2",
                  "arrival.max_concurrency=1")
    summary = execute(cfg, tmp_path)
    assert summary["num_requests"] == len(stub.received) == 2 * (15 + 7)
    sent = [Request(id=str(i), prompt=toks(*b["prompt"]), output=toks(*h[len(b["prompt"]):]))
            for i, (b, h) in enumerate(zip(stub.received, stub.history))]
    assert stub.cached == ideal_hits(sent)
    assert summary["hit_rate"] == pytest.approx(summary["ideal_hit_rate"])


def test_a_connection_refused_mid_run_stops_it_naming_the_url():
    import asyncio

    from testbed.remote.openai_client import OpenAIClient, ServerUnreachable, completion_body
    from testbed.remote.settings import ServerSettings

    url = f"http://127.0.0.1:{free_port()}"

    async def one_call():
        async with OpenAIClient(ServerSettings(url)) as client:
            return await client.complete(completion_body(MODEL, [1, 2], 2, True, 0.0, 1.0))

    with pytest.raises(ServerUnreachable, match=rf"^cannot reach the server at {url}: "):
        asyncio.run(one_call())


def peak_outstanding(rows: dict) -> int:
    """The most calls outstanding at once: sent (``arrival_s``) to the stream's end."""
    events = sorted([(r["arrival_s"], 1) for r in rows.values()]
                    + [(r["finish_s"], -1) for r in rows.values()])
    now = peak = 0
    for _, delta in events:  # an end sorts before a start at the same instant
        now += delta
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("concurrency, peak", [(2, 2), (None, None)])
def test_call_slots_bound_the_calls_outstanding(compose, tmp_path, stub, concurrency, peak):
    cfg = compose("backend=server", f"server.url={stub.url}", "workload.num_problems=2",
                  f"arrival.max_concurrency={'null' if concurrency is None else concurrency}")
    execute(cfg, tmp_path)
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "requests.jsonl").open())}
    if peak is None:
        assert peak_outstanding(rows) > 2  # the two problems' forks at once
    else:
        assert peak_outstanding(rows) == peak


def test_a_closed_loop_runs_one_program_after_another(compose, tmp_path, stub):
    cfg = compose("backend=server", f"server.url={stub.url}", "workload.num_problems=3",
                  "arrival.max_in_flight=1")
    execute(cfg, tmp_path)
    programs = [json.loads(line)["program"] for line in (tmp_path / "requests.jsonl").open()]
    assert programs == sorted(programs) and len(set(programs)) == 3


def test_error_bodies_of_the_usual_servers_give_their_message():
    from testbed.remote.openai_client import error_message

    assert error_message(400, '{"error": {"message": "too long", "code": 400}}') == "too long"
    assert error_message(400, '{"object": "error", "message": "bad max_tokens"}') == \
        "bad max_tokens"
    assert error_message(422, '{"detail": [{"loc": ["body"], "msg": "x"}]}') == \
        '[{"loc": ["body"], "msg": "x"}]'
    assert error_message(502, "Bad Gateway\n") == "Bad Gateway"
    assert error_message(500, "") == "HTTP 500"
