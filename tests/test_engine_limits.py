"""The engine refuses requests its model cannot take before it runs a step: a token id outside
the vocabulary, a prompt plus output longer than the checkpoint's context
(``max_position_embeddings`` in its config.json), an empty prompt. One `BadInput` line names the
request and the limit; on the command line, exit 2 and one ``error:`` line. A prompt rebuilt
from real outputs is refused when its call is formed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.config.assembly import compose_config  # noqa: E402
from testbed.engine.limits import ModelLimits  # noqa: E402
from testbed.engine.loader import save_random_hf_model, tiny_config  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from testbed.errors import BadInput  # noqa: E402
from testbed.execute import execute  # noqa: E402
from testbed.workloads.request import OutputRef, Request  # noqa: E402
from tests.conftest import toks  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(4)


def tok(n: int) -> list[int]:
    return rng.integers(0, 256, n).tolist()


@pytest.fixture(scope="module")
def ctx256(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint whose context is 256 positions."""
    path = tmp_path_factory.mktemp("ckpt") / "ctx256"
    save_random_hf_model(path, tiny_config(max_position_embeddings=256), seed=0)
    return path


def trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def engine_overrides(trace_path: Path, *extra: str) -> list[str]:
    return ["backend=engine", "device=cpu", "workload=trace", "workload.format=tokens",
            f"workload.path={trace_path}", *extra]


def run_engine(tmp_path: Path, overrides: list[str]) -> dict:
    cfg = compose_config(["progress=false", "hardware=cpu", *overrides])
    return execute(cfg, tmp_path / "run")


def cli(tmp_path: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.run", *overrides,
                           f"hydra.run.dir={tmp_path / 'cli'}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def bad_traces(tmp_path: Path, ctx256: Path) -> dict[str, tuple[list[str], str]]:
    """Each case: the run's overrides and the one line that refuses it."""
    ok = {"id": "ok", "prompt": tok(20), "output": tok(3)}
    vocab = trace(tmp_path / "vocab.jsonl", [
        ok, {"id": "3", "prompt": [*tok(12), 70000, *tok(4)], "output": tok(2)}])
    long = trace(tmp_path / "long.jsonl", [
        ok, {"id": "17", "prompt": tok(404), "max_new_tokens": 16}])
    empty = trace(tmp_path / "empty.jsonl", [ok, {"id": "e", "prompt": [], "output": tok(2)}])
    return {
        "vocab": (engine_overrides(vocab, "model=tiny"),
                  "request 3: token id 70000 at position 12 is outside the model's vocabulary "
                  "of 256 tokens"),
        "context": (engine_overrides(long, f"model.path={ctx256}"),
                    f"request 17: prompt 404 + output 16 tokens exceeds the model's context of "
                    f"256 (max_position_embeddings in {ctx256}/config.json)"),
        "empty": (engine_overrides(empty, "model=tiny"),
                  f"{empty}:2: request e: empty prompt (a call is served by prefilling at least "
                  "one prompt token)"),
    }


@pytest.mark.parametrize("case", ["vocab", "context", "empty"])
def test_a_request_the_model_cannot_take_is_refused_before_any_step(tmp_path, ctx256, case,
                                                                    monkeypatch):
    overrides, message = bad_traces(tmp_path, ctx256)[case]

    def no_step(self, batch):
        raise AssertionError("a step ran before the requests were checked")

    monkeypatch.setattr(ModelRunner, "run", no_step)
    with pytest.raises(BadInput) as refused:
        run_engine(tmp_path, overrides)
    assert str(refused.value) == message


@pytest.mark.parametrize("case", ["vocab", "context", "empty"])
def test_the_command_line_exits_2_with_one_error_line(tmp_path, ctx256, case):
    overrides, message = bad_traces(tmp_path, ctx256)[case]
    done = cli(tmp_path, overrides)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {message}"]


def test_a_prompt_within_the_context_runs(tmp_path, ctx256):
    path = trace(tmp_path / "fits.jsonl", [{"id": "17", "prompt": tok(240), "max_new_tokens": 16}])
    summary = run_engine(tmp_path, engine_overrides(path, f"model.path={ctx256}"))
    assert summary["num_requests"] == 1 and summary["output_tokens"] == 16


def test_a_prompt_rebuilt_from_real_outputs_is_refused_when_its_call_is_formed(tmp_path, ctx256):
    """d's literal 210 tokens + 20 fit in 256 before running; with a's 30 generated tokens
    spliced in, they do not: refused when d is formed, naming d. With 250 literal tokens the
    check before running already refuses it."""
    first = tok(100)
    late = [{"id": "a", "prompt": first, "max_new_tokens": 30, "program": "p"},
            {"id": "d", "prompt": [*first, {"output": "a"}, *tok(110)], "max_new_tokens": 20,
             "after": ["a"], "program": "p"}]
    with pytest.raises(BadInput, match=r"^request d: prompt 240 \+ output 20 tokens exceeds the "
                                       r"model's context of 256 \(max_position_embeddings in "):
        run_engine(tmp_path, engine_overrides(trace(tmp_path / "late.jsonl", late),
                                              f"model.path={ctx256}"))
    late[1]["prompt"] = [*first, {"output": "a"}, *tok(150)]
    with pytest.raises(BadInput, match=r"^request d: prompt 250 \(before its spliced outputs\) "
                                       r"\+ output 20 tokens exceeds the model's context of 256"):
        run_engine(tmp_path, engine_overrides(trace(tmp_path / "early.jsonl", late),
                                              f"model.path={ctx256}", "forced=false"))


# ---------------------------------------------------------------------------- the checks alone
LIMITS = ModelLimits(vocab_size=100, context=50, context_source="max_position_embeddings in X")


def test_negative_ids_and_fed_outputs_outside_the_vocabulary_are_refused():
    with pytest.raises(BadInput, match=r"^request n: token id -3 at position 1 is outside the "
                                       r"model's vocabulary of 100 tokens$"):
        LIMITS.check_workload([Request("n", toks(5, -3, 7), toks(1))], rebuilt=False,
                              forced=True)
    replayed = [Request("o", toks(5, 6), toks(1, 100))]
    with pytest.raises(BadInput, match=r"^request o: output token id 100 at position 1 is "):
        LIMITS.check_workload(replayed, rebuilt=False, forced=True)
    LIMITS.check_workload(replayed, rebuilt=False, forced=False)  # the model generates instead


def test_a_rebuilt_prompts_literal_ids_are_checked_at_their_positions_before_running():
    a = Request("a", toks(1, 2), toks(3, 4, 5))
    d = Request("d", toks(1, 2, 3, 4, 5, 120), toks(9), after=["a"],
                segments=(toks(1, 2), OutputRef("a"), toks(120)))
    with pytest.raises(BadInput, match=r"^request d: token id 120 at position 5 is outside"):
        LIMITS.check_workload([a, d], rebuilt=True, forced=False)


def test_a_random_model_holds_requests_to_the_context_its_group_states():
    assert ModelLimits.for_group({"name": "tiny", "max_position_embeddings": 4096}, 256) == \
        ModelLimits(256, 4096, "model.max_position_embeddings of model=tiny")
    assert ModelLimits.for_group({"name": "llama3_8b"}, 128256).context is None
    ModelLimits(10, None).check_prompt("x", toks(*range(10)) % 10, 10**6)  # no limit stated
