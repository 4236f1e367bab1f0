"""The OpenAI-compatible request and response bodies: parsing with every refusal as an `ApiError`
(an OpenAI-shaped error with its HTTP status), and the JSON the endpoints answer.

Parsing needs only what the server fixes (`ServerFacts`: the served name, sampling settings,
default max tokens, the model's limits, the KV pool, the tokenizer); it touches no engine state,
so the HTTP threads run it. docs/design.md §3 "Serving over HTTP" lists fields and statuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from testbed.engine.limits import ModelLimits
from testbed.errors import BadInput
from testbed.workloads.request import TOKEN_DTYPE


class ApiError(Exception):
    """A refused request: ``status`` and the OpenAI error body's message, type and code."""

    def __init__(self, status: int, message: str, code: str = "invalid_request",
                 kind: str = "invalid_request_error", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind, self.param = \
            status, message, code, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class ServerFacts:
    model_name: str
    temperature: float
    top_p: float
    default_max_tokens: int
    limits: ModelLimits
    fits: Callable[[int], bool]  # whether a request of that many KV tokens fits the pool
    kv_tokens: int  # the KV pool (for the message)
    tokenizer: Any = None  # a `transformers` tokenizer, or None (token ids only)
    cache_label: str = "radix"  # the cache served (for messages)


@dataclass(frozen=True)
class Generation:
    """One parsed request."""

    chat: bool
    prompt: np.ndarray
    max_tokens: int
    stream: bool
    include_usage: bool
    ignore_eos: bool
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    return_token_ids: bool


# ---------------------------------------------------------------------------- fields
def _bool(body: dict, key: str, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{key} must be true or false, got {value!r}", param=key)
    return value


def _int(body: dict, key: str, default: int | None, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{key} must be an integer, got {value!r}", param=key)
    if value < minimum:
        raise ApiError(400, f"{key} must be >= {minimum}, got {value}", param=key)
    return value


def _token_list(value: Any, key: str) -> list[int] | None:
    """``value`` as a flat list of ints, or None when it is not one."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                       for t in value):
        return value
    return None


def _sampling(body: dict, facts: ServerFacts) -> None:
    """The engine samples with the run's settings; a request asking for others is refused."""
    for key, ours in (("temperature", facts.temperature), ("top_p", facts.top_p)):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(400, f"{key} must be a number, got {value!r}", param=key)
        if float(value) != float(ours):
            raise ApiError(400, f"{key}={value} is not served: this server samples with "
                           f"temperature={facts.temperature}, top_p={facts.top_p} (set at "
                           f"start: python -m testbed.serve temperature=... top_p=...)",
                           param=key)
    if _int(body, "n", 1, 1) != 1:
        raise ApiError(400, "n must be 1: one choice per request", param="n")
    if body.get("stop"):
        raise ApiError(400, "stop strings are not supported; use stop_token_ids", param="stop")
    if _bool(body, "echo"):
        raise ApiError(400, "echo is not supported", param="echo")


def _tokenizer(facts: ServerFacts, what: str) -> Any:
    if facts.tokenizer is None:
        raise ApiError(400, f"model {facts.model_name} has no tokenizer, so {what} cannot be "
                       "served; send the prompt as a list of token ids to /v1/completions",
                       param="prompt" if what == "a text prompt" else "messages")
    return facts.tokenizer


def completion_prompt(body: dict, facts: ServerFacts) -> np.ndarray:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt is required: a string, or a list of token ids (integers)",
                       param="prompt")
    if isinstance(prompt, str):
        ids = _tokenizer(facts, "a text prompt").encode(prompt)
    elif (ids := _token_list(prompt, "prompt")) is None:
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                       for p in prompt):
            raise ApiError(400, "one prompt per request: prompt must be a string or a list of "
                           "token ids, not a batch of prompts", param="prompt")
        raise ApiError(400, "prompt must be a string or a list of token ids (integers), got "
                       f"{type(prompt).__name__}", param="prompt")
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id beyond 64 bits: in no vocabulary, which the limits' check says
        return np.asarray(ids, dtype=object)


def chat_prompt(body: dict, facts: ServerFacts) -> np.ndarray:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of objects with a role and a "
                       "content", param="messages")
    plain = [{"role": m["role"], "content": _content(m.get("content"))} for m in messages]
    tok = _tokenizer(facts, "chat")
    try:
        ids = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (roles, order)
        raise ApiError(400, f"the chat template refused these messages: {e}",
                       param="messages") from None
    if hasattr(ids, "keys"):  # newer transformers: a BatchEncoding
        ids = ids["input_ids"]
    return np.asarray(list(ids), dtype=np.int64)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, "a message's content must be a string or a list of text parts",
                   param="messages")


