"""The fuzzer's workloads: every generator of conf/workload/ at a size that runs in well under a
second, a user's generator (``workload=custom``, a built-in by import path), and traces of every
format, written small into the fuzzer's work folder.

Text workloads read the fuzzer's own tokenizer and ShareGPT file (`testbed.fuzz.fixtures`), not
the data folder's: a character-level tokenizer inside ``model=tiny``'s vocabulary. Token traces
are malformed half the time (`testbed.fuzz.bad_traces`); the production formats (mooncake,
bailian, azure) and ShareGPT-as-a-trace are written valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from testbed.fuzz.bad_traces import KINDS, bad_trace_path, spoil
from testbed.fuzz.fixtures import Fixtures, conversations
from testbed.fuzz.group_space import choice

GENERATED = ["chat", "chat_long", "few_shot", "self_consistency", "tree_of_thought",
             "multimodal", "shared_prefix", "random_tree", "rag", "paraphrase", "mixed",
             "chat_tenants", "beam_search"]
TEXT = ["sharegpt", "sharegpt_chat", "copy_text", "few_shot_text", "rag_text",
        "paraphrase_text"]
TRACE_FORMATS = ["tokens", "tokens", "sharegpt", "mooncake", "bailian", "azure"]
MAX_NEW = ["null", "null", 1, 4]
QUOTED_TASKS = "'repeat,quote,edit'"
CONVERSATIONS = conversations()  # text workloads: forced output, or generated (engine only)


def _small(rng: np.random.Generator, lo: int, hi: int) -> int:
    return int(rng.integers(lo, hi + 1))


def _bool(rng: np.random.Generator) -> str:
    return str(bool(rng.random() < 0.5)).lower()


def generated_sizes(name: str, rng: np.random.Generator) -> list[str]:
    """``KEY=VALUE`` of a generated workload (`GENERATED` but mixed) at a small size."""
    n = lambda lo, hi: _small(rng, lo, hi)  # noqa: E731
    q, o, corpus = n(1, 30), n(1, 8), n(1, 6)  # docs_per_prompt past corpus_docs: refused
    chat = [f"num_sessions={n(1, 4)}", f"turns={n(1, 3)}", f"system_prompt_len={n(0, 24)}",
            f"min_question_len={n(1, q)}", f"max_question_len={q}", f"min_output_len={n(1, o)}",
            f"max_output_len={o}", f"think_time_s={choice(rng, [0.0, 0.01])}"]
    sizes = {
        "chat": chat,
        "chat_long": chat,
        "chat_tenants": [f"num_tenants={n(1, 3)}", *chat, f"zipf={choice(rng, [0.0, 1.0])}"],
        "few_shot": [f"num_tasks={n(1, 3)}", f"questions_per_task={n(1, 5)}",
                     f"num_shots={n(0, 3)}", f"example_len={n(1, 16)}",
                     f"question_len={n(1, 12)}", f"output_len={n(1, 4)}"],
        "self_consistency": [f"num_questions={n(1, 3)}", f"num_samples={n(1, 4)}",
                             f"prefix_len={n(0, 32)}", f"question_len={n(1, 16)}",
                             f"output_len={n(1, 12)}", f"fork_prefill={_bool(rng)}"],
        "tree_of_thought": [f"num_problems={n(1, 3)}", f"depth={n(1, 3)}",
                            f"branching={n(1, 3)}", f"instruction_len={n(0, 16)}",
                            f"problem_len={n(1, 16)}", f"step_prompt_len={n(1, 8)}",
                            f"thought_len={n(1, 8)}", f"max_in_flight={n(1, 4)}",
                            f"fork_prefill={_bool(rng)}"],
        "multimodal": [f"num_requests={n(1, 16)}", f"num_images={n(1, 4)}",
                       f"images_per_request={n(1, 2)}", f"image_len={n(1, 16)}",
                       f"popularity={choice(rng, [0.0, 1.1])}",
                       f"system_prompt_len={n(0, 8)}", f"question_len={n(1, 8)}",
                       f"output_len={n(1, 6)}"],
        "shared_prefix": [f"num_groups={n(1, 4)}", f"prompts_per_group={n(1, 5)}",
                          f"system_prompt_len={n(0, 32)}", f"question_len={n(1, 12)}",
                          f"output_len={n(1, 8)}"],
        "random_tree": [f"num_requests={n(1, 30)}", f"root_prob={choice(rng, [0.0, 0.2, 1.0])}",
                        f"max_burst={n(1, 4)}", f"root_len={n(0, 24)}",
                        f"segment_len={n(0, 8)}", f"output_len={n(0, 6)}"],
        "rag": [f"num_requests={n(1, 12)}", f"corpus_docs={corpus}",
                f"docs_per_prompt={n(1, min(corpus + 1, 3))}", f"doc_len={n(1, 16)}",
                f"question_len={n(1, 8)}",
                f"system_prompt_len={n(0, 8)}", f"output_len={n(1, 6)}",
                f"zipf={choice(rng, [0.0, 1.0])}"],
        "paraphrase": [f"num_originals={n(1, 4)}", f"paraphrases={n(0, 3)}",
                       f"prompt_len={n(4, 32)}", f"edits={n(0, 4)}",
                       f"edit_kind={choice(rng, ['substitute', 'insert', 'delete', 'mixed'])}",
                       f"edit_at={choice(rng, ['null', '0.5', '0.0'])}",
                       f"system_prompt_len={n(0, 8)}", f"output_len={n(1, 6)}"],
        "beam_search": [f"num_prompts={n(1, 3)}", f"prompt_len={n(1, 16)}",
                        f"system_prompt_len={n(0, 8)}", f"beam_width={n(1, 3)}",
                        f"depth={n(1, 4)}"],
    }
    return sizes[name]


def text_sizes(name: str, rng: np.random.Generator, fixtures: Fixtures) -> list[str]:
    """``KEY=VALUE`` of a text workload on the fuzzer's tokenizer (and ShareGPT file)."""
    n = lambda lo, hi: _small(rng, lo, hi)  # noqa: E731
    tok = [f"tokenizer={fixtures.tokenizer}"]
    data = [f"path={fixtures.sharegpt}", *tok]
    corpus = n(1, 6)
    rag = [f"corpus_docs={corpus}", f"docs_per_prompt={n(1, min(corpus + 1, 3))}",
           f"zipf={choice(rng, [0.0, 1.0])}", f"max_new_tokens={choice(rng, MAX_NEW)}",
           f"chat_template={_bool(rng)}", *tok]
    sizes = {
        "sharegpt": [f"num_prompts={n(1, 6)}", f"min_len={choice(rng, [1, 2, 40])}",
                     f"max_prompt_len={choice(rng, ['null', 64, 1024])}",
                     f"max_total_len={choice(rng, ['null', 128, 2048])}", *data],
        "sharegpt_chat": [f"num_conversations={n(1, 4)}",
                          f"think_time_s={choice(rng, [0.0, 0.01])}",
                          f"max_turns={choice(rng, ['null', 1, 2])}",
                          f"max_total_len={choice(rng, ['null', 200, 8192])}", *data],
        "copy_text": [f"num_prompts={n(1, 4)}",
                      # quoted: Hydra reads an unquoted a,b,c as a list
                      f"tasks={choice(rng, [QUOTED_TASKS, 'quote', 'edit'])}",
                      f"min_passage_len={choice(rng, [4, 16, 48])}",
                      f"max_passage_len={choice(rng, [16, 64, 160])}",
                      f"max_new_tokens={choice(rng, MAX_NEW)}", *data],
        "few_shot_text": [f"num_tasks={n(1, 3)}", f"questions_per_task={n(1, 3)}",
                          f"num_shots={n(0, 3)}", f"min_operand={n(0, 5)}",
                          f"max_operand={n(5, 20)}",
                          f"operations={choice(rng, ['+-*', '+', '*-'])}",
                          f"max_new_tokens={choice(rng, MAX_NEW)}",
                          f"chat_template={_bool(rng)}", *tok],
        "rag_text": [f"num_requests={n(1, 6)}", *rag],
        "paraphrase_text": [f"num_originals={n(1, 3)}", f"paraphrases={n(0, 2)}",
                            f"shuffle_docs={_bool(rng)}", *rag],
    }
    return sizes[name]


