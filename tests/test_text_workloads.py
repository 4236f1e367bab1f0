"""The text workloads (testbed/workloads/text.py) on SmolLM2's tokenizer and ShareGPT V3: prompts
are the templated text they claim (decoded back and compared), sharegpt_chat's turn k starts with
turn k-1's prompt + output token for token, an unlimited replay reaches the ideal hit rate, the
few-shot and RAG answers are right by construction (parsed from the prompt text), a paraphrase
asks its original's question reworded over the same documents reordered, and generation is
seeded. Bad values are refused, naming the key, before anything is loaded (these run without
the data folder; the others skip, with the command to run, when it lacks the model or the file).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from testbed.data import is_here, lookup
from testbed.errors import BadInput
from testbed.workloads import generate
from testbed.workloads.ideal import ideal_hit_rate
from testbed.workloads.request import OutputRef
from testbed.workloads.rag_text import FIRST, LAST, paraphrase_text, rag_text
from testbed.workloads.text import few_shot_text, sharegpt, sharegpt_chat
from testbed.workloads.copy_text import copy_text


def needs(*names: str) -> None:
    missing = [n for n in names if not is_here(lookup(n))]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in the data folder: python -m testbed.data fetch "
                    f"{' '.join(missing)} (make real)")


@pytest.fixture(scope="module")
def tok():
    needs("smollm2_135m_instruct")
    from testbed.workloads.sharegpt import load_tokenizer

    return load_tokenizer("data:smollm2_135m_instruct")


@pytest.fixture(scope="module")
def chat(tok):
    needs("sharegpt_v3")
    return sharegpt_chat(num_conversations=40, seed=1)


def text(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False)


def whole(tok, s: str) -> list[int]:
    return tok(s, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("fn, kwargs, key", [
    (sharegpt, {"num_prompts": -1}, "workload.num_prompts"),
    (sharegpt, {"max_prompt_len": 0}, "workload.max_prompt_len"),
    (sharegpt, {"min_len": -2}, "workload.min_len"),
    (sharegpt_chat, {"think_time_s": -1.0}, "workload.think_time_s"),
    (sharegpt_chat, {"max_turns": 0}, "workload.max_turns"),
    (few_shot_text, {"min_operand": 5, "max_operand": 4}, "workload.min_operand"),
    (few_shot_text, {"operations": "+/"}, "workload.operations"),
    (few_shot_text, {"num_shots": -1}, "workload.num_shots"),
    (rag_text, {"docs_per_prompt": 0}, "workload.docs_per_prompt"),
    (rag_text, {"corpus_docs": 0}, "workload.corpus_docs"),
    (rag_text, {"corpus_docs": 10_000}, "workload.corpus_docs"),
    (rag_text, {"zipf": -1.0}, "workload.zipf"),
    (rag_text, {"max_new_tokens": 0}, "workload.max_new_tokens"),
    (few_shot_text, {"max_new_tokens": -3}, "workload.max_new_tokens"),
    (paraphrase_text, {"num_originals": -1}, "workload.num_originals"),
    (paraphrase_text, {"paraphrases": -1}, "workload.paraphrases"),
    (paraphrase_text, {"docs_per_prompt": 0}, "workload.docs_per_prompt"),
    (paraphrase_text, {"corpus_docs": 0}, "workload.corpus_docs"),
    (paraphrase_text, {"max_new_tokens": 0}, "workload.max_new_tokens"),
    (copy_text, {"tasks": "repeat,summarize"}, "workload.tasks"),
    (copy_text, {"min_passage_len": 90, "max_passage_len": 80}, "workload.min_passage_len"),
    (copy_text, {"max_new_tokens": 0}, "workload.max_new_tokens"),
])
def test_bad_values_are_refused_in_one_line_naming_the_key(fn, kwargs, key):
    with pytest.raises(BadInput) as refused:  # checked before the tokenizer or file is read
        fn(tokenizer="/nonexistent", path="/nonexistent", **kwargs) \
            if fn in (sharegpt, sharegpt_chat, copy_text) \
            else fn(tokenizer="/nonexistent", **kwargs)
    message = str(refused.value)
    assert key in message and "\n" not in message


def test_sharegpt_chat_turn_k_starts_with_turn_k_minus_1s_prompt_and_output(tok, chat):
    by_id = {r.id: r for r in chat}
    later = [r for r in chat if r.after]
    assert len(later) >= 20
    eos = tok.eos_token_id
    for r in chat:
        assert r.output[-1] == eos and r.output.size >= 2  # the reply, then <|im_end|>
        if not r.after:
            assert r.prompt.tolist() == whole(tok, text(tok, r.prompt))  # templated text, whole
            assert text(tok, r.prompt).endswith("<|im_start|>assistant\n")
            continue
        prev = by_id[r.after[0]]
        history = np.concatenate([prev.prompt, prev.output])
        assert np.array_equal(r.prompt[:len(history)], history), r.id
        assert isinstance(r.segments[-2], OutputRef) and r.segments[-2].call == prev.id
        assert text(tok, r.prompt).endswith("<|im_start|>assistant\n")
        assert r.program == prev.program


def test_sharegpt_chat_prompts_are_the_templated_history(tok, chat):
    """Decoded, turn t's prompt is the chat template's text of its conversation up to its t-th
    (non-empty) gpt reply, with the generation prompt."""
    from testbed.workloads.text import _conversations

    convs: dict[str, list] = {}
    for cid, msgs in _conversations("data:sharegpt_v3"):
        convs.setdefault(cid, []).append(msgs)
    for r in chat[::3]:
        _, cid, turn = r.id.split("/")
        t = int(turn.removeprefix("turn"))
        rendered = set()
        for msgs in convs[cid]:
            history, replies = [], 0
            for role, body in msgs:
                if role == "assistant" and not whole(tok, body):
                    continue
                if role == "assistant" and replies == t:
                    break
                replies += role == "assistant"
                history.append({"role": role, "content": body})
            rendered.add(tok.apply_chat_template(history, add_generation_prompt=True,
                                                 tokenize=False))
        assert text(tok, r.prompt) in rendered, r.id


def test_an_unlimited_replay_of_sharegpt_chat_reaches_the_ideal_hit_rate(chat, compose, tmp_path):
    from testbed.execute import execute

    summary = execute(compose("backend=replay", "workload=sharegpt_chat",
                              "workload.num_conversations=40", "seed=1", "progress=false"),
                      tmp_path)
    ideal = ideal_hit_rate(chat)  # counted from the requests, not the run
    assert summary["num_requests"] == len(chat)
    assert summary["hit_rate"] == pytest.approx(ideal, abs=1e-12)
    histories = sum(len(r.prompt) for r in chat if r.after)
    assert ideal >= 0.9 * histories / sum(len(r.prompt) for r in chat)


def test_sharegpt_samples_the_first_exchange_with_bench_serving_filters(tok):
    needs("sharegpt_v3")
    reqs = sharegpt(num_prompts=30, seed=3)
    assert len(reqs) == 30 and len({r.id for r in reqs}) == 30
    for r in reqs:
        p, o = len(r.prompt), len(r.output)
        assert p >= 2 and o >= 2 and p <= 1024 and p + o <= 2048
        decoded = text(tok, r.prompt)
        assert decoded.startswith("<|im_start|>system\n") and decoded.endswith(
            "<|im_start|>assistant\n") and decoded.count("<|im_start|>user\n") == 1
    again = sharegpt(num_prompts=30, seed=3)
    assert [r.id for r in again] == [r.id for r in reqs]
    assert all(np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
               for a, b in zip(reqs, again))
    assert [r.id for r in sharegpt(num_prompts=30, seed=4)] != [r.id for r in reqs]
    strict = sharegpt(num_prompts=30, seed=3, min_len=4, max_prompt_len=64, max_total_len=256)
    assert all(4 <= len(r.prompt) <= 64 and len(r.prompt) + len(r.output) <= 256 for r in strict)


@pytest.mark.parametrize("chat_template", [True, False])
def test_few_shot_text_answers_are_right_by_construction(tok, chat_template):
    reqs = few_shot_text(num_tasks=3, questions_per_task=5, num_shots=4, min_operand=-20,
                         max_operand=500, chat_template=chat_template, seed=2)
    assert len(reqs) == 15
    heads: dict[str, np.ndarray] = {}
    line = re.compile(r"Q: (-?\d+)([-+*])(-?\d+)=\? A:(?: (-?\d+))?")
    for r in reqs:
        decoded = text(tok, r.prompt)
        assert r.prompt.tolist() == whole(tok, decoded)  # pieces split where tokenizing splits
        found = line.findall(decoded)
        assert len(found) == 5  # four shots and the question
        for a, op, b, c in found:
            value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert str(value) == (c or r.answer)
        assert text(tok, r.output).strip() == r.answer
        task = r.program.split("/")[0]
        head = r.segments[0]
        if task in heads:
            assert heads[task] is head  # the examples block, shared
        heads[task] = head
        assert np.array_equal(r.prompt[:len(head)], head)
        assert decoded.endswith("<|im_start|>assistant\n") == chat_template
    again = few_shot_text(num_tasks=3, questions_per_task=5, num_shots=4, min_operand=-20,
                          max_operand=500, chat_template=chat_template, seed=2)
    assert [r.answer for r in again] == [r.answer for r in reqs]


@pytest.mark.parametrize("chat_template", [True, False])
def test_rag_text_answer_is_in_exactly_one_document_of_the_prompt(tok, chat_template):
    reqs = rag_text(num_requests=40, corpus_docs=12, docs_per_prompt=4,
                    chat_template=chat_template, seed=5)
    corpus: dict[str, np.ndarray] = {}
    for r in reqs:
        decoded = text(tok, r.prompt)
        assert r.prompt.tolist() == whole(tok, decoded)
        docs = [text(tok, d) for d in r.segments[1:-1]]
        assert len(docs) == 4 and len(set(docs)) == 4
        for d, ids in zip(docs, r.segments[1:-1]):
            assert np.array_equal(corpus.setdefault(d, ids), ids)  # same tokens everywhere
        question = re.search(r"Question: (.*\?)", decoded).group(1)
        name = re.search(r"([A-Z][a-z]+ [A-Z][a-z]+)", question.split(" ", 1)[1]).group(1)
        holding = [d for d in docs if name in d]
        assert len(holding) == 1
        doc = holding[0]
        if question.startswith("In which year"):
            got = re.search(rf"{name} was born in (\d+)\.", doc).group(1)
        elif question.startswith("In which city"):
            got = re.search(rf"{name} lives in (\w+)\.", doc).group(1)
        elif question.startswith("How many"):
            got = re.search(rf"{name} keeps (\d+) ", doc).group(1)
        else:
            got = re.search(rf"{name} is (\d+) centimetres", doc).group(1)
        assert got == r.answer and text(tok, r.output).strip() == r.answer
    assert len(corpus) <= 12
    again = rag_text(num_requests=40, corpus_docs=12, docs_per_prompt=4,
                     chat_template=chat_template, seed=5)
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(reqs, again))


def test_answers_reach_requests_jsonl(tok, compose, tmp_path):
    from testbed.execute import execute

    execute(compose("backend=replay", "workload=rag_text", "workload.num_requests=6",
                    "progress=false"), tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    expected = {r.id: r.answer for r in generate({"name": "rag_text", "num_requests": 6})}
    assert {r["id"]: r["answer"] for r in rows} == expected


def person(question: str) -> str:
    """The generated name a question asks about."""
    names = [f"{f} {la}" for f in FIRST for la in LAST if f"{f} {la}" in question]
    assert len(names) == 1
    return names[0]


def test_paraphrase_text_rewords_the_question_and_reorders_the_documents(tok):
    reqs = paraphrase_text(num_originals=10, paraphrases=3, corpus_docs=12, docs_per_prompt=3,
                           seed=4)
    assert len(reqs) == 40
    originals, variants = reqs[:10], reqs[10:]
    assert all(r.category == "original" for r in originals)
    assert all(r.category == "paraphrase" for r in variants)
    # the originals are rag_text's prompts for the same keys
    rag = rag_text(num_requests=10, corpus_docs=12, docs_per_prompt=3, seed=4)
    assert all(np.array_equal(o.prompt, g.prompt) and o.answer == g.answer
               for o, g in zip(originals, rag))
    for k, v in enumerate(variants):
        o = originals[k % 10]
        assert v.program == f"{o.program}/p{k // 10}" and v.answer == o.answer
        assert np.array_equal(v.output, o.output) and not np.array_equal(v.prompt, o.prompt)
        assert v.prompt.tolist() == whole(tok, text(tok, v.prompt))
        v_docs = [text(tok, d) for d in v.segments[1:-1]]
        o_docs = [text(tok, d) for d in o.segments[1:-1]]
        assert sorted(v_docs) == sorted(o_docs) and v_docs != o_docs  # same documents, reordered
        vq = re.search(r"Question: (.*\?)", text(tok, v.prompt)).group(1)
        oq = re.search(r"Question: (.*\?)", text(tok, o.prompt)).group(1)
        assert vq != oq and person(vq) == person(oq)
        holding = [d for d in v_docs if person(vq) in d]
        assert len(holding) == 1 and re.search(rf"\b{v.answer}\b", holding[0])
    again = paraphrase_text(num_originals=10, paraphrases=3, corpus_docs=12, docs_per_prompt=3,
                            seed=4)
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(reqs, again))
    other = paraphrase_text(num_originals=10, paraphrases=3, corpus_docs=12, docs_per_prompt=3,
                            seed=5)
    assert any(not np.array_equal(a.prompt, b.prompt) for a, b in zip(reqs, other))
    kept = paraphrase_text(num_originals=4, paraphrases=1, corpus_docs=12, shuffle_docs=False,
                           seed=4)
    assert all(np.array_equal(o.segments[1], v.segments[1]) for o, v in zip(kept[:4], kept[4:]))


@pytest.mark.parametrize("fn, kwargs", [(rag_text, {"num_requests": 3}),
                                        (paraphrase_text, {"num_originals": 2}),
                                        (few_shot_text, {"num_tasks": 1, "questions_per_task": 3})])
def test_max_new_tokens_makes_calls_the_engine_generates_with_the_same_prompts(tok, fn, kwargs):
    forced, generated = fn(**kwargs), fn(max_new_tokens=12, **kwargs)
    assert all(r.max_new_tokens is None and len(r.output) > 0 for r in forced)
    assert all(r.generates and r.output_limit == 12 and len(r.output) == 0 for r in generated)
    assert [(r.id, r.answer) for r in generated] == [(r.id, r.answer) for r in forced]
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(forced, generated))


def test_copy_text_asks_each_task_in_turn_about_a_passage_its_prompt_contains(tok):
    needs("sharegpt_v3")
    calls = copy_text(num_prompts=6, seed=2)
    assert [c.id.split("/")[1] for c in calls] == ["repeat", "quote", "edit"] * 2
    for c in calls:
        prompt = text(tok, c.prompt)
        passage = c.answer.strip('"') if c.category == "quote" else c.answer
        assert passage in prompt and prompt.endswith("<|im_start|>assistant\n")
        assert 48 // 2 <= len(whole(tok, passage)) <= 160
        assert text(tok, c.output) == c.answer  # forced: the ideal copy
    assert calls[1].answer.startswith('"') and calls[1].answer.endswith('"')
    generated = copy_text(num_prompts=2, seed=2, max_new_tokens=32)
    assert [len(c.output) for c in generated] == [0, 0]
    assert [c.max_new_tokens for c in generated] == [32, 32]
