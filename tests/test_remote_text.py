"""``backend=server server.prompt_format=text``: prompts go out as text (SGLang's gateway takes no
token ids) and are recorded as the server tokenized them; a model without a tokenizer is refused
in one line. Against ``testbed.serve`` on SmolLM2 (skipped without it in the data folder)."""

from __future__ import annotations

import json

import httpx
import pytest

from testbed.api.server import load_tokenizer, start_server
from testbed.config.assembly import compose_config
from testbed.data import is_here, lookup, resolve_model
from testbed.errors import BadInput
from testbed.execute import execute

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_text_prompts_are_recorded_as_the_server_tokenized_them(tmp_path):
    if not is_here(lookup("smollm2_135m_instruct")):
        pytest.skip("smollm2_135m_instruct is not in the data folder: python -m testbed.data "
                    "fetch smollm2_135m_instruct (make real)")
    server = start_server(["model=smollm2_135m", "device=cpu", "cache.capacity_tokens=4000"],
                          timeout_s=300)
    try:
        execute(compose_config([
            "backend=server", f"server.url={server.url}", "server.prompt_format=text",
            "model=smollm2_135m", "workload=chat", "workload.num_sessions=2", "workload.turns=2",
            "workload.system_prompt_len=40", "workload.min_question_len=8",
            "workload.max_question_len=16", "workload.min_output_len=4",
            "workload.max_output_len=6", "save_token_ids=true", "progress=false",
            "arrival.max_concurrency=1"]), tmp_path)
        rows = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["prompt_format"] == "text" and not any(r["failed"] for r in rows)
        tok = load_tokenizer(str(resolve_model("data:smollm2_135m_instruct")))
        for r in rows:  # the ids recorded are a tokenization of text: the server's
            assert r["prompt_tokens"] == len(r["prompt_ids"])
            text = tok.decode(r["prompt_ids"], skip_special_tokens=False)
            assert tok.encode(text) == r["prompt_ids"]
        assert summary["hit_rate"] > 0  # the second turns share the first ones' text
        counters = httpx.get(server.url + "/debug/state").json()["counters"]
        assert counters["prefix_cache_queries"] == sum(r["prompt_tokens"] for r in rows)
    finally:
        server.stop()


def test_a_model_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    with pytest.raises(BadInput, match="server.prompt_format=text needs a model with a tokenizer"):
        execute(compose_config(["backend=server", "server.url=http://127.0.0.1:9",
                                "server.prompt_format=text", "model=tiny", "progress=false",
                                "workload=chat", "workload.num_sessions=1"]), tmp_path)
