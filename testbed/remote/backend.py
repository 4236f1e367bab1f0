"""``backend=server``: the workload served by a live OpenAI-compatible server (``server.url``),
its records and summary figures made as the other backends make theirs.

With ``server.prompt_format=text`` each prompt is sent as its text (`TextPrompts`: the ``model``
group's tokenizer) and recorded as the server tokenized it (``prompt_token_ids``, else our own
encoding of that text); a server that sends no output ids has its output text encoded instead.

The model is ``server.model``, else the first one ``GET /v1/models`` lists (a refused connection
there stops the run in one line naming the URL). Each call asks for its workload output's length
(``max_tokens``; with ``forced=true`` also ``ignore_eos`` and ``min_tokens``, so the server
produces exactly that many tokens, its own ones; ``forced=false``: up to that many, EOS ends it) or,
for a generated call, ``max_new_tokens``; greedy unless the run's ``temperature`` says otherwise.
A prefill-only call (output length 0) asks for 0 tokens, or with ``server.prefill_only=one_token``
for 1, dropped from its record (vLLM refuses ``max_tokens: 0``).
The server's cache is the server's: the records' ``cached_tokens`` are what it reports (None
where it reports nothing), ``evicted_tokens`` is 0 and ``inserted`` true (neither is known), and
the summary's ``cache`` and ``eviction`` say ``server``. The ideal hit rate is of the calls as
they ran: their prompts as sent and the outputs received. A run in which every call failed
measured nothing: it stops with one line naming the first failure (`EveryCallFailed`, exit 2).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from testbed.config.assembly import Assembly
from testbed.errors import BadInput
from testbed.results.metrics import RequestRecord, ideal_hit_rate
from testbed.remote.driver import RemoteDriver, Sent
from testbed.remote.openai_client import Completion, OpenAIClient, completion_body
from testbed.remote.settings import ServerSettings
from testbed.workloads.request import TOKEN_DTYPE, OutputRef, Request

NOT_REPORTED = ("the server did not report cached tokens (usage.prompt_tokens_details."
                "cached_tokens), so hit_rate is null: start vLLM with "
                "--enable-prompt-tokens-details, SGLang with --enable-cache-report")


class EveryCallFailed(BadInput):
    """No call of the run got an answer (the server refused or failed every one): the run stops
    with one line naming the first failure (exit 2), since its summary would measure nothing."""


@dataclass
class ServerRun:
    """What `testbed.backends.dispatch` makes its `BackendResult` of (this module does not import
    it: it imports this one)."""

    records: list[RequestRecord]
    extra: dict[str, Any]  # summary fields
    notes: list[str] = field(default_factory=list)  # printed after the run
    ideal_hit_rate: float | None = None  # of the calls as they ran


def run_server(run: Assembly, requests: list[Request]) -> ServerRun:
    """Serve ``requests`` on the server of ``run.server``."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_run(run, requests))


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (as uvicorn's servers run theirs), else
    asyncio's own (None): the client reads every streamed chunk, on the cores the server uses."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _run(run: Assembly, requests: list[Request]) -> ServerRun:
    settings: ServerSettings = run.server
    forced, temperature, top_p = run.engine.forced, run.engine.temperature, run.engine.top_p
    splices = [r.id for r in requests if any(isinstance(s, OutputRef) for s in r.segments or ())]
    text = TextPrompts.of(run) if settings.prompt_format == "text" else None
    async with OpenAIClient(settings) as client:
        model = settings.model or await client.first_model()

        async def send(call: Request, prompt: np.ndarray):
            one_token = call.output_limit == 0 and settings.prefill_only == "one_token"
            limit = 1 if one_token else call.output_limit
            body = completion_body(model, text.decode(prompt) if text else prompt.tolist(),
                                   limit, forced and not call.generates, temperature, top_p)
            done = await client.complete(body, call.id)
            if text is not None and not done.failed and done.output_ids is None:
                done.output_ids = text.encode("".join(done.text))  # the server sent text only
            if one_token and not done.failed:
                drop_output(done)
            if splices and not done.failed and done.output_ids is None:
                raise BadInput(f"the server at {settings.url} sends no output token ids "
                               "(vLLM's return_token_ids: token_ids on each choice), and "
                               f"request {splices[0]}'s prompt splices in an earlier call's "
                               "output; serve a workload without such calls, or a server "
                               "that returns them")
            return done

        driver = RemoteDriver(requests, send, max_in_flight=run.max_in_flight,
                              max_concurrency=run.max_concurrency,
                              progress=run.get("progress", False))
        sent = await driver.run()
    if text is not None:  # the prompt as the server tokenized it (else as we would)
        for s in sent:
            ids = s.completion.prompt_ids
            s.prompt = np.asarray(ids if ids is not None else text.encode(text.decode(s.prompt),
                                                                            special=True),
                                  dtype=TOKEN_DTYPE)
    save_ids = run.get("save_token_ids", False)
    records = [record_of(s, driver.t0, save_ids) for s in sent]
    if records and all(r.failed for r in records):  # nothing measured: not a run to summarize
        raise EveryCallFailed(f"all {len(records):,} calls to the server at {settings.url} "
                              f"failed, so the run measured nothing; the first, "
                              f"{first_failure(records)}")
    extra = {"server_url": settings.url, "server_model": model, "forced": forced,
             "temperature": temperature, "prompt_format": settings.prompt_format}
    return ServerRun(records, extra, notes_of(records, sent, forced),
                     ideal_hit_rate(as_ran(s) for s in sent))


@dataclass
class TextPrompts:
    """``server.prompt_format=text``: token ids to text and back with the ``model`` group's
    tokenizer (special tokens kept as their text, which the server's tokenizer reads back)."""

    tokenizer: Any

    @classmethod
    def of(cls, run: Assembly) -> "TextPrompts":
        from testbed.api.server import load_tokenizer

        path = run.config["model"].get("path")
        tokenizer = load_tokenizer(str(path)) if path else None
        if tokenizer is None:
            raise BadInput(f"server.prompt_format=text needs a model with a tokenizer "
                           f"(model=smollm2_135m or model.path=DIR); model="
                           f"{run.config['model'].get('name')} has none")
        return cls(tokenizer)

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids.tolist(), skip_special_tokens=False)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))