def workload_overrides(rng: np.random.Generator, workdir: Path, index: int,
                       fixtures: Fixtures) -> list[str]:
    """One workload: a generated one half the time, else a text one, a trace, a mix or a
    user's generator."""
    u = rng.random()
    vocab = int(choice(rng, [2, 5, 50, 256]))
    if u < 0.55:
        name = choice(rng, GENERATED)
        if name == "mixed":
            return ["workload=mixed", *mixed(rng, vocab)]
        return [f"workload={name}", *(f"workload.{kv}" for kv in generated_sizes(name, rng)),
                f"workload.vocab_size={vocab}"]
    if u < 0.8:
        name = choice(rng, TEXT)
        return [f"workload={name}", *(f"workload.{kv}" for kv in text_sizes(name, rng,
                                                                              fixtures))]
    if u < 0.97:
        return trace_overrides(rng, workdir, index, fixtures, vocab)
    # a user's generator: a built-in by import path, its sizes as added keys
    name = choice(rng, ["random_tree", "shared_prefix"])
    return ["workload=custom", f"workload.target=testbed.workloads.synthetic.{name}",
            *(f"+workload.{kv}" for kv in generated_sizes(name, rng)),
            f"+workload.vocab_size={vocab}"]


def mixed(rng: np.random.Generator, vocab: int) -> list[str]:
    out = [f"workload.num_programs={choice(rng, ['null', str(_small(rng, 1, 6))])}"]
    for part in ("few_shot", "chat", "self_consistency", "tree_of_thought"):
        out += [f"workload.components.{part}.{kv}" for kv in generated_sizes(part, rng)]
        out += [f"workload.components.{part}.vocab_size={vocab}",
                f"workload.weights.{part}={choice(rng, [0.0, 1.0, 2.0])}"]
    return out


