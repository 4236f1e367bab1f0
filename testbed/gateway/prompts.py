"""The tokens a request is routed on: the prompt as the replica will see it.

A list of token ids is taken as is; a text prompt and chat messages go through the ``model``
group's tokenizer with the rules ``testbed.serve`` applies (`testbed.api.protocol`: the text
encoded with its special tokens, as vLLM does; messages through the chat template with the
generation prompt), so that ``router=kv_events`` looks up exactly what the replica caches.
Without a tokenizer a text is routed on its UTF-8 bytes (a byte per token: SGLang's gateway
routes on characters) and chat on its messages' contents joined.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from testbed.api.protocol import chat_prompt, completion_prompt
from testbed.workloads.request import TOKEN_DTYPE


def route_tokens(body: Any, chat: bool, tokenizer: Any) -> np.ndarray:
    """The tokens of ``body``'s prompt; an `testbed.api.protocol.ApiError` (400) for a body
    the replica would refuse for its prompt too."""
    if tokenizer is None and isinstance(body, dict):
        text = _text(body, chat)
        if text is not None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(TOKEN_DTYPE)
    shim = SimpleNamespace(tokenizer=tokenizer, model_name="the router's model")
    ids = chat_prompt(body, shim) if chat else completion_prompt(body, shim)
    try:
        return np.asarray(ids, dtype=np.int64).astype(TOKEN_DTYPE)
    except (OverflowError, ValueError):  # ids no vocabulary has: the replica answers 400
        return np.zeros(0, TOKEN_DTYPE)


def _text(body: dict, chat: bool) -> str | None:
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"{m.get('role') if isinstance(m, dict) else ''}:{content or ''}\n")
    return "".join(parts)
