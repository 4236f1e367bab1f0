"""Text workloads: real prompts through a model's tokenizer and chat template (docs/design.md §3).

- `sharegpt`: single-turn ShareGPT prompts as SGLang's ``bench_serving --dataset-name sharegpt``
  samples them;
- `sharegpt_chat`: whole ShareGPT conversations, turn k's prompt the templated history;
- `few_shot_text`: arithmetic few-shot prompts ("Q: 1+1=? A: 2") with a ground-truth answer;
- `rag_text`, `paraphrase_text` (in `testbed.workloads.rag_text`): generated documents stating
  facts and a question answered by exactly one of them; reworded repeats of such prompts.

Every prompt is tokenized with ``add_special_tokens=False`` from the chat template's text (the
template writes the special tokens it wants). Where a prompt is built from pieces (a shared
few-shot block, a document, a conversation's history), each piece is tokenized on its own and
the pieces end at a newline or a special token, so that a piece has the same tokens wherever it
appears: that is what lets the radix cache hit it. The tokenizer is loaded once per process
(`testbed.workloads.sharegpt.load_tokenizer`); the ShareGPT file is read once per process too.

Requests of `few_shot_text`, `rag_text` and `paraphrase_text` carry ``answer``, the expected
answer text. With ``max_new_tokens`` set they carry no output: the engine generates up to that
many tokens (``forced=false`` or not), so the answer can be read from what the model writes.
"""

from __future__ import annotations

import functools
import random
import sys
from typing import Sequence

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.beyond_prefix import zipf_weights
from testbed.workloads.program import check_nonnegative
from testbed.workloads.request import TOKEN_DTYPE, OutputRef, Request, Segment, materialize
from testbed.workloads.sharegpt import load_tokenizer, read_conversations

DEFAULT_TOKENIZER = "data:smollm2_135m_instruct"  # conf/model/smollm2_135m.yaml's path
DEFAULT_SHAREGPT = "data:sharegpt_v3"
# the data-folder entries each text workload reads by default (the fuzzer gives them its own
# tokenizer and ShareGPT file instead: testbed/fuzz/fixtures.py)
NEEDS = {"sharegpt": ("smollm2_135m_instruct", "sharegpt_v3"),
         "sharegpt_chat": ("smollm2_135m_instruct", "sharegpt_v3"),
         "few_shot_text": ("smollm2_135m_instruct",), "rag_text": ("smollm2_135m_instruct",),
         "paraphrase_text": ("smollm2_135m_instruct",),
         "copy_text": ("smollm2_135m_instruct", "sharegpt_v3")}
ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "system": "system"}


def _tokens(tok, text: str) -> np.ndarray:
    return np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=TOKEN_DTYPE)


def _render(tok, messages: list[dict], generation_prompt: bool = True) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                   tokenize=False)


@functools.lru_cache(maxsize=2)
def _conversations(path: str) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """The file's conversations as ``(id, ((role, text), ...))`` with chat-template roles (user,
    assistant, system); items that are not well-formed ShareGPT conversations, or that have
    another role, are left out. Read once per process and path."""
    from testbed.data import resolve_trace

    file, _ = resolve_trace(path, None if path.startswith("data:") else "sharegpt")
    out = []
    for item in read_conversations(file):
        msgs = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and m.get("from") in ROLE_OF and isinstance(m.get("value"), str)
                for m in msgs):
            continue
        out.append((str(item.get("id")), tuple((ROLE_OF[m["from"]], m["value"]) for m in msgs)))
    return tuple(out)


def _shuffled(path: str, seed: int) -> list[tuple[str, tuple[tuple[str, str], ...]]]:
    """The conversations shuffled by Python's ``random`` seeded with ``seed``, as bench_serving
    shuffles its list before taking from its head."""
    convs = list(_conversations(str(path)))
    random.Random(seed).shuffle(convs)
    return convs


def _check_limits(**limits: int | None) -> None:
    """Raise BadInput naming the first ``workload.KEY`` that is set and under 1."""
    for key, value in limits.items():
        if value is not None and value < 1:
            raise BadInput(f"workload.{key} must be >= 1 or null, got {value}")


