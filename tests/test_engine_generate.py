"""Generate mode and checkpoints by path: token traces with ``max_new_tokens`` run on the engine
(torch and Triton attention) and equal HF ``generate``; replay and the simulator refuse them in
one line; ``model.path=DIR`` alone runs a saved Llama, Mistral or Qwen2 with its own shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.config.assembly import compose_config  # noqa: E402
from testbed.engine.loader import save_random_hf_model, tiny_config  # noqa: E402
from testbed.config.model_group import checkpoint_group, resolve_model_group  # noqa: E402
from testbed.execute import execute  # noqa: E402
from testbed.workloads.request import OutputRef  # noqa: E402
from testbed.workloads.traces import TraceError, load_tokens, save_tokens  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def hf_generate(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens, stopping at the config's EOS (kept) as generate does."""
    ids = torch.tensor([prompt])  # the mask says every token is real: token 0 is no padding
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                      pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(tmp_path: Path, *overrides: str) -> tuple[dict, list[dict]]:
    cfg = compose_config(["progress=false", "hardware=cpu", *overrides])
    out = tmp_path / "run"
    summary = execute(cfg, out)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return summary, records


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def generating_trace(path: Path, vocab: int = 256) -> Path:
    """Three calls sharing a 40-token system prompt, a follow-up that splices in the first one's
    real output, a replayed call (``output``) and, later, unrelated calls that force evictions."""
    rng = np.random.default_rng(3)
    tok = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    system = tok(40)
    first = system + tok(6)
    records = [{"id": "a", "prompt": first, "max_new_tokens": 6, "program": "p"},
               {"id": "b", "prompt": system + tok(9), "max_new_tokens": 5, "arrival_s": 10.0},
               {"id": "c", "prompt": system + tok(3), "output": tok(4)},
               {"id": "d", "prompt": [*first, {"output": "a"}, *tok(5)], "max_new_tokens": 6,
                "program": "p", "after": ["a"]}]
    records += [{"id": f"late{i}", "prompt": tok(30), "max_new_tokens": 4, "arrival_s": 50.0}
                for i in range(3)]
    records.append({"id": "again", "prompt": system + tok(4), "max_new_tokens": 4,
                    "arrival_s": 100.0})
    return write_trace(path, records)


@pytest.fixture(scope="module")
def llama_with_eos(tmp_path_factory):
    """A tiny random Llama checkpoint whose EOS is a token its greedy continuation of call a's
    prompt produces third, so generation stops early there (and wherever else it comes up)."""
    base = tmp_path_factory.mktemp("eos")
    trace = generating_trace(base / "trace.jsonl")
    prompt = load_tokens(trace)[0].prompt.tolist()
    probe = save_random_hf_model(base / "probe", tiny_config(), seed=5)
    eos = hf_generate(probe, prompt, 3)[2]
    hf = save_random_hf_model(base / "ckpt", tiny_config(eos_token_id=eos), seed=5)
    return base / "ckpt", hf, trace, eos


# ---------------------------------------------------------------------------- trace format
def test_a_token_trace_reads_max_new_tokens_and_output_references(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [
        {"id": "q", "program": "p", "prompt": [1, 2, 3], "max_new_tokens": 4},
        {"id": "r", "program": "p", "prompt": [1, 2, 3, {"output": "q"}, 9], "max_new_tokens": 2,
         "after": ["q"]},
        {"id": "s", "program": "p", "prompt": [7, {"output": "r"}], "output": [5],
         "after": ["r"]}])
    q, r, s = load_tokens(path)
    assert q.generates and q.max_new_tokens == 4 and q.output_limit == 4 and len(q.output) == 0
    assert r.prompt.tolist() == [1, 2, 3, 9]  # q's output is not known before the engine runs
    assert [x.call if isinstance(x, OutputRef) else x.tolist() for x in r.segments] == \
        [[1, 2, 3], "q", [9]]
    assert not s.generates and s.output_limit == 1 and s.segments[1].call == "r"
    save_tokens([q, r, s], tmp_path / "again.jsonl")
    again = load_tokens(tmp_path / "again.jsonl")
    assert [(x.id, x.max_new_tokens, x.prompt.tolist()) for x in again] == \
        [(x.id, x.max_new_tokens, x.prompt.tolist()) for x in (q, r, s)]
    assert again[1].segments[1].call == "q"


@pytest.mark.parametrize("record, message", [
    ({"prompt": [1], "output": [2], "max_new_tokens": 3}, "not both"),
    ({"prompt": [1], "max_new_tokens": -1}, "'max_new_tokens' must be >= 0"),
    ({"prompt": [1]}, "missing field 'output' \\(or 'max_new_tokens'\\)"),
    ({"prompt": [1, {"output": "zz"}], "max_new_tokens": 1}, "output of 'zz', which must be an "
                                                              "earlier line"),
    ({"prompt": [1, {"out": "0"}], "max_new_tokens": 1}, 'must be {"output": "ID"}'),
])
def test_a_bad_generating_line_is_named(tmp_path, record, message):
    path = write_trace(tmp_path / "t.jsonl", [record])
    with pytest.raises(TraceError, match=message):
        load_tokens(path)


