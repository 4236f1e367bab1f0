"""Retrieval-augmented text workloads with ground truth (docs/design.md §3 "Text workloads").

- `rag_text`: generated documents, each stating four facts about one person, and a question
  answered by exactly one document of the prompt;
- `paraphrase_text`: such prompts (the originals), each asked again later with the question
  reworded and the documents in another order: the same answer, so approximate reuse (semantic
  matching, chunk reuse) finds donors whose KV is close but not exact.

Both go through a tokenizer and chat template as `testbed.workloads.text` does: each document is
one paragraph ending in a newline, tokenized on its own, so it has the same tokens in every prompt.
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.beyond_prefix import zipf_weights
from testbed.workloads.program import check_nonnegative
from testbed.workloads.request import Request, materialize
from testbed.workloads.sharegpt import load_tokenizer
from testbed.workloads.text import (DEFAULT_TOKENIZER, _chat_pieces, _check_limits, _tokens,
                                    answer_output)

FIRST = ("Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas",
         "Kenji", "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Samir", "Talia",
         "Ugo", "Vera", "Wim", "Xenia", "Yusuf", "Zofia")
LAST = ("Abara", "Bellamy", "Castell", "Dunmore", "Eastwick", "Falkner", "Garrow", "Holm",
        "Ivers", "Jarrow", "Kessler", "Lindqvist", "Marlow", "Norcross", "Okafor", "Pellham",
        "Quarry", "Rourke", "Sandoval", "Thorne", "Umber", "Vance", "Whitlock", "Yarrow")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Osaka", "Tunis", "Quito", "Perth", "Riga",
          "Dakar", "Hanoi", "Porto", "Tallinn", "Bergen", "Cusco", "Kyoto")
PETS = ("cats", "dogs", "goats", "parrots", "horses", "rabbits")
# attribute -> (sentence about NAME with VALUE, the ways to ask about it: rag_text asks the first,
# a paraphrase one of the others)
FACTS = {
    "born": ("{name} was born in {value}.",
             ("In which year was {name} born?", "What year was {name} born in?",
              "{name} was born in which year?")),
    "city": ("{name} lives in {value}.",
             ("In which city does {name} live?", "Which city is the home of {name}?",
              "{name} lives in which city?")),
    "pets": ("{name} keeps {value} {pet}.",
             ("How many {pet} does {name} keep?", "What is the number of {pet} that {name} keeps?",
              "{name} keeps how many {pet}?")),
    "height": ("{name} is {value} centimetres tall.",
               ("How tall is {name}, in centimetres?", "What is the height of {name} in centimetres?",
                "In centimetres, how tall is {name}?")),
}
RAG_SYSTEM = "Answer the question from the documents. Reply with the answer only."


def _check(num_requests: int, corpus_docs: int, docs_per_prompt: int, zipf: float,
           max_new_tokens: int | None) -> None:
    check_nonnegative(num_requests=num_requests, zipf=zipf)
    _check_limits(max_new_tokens=max_new_tokens)
    if corpus_docs < 1:
        raise BadInput(f"workload.corpus_docs must be >= 1, got {corpus_docs}")
    if corpus_docs > len(FIRST) * len(LAST):
        raise BadInput(f"workload.corpus_docs must be <= {len(FIRST) * len(LAST)} (distinct "
                       f"names), got {corpus_docs}")
    if not 1 <= docs_per_prompt <= corpus_docs:
        raise BadInput(f"workload.docs_per_prompt must be in [1, workload.corpus_docs="
                       f"{corpus_docs}], got {docs_per_prompt}")


def _corpus(rng: np.random.Generator, corpus_docs: int
            ) -> list[tuple[str, dict[str, tuple[tuple[str, ...], str]]]]:
    """``corpus_docs`` documents: text, and attribute -> (the questions about it, its value)."""
    names = [f"{FIRST[i % len(FIRST)]} {LAST[i // len(FIRST)]}"
             for i in rng.permutation(len(FIRST) * len(LAST))[:corpus_docs]]
    corpus = []
    for name in names:
        pet = PETS[int(rng.integers(len(PETS)))]
        values = {"born": str(int(rng.integers(1930, 2011))),
                  "city": CITIES[int(rng.integers(len(CITIES)))],
                  "pets": str(int(rng.integers(2, 40))),
                  "height": str(int(rng.integers(150, 201)))}
        sentences, asks = [], {}
        for attr, (fact, questions) in FACTS.items():
            sentences.append(fact.format(name=name, value=values[attr], pet=pet))
            asks[attr] = (tuple(q.format(name=name, pet=pet) for q in questions), values[attr])
        corpus.append((" ".join(sentences) + "\n", asks))
    return corpus


class _Prompts:
    """Turns (documents, question, answer) into a call, through the tokenizer and template."""

    def __init__(self, corpus: list, chat_template: bool, tokenizer: str,
                 max_new_tokens: int | None) -> None:
        self.tok = load_tokenizer(tokenizer)
        self.chat_template, self.max_new_tokens = chat_template, max_new_tokens
        before, self.after = _chat_pieces(self.tok, chat_template, RAG_SYSTEM)
        self.head = _tokens(self.tok, before if chat_template else RAG_SYSTEM + "\n")
        self.docs = [_tokens(self.tok, text) for text, _ in corpus]

    def call(self, program: str, docs, question: str, answer: str, category: str) -> Request:
        end = self.after if self.chat_template else "\nAnswer:"
        segments = (self.head, *(self.docs[d] for d in docs),
                    _tokens(self.tok, f"Question: {question}" + end))
        output, generated = answer_output(self.tok, answer, self.chat_template,
                                          self.max_new_tokens)
        return Request(id=f"{program}/answer", prompt=materialize(segments, {}), output=output,
                       program=program, segments=segments, category=category,
                       max_new_tokens=generated, answer=answer)


def _draw(rng: np.random.Generator, corpus: list, docs_per_prompt: int, popularity: np.ndarray
          ) -> tuple[np.ndarray, tuple[str, ...], str]:
    """A prompt's documents (distinct, by popularity), the ways of asking its question and the
    answer (about one of those documents, document and attribute uniform)."""
    docs = rng.choice(len(corpus), size=docs_per_prompt, replace=False, p=popularity)
    target = int(docs[int(rng.integers(docs_per_prompt))])
    questions, answer = corpus[target][1][list(FACTS)[int(rng.integers(len(FACTS)))]]
    return docs, questions, answer


def _prompts(n: int, corpus_docs: int, docs_per_prompt: int, zipf: float,
             max_new_tokens: int | None, chat_template: bool, tokenizer: str, seed: int
             ) -> tuple[np.random.Generator, _Prompts | None, list]:
    """Check the keys; the seeded generator (after the corpus and the prompts), the call builder
    and the draws (`_draw`) of ``n`` prompts (None and none when ``n`` is 0: no tokenizer)."""
    _check(n, corpus_docs, docs_per_prompt, zipf, max_new_tokens)
    rng = np.random.default_rng(seed)
    corpus = _corpus(rng, corpus_docs)
    if n == 0:
        return rng, None, []
    prompts = _Prompts(corpus, chat_template, tokenizer, max_new_tokens)
    popularity = zipf_weights(corpus_docs, zipf)
    return rng, prompts, [_draw(rng, corpus, docs_per_prompt, popularity) for _ in range(n)]


def rag_text(num_requests: int = 64, corpus_docs: int = 50, docs_per_prompt: int = 3,
             zipf: float = 1.0, max_new_tokens: int | None = None, chat_template: bool = True,
             tokenizer: str = DEFAULT_TOKENIZER, seed: int = 0) -> list[Request]:
    """Retrieval-augmented prompts in text with ground truth: ``corpus_docs`` generated
    documents, each about one person of a unique generated name and stating four facts (year of
    birth, city, how many of an animal they keep, height in centimetres). A prompt is a system
    prompt, ``docs_per_prompt`` distinct documents drawn with Zipf popularity ``zipf`` (document
    0 the most popular) in the order drawn, and a question about one fact of one of those
    documents (document and fact uniform): its person is named in that document only, so the
    answer is in exactly one document of the prompt. ``answer`` is the fact's value as text and
    the forced output its tokens (none with ``max_new_tokens``: generated).

    With ``chat_template`` the system prompt is the system message and documents and question the
    user message, followed by the generation prompt; without it, the bare text. Each document is
    one paragraph ending in a newline, tokenized on its own, so a document has the same tokens in
    every prompt (prefix caching hits a repeated first document; position-independent reuse
    could hit the others). One call per program, ``rag{i}``, in generation order.
    """
    _, prompts, drawn = _prompts(num_requests, corpus_docs, docs_per_prompt, zipf,
                                 max_new_tokens, chat_template, tokenizer, seed)
    return [prompts.call(f"rag{i}", docs, questions[0], answer, "rag_text")
            for i, (docs, questions, answer) in enumerate(drawn)]


def paraphrase_text(num_originals: int = 16, paraphrases: int = 2, corpus_docs: int = 50,
                    docs_per_prompt: int = 3, zipf: float = 1.0, shuffle_docs: bool = True,
                    max_new_tokens: int | None = None, chat_template: bool = True,
                    tokenizer: str = DEFAULT_TOKENIZER, seed: int = 0) -> list[Request]:
    """``num_originals`` `rag_text` prompts (the same corpus and prompts as `rag_text` with
    ``num_requests=num_originals`` and the other keys equal), each followed later by
    ``paraphrases`` variants asking the same question about the same documents, so with the
    same ``answer``: variant r words the question in the ``1 + r % 2``-th of the fact's other
    two ways, and with ``shuffle_docs`` lists the documents in a random order other than the
    original's (when there are two or more). Listed originals first (``orig{i}``, category
    ``original``), then the variants round by round (``orig{i}/p{r}``, category
    ``paraphrase``), as `testbed.workloads.beyond_prefix.paraphrase` lists its token variants.
    """
    check_nonnegative(num_originals=num_originals, paraphrases=paraphrases)
    rng, prompts, drawn = _prompts(num_originals, corpus_docs, docs_per_prompt, zipf,
                                   max_new_tokens, chat_template, tokenizer, seed)
    calls = [prompts.call(f"orig{i}", docs, questions[0], answer, "original")
             for i, (docs, questions, answer) in enumerate(drawn)]
    for r in range(paraphrases):
        for i, (docs, questions, answer) in enumerate(drawn):
            order = docs
            if shuffle_docs and len(docs) > 1:
                order = docs[rng.permutation(len(docs))]
                if np.array_equal(order, docs):  # another order: rotate by one
                    order = np.roll(docs, 1)
            calls.append(prompts.call(f"orig{i}/p{r}", order, questions[1 + r % 2], answer,
                                      "paraphrase"))
    return calls