def sharegpt(num_prompts: int = 1000, path: str = DEFAULT_SHAREGPT,
             tokenizer: str = DEFAULT_TOKENIZER, min_len: int = 2,
             max_prompt_len: int | None = 1024, max_total_len: int | None = 2048,
             seed: int = 0) -> list[Request]:
    """Single-turn ShareGPT, sampled as SGLang's ``bench_serving --dataset-name sharegpt``
    (``--apply-chat-template``): conversations whose first message is a human turn and second a
    gpt reply, shuffled with Python's ``random`` seeded by ``seed``, then taken in that order,
    dropping a pair whose prompt or output is under ``min_len`` tokens (bench_serving: 2; vLLM's
    benchmark: 4), whose prompt is over ``max_prompt_len`` or whose prompt + output is over
    ``max_total_len`` (1024 and 2048: vLLM's benchmark and bench_serving before it; bench_serving
    today caps only prompt + output, at ``--sharegpt-context-len``, unset by default; null: no
    cap), until ``num_prompts`` are kept (fewer when the file runs out, with a note on stderr).

    The prompt is the human turn through the chat template with the generation prompt; the
    output, forced, is the gpt reply's tokens (its length is bench_serving's output length).
    Unlike bench_serving, the templated text is tokenized with ``add_special_tokens=False`` and
    its BOS text is kept (SmolLM2's BOS is ``<|im_start|>``, which bench_serving's
    ``replace(bos_token, "")`` would strip from every ChatML turn). One program per prompt,
    ``sharegpt{i}``, all arriving at 0.
    """
    check_nonnegative(num_prompts=num_prompts, min_len=min_len)
    _check_limits(max_prompt_len=max_prompt_len, max_total_len=max_total_len)
    if num_prompts == 0:
        return []
    tok = load_tokenizer(tokenizer)
    calls: list[Request] = []
    for cid, msgs in _shuffled(path, seed):
        if len(msgs) < 2 or msgs[0][0] != "user" or msgs[1][0] != "assistant":
            continue
        prompt = _tokens(tok, _render(tok, [{"role": "user", "content": msgs[0][1]}]))
        output = _tokens(tok, msgs[1][1])
        p, o = len(prompt), len(output)
        if p < min_len or o < min_len or (max_prompt_len is not None and p > max_prompt_len) \
                or (max_total_len is not None and p + o > max_total_len):
            continue
        i = len(calls)
        calls.append(Request(id=f"sharegpt{i}/{cid}", prompt=prompt, output=output,
                             program=f"sharegpt{i}", segments=(prompt,), category="sharegpt"))
        if len(calls) == num_prompts:
            break
    else:
        print(f"note: workload=sharegpt: {path} has {len(calls):,} prompts that pass the length "
              f"filters, fewer than workload.num_prompts={num_prompts:,}", file=sys.stderr)
    return calls


def _turn_end(tok) -> str:
    """The text the chat template writes right after an assistant message's content, when it is
    the tokenizer's EOS (ChatML: ``<|im_end|>``); else ''. A generating model ends its reply with
    EOS, so a forced reply carries it too and a spliced real output fits the history."""
    eos = tok.eos_token or ""
    if not eos:
        return ""
    probe = [{"role": "user", "content": "u"}]
    head = _render(tok, probe) + "r"
    full = _render(tok, [*probe, {"role": "assistant", "content": "r"},
                         {"role": "user", "content": "v"}])
    return eos if full.startswith(head + eos) else ""


