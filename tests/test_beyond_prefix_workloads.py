"""The rag and paraphrase workloads (testbed/workloads/beyond_prefix.py): their prompts are built
as stated, and exact prefix caching reuses exactly the part before the first difference."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from testbed.workloads import generate
from testbed.workloads.beyond_prefix import edited, paraphrase, rag
from testbed.workloads.ideal import ideal_hits
from testbed.workloads.program import TokenSource


def test_a_rag_prompt_is_the_system_prompt_distinct_documents_and_a_question():
    reqs = rag(num_requests=50, corpus_docs=10, docs_per_prompt=3, doc_len=5, question_len=2,
               system_prompt_len=4, output_len=1, seed=3)
    system = reqs[0].segments[0]
    corpus = {}
    for r in reqs:
        assert len(r.segments) == 1 + 3 + 1 and r.segments[0] is system
        assert len(r.prompt) == 4 + 3 * 5 + 2
        docs = [bytes(d) for d in r.segments[1:4]]
        assert len(set(docs)) == 3  # distinct within a prompt
        for d in r.segments[1:4]:
            corpus[bytes(d)] = corpus.get(bytes(d), 0) + 1
        assert np.array_equal(r.prompt, np.concatenate(r.segments))
    assert len(corpus) <= 10


def test_rag_popularity_follows_zipf_and_zero_is_uniform():
    def counts(zipf):
        reqs = rag(num_requests=2000, corpus_docs=20, docs_per_prompt=1, doc_len=3,
                   question_len=1, system_prompt_len=0, output_len=1, zipf=zipf, seed=1)
        return Counter(bytes(r.segments[1]) for r in reqs).most_common()
    skewed, flat = counts(1.5), counts(0.0)
    assert skewed[0][1] > 5 * skewed[-1][1]  # the head document dominates
    assert flat[0][1] < 2 * flat[-1][1]


def test_rag_prefix_reuse_stops_at_the_first_document_that_differs():
    reqs = rag(num_requests=200, corpus_docs=6, docs_per_prompt=3, doc_len=8, question_len=4,
               system_prompt_len=16, output_len=2, zipf=0.0, seed=0)
    hits = ideal_hits(reqs)
    for i, (r, hit) in enumerate(zip(reqs, hits)):
        if i == 0:
            assert hit == 0
            continue
        # the longest earlier prompt sharing the same leading documents decides the hit
        best = 0
        for earlier in reqs[:i]:
            same = 0
            for a, b in zip(r.segments[1:4], earlier.segments[1:4]):
                if not np.array_equal(a, b):
                    break
                same += 1
            best = max(best, same)
        assert 16 + best * 8 <= hit < 16 + (best + 1) * 8 + (4 if best == 3 else 0) + 1


def test_a_substituted_paraphrase_hits_exactly_up_to_its_edit():
    reqs = paraphrase(num_originals=5, paraphrases=2, prompt_len=40, edits=3,
                      edit_kind="substitute", edit_at=0.25, system_prompt_len=8, output_len=2)
    originals, variants = reqs[:5], reqs[5:]
    hits = ideal_hits(reqs)
    for k, (v, hit) in enumerate(zip(variants, hits[5:])):
        o = originals[k % 5]
        diff = np.flatnonzero(v.prompt != o.prompt)
        assert diff.tolist() == [18, 19, 20]  # 8 system + 40 * 0.25, three in a row
        if k < 5:  # round 0: only the original came before
            assert hit == 18
    assert [r.category for r in reqs] == ["original"] * 5 + ["paraphrase"] * 10


@pytest.mark.parametrize("kind, length, first_diff", [("insert", 23, 5), ("delete", 17, 5)])
def test_insertions_and_deletions_shift_the_rest(kind, length, first_diff):
    rng = np.random.default_rng(0)
    prompt = np.arange(100, 120, dtype=np.int32)
    out = edited(prompt, 5, 3, kind, rng, TokenSource(rng, 32000))
    assert len(out) == length
    assert np.array_equal(out[:first_diff], prompt[:first_diff])
    tail = prompt[5:] if kind == "insert" else prompt[8:]
    assert np.array_equal(out[len(out) - len(tail):], tail)


def test_both_are_deterministic_by_seed_and_check_their_keys():
    for name in ("rag", "paraphrase"):
        a, b = generate({"name": name}, seed=4), generate({"name": name}, seed=4)
        assert [r.prompt.tobytes() for r in a] == [r.prompt.tobytes() for r in b]
        c = generate({"name": name}, seed=5)
        assert [r.prompt.tobytes() for r in a] != [r.prompt.tobytes() for r in c]
    with pytest.raises(ValueError, match="workload.docs_per_prompt must be in"):
        rag(corpus_docs=3, docs_per_prompt=4)
    with pytest.raises(ValueError, match="workload.edit_kind must be one of substitute, insert"):
        paraphrase(edit_kind="swap")
    with pytest.raises(ValueError, match=r"workload.edit_at must be in \[0, 1\] or null"):
        paraphrase(edit_at=1.5)
