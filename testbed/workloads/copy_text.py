"""`copy_text`: requests that ask the model to repeat, quote or lightly edit a passage their
prompt contains, the passages cut from real text (ShareGPT replies), for speculative decoding
(docs/design.md §3, "Text workloads"): what a copying answer writes is already in its prompt,
where prompt lookup (``speculative.method=ngram``) finds it.

Each request takes the next ShareGPT conversation (shuffled with ``seed``, as `sharegpt`) whose
first reply has at least ``min_passage_len`` tokens, cuts the reply to its first
``max_passage_len`` tokens at the last line end (else sentence end) in its second half
(decoded back to text, so the prompt states what the tokenizer round-trips), and asks, in turn
over ``tasks``:

- ``repeat``: "Repeat the following passage exactly, word for word." and the passage;
- ``quote``: "Quote the following passage verbatim, inside double quotation marks.";
- ``edit``: "Copy the following passage, fixing any spelling or grammar mistakes; change
  nothing else.".

The prompt is the instruction, a blank line and the passage as one user message through the chat
template with the generation prompt. The forced output is the passage's tokens (the ideal copy;
with quotes for ``quote``), or none with ``max_new_tokens`` set: the engine generates up to that
many tokens. One program per request, ``copy{i}``, all arriving at 0.
"""

from __future__ import annotations

import sys

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.program import check_nonnegative
from testbed.workloads.request import TOKEN_DTYPE, Request
from testbed.workloads.sharegpt import load_tokenizer
from testbed.workloads.text import DEFAULT_SHAREGPT, DEFAULT_TOKENIZER, _check_limits, \
    _render, _shuffled, _tokens

INSTRUCTIONS = {
    "repeat": "Repeat the following passage exactly, word for word.",
    "quote": "Quote the following passage verbatim, inside double quotation marks.",
    "edit": "Copy the following passage, fixing any spelling or grammar mistakes; change "
            "nothing else.",
}


def cut_passage(text: str, tok, max_len: int) -> str:
    """``text`` cut to at most ``max_len`` tokens, ending at the last newline or sentence end
    inside them when there is one past the first half."""
    ids = tok(text, add_special_tokens=False)["input_ids"][:max_len]
    head = tok.decode(ids)
    end = head.rfind("\n")  # a line end first: a list item's "7. " is no sentence end
    if end <= len(head) // 2:
        end = max(head.rfind(mark) for mark in (". ", "? ", "! "))
    if end > len(head) // 2:
        head = head[: end + 1]
    return head.strip()


def copy_text(num_prompts: int = 32, tasks: str = "repeat,quote,edit",
              min_passage_len: int = 48, max_passage_len: int = 160,
              max_new_tokens: int | None = None, path: str = DEFAULT_SHAREGPT,
              tokenizer: str = DEFAULT_TOKENIZER, seed: int = 0) -> list[Request]:
    """Copy-heavy prompts from ShareGPT replies (module docstring)."""
    check_nonnegative(num_prompts=num_prompts)
    _check_limits(min_passage_len=min_passage_len, max_passage_len=max_passage_len,
                  max_new_tokens=max_new_tokens)
    kinds = [t.strip() for t in str(tasks).split(",") if t.strip()]
    if not kinds or any(k not in INSTRUCTIONS for k in kinds):
        raise BadInput(f"workload.tasks must be a comma-separated list of "
                       f"{', '.join(INSTRUCTIONS)}; got {tasks!r}")
    if min_passage_len > max_passage_len:
        raise BadInput(f"workload.min_passage_len ({min_passage_len}) must be <= "
                       f"workload.max_passage_len ({max_passage_len})")
    if num_prompts == 0:
        return []
    tok = load_tokenizer(tokenizer)
    calls: list[Request] = []
    for cid, msgs in _shuffled(path, seed):
        if len(msgs) < 2 or msgs[1][0] != "assistant":
            continue
        if len(tok(msgs[1][1], add_special_tokens=False)["input_ids"]) < min_passage_len:
            continue
        passage = cut_passage(msgs[1][1], tok, max_passage_len)
        if len(_tokens(tok, passage)) < min_passage_len // 2:
            continue
        i = len(calls)
        kind = kinds[i % len(kinds)]
        content = f"{INSTRUCTIONS[kind]}\n\n{passage}"
        prompt = _tokens(tok, _render(tok, [{"role": "user", "content": content}]))
        answer = f'"{passage}"' if kind == "quote" else passage
        output = np.zeros(0, dtype=TOKEN_DTYPE) if max_new_tokens is not None \
            else _tokens(tok, answer)
        calls.append(Request(id=f"copy{i}/{kind}/{cid}", prompt=prompt, output=output,
                             program=f"copy{i}", segments=(prompt,), category=kind,
                             max_new_tokens=max_new_tokens, answer=answer))
        if len(calls) == num_prompts:
            break
    else:
        print(f"note: workload=copy_text: {path} has {len(calls):,} passages that pass the "
              f"length filters, fewer than workload.num_prompts={num_prompts:,}",
              file=sys.stderr)
    return calls