def sharegpt_chat(num_conversations: int = 50, think_time_s: float = 0.0,
                  max_turns: int | None = None, max_total_len: int | None = 8192,
                  path: str = DEFAULT_SHAREGPT, tokenizer: str = DEFAULT_TOKENIZER,
                  seed: int = 0) -> list[Request]:
    """Whole ShareGPT conversations, each one program, one call per gpt reply (turn).

    Conversations are shuffled as in `sharegpt` and taken in that order: those that start with a
    human or system message (ShareGPT V3 has many that start with a gpt message: left out). Turn
    k's prompt is the conversation up to its k-th gpt reply through the chat template with the
    generation prompt (every earlier human, system and recorded gpt message); its forced output
    is the reply's tokens followed by the template's end of turn when that is the tokenizer's
    EOS (ChatML's ``<|im_end|>``: the token a generating model stops on). Turn k waits for turn
    k-1 (``after``) plus ``think_time_s``.

    Tokenizing each turn's templated text whole would not make turn k's prompt start with turn
    k-1's prompt + output: the reply is tokenized with the text before it (``assistant\\n``),
    which can merge across the boundary, and the recorded reply is not what a generating model
    wrote. So the prompt is built from pieces: turn 0's templated text; then turn k-1's prompt,
    its output (an `OutputRef`: with the engine and ``forced=false`` the real output is spliced
    in) and the tokens of the text the template adds after it (the rest of the end of turn, the
    next human messages, the generation prompt), tokenized on its own. Turn k's prompt starts
    with turn k-1's prompt + output exactly, so the radix cache can hit the whole history. When a
    template does not render turn k's text as an extension of turn k-1's text plus the reply
    (one that rewrites earlier turns), that turn's prompt is its templated text tokenized whole.

    ``max_turns`` keeps the first turns of each conversation (null: all); ``max_total_len`` ends
    a conversation before the first turn whose prompt + output would pass it (default SmolLM2's
    context; null: no limit). A conversation left with no turn is skipped and the next taken.
    Calls are listed turn by turn across conversations, all arriving at 0; fewer conversations
    when the file runs out (a note on stderr).
    """
    check_nonnegative(num_conversations=num_conversations, think_time_s=think_time_s)
    _check_limits(max_turns=max_turns, max_total_len=max_total_len)
    if num_conversations == 0:
        return []
    tok = load_tokenizer(tokenizer)
    end = _turn_end(tok)
    end_ids = _tokens(tok, end) if end else np.zeros(0, dtype=TOKEN_DTYPE)
    programs: list[list[Request]] = []
    for cid, msgs in _shuffled(path, seed):
        if not msgs or msgs[0][0] == "assistant":
            continue
        turns = _conversation(tok, f"conv{len(programs)}", cid, msgs, end, end_ids,
                              think_time_s, max_turns, max_total_len)
        if turns:
            programs.append(turns)
        if len(programs) == num_conversations:
            break
    else:
        print(f"note: workload=sharegpt_chat: {path} has {len(programs):,} usable conversations, "
              f"fewer than workload.num_conversations={num_conversations:,}", file=sys.stderr)
    longest = max(len(p) for p in programs) if programs else 0
    return [p[t] for t in range(longest) for p in programs if t < len(p)]


def _conversation(tok, program: str, cid: str, msgs: Sequence[tuple[str, str]], end: str,
                  end_ids: np.ndarray, think_time_s: float, max_turns: int | None,
                  max_total_len: int | None) -> list[Request]:
    """The calls of one conversation (`sharegpt_chat`)."""
    calls: list[Request] = []
    outputs: dict[str, np.ndarray] = {}
    history: list[dict] = []
    segments: list[Segment] = []
    expected = ""  # the previous turn's prompt text + its reply + end of turn
    for role, text in msgs:
        if role != "assistant":
            history.append({"role": role, "content": text})
            continue
        reply = _tokens(tok, text)
        if reply.size == 0:  # adds nothing (left out of the history too, as format=sharegpt)
            continue
        rendered = _render(tok, history)
        if not calls:
            segments = [_tokens(tok, rendered)]
        elif rendered.startswith(expected):
            segments = [*segments, OutputRef(calls[-1].id),
                        _tokens(tok, rendered[len(expected):])]
        else:  # the template rewrote earlier turns: no exact extension of the history
            segments = [_tokens(tok, rendered)]
        output = np.concatenate([reply, end_ids]).astype(TOKEN_DTYPE)
        call_id = f"{program}/{cid}/turn{len(calls)}"
        prompt = materialize(tuple(segments), outputs)
        if max_total_len is not None and len(prompt) + len(output) > max_total_len:
            break
        prev = calls[-1].id if calls else None
        calls.append(Request(id=call_id, prompt=prompt, output=output, program=program,
                             after=[prev] if prev else [],
                             think_time_s=think_time_s if prev else 0.0,
                             segments=tuple(segments), category="sharegpt_chat"))
        outputs[call_id] = output
        history.append({"role": role, "content": text})
        expected = rendered + text + end
        if max_turns is not None and len(calls) == max_turns:
            break
    return calls


