"""The HTTP server (`python -m testbed.serve`, `testbed/api/`) on the tiny random Llama: answers
equal offline greedy generation token for token, streamed or not; usage reports the exact shared
prefix as cached; stop rules; every malformed request gets a 4xx naming what is wrong; a client
that goes away mid-stream has its request aborted and the server stays healthy, drained, with no
lock left; past ``serve.max_queue`` a request gets 429. Servers start on a free loopback port and
are polled at ``/health`` (`testbed.api.server.start_server`)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import numpy as np
import pytest

from testbed.api.server import start_server
from testbed.config.assembly import compose_config
from testbed.execute import execute

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = ["model=tiny", "device=cpu", "cache.capacity_tokens=384",
        "scheduler.chunked_prefill_size=32"]
rng = np.random.default_rng(30)
SYSTEM = rng.integers(0, 256, 40).tolist()  # a shared prefix


def tokens(n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def server():
    handle = start_server(TINY)
    yield handle
    handle.stop()


def post(server, path: str, body, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=timeout)


def completion(server, prompt, **fields) -> dict:
    r = post(server, "/v1/completions", {"prompt": prompt, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, prompt, **fields) -> list[dict]:
    body = {"prompt": prompt, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **fields}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def state(server) -> dict:
    return httpx.get(server.url + "/debug/state", timeout=30).json()


def wait_until(what, deadline_s: float = 30.0):
    """Poll ``what()`` until it returns a true value (or fail after ``deadline_s``)."""
    end = time.monotonic() + deadline_s
    while not (found := what()):
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)
    return found


def offline(tmp_path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """The same model generating the same prompts offline (backend=engine, forced=false)."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": max_new,
                                         "arrival_s": float(i)}) + "\n"
                             for i, p in enumerate(prompts)))
    execute(compose_config(["progress=false", "backend=engine", "hardware=cpu", "forced=false",
                            "workload=trace", f"workload.path={trace}", "save_token_ids=true",
                            *TINY]), tmp_path / "run")
    lines = (tmp_path / "run" / "requests.jsonl").read_text().splitlines()
    return [json.loads(line)["output_ids"] for line in lines]


def test_answers_equal_offline_greedy_generation_streamed_or_not(server, tmp_path):
    prompts = [SYSTEM + tokens(7), SYSTEM + tokens(50), tokens(12)]  # the second is chunked
    expected = offline(tmp_path, prompts, 9)
    for prompt, want in zip(prompts, expected):
        whole = completion(server, prompt, max_tokens=9)
        (c,) = whole["choices"]
        assert c["token_ids"] == want and c["finish_reason"] == "length"
        assert whole["prompt_token_ids"] == c["prompt_token_ids"] == prompt
        assert whole["usage"]["completion_tokens"] == 9
        chunks = streamed(server, prompt, max_tokens=9)
        assert chunks[0]["prompt_token_ids"] == prompt
        assert sum((ch["choices"][0]["token_ids"] for ch in chunks[:-1]), []) == want
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 9


def test_cached_tokens_is_the_exact_shared_prefix(server):
    prefix = tokens(33)
    first = completion(server, prefix + [1, 2, 3], max_tokens=2)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = completion(server, prefix + [4, 5], max_tokens=2)
    assert second["usage"] == {"prompt_tokens": 35, "completion_tokens": 2, "total_tokens": 37,
                               "prompt_tokens_details": {"cached_tokens": 33}}


def test_max_tokens_0_is_a_prefill_only_call_whose_prompt_is_cached(server):
    """SGLang's fork: the shared prompt computed once, nothing produced; later calls hit it."""
    prompt = tokens(40)
    first = completion(server, prompt, max_tokens=0)
    assert first["choices"][0]["token_ids"] == [] and first["choices"][0]["finish_reason"] == \
        "length"
    assert first["usage"]["completion_tokens"] == 0
    chunks = streamed(server, prompt + tokens(5), max_tokens=0)
    assert [c for chunk in chunks for choice in chunk["choices"] for c in choice["token_ids"]] \
        == []
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 40


