"""``workload=beam_search``: the requests beam search makes, for replay and the simulator.

The engine runs a beam call as rounds of prefill-only requests, one per live beam, each prompt its
parent's plus one token (`testbed.scheduler.beam`); this generator makes programs of that shape
without a model: per prompt, round 0 is the prompt alone and each of the next ``depth − 1``
rounds has ``beam_width`` requests. Which beams survive follows what beam search does: every live
beam proposes ``2 · beam_width`` continuations whose log-probs are drawn (an exponential's
negatives, so each beam has a few likely tokens and a tail), and the ``beam_width`` best by
cumulative score over all beams are the next round's beams, so a strong beam forks several times
and weak ones are pruned. Tokens are random (distinct among one beam's continuations); a round
waits for the whole previous round, as HF's and vLLM's beam search step in lockstep. The engine's
own beam tree, saved as ``beam_trace.jsonl`` (docs/design.md §3), is the measured alternative.
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.program import ProgramBuilder, TokenSource, check_nonnegative
from testbed.workloads.request import TOKEN_DTYPE, Request


def beam_search(num_prompts: int = 8, prompt_len: int = 256, system_prompt_len: int = 0,
                beam_width: int = 4, depth: int = 64, vocab_size: int = 32000,
                seed: int = 0) -> list[Request]:
    """Per prompt a program of ``1 + beam_width · (depth − 1)`` prefill-only requests (the
    requests a beam search of ``depth`` tokens makes when no hypothesis ends early); prompts
    share a ``system_prompt_len`` prefix. Programs are listed one after another."""
    check_nonnegative(num_prompts=num_prompts, prompt_len=prompt_len,
                      system_prompt_len=system_prompt_len)
    for key, value in (("beam_width", beam_width), ("depth", depth)):
        if value < 1:
            raise BadInput(f"workload.{key} must be >= 1, got {value}")
    if vocab_size < 2 * beam_width:
        raise BadInput(f"workload.vocab_size ({vocab_size}) must be at least 2 × "
                       f"workload.beam_width ({beam_width}): a beam's continuations are distinct")
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng, vocab_size)
    system = tokens(system_prompt_len)
    calls: list[Request] = []
    for p in range(num_prompts):
        calls += _program(f"beam{p}", np.concatenate([system, tokens(prompt_len)]), beam_width,
                          depth, vocab_size, rng)
    return calls


def _program(name: str, prompt: np.ndarray, width: int, depth: int, vocab_size: int,
             rng: np.random.Generator) -> list[Request]:
    program = ProgramBuilder(name, TokenSource(rng, vocab_size))
    beams = [np.zeros(0, dtype=TOKEN_DTYPE)]  # each live beam's tokens
    scores = np.zeros(1)
    previous: list[str] = []
    for round_ in range(depth):
        previous = [program.call(f"r{round_}b{i}", [np.concatenate([prompt, beam])], 0,
                                 after=previous).id for i, beam in enumerate(beams)]
        if round_ == depth - 1:  # the last token's candidates end the search without a request
            break
        proposals = -rng.exponential(1.0, size=(len(beams), 2 * width))
        total = (scores[:, None] + proposals).ravel()
        best = np.argsort(-total, kind="stable")[:width]
        words = [rng.choice(vocab_size, size=2 * width, replace=False) for _ in beams]
        beams = [np.append(beams[j // (2 * width)], words[j // (2 * width)][j % (2 * width)])
                 .astype(TOKEN_DTYPE) for j in best]
        scores = total[best]
    return program.calls