@pytest.mark.parametrize("backend", ["replay", "sim"])
def test_replay_and_the_simulator_refuse_a_generating_trace_naming_the_engine(tmp_path, backend):
    trace = generating_trace(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match=r"request a has 'max_new_tokens' and no 'output': only "
                                         rf"backend=engine generates outputs; backend={backend} "
                                         r"needs concrete output ids"):
        run(tmp_path, f"backend={backend}", "workload=trace", f"workload.path={trace}")


def test_the_refusal_is_one_line_on_the_command_line(tmp_path):
    trace = generating_trace(tmp_path / "t.jsonl")
    done = subprocess.run([sys.executable, "-m", "testbed.run", "backend=replay",
                           "workload=trace", f"workload.path={trace}",
                           f"hydra.run.dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: request a has 'max_new_tokens' and no 'output': only backend=engine generates "
        "outputs; backend=replay needs concrete output ids"]


# ---------------------------------------------------------------------------- generating
@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_a_generating_trace_on_the_engine_equals_hf_generate_with_hits_and_eviction(
        tmp_path, llama_with_eos, attention):
    """Greedy tokens equal HF's for every call, EOS included; call d's prompt holds a's real
    output; prefixes are hit and the 130-token pool forces evictions."""
    if attention == "triton" and not torch.cuda.is_available() \
            and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET unset")
    ckpt, hf, trace, eos = llama_with_eos
    summary, records = run(tmp_path, "backend=engine", "workload=trace",
                           f"workload.path={trace}", f"model.path={ckpt}",
                           f"device={'cuda' if torch.cuda.is_available() else 'cpu'}",
                           f"attention={attention}", "cache.capacity_tokens=130",
                           "save_token_ids=true")
    by_id = {r["id"]: r for r in records}
    requests = {r.id: r for r in load_tokens(trace)}
    for rid, rec in by_id.items():
        req = requests[rid]
        if req.generates:
            assert rec["output_ids"] == hf_generate(hf, rec["prompt_ids"], req.max_new_tokens), rid
        else:
            assert rec["output_ids"] == req.output.tolist()  # replayed, EOS or not
    assert by_id["a"]["output_ids"][-1] == eos and len(by_id["a"]["output_ids"]) == 3
    assert by_id["d"]["prompt_ids"] == (requests["a"].prompt.tolist() + by_id["a"]["output_ids"]
                                        + requests["d"].segments[-1].tolist())
    assert by_id["d"]["cached_tokens"] >= len(requests["a"].prompt) + 2  # a's prompt and output
    assert by_id["b"]["cached_tokens"] >= 40  # the system prompt, cached by a
    assert summary["evicted_tokens"] > 0 and summary["aborted_requests"] == 0
    assert summary["model"] == "ckpt" and summary["attention"] == attention


# ---------------------------------------------------------------------------- any checkpoint
def small(**extra):
    return dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=200, max_position_embeddings=4096,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None) | extra


CHECKPOINTS = {
    "llama": lambda: tiny_config(num_hidden_layers=3, hidden_size=96, num_attention_heads=6,
                                 num_key_value_heads=2, intermediate_size=160, vocab_size=300),
    "mistral": lambda: transformers.MistralConfig(**small(sliding_window=None)),
    "qwen2": lambda: transformers.Qwen2Config(**small(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("kind", CHECKPOINTS)
def test_model_path_alone_runs_any_supported_checkpoint_and_equals_hf_generate(tmp_path, kind):
    config = CHECKPOINTS[kind]()
    hf = save_random_hf_model(tmp_path / kind, config, seed=2)
    group = checkpoint_group(tmp_path / kind)
    assert (group["model_type"], group["num_layers"], group["num_kv_heads"]) == \
        (kind, config.num_hidden_layers, 2)
    summary, records = run(tmp_path, "backend=engine", f"model.path={tmp_path / kind}",
                           "device=cpu", "workload=shared_prefix", "workload.num_groups=2",
                           "workload.prompts_per_group=3", "workload.system_prompt_len=24",
                           "workload.question_len=6", "workload.output_len=5", "forced=false",
                           "arrival.max_in_flight=2",
                           "save_token_ids=true")
    assert summary["model"] == kind and summary["hit_rate"] > 0
    for rec in records:
        assert rec["output_ids"] == hf_generate(hf, rec["prompt_ids"], 5), rec["id"]


def test_the_simulator_prices_the_checkpoints_shape_and_a_named_preset_must_match(tmp_path):
    save_random_hf_model(tmp_path / "ck", tiny_config(num_hidden_layers=3), seed=0)
    sim, _ = run(tmp_path, "backend=sim", f"model.path={tmp_path / 'ck'}", "workload=few_shot",
                 "workload.num_tasks=1", "workload.questions_per_task=2")
    kv_bytes = 2 * 3 * 2 * 16 * 4  # layers, KV heads, head_dim, fp32 as saved
    assert sim["model"] == "ck"
    assert sim["kv_capacity_tokens"] == int((24e9 * 0.9 - group_params(tmp_path / "ck") * 4)
                                            // kv_bytes)
    with pytest.raises(ValueError, match=r"model=llama2_7b does not match model.path=.*: "
                                         r"num_layers=32 but the checkpoint has 3"):
        run(tmp_path, "backend=sim", "model=llama2_7b", f"model.path={tmp_path / 'ck'}")
    assert resolve_model_group({"name": "tiny", "num_layers": 2}) == {"name": "tiny",
                                                                      "num_layers": 2}


def group_params(path: Path) -> int:
    from testbed.sim.specs import model_spec

    return model_spec(checkpoint_group(path)).params
