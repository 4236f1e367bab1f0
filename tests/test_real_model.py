"""The engine on the real model (SmolLM2-135M-Instruct, ``model=smollm2_135m``): its greedy tokens
equal HF ``generate`` from the converted directory on chat prompts through the chat template,
sharing a system prompt, with prefix hits and evictions, and when decoding outgrows the pool and
requests are retracted. Skipped, with the command to run, when
the model is not in the data folder (``.ci/run`` fetches it)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from testbed.data import is_here, lookup, resolve_model  # noqa: E402
from tests.test_engine_generate import hf_generate, run, write_trace  # noqa: E402

SYSTEM = "You are a terse assistant. Answer in at most one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.",
             "How many legs has a spider?", "What is two plus three?",
             "Which planet is closest to the sun?"]


@pytest.fixture(scope="module")
def smollm2():
    if not is_here(lookup("smollm2_135m_instruct")):
        pytest.skip("smollm2_135m_instruct is not in the data folder: python -m testbed.data "
                    "fetch smollm2_135m_instruct (make real)")
    path = resolve_model("data:smollm2_135m_instruct")
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, tok, hf


def chat_ids(tok, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_greedy_tokens_equal_hf_generate_with_hits_and_eviction(tmp_path, smollm2):
    path, tok, hf = smollm2
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    shared = len(os.path.commonprefix(prompts))  # the templated system prompt
    assert shared >= 20
    rng = np.random.default_rng(0)
    records = [{"id": f"q{i}", "prompt": p, "max_new_tokens": 8, "arrival_s": float(i // 2)}
               for i, p in enumerate(prompts[:4])]
    # unrelated prompts push the system prompt out of a small pool, then it is needed again
    records += [{"id": f"other{i}", "prompt": rng.integers(3, 49152, 60).tolist(),
                 "max_new_tokens": 4, "arrival_s": 10.0 + i} for i in range(2)]
    records.append({"id": "again", "prompt": prompts[4], "max_new_tokens": 8, "arrival_s": 20.0})
    trace = write_trace(tmp_path / "chat.jsonl", records)
    summary, out = run(tmp_path, "backend=engine", "model=smollm2_135m", "device=cpu",
                       "workload=trace", f"workload.path={trace}", "cache.capacity_tokens=144",
                       "save_token_ids=true")
    by_id = {r["id"]: r for r in out}
    for rec in records:
        got = by_id[rec["id"]]
        assert got["prompt_ids"] == rec["prompt"]
        assert got["output_ids"] == hf_generate(hf, rec["prompt"], rec["max_new_tokens"]), rec["id"]
    assert sum(by_id[f"q{i}"]["cached_tokens"] >= shared for i in range(1, 4)) >= 2
    assert summary["evicted_tokens"] > 0 and summary["aborted_requests"] == 0
    answer = tok.decode(by_id["q0"]["output_ids"])
    assert "Paris" in answer, answer


def test_greedy_tokens_equal_hf_generate_when_decoding_outgrows_the_pool_and_retracts(tmp_path,
                                                                                      smollm2):
    """Admission reserves one output token per request (``clip_max_new_tokens=1``), so all four
    chats are admitted and their decoding outgrows the pool: requests are retracted and run again
    from their cached prefixes, and every output still equals HF's."""
    path, tok, hf = smollm2
    prompts = [chat_ids(tok, q) for q in QUESTIONS[:4]]
    shared = len(os.path.commonprefix(prompts))
    distinct = shared + sum(len(p) - shared for p in prompts)
    new = 12
    capacity = distinct + len(prompts) + 2  # every prompt fits with a token each, few more
    assert max(len(p) for p in prompts) + new <= capacity
    records = [{"id": f"q{i}", "prompt": p, "max_new_tokens": new, "arrival_s": 0.0}
               for i, p in enumerate(prompts)]
    trace = write_trace(tmp_path / "chat.jsonl", records)
    summary, out = run(tmp_path, "backend=engine", "model=smollm2_135m", "device=cpu",
                       "workload=trace", f"workload.path={trace}",
                       f"cache.capacity_tokens={capacity}", "scheduler.clip_max_new_tokens=1",
                       "save_token_ids=true")
    assert summary["preemptions"] > 0 and summary["aborted_requests"] == 0
    by_id = {r["id"]: r for r in out}
    for rec in records:
        assert by_id[rec["id"]]["output_ids"] == hf_generate(hf, rec["prompt"], new), rec["id"]