def parse(body: Any, facts: ServerFacts, chat: bool) -> Generation:
    """A request body, checked; refused with an `ApiError` naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != facts.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves "
                       f"{facts.model_name!r}", code="model_not_found", param="model")
    _sampling(body, facts)
    prompt = chat_prompt(body, facts) if chat else completion_prompt(body, facts)
    asked = _int(body, "max_completion_tokens" if chat and "max_completion_tokens" in body
                 else "max_tokens", None, 0)
    context = facts.limits.context
    max_tokens = asked if asked is not None else facts.default_max_tokens
    if asked is None and context is not None:  # the default never runs past the context
        max_tokens = max(1, min(max_tokens, context - len(prompt)))
    try:
        facts.limits.check_prompt("prompt", prompt, max_tokens)
    except BadInput as e:  # the limits' own line, less its "request prompt: "
        raise ApiError(400, str(e).removeprefix("request prompt: "), param="prompt") from None
    kv = len(prompt) + max_tokens
    if not facts.fits(kv):
        raise ApiError(400, f"prompt {len(prompt)} + max_tokens {max_tokens} tokens need more KV "
                       f"than this server's whole pool of {facts.kv_tokens} tokens "
                       "(cache.capacity_tokens)", param="max_tokens")
    min_tokens = _int(body, "min_tokens", 0, 0)
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens {min_tokens} must be at most max_tokens {max_tokens}",
                       param="min_tokens")
    stops = body.get("stop_token_ids") or []
    if _token_list(stops, "stop_token_ids") is None:
        raise ApiError(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
    vocab = facts.limits.vocab_size
    if any(not 0 <= t < vocab for t in stops):
        raise ApiError(400, f"stop_token_ids must lie in the model's vocabulary 0 .. {vocab - 1}",
                       param="stop_token_ids")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return Generation(chat=chat, prompt=prompt.astype(TOKEN_DTYPE), max_tokens=max_tokens,
                      stream=_bool(body, "stream"),
                      include_usage=_bool(options, "include_usage"),
                      ignore_eos=_bool(body, "ignore_eos"), min_tokens=min_tokens,
                      stop_token_ids=tuple(stops),
                      return_token_ids=_bool(body, "return_token_ids"))


# ---------------------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice(gen: Generation, text: str, token_ids: list[int], finish_reason: str | None,
           stream: bool) -> dict[str, Any]:
    """One choice (index 0) of a response or of a stream chunk."""
    if gen.chat:
        message = {"role": "assistant", "content": text}
        out = {"index": 0, ("delta" if stream else "message"): message}
    else:
        out = {"index": 0, "text": text, "logprobs": None}
    out["finish_reason"] = finish_reason
    if gen.return_token_ids:
        out["token_ids"] = token_ids
    return out


def envelope(gen: Generation, request_id: str, model: str, choices: list, stream: bool,
             first: bool = False) -> dict[str, Any]:
    """A response (or a stream chunk) around its choices; with ``return_token_ids`` the
    response and the first chunk carry ``prompt_token_ids`` (a completion's choice too, as
    vLLM's)."""
    kind = "chat.completion" if gen.chat else "text_completion"
    out = {"id": request_id, "object": kind + (".chunk" if stream and gen.chat else ""),
           "created": int(time.time()), "model": model, "choices": choices}
    if gen.return_token_ids and (first or not stream):
        out["prompt_token_ids"] = gen.prompt.tolist()
        if not gen.chat:
            for c in choices:
                c["prompt_token_ids"] = out["prompt_token_ids"]
    return out
