"""The four workload families of the RadixAttention paper: few-shot, multi-turn chat,
self-consistency and tree-of-thought, and `chat_tenants`, multi-turn chat of many tenants with a
system prompt each (the routing study's). Each generator returns its calls in a valid submission
order (every call after the calls it depends on), all programs arriving at t=0; `arrivals` spreads
them.

Sizes default to the SGLang benchmarks' (the config files in ``conf/workload/`` say which).
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput
from testbed.workloads.program import ProgramBuilder, TokenSource, check_nonnegative, check_range, \
    questions_on_prefixes
from testbed.workloads.request import OutputRef, Request


def few_shot(num_tasks: int = 8, questions_per_task: int = 32, num_shots: int = 5,
             example_len: int = 128, question_len: int = 96, output_len: int = 1,
             vocab_size: int = 32000, seed: int = 0) -> list[Request]:
    """Per task, ``num_shots`` examples form one shared block; each question is a program of one
    call, prompt = the task's example block + the question. Questions are interleaved across tasks
    (question 0 of every task, then question 1, ...), so arrival order does not group tasks."""
    check_nonnegative(num_tasks=num_tasks, questions_per_task=questions_per_task,
                      num_shots=num_shots, example_len=example_len, question_len=question_len,
                      output_len=output_len)
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    examples = [tokens(num_shots * example_len) for _ in range(num_tasks)]
    return questions_on_prefixes(tokens, examples, questions_per_task, question_len, output_len,
                                 "task")


def chat(num_sessions: int = 20, turns: int = 4, system_prompt_len: int = 64,
         min_question_len: int = 256, max_question_len: int = 512, min_output_len: int = 4,
         max_output_len: int = 8, think_time_s: float = 0.0, vocab_size: int = 32000,
         seed: int = 0) -> list[Request]:
    """Sessions of ``turns`` turns; one system prompt shared by all sessions. Turn t's prompt is
    turn t-1's prompt and output followed by a new question; turn t waits for turn t-1 plus
    ``think_time_s``. Calls are listed turn by turn across sessions."""
    check_nonnegative(num_sessions=num_sessions, turns=turns, system_prompt_len=system_prompt_len,
                      think_time_s=think_time_s)
    check_range("min_question_len", min_question_len, "max_question_len", max_question_len)
    check_range("min_output_len", min_output_len, "max_output_len", max_output_len)
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    system = tokens(system_prompt_len)
    sessions = [(ProgramBuilder(f"chat{s}", tokens), [system]) for s in range(num_sessions)]
    calls = []
    for t in range(turns):
        for program, segments in sessions:
            calls.append(chat_turn(program, segments, t, (min_question_len, max_question_len),
                                   (min_output_len, max_output_len), think_time_s))
    return calls


def chat_turn(program: ProgramBuilder, segments: list, t: int, question_len: tuple[int, int],
              output_len: tuple[int, int], think_time_s: float) -> Request:
    """Turn ``t`` of a session whose history is ``segments``: a new question of a length drawn
    from ``question_len``, waiting for turn t-1 plus ``think_time_s``; its answer joins the
    history."""
    tokens = program.tokens
    segments.append(tokens(tokens.length(*question_len)))
    after = [program.calls[-1].id] if t else []
    call = program.call(f"turn{t}", segments, tokens.length(*output_len), after=after,
                        think_time_s=think_time_s if t else 0.0)
    segments.append(OutputRef(call.id))
    return call


def chat_tenants(num_tenants: int = 16, num_sessions: int = 256, turns: int = 6,
                 system_prompt_len: int = 2048, min_question_len: int = 128,
                 max_question_len: int = 512, min_output_len: int = 64, max_output_len: int = 256,
                 think_time_s: float = 5.0, zipf: float = 1.0, vocab_size: int = 128256,
                 seed: int = 0) -> list[Request]:
    """Sessions of ``turns`` turns, each of a tenant drawn with probability ∝ 1/rank^zipf; every
    tenant has its own system prompt. A turn's prompt is the tenant's system prompt, every
    earlier question and answer of the session, and a new question; turn t waits for turn t-1
    plus ``think_time_s``. Calls are listed session by session (program order = session order)."""
    check_nonnegative(num_sessions=num_sessions, turns=turns, system_prompt_len=system_prompt_len,
                      think_time_s=think_time_s, zipf=zipf)
    if num_tenants < 1:
        raise BadInput(f"workload.num_tenants must be >= 1, got {num_tenants}")
    check_range("min_question_len", min_question_len, "max_question_len", max_question_len)
    check_range("min_output_len", min_output_len, "max_output_len", max_output_len)
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    systems = [tokens(system_prompt_len) for _ in range(num_tenants)]
    weights = 1.0 / np.arange(1, num_tenants + 1) ** zipf
    tenant_of = tokens.rng.choice(num_tenants, size=num_sessions, p=weights / weights.sum())
    calls = []
    for s, tenant in enumerate(tenant_of):
        program, segments = ProgramBuilder(f"tenant{tenant}/chat{s}", tokens), [systems[tenant]]
        for t in range(turns):
            calls.append(chat_turn(program, segments, t, (min_question_len, max_question_len),
                                   (min_output_len, max_output_len), think_time_s))
    return calls


def self_consistency(num_questions: int = 32, num_samples: int = 5, prefix_len: int = 768,
                     question_len: int = 96, output_len: int = 128, fork_prefill: bool = True,
                     vocab_size: int = 32000, seed: int = 0) -> list[Request]:
    """Each question is a program of ``num_samples`` parallel calls with the same prompt: a
    few-shot prefix shared by all questions, then the question. With ``fork_prefill`` the samples
    wait for a prefill-only call of that prompt, as SGLang's frontend commits a prefix before
    ``fork(n)`` so the forks hit it instead of computing it n times."""
    check_nonnegative(num_questions=num_questions, num_samples=num_samples, prefix_len=prefix_len,
                      question_len=question_len, output_len=output_len)
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    prefix = tokens(prefix_len)
    calls = []
    for q in range(num_questions):
        program = ProgramBuilder(f"question{q}", tokens)
        segments = [prefix, tokens(question_len)]
        after = [program.call("fork", segments, 0).id] if fork_prefill and num_samples > 1 else []
        for i in range(num_samples):
            program.call(f"sample{i}", segments, output_len, after=after)
        calls += program.calls
    return calls


def tree_of_thought(num_problems: int = 64, depth: int = 4, branching: int = 2,
                    instruction_len: int = 64, problem_len: int = 96, step_prompt_len: int = 32,
                    thought_len: int = 128, fork_prefill: bool = True, vocab_size: int = 32000,
                    seed: int = 0) -> list[Request]:
    """Per problem a tree of ``depth`` levels of calls, ``branching`` children per call
    (Σ_{i<depth} branching^i calls). A call's prompt is the instruction (shared by all problems),
    the problem, and for every ancestor its thought followed by the next level's step prompt; the
    ``branching`` siblings share their prompt and differ in their sampled thoughts. With
    ``fork_prefill`` the siblings wait for a prefill-only call of their shared prompt (SGLang's
    fork), one per internal node. Calls are listed level by level within each problem."""
    check_nonnegative(num_problems=num_problems, branching=branching,
                      instruction_len=instruction_len, problem_len=problem_len,
                      step_prompt_len=step_prompt_len, thought_len=thought_len)
    if depth < 1:
        raise BadInput(f"workload.depth must be >= 1, got {depth}")
    tokens = TokenSource(np.random.default_rng(seed), vocab_size)
    instruction = tokens(instruction_len)
    calls = []
    for p in range(num_problems):
        program = ProgramBuilder(f"problem{p}", tokens)
        steps = [tokens(step_prompt_len) for _ in range(depth)]
        level = [program.call("n0", [instruction, tokens(problem_len), steps[0]], thought_len)]
        for d in range(1, depth):
            next_level = []
            for parent in level:
                name = parent.id.rsplit("/", 1)[1]
                segments = [*parent.segments, OutputRef(parent.id), steps[d]]
                after = [parent.id]
                if fork_prefill and branching > 1:
                    after = [program.call(f"{name}.fork", segments, 0, after=after).id]
                for b in range(branching):
                    next_level.append(program.call(f"{name}.{b}", segments, thought_len, after=after))
            level = next_level
        calls += program.calls
    return calls