def trace_overrides(rng: np.random.Generator, workdir: Path, index: int, fixtures: Fixtures,
                    vocab: int) -> list[str]:
    """``workload=trace`` of a file written here, in one of the formats; a token trace is
    malformed half the time, drawn from a stream of its own (`testbed.fuzz.bad_traces`)."""
    fmt = choice(rng, TRACE_FORMATS)
    if fmt == "sharegpt":  # a trace replays every conversation: a few of the fixture's
        path = workdir / f"trace{index}.json"
        picked = rng.choice(len(CONVERSATIONS), size=int(rng.integers(1, 4)), replace=False)
        path.write_text(json.dumps([CONVERSATIONS[int(i)] for i in picked]))
        return ["workload=trace", f"workload.path={path}", "workload.format=sharegpt",
                f"workload.tokenizer={fixtures.tokenizer}"]
    if fmt != "tokens":
        path = workdir / f"trace{index}.{'csv' if fmt == 'azure' else 'jsonl'}"
        write_production_trace(path, fmt, rng)
        out = ["workload=trace", f"workload.path={path}", f"workload.format={fmt}"]
        return out + [f"arrival.time_scale={choice(rng, [0.0, 0.5, 1.0])}"] \
            if rng.random() < 0.3 else out
    bad = np.random.default_rng([index, 44])
    kind = str(bad.choice(KINDS)) if bad.random() < 0.5 else None
    path = workdir / f"trace{index}.jsonl" if kind is None else bad_trace_path(workdir, index, kind)
    write_token_trace(path, rng, vocab)
    if kind is not None:
        spoil(path, kind, bad)
    return ["workload=trace", f"workload.path={path}", "workload.format=tokens"]


def write_token_trace(path: Path, rng: np.random.Generator, vocab: int) -> None:
    """A small token trace (`workload.format=tokens`): a random tree of continuations, some calls
    with arrival times, priorities and think times."""
    from testbed.workloads.synthetic import random_tree
    from testbed.workloads.traces import save_tokens

    requests = random_tree(num_requests=_small(rng, 1, 30), root_prob=0.2,
                           max_burst=_small(rng, 1, 4), root_len=_small(rng, 1, 24),
                           segment_len=_small(rng, 0, 8), output_len=_small(rng, 0, 6),
                           vocab_size=vocab, seed=int(rng.integers(1 << 30)))
    timed = rng.random() < 0.5
    for i, r in enumerate(requests):
        r.arrival_s = float(i * rng.uniform(0, 0.05)) if timed else 0.0
        r.priority = int(rng.integers(0, 3))
    save_tokens(requests, path)


def write_production_trace(path: Path, fmt: str, rng: np.random.Generator) -> None:
    """A few lines of a mooncake, bailian or azure trace (testbed/workloads/production_traces.py):
    lengths, block hashes drawn from a few (so that prompts share blocks), times."""
    count = _small(rng, 1, 8)
    lengths = [(_small(rng, 1, 40), _small(rng, 0, 6)) for _ in range(count)]
    if fmt == "azure":
        rows = [f"2023-11-16 18:15:{i:02d}.000,{n_in},{n_out}"
                for i, (n_in, n_out) in enumerate(lengths)]
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
        return
    block = 512 if fmt == "mooncake" else 16
    lines = []
    for i, (n_in, n_out) in enumerate(lengths):
        blocks = [int(b) for b in rng.integers(0, 4, size=-(-n_in // block))]
        line = {"timestamp": i * (10 if fmt == "mooncake" else 0.01), "input_length": n_in,
                "output_length": n_out, "hash_ids": blocks}
        if fmt == "bailian":
            parent = int(rng.integers(-1, i)) if i else -1
            line.update(chat_id=i, parent_chat_id=parent, type="text", turn=1 + (parent >= 0))
        lines.append(json.dumps(line))
    path.write_text("\n".join(lines) + "\n")