def answer_output(tok, answer: str, chat_template: bool, max_new_tokens: int | None
                  ) -> tuple[np.ndarray, int | None]:
    """A ground-truth call's ``(output, max_new_tokens)``: the answer's tokens as the forced
    output (`` answer`` without the template, continuing ``Answer:``), or none and
    ``max_new_tokens`` to generate when that is set."""
    if max_new_tokens is not None:
        return np.zeros(0, dtype=TOKEN_DTYPE), max_new_tokens
    return _tokens(tok, answer if chat_template else " " + answer), None


OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _chat_pieces(tok, chat_template: bool, system: str | None) -> tuple[str, str]:
    """The text before a user message's content and after it (through the generation prompt):
    the template rendered around a marker; ('', '') without the template."""
    if not chat_template:
        return "", ""
    marker = "\x00MARK\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": marker}]
    text = _render(tok, messages)
    if text.count(marker) != 1:
        raise BadInput("workload.chat_template: the tokenizer's chat template does not write "
                       "the user message as it is; set workload.chat_template=false")
    before, after = text.split(marker)
    return before, after


def few_shot_text(num_tasks: int = 4, questions_per_task: int = 16, num_shots: int = 8,
                  min_operand: int = 0, max_operand: int = 99, operations: str = "+-*",
                  max_new_tokens: int | None = None, chat_template: bool = True,
                  tokenizer: str = DEFAULT_TOKENIZER, seed: int = 0) -> list[Request]:
    """Arithmetic few-shot prompts with ground truth, in the form "Q: 1+1=? A: 2".

    Task t asks one operation, ``operations[t % len(operations)]`` (of ``+``, ``-``, ``*``), on
    operands drawn uniformly from ``[min_operand, max_operand]``; its ``num_shots`` solved
    examples, one line each, are shared by all its questions. A question's prompt is those lines
    and ``Q: a+b=? A:``, inside one user message through the chat template with the generation
    prompt (``chat_template=false``: the bare text, for completion); its forced output is the
    answer's tokens (``7``; `` 7`` without the template, continuing ``A:``; none with
    ``max_new_tokens``, `answer_output`) and ``answer`` the answer text without spaces. The examples block (with the template's text before it) and the
    question are tokenized on their own and split after a newline, so every question of a task
    starts with the same tokens. Questions are interleaved across tasks (question 0 of every
    task, then question 1, ...), one program each, ``task{t}/q{q}``.
    """
    check_nonnegative(num_tasks=num_tasks, questions_per_task=questions_per_task,
                      num_shots=num_shots)
    _check_limits(max_new_tokens=max_new_tokens)
    if min_operand > max_operand:
        raise BadInput(f"workload.min_operand ({min_operand}) must be <= workload.max_operand "
                       f"({max_operand})")
    if not operations or any(op not in OPERATIONS for op in operations):
        raise BadInput(f"workload.operations must be a string of {', '.join(OPERATIONS)}; "
                       f"got {operations!r}")
    rng = np.random.default_rng(seed)
    if num_tasks == 0 or questions_per_task == 0:
        return []
    tok = load_tokenizer(tokenizer)
    before, after = _chat_pieces(tok, chat_template, None)

    def problem(op: str) -> tuple[str, str]:
        a, b = (int(x) for x in rng.integers(min_operand, max_operand + 1, size=2))
        return f"Q: {a}{op}{b}=? A:", str(OPERATIONS[op](a, b))

    heads = []
    for t in range(num_tasks):
        op = operations[t % len(operations)]
        lines = "".join(f"{q} {a}\n" for q, a in (problem(op) for _ in range(num_shots)))
        heads.append((op, _tokens(tok, before + lines)))
    tail = _tokens(tok, after) if after else np.zeros(0, dtype=TOKEN_DTYPE)
    calls = []
    for q in range(questions_per_task):
        for t, (op, head) in enumerate(heads):
            question, answer = problem(op)
            segments = (head, _tokens(tok, question), tail)
            output, generated = answer_output(tok, answer, chat_template, max_new_tokens)
            calls.append(Request(id=f"task{t}/q{q}/answer", prompt=materialize(segments, {}),
                                 output=output, program=f"task{t}/q{q}", segments=segments,
                                 category="few_shot_text", max_new_tokens=generated,
                                 answer=answer))
    return calls
