"""Workloads whose reuse is not an exact prefix: retrieval-augmented prompts and paraphrases.

- `rag`: a system prompt, ``docs_per_prompt`` documents drawn from a corpus with Zipf popularity,
  in the order drawn, and a question. Prefix caching reuses the system prompt and, when it repeats,
  the first document; a document's KV at another position, or after other documents, is what
  position-independent reuse (CacheBlend, EPIC) would recover. Each prompt's segments are the
  system prompt, the documents and the question, so chunk boundaries come from the workload.
- `paraphrase`: prompts that repeat an earlier one with ``edits`` tokens substituted, inserted or
  deleted at a chosen place; prefix caching reuses what precedes the first edit, a semantic
  (similarity) match would recover the rest.

One call per program, listed in generation order; deterministic by seed.
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput, check_choice
from testbed.workloads.program import ProgramBuilder, TokenSource, check_nonnegative
from testbed.workloads.request import TOKEN_DTYPE, Request

EDIT_KINDS = ("substitute", "insert", "delete", "mixed")


def zipf_weights(n: int, s: float) -> np.ndarray:
    """P(rank k) ∝ 1 / k^s for k = 1..n (s = 0: uniform)."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def rag(num_requests: int = 512, corpus_docs: int = 200, docs_per_prompt: int = 4,
        doc_len: int = 256, question_len: int = 32, system_prompt_len: int = 64,
        output_len: int = 32, zipf: float = 1.0, vocab_size: int = 32000,
        seed: int = 0) -> list[Request]:
    """``num_requests`` prompts of system prompt + ``docs_per_prompt`` distinct documents (Zipf
    popularity ``zipf`` over ``corpus_docs`` documents of ``doc_len`` tokens; document 0 the most
    popular) in the order drawn + a ``question_len``-token question."""
    check_nonnegative(num_requests=num_requests, doc_len=doc_len, question_len=question_len,
                      system_prompt_len=system_prompt_len, output_len=output_len, zipf=zipf)
    if corpus_docs < 1:
        raise BadInput(f"workload.corpus_docs must be >= 1, got {corpus_docs}")
    if not 0 <= docs_per_prompt <= corpus_docs:
        raise BadInput(f"workload.docs_per_prompt must be in [0, workload.corpus_docs="
                       f"{corpus_docs}], got {docs_per_prompt}")
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng, vocab_size)
    system = tokens(system_prompt_len)
    corpus = [tokens(doc_len) for _ in range(corpus_docs)]
    popularity = zipf_weights(corpus_docs, zipf)
    calls = []
    for i in range(num_requests):
        docs = rng.choice(corpus_docs, size=docs_per_prompt, replace=False, p=popularity)
        program = ProgramBuilder(f"rag{i}", tokens)
        call = program.call("answer", [system, *(corpus[d] for d in docs),
                                       tokens(question_len)], output_len)
        call.category = "rag"
        calls.append(call)
    return calls


def edited(prompt: np.ndarray, at: int, edits: int, kind: str, rng: np.random.Generator,
           tokens: TokenSource) -> np.ndarray:
    """``prompt`` with ``edits`` consecutive edits of ``kind`` starting at token ``at``:
    substitutions replace tokens with different ones, insertions add fresh tokens before
    ``at``, deletions remove tokens from ``at``; ``mixed`` draws the kind of each edit."""
    out = prompt.copy()
    for _ in range(edits):
        what = EDIT_KINDS[int(rng.integers(3))] if kind == "mixed" else kind
        at = min(at, len(out) - 1 if what != "insert" else len(out))
        if what == "substitute":  # another token (the same one only if the vocabulary has one)
            shift = 1 + int(rng.integers(max(tokens.vocab_size - 1, 1)))
            out[at] = (int(out[at]) + shift) % tokens.vocab_size
            at += 1
        elif what == "insert":
            out = np.concatenate([out[:at], tokens(1), out[at:]]).astype(TOKEN_DTYPE)
            at += 1
        elif what == "delete" and len(out) > 1:  # a prompt keeps at least one token
            out = np.delete(out, at)
    return out


def paraphrase(num_originals: int = 64, paraphrases: int = 3, prompt_len: int = 512,
               edits: int = 4, edit_kind: str = "substitute", edit_at: float | None = 0.5,
               system_prompt_len: int = 0, output_len: int = 32, vocab_size: int = 32000,
               seed: int = 0) -> list[Request]:
    """``num_originals`` prompts of ``prompt_len`` tokens (after a shared system prompt of
    ``system_prompt_len``), each followed later by ``paraphrases`` variants with ``edits``
    consecutive edits of ``edit_kind`` (substitute, insert, delete, mixed) starting at fraction
    ``edit_at`` of the prompt (null: a uniformly random place per variant). Listed originals
    first, then the variants round by round (variant r of every original, then r + 1)."""
    check_nonnegative(num_originals=num_originals, paraphrases=paraphrases,
                      prompt_len=prompt_len, edits=edits, system_prompt_len=system_prompt_len,
                      output_len=output_len)
    check_choice("workload.edit_kind", edit_kind, EDIT_KINDS)
    if edit_at is not None and not 0.0 <= edit_at <= 1.0:
        raise BadInput(f"workload.edit_at must be in [0, 1] or null, got {edit_at}")
    if prompt_len < 1 and edits:
        raise BadInput("workload.prompt_len must be >= 1 to edit it")
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng, vocab_size)
    system = tokens(system_prompt_len)
    originals = [tokens(prompt_len) for _ in range(num_originals)]
    calls = []
    for i, body in enumerate(originals):
        call = ProgramBuilder(f"orig{i}", tokens).call("answer", [system, body], output_len)
        call.category = "original"
        calls.append(call)
    for r in range(paraphrases):
        for i, body in enumerate(originals):
            at = int(rng.integers(prompt_len)) if edit_at is None else \
                min(int(edit_at * prompt_len), max(prompt_len - 1, 0))
            variant = edited(body, at, edits, edit_kind, rng, tokens)
            call = ProgramBuilder(f"orig{i}/p{r}", tokens).call("answer", [system, variant],
                                                                output_len)
            call.category = "paraphrase"
            calls.append(call)
    return calls