def test_eos_ignore_eos_min_tokens_and_stop_token_ids(server):
    prompt = tokens(20)
    ids = completion(server, prompt, max_tokens=6)["choices"][0]["token_ids"]
    stop = ids[1]
    first = ids.index(stop)  # the first time the model writes it (index 0 or 1)

    def answer(**fields):
        c = completion(server, prompt, max_tokens=6, **fields)["choices"][0]
        return c["token_ids"], c["finish_reason"]

    assert answer(stop_token_ids=[stop]) == (ids[:first + 1], "stop")
    assert answer(stop_token_ids=[stop], min_tokens=6) == (ids, "length")
    engine = server.engine  # the tiny model has no EOS: make that token its EOS for a while
    before = engine.scheduler.eos_token_ids
    engine.scheduler.eos_token_ids = frozenset([stop])
    try:
        assert answer() == (ids[:first + 1], "stop")
        assert answer(ignore_eos=True) == (ids, "length")
        assert answer(ignore_eos=True, min_tokens=3) == (ids, "length")
    finally:
        engine.scheduler.eos_token_ids = before


MALFORMED = [
    ("not json", "{\"prompt\": [1, 2", 400,
     "the request body is not valid JSON: Expecting ',' delimiter: line 1 column 17 (char 16)"),
    ("nested too deeply", "[" * 100_000 + "]" * 100_000, 400,  # was a plain-text 500
     "the request body is not valid JSON: nested too deeply"),
    ("not an object", "[1, 2]", 400, "the request body must be a JSON object"),
    ("no prompt", {"max_tokens": 3}, 400,
     "prompt is required: a string, or a list of token ids (integers)"),
    ("a batch", {"prompt": [[1, 2], [3]]}, 400, "one prompt per request: prompt must be a string "
     "or a list of token ids, not a batch of prompts"),
    ("empty prompt", {"prompt": []}, 400, "empty prompt (the model needs at least one prompt "
     "token)"),
    ("max_tokens negative", {"prompt": [1], "max_tokens": -4}, 400,
     "max_tokens must be >= 0, got -4"),
    ("max_tokens text", {"prompt": [1], "max_tokens": "5"}, 400,
     "max_tokens must be an integer, got '5'"),
    ("past the context", {"prompt": [1] * 100, "max_tokens": 4000}, 400,
     "prompt 100 + output 4000 tokens exceeds the model's context of 4096 "
     "(model.max_position_embeddings of model=tiny)"),
    ("past the KV pool", {"prompt": [1] * 300, "max_tokens": 100}, 400,
     "prompt 300 + max_tokens 100 tokens need more KV than this server's whole pool of 384 "
     "tokens (cache.capacity_tokens)"),
    ("id past the vocabulary", {"prompt": [1, 256]}, 400,
     "token id 256 at position 1 is outside the model's vocabulary of 256 tokens"),
    ("id of 2**64", {"prompt": [1, 2**64]}, 400,  # was a plain-text 500 (OverflowError)
     "token id 18446744073709551616 at position 1 is outside the model's vocabulary of 256 "
     "tokens"),
    ("negative id", {"prompt": [-1, 2]}, 400,
     "token id -1 at position 0 is outside the model's vocabulary of 256 tokens"),
    ("text without tokenizer", {"prompt": "hello"}, 400, "model tiny has no tokenizer, so a text "
     "prompt cannot be served; send the prompt as a list of token ids to /v1/completions"),
    ("other temperature", {"prompt": [1], "temperature": 0.7}, 400,
     "temperature=0.7 is not served: this server samples with temperature=0.0, top_p=1.0 (set "
     "at start: python -m testbed.serve temperature=... top_p=...)"),
    ("n of 2", {"prompt": [1], "n": 2}, 400, "n must be 1: one choice per request"),
    ("stop strings", {"prompt": [1], "stop": ["\n"]}, 400,
     "stop strings are not supported; use stop_token_ids"),
    ("min past max", {"prompt": [1], "max_tokens": 2, "min_tokens": 3}, 400,
     "min_tokens 3 must be at most max_tokens 2"),
    ("stop id past vocabulary", {"prompt": [1], "stop_token_ids": [300]}, 400,
     "stop_token_ids must lie in the model's vocabulary 0 .. 255"),
    ("stop id of 2**64", {"prompt": [1], "stop_token_ids": [2**64]}, 400,
     "stop_token_ids must lie in the model's vocabulary 0 .. 255"),
    ("stream not a bool", {"prompt": [1], "stream": "yes"}, 400,
     "stream must be true or false, got 'yes'"),
    ("another model", {"prompt": [1], "model": "gpt-4"}, 404,
     "model 'gpt-4' is not served here; this server serves 'tiny'"),
]


