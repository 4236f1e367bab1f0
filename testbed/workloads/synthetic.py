"""Synthetic sharing patterns beyond the paper's families: SGLang's generated-shared-prefix
benchmark, a random tree of continuations with sibling bursts, and multimodal requests whose
images are runs of pseudo-tokens shared across requests."""

from __future__ import annotations

import hashlib

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.program import ProgramBuilder, TokenSource, check_nonnegative, \
    questions_on_prefixes
from testbed.workloads.request import OutputRef, Request


def shared_prefix(num_groups: int = 64, prompts_per_group: int = 16, system_prompt_len: int = 2048,
                  question_len: int = 128, output_len: int = 256, vocab_size: int = 32000,
                  seed: int = 0) -> list[Request]:
    """``num_groups`` system prompts, each followed by ``prompts_per_group`` distinct questions;
    one call per program. Listed question by question across groups (consecutive requests never
    share a system prompt: the hard case for an LRU cache without scheduling)."""
    check_nonnegative(num_groups=num_groups, prompts_per_group=prompts_per_group,
                      system_prompt_len=system_prompt_len, question_len=question_len,
                      output_len=output_len)
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    systems = [tokens(system_prompt_len) for _ in range(num_groups)]
    return questions_on_prefixes(tokens, systems, prompts_per_group, question_len, output_len, "g")


def random_tree(num_requests: int = 512, root_prob: float = 0.1, max_burst: int = 4,
                root_len: int = 256, segment_len: int = 32, output_len: int = 32,
                vocab_size: int = 32000, seed: int = 0) -> list[Request]:
    """A forest grown at random, like SGLang's radix-cache stress workload: with probability
    ``root_prob`` (always for the first) a new root call (its own program); otherwise a uniformly
    chosen earlier call gets a burst of 1..``max_burst`` children, each continuing the parent's
    prompt and output with a fresh segment. Listed in generation order."""
    check_nonnegative(num_requests=num_requests, root_len=root_len, segment_len=segment_len,
                      output_len=output_len)
    if not 0.0 <= root_prob <= 1.0:
        raise BadInput(f"workload.root_prob must be in [0, 1], got {root_prob}")
    if max_burst < 1:
        raise BadInput(f"workload.max_burst must be >= 1, got {max_burst}")
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng, vocab_size)
    calls: list[Request] = []
    programs: dict[str, ProgramBuilder] = {}
    while len(calls) < num_requests:
        if not calls or rng.random() < root_prob:
            program = ProgramBuilder(f"tree{len(programs)}", tokens)
            programs[program.program] = program
            calls.append(program.call("n0", [tokens(root_len), tokens(segment_len)], output_len))
            continue
        parent = calls[int(rng.integers(len(calls)))]
        program = programs[parent.program]
        for _ in range(min(int(rng.integers(1, max_burst + 1)), num_requests - len(calls))):
            segments = [*parent.segments, OutputRef(parent.id), tokens(segment_len)]
            calls.append(program.call(f"n{len(program.calls)}", segments, output_len,
                                      after=[parent.id]))
    return calls


def image_tokens(image: int, length: int, vocab_size: int, seed: int) -> np.ndarray:
    """The pseudo-tokens of image number ``image``: a fixed run determined by the image's hash."""
    digest = hashlib.blake2b(f"{seed}:image:{image}".encode(), digest_size=8).digest()
    return TokenSource(np.random.default_rng(int.from_bytes(digest, "little")), vocab_size)(length)


def multimodal(num_requests: int = 256, num_images: int = 32, images_per_request: int = 1,
               image_len: int = 256, popularity: float = 1.1, system_prompt_len: int = 64,
               question_len: int = 64, output_len: int = 64, vocab_size: int = 32000,
               seed: int = 0) -> list[Request]:
    """Requests (one-call programs) asking about images: prompt = a shared system prompt, then
    ``images_per_request`` images drawn with Zipf-like popularity (weight ∝ 1/rank^popularity,
    so a few images recur often), then a question. Each image is ``image_len`` pseudo-tokens."""
    check_nonnegative(num_requests=num_requests, images_per_request=images_per_request,
                      image_len=image_len, popularity=popularity,
                      system_prompt_len=system_prompt_len, question_len=question_len,
                      output_len=output_len)
    if num_images < 1:
        raise BadInput(f"workload.num_images must be >= 1, got {num_images}")
    rng = np.random.default_rng(seed)
    tokens = TokenSource(rng, vocab_size)
    weights = 1.0 / np.arange(1, num_images + 1) ** popularity
    images = [image_tokens(i, image_len, vocab_size, seed) for i in range(num_images)]
    system = tokens(system_prompt_len)
    calls = []
    for r in range(num_requests):
        chosen = rng.choice(num_images, size=images_per_request, p=weights / weights.sum())
        program = ProgramBuilder(f"req{r}", tokens)
        segments = [system, *(images[i] for i in chosen), tokens(question_len)]
        calls.append(program.call("answer", segments, output_len))
    return calls
