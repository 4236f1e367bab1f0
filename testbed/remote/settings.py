"""The ``server`` config block (used only by ``backend=server``), read and checked before anything
is generated: where the OpenAI-compatible server is, which of its models to ask, and how long to
wait. Importing it pulls in no HTTP client (`testbed.config.assembly` reads it for every
backend=server run, even one refused later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlsplit

from testbed.errors import BadInput, check_choice
from testbed.config.group_values import check_setting

#: the keys of the ``server`` block (conf/config.yaml)
SERVER_KEYS = ("url", "model", "timeout_s", "connect_timeout_s", "prefill_only", "prompt_format")
#: how a prefill-only call (output length 0, a fork's shared prompt) is asked for
PREFILL_ONLY = ("zero", "one_token")
#: how a call's prompt is sent: its token ids, or their text (the model group's tokenizer)
PROMPT_FORMATS = ("tokens", "text")


@dataclass(frozen=True)
class ServerSettings:
    """``url``: the server's base, ``http(s)://HOST:PORT`` (a trailing ``/v1`` or slash is
    dropped: the client adds ``/v1/...``). ``model``: the ``model`` of every call; None asks
    ``GET /v1/models`` and takes the first. ``timeout_s``: one call's limit, from sending it to
    the stream's end (None: none). ``connect_timeout_s``: the limit on opening a connection.
    ``prefill_only``: how a call with an output of length 0 is sent: ``zero`` asks for
    ``max_tokens: 0`` (SGLang and testbed.serve compute and cache the prompt); ``one_token`` asks
    for 1 token (forced) and drops it from the record, for servers that refuse 0 (vLLM): the
    server's cache then holds the same KV, the prompt's, as the sampled token's KV is never
    computed. ``prompt_format``: ``tokens`` sends the prompt's ids; ``text`` their text, decoded
    by the ``model`` group's tokenizer, for servers and gateways that take text only (SGLang's
    gateway routes on text); the server's own tokenization (``prompt_token_ids``) is then what is
    recorded."""

    url: str
    model: str | None = None
    timeout_s: float | None = None
    connect_timeout_s: float = 10.0
    prefill_only: str = "zero"
    prompt_format: str = "tokens"

    @classmethod
    def from_mapping(cls, server: Mapping[str, Any] | None) -> "ServerSettings":
        server = dict(server or {})
        unknown = sorted(set(server) - set(SERVER_KEYS))
        if unknown:
            raise BadInput(f"server.{unknown[0]} is not a setting of server; allowed: "
                           f"{', '.join(SERVER_KEYS)}")
        url = _base_url(server.get("url"))
        model = server.get("model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise BadInput(f"server.model must be a model id (a non-empty string) or null, "
                           f"got {model!r}")
        timeout_s = check_setting("server.timeout_s", "float", server.get("timeout_s"))
        if timeout_s is not None and timeout_s <= 0:
            raise BadInput(f"server.timeout_s must be > 0 (seconds) or null, got {timeout_s}")
        connect = check_setting("server.connect_timeout_s", "float",
                                server.get("connect_timeout_s"))
        connect = 10.0 if connect is None else connect
        if connect <= 0:
            raise BadInput(f"server.connect_timeout_s must be > 0 (seconds), got {connect}")
        prefill_only = server.get("prefill_only")
        prefill_only = "zero" if prefill_only is None else prefill_only
        check_choice("server.prefill_only", prefill_only, PREFILL_ONLY)
        prompt_format = server.get("prompt_format") or "tokens"
        check_choice("server.prompt_format", prompt_format, PROMPT_FORMATS)
        return cls(url, model, timeout_s, float(connect), prefill_only, prompt_format)


def _base_url(url: Any) -> str:
    """``url`` checked and without a trailing slash or ``/v1``; BadInput naming the key."""
    usage = "server.url=http://HOST:PORT"
    if url is None or url == "":
        raise BadInput(f"backend=server needs the server's address: {usage}")
    if not isinstance(url, str):
        raise BadInput(f"server.url must be a URL like http://HOST:PORT, got {url!r}")
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 \
            or parts.query or parts.fragment:
        raise BadInput(f"server.url must be a URL like http://HOST:PORT (http or https), "
                       f"got {url!r}")
    base = url.strip().rstrip("/")
    return base.removesuffix("/v1")