def drop_output(done: Completion) -> None:
    """A prefill-only call sent as one token (``server.prefill_only=one_token``) recorded as
    asked: no output, no token times."""
    done.output_ids = [] if done.output_ids is not None else None
    done.token_times.clear()
    done.chunks_with_tokens = 0
    done.usage_output_tokens = 0


def as_ran(s: Sent) -> Request:
    """The call as it ran: the prompt sent and the output received (the workload's where the
    call failed or the server sent no ids)."""
    ids = s.completion.output_ids
    output = np.asarray(ids, dtype=TOKEN_DTYPE) if ids is not None and not s.completion.failed \
        else s.call.output
    return Request(id=s.call.id, prompt=s.prompt, output=output)


def record_of(s: Sent, t0: float, save_token_ids: bool) -> RequestRecord:
    """A call's record; times in seconds since the run began."""
    done = s.completion
    times = [t - t0 for t in done.token_times]
    return RequestRecord(
        id=s.call.id, program=s.call.program, arrival_s=s.sent_s,
        first_token_s=times[0] if times else None, finish_s=done.finish - t0,
        prompt_tokens=len(s.prompt), cached_tokens=done.cached_tokens,
        output_tokens=done.output_tokens, evicted_tokens=0, inserted=True,
        prompt_ids=s.prompt.tolist() if save_token_ids else None,
        output_ids=list(done.output_ids or []) if save_token_ids else None,
        itl_s=[b - a for a, b in zip(times, times[1:])], status=done.status, error=done.error,
        failed=done.failed)


def first_failure(records: list[RequestRecord]) -> str:
    """``ID: HTTP STATUS: ERROR`` of the first failed call, on one line."""
    first = next(r for r in records if r.failed)
    status = f"HTTP {first.status}: " if first.status not in (None, 200) else ""
    return f"{first.id}: {status}{' '.join(str(first.error).split())}"


def notes_of(records: list[RequestRecord], sent: list[Sent], forced: bool) -> list[str]:
    """The lines printed after the run: failed calls, cached tokens not reported, forced
    lengths the server did not keep."""
    notes = []
    failed = [r for r in records if r.failed]
    if failed:
        notes.append(f"{len(failed):,} of {len(records):,} requests failed (recorded with their "
                     f"status and error; left out of the latency figures), the first "
                     f"{first_failure(records)}")
    if records and len(failed) < len(records) and \
            all(r.cached_tokens is None for r in records if not r.failed):
        notes.append(f"note: {NOT_REPORTED}")
    if forced:
        short = [s.call.id for s in sent if not s.completion.failed and not s.call.generates
                 and s.completion.output_tokens != len(s.call.output)]
        if short:
            notes.append(f"{len(short):,} requests got another output length than forced "
                         f"(first: {short[0]}): the server does not honour ignore_eos / "
                         "min_tokens")
    return notes