@pytest.mark.parametrize("body, status, message", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_a_malformed_completion_gets_its_json_4xx_naming_what_is_wrong(server, body, status,
                                                                       message):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] == message and error["type"]


def test_chat_on_a_model_without_tokenizer_is_refused(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "has no tokenizer" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and "messages must be a non-empty list" in r.text


def test_models_and_health(server):
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny"
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_debug_state_counts_the_servers_answers_by_status(server):
    before = state(server)["http_answered"]
    assert post(server, "/v1/completions", {"prompt": [1], "model": "gpt-4"}).status_code == 404
    completion(server, [1, 2], max_tokens=1)
    after = state(server)
    assert after["http_in_progress"] == 1  # this request
    assert after["http_answered"]["404"] == before.get("404", 0) + 1
    assert after["http_answered"]["200"] == before.get("200", 0) + 2  # and the state read before


def stall(engine):
    """Hold the engine's loop between steps (an inspection that waits) until the returned event
    is set."""
    gate = threading.Event()
    threading.Thread(target=engine.inspect, args=(lambda e: gate.wait(30),), daemon=True).start()
    return gate


def test_a_client_leaving_mid_stream_aborts_its_request_and_the_server_drains(server):
    before = state(server)["aborted"]
    body = {"prompt": SYSTEM + tokens(5), "max_tokens": 330, "stream": True}  # 374 KV of 384
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few chunks (and the blank lines between)
    assert all(json.loads(line[6:])["choices"][0]["finish_reason"] is None
               for line in got if line)
    # a non-streaming client that gives up is found gone too (the loop held meanwhile, so its
    # request cannot finish first)
    gate = stall(server.engine)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", {"prompt": tokens(9), "max_tokens": 300}, timeout=0.3)
    wait_until(lambda: any(kind == "abort" for kind, _ in list(server.engine._inbox)))
    gate.set()
    done = wait_until(lambda: (s := state(server))["live"] == 0 and not s["has_work"] and s)
    assert done["aborted"] == before + 2
    assert (done["invariants"], done["leases"], done["protected_tokens"]) == ("ok", 0, 0)
    assert done["evictable_tokens"] + done["free_tokens"] == 384
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert completion(server, SYSTEM + [7], max_tokens=2)["usage"]["completion_tokens"] == 2
    server.engine.inspect(lambda e: e.scheduler.check_drained())


async def asgi_post(app, body: bytes | None, path: str = "/v1/completions") -> list[dict]:
    """POST ``body`` to the ASGI ``app`` as a client that then goes away (``None``: before
    sending it): every later receive is ``http.disconnect``. The messages the app sent; an
    exception escaping the app (a traceback in the server's log) fails the test."""
    sent: list[dict] = []
    pending = [] if body is None else [{"type": "http.request", "body": body,
                                        "more_body": False}]

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


def test_a_non_streaming_client_gone_before_its_answer_gets_499_and_its_request_aborted(server):
    """It used to be a 500 with a traceback in the log: the answer, cancelled a moment before,
    was read before the cancellation ran (InvalidStateError)."""
    import asyncio

    before = state(server)["aborted"]
    gate = stall(server.engine)  # its request cannot finish before the client is found gone
    try:
        body = json.dumps({"prompt": tokens(9), "max_tokens": 300}).encode()
        sent = asyncio.run(asgi_post(server.app, body))
    finally:
        gate.set()
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    done = wait_until(lambda: (s := state(server))["live"] == 0 and not s["has_work"] and s)
    assert done["aborted"] == before + 1 and (done["leases"], done["protected_tokens"]) == (0, 0)


def test_a_client_gone_before_its_body_was_read_gets_499_without_a_traceback(server):
    import asyncio

    submitted = state(server)["submitted"]
    sent = asyncio.run(asgi_post(server.app, None))
    assert sent[0]["status"] == 499
    assert json.loads(sent[1]["body"])["error"]["message"] == \
        "the client closed the connection before its request was read"
    assert state(server)["submitted"] == submitted  # nothing reached the engine


def test_debug_state_answers_a_json_503_while_the_engine_is_busy(server, monkeypatch):
    """It used to be a plain-text 500 once a step outlasted the 30 s inspection timeout. A
    withdrawn reset never runs late: the cache keeps what it held."""
    import testbed.api.app

    completion(server, tokens(20), max_tokens=2)
    held = state(server)["evictable_tokens"]
    monkeypatch.setattr(testbed.api.app, "BETWEEN_STEPS_WAIT_S", 0.2)
    gate = stall(server.engine)  # the loop busy, as in a long step
    try:
        busy = [httpx.get(server.url + "/debug/state", timeout=30),
                httpx.post(server.url + "/reset_prefix_cache", timeout=30)]
    finally:
        gate.set()
    for r in busy:
        assert r.status_code == 503
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_busy")
        assert re.fullmatch(r"the engine is busy: \d+\.\d s in its current step \(since its "
                            r"loop last came between steps\); this is answered between steps, "
                            r"retry later", error["message"]), error["message"]
    monkeypatch.undo()
    assert state(server)["evictable_tokens"] == held > 0


def test_past_the_queue_limit_a_request_gets_429_and_is_served_once_there_is_room():
    handle = start_server([*TINY, "serve.max_queue=1"])
    try:
        gate = stall(handle.engine)  # the first request cannot finish before the second comes
        body = {"prompt": [1, 2, 3], "max_tokens": 380, "stream": True}
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            refused = post(handle, "/v1/completions", {"prompt": [4, 5], "max_tokens": 2})
            gate.set()
        assert refused.status_code == 429
        assert "serve.max_queue" in refused.json()["error"]["message"]
        wait_until(lambda: state(handle)["live"] == 0)
        assert post(handle, "/v1/completions", {"prompt": [4, 5], "max_tokens": 2}).status_code \
            == 200
    finally:
        handle.stop()


# ---------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def smollm2_server():
    from testbed.data import is_here, lookup, resolve_model

    if not is_here(lookup("smollm2_135m_instruct")):
        pytest.skip("smollm2_135m_instruct is not in the data folder: python -m testbed.data "
                    "fetch smollm2_135m_instruct (make real)")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(
        str(resolve_model("data:smollm2_135m_instruct")))
    handle = start_server(["model=smollm2_135m", "device=cpu", "cache.capacity_tokens=1024"])
    yield handle, tok
    handle.stop()


def test_text_and_chat_go_through_the_checkpoints_tokenizer_and_chat_template(smollm2_server):
    server, tok = smollm2_server
    system = {"role": "system", "content": "You are a terse assistant."}
    chats = [[system, {"role": "user", "content": q}]
             for q in ("What is the capital of France?", "Name a primary colour.")]
    templated = []
    for m in chats:
        ids = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        templated.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    answers = []
    for messages, ids in zip(chats, templated):
        r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 12,
                                                  "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "smollm2_135m"
        assert body["prompt_token_ids"] == ids
        (c,) = body["choices"]
        assert c["message"]["content"] == tok.decode(c["token_ids"], skip_special_tokens=True)
        answers.append(body)
    shared = next(i for i, (a, b) in enumerate(zip(*templated)) if a != b)
    assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60, json={
            "messages": chats[0], "max_tokens": 12, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) \
        == answers[0]["choices"][0]["message"]["content"]
    text = "The capital of France is"
    r = completion(server, text, max_tokens=4)
    assert r["prompt_token_ids"] == tok.encode(text)
    assert r["choices"][0]["text"] == tok.decode(r["choices"][0]["token_ids"],
                                                 skip_special_tokens=True)


# ---------------------------------------------------------------------------- the KV pool
@pytest.mark.parametrize("overrides, tokens, how", [
    (["model=tiny"], 4_194_304,  # 2 GiB / (2 x 2 layers x 2 KV heads x 16 x 4 bytes)
     "2 GiB (engine.cpu_kv_cache_gib=2) / 512 bytes a token (tiny KV in float32)"),
    (["model=tiny", "engine.cpu_kv_cache_gib=0.001"], 2_097,  # 1,073,741 bytes / 512
     "0.001 GiB (engine.cpu_kv_cache_gib=0.001) / 512 bytes a token (tiny KV in float32)"),
    (["model=tiny", "engine.dtype=bfloat16", "engine.cpu_kv_cache_gib=0.5"], 2_097_152,
     "0.5 GiB (engine.cpu_kv_cache_gib=0.5) / 256 bytes a token (tiny KV in bfloat16)"),
    (["model=smollm2_135m"], 46_603,  # vLLM's 2 GiB held 46,592 (its 16-token blocks)
     "2 GiB (engine.cpu_kv_cache_gib=2) / 46,080 bytes a token (smollm2_135m KV in float32)"),
    (["model=smollm2_135m", "cache.capacity_tokens=5000", "engine.cpu_kv_cache_gib=1"], 5_000,
     "cache.capacity_tokens=5000"),  # given explicitly, the tokens win
])
def test_the_cpu_kv_pool_is_engine_cpu_kv_cache_gib_of_the_models_kv(compose, overrides, tokens,
                                                                       how):
    from testbed.api.server import kv_pool
    from testbed.config.assembly import assemble

    run = assemble(compose("engine.device=cpu", *overrides))  # the pool needs no checkpoint
    assert kv_pool(run) == (tokens, how)


# ---------------------------------------------------------------------------- the entry point
def test_python_m_testbed_serve_prints_its_ready_line_and_stops_cleanly_on_sigterm():
    handle = start_server([*TINY, "serve.model_name=tb-tiny"], in_process=False)
    try:
        assert completion(handle, [1, 2, 3], max_tokens=2, model="tb-tiny")["model"] == "tb-tiny"
    finally:
        status = handle.stop()
    port = handle.url.rsplit(":", 1)[1]
    assert "kv pool: 384 tokens, cache.capacity_tokens=384\n" in handle.output  # how it was sized
    assert f"serving tb-tiny on http://127.0.0.1:{port} (cache=radix, scheduler=lpm, " \
           "kv_capacity_tokens=384)" in handle.output
    assert status == 0, handle.output


@pytest.mark.parametrize("override, line", [
    ("serve.max_queue=0", "error: serve.max_queue must be >= 1, got 0"),
    ("+serve.workers=2", "error: serve.workers is not a serve key; allowed: host, port, "
     "model_name, max_queue, default_max_tokens, log_level"),
    ("serve.log_level=loud", "error: serve.log_level must be one of critical, error, warning, "
     "info, debug, trace; got 'loud'"),
])
def test_a_bad_serve_key_stops_the_entry_point_with_one_line(override, line):
    from testbed.api.settings import assemble_serve
    from testbed.errors import BadInput

    with pytest.raises(BadInput) as e:
        assemble_serve(compose_config([*TINY, override], name="serve"))
    assert f"error: {e.value}" == line


def test_reset_prefix_cache_empties_the_cache_so_a_repeated_prompt_misses(server):
    prompt = tokens(45)
    completion(server, prompt, max_tokens=3)
    assert completion(server, prompt, max_tokens=3)["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 44  # the last prompt token is always computed
    held = state(server)["evictable_tokens"]
    r = post(server, "/reset_prefix_cache", None)
    assert r.status_code == 200 and r.json() == {"success": True, "evicted_tokens": held,
                                                 "live": 0}
    assert state(server)["evictable_tokens"] == 0
    assert completion(server, prompt, max_tokens=3)["usage"]["prompt_tokens_details"][
        "cached_tokens"] == 0
