"""Trace loaders: Bailian (ATC'25) blocks and conversations, Azure 2023 CSV, ShareGPT, token extras."""

import json

import numpy as np
import pytest

from conftest import data_file
from testbed.workloads.request import Request
from testbed.workloads.traces import (
    LOADERS, TRACE_FORMATS, TraceError, load_azure, load_bailian, load_tokens, load_trace,
    save_tokens,
)
from testbed.workloads.sharegpt import load_sharegpt

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def write_lines(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat(chat_id, parent=-1, ts=0.0, n_in=16, n_out=1, hash_ids=None, **extra):
    rec = {"chat_id": chat_id, "parent_chat_id": parent, "timestamp": ts, "input_length": n_in,
           "output_length": n_out, "type": "text", "turn": 1,
           "hash_ids": hash_ids if hash_ids is not None else list(range(-(-n_in // 16)))}
    rec.update(extra)
    return rec


def all_tokens(requests):
    return np.concatenate([r.sequence() for r in requests])


def test_all_formats_are_registered():
    assert list(TRACE_FORMATS) == ["tokens", "mooncake", "bailian", "azure", "sharegpt"]
    assert list(LOADERS) == list(TRACE_FORMATS)  # every format has its loader


# --- tokens: think time and priority ------------------------------------------------------------

def test_tokens_round_trip_keeps_think_time_and_priority(tmp_path):
    reqs = [Request(id="a", prompt=np.array([1, 2], np.int32), output=np.array([3], np.int32),
                    program="p"),
            Request(id="b", prompt=np.array([1], np.int32), output=np.array([], np.int32),
                    program="p", after=["a"], think_time_s=2.5, priority=-3)]
    save_tokens(reqs, tmp_path / "t.jsonl")
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert "think_time_s" not in lines[0] and "priority" not in lines[0]  # defaults not written
    assert (lines[1]["think_time_s"], lines[1]["priority"]) == (2.5, -3)
    a, b = load_tokens(tmp_path / "t.jsonl")
    assert (a.think_time_s, a.priority, b.think_time_s, b.priority) == (0.0, 0, 2.5, -3)
    assert (b.id, b.program, b.after) == ("b", "p", ["a"])


def test_a_trace_loaded_again_unchanged_is_read_once_and_each_load_gets_its_own_requests(
        tmp_path, monkeypatch):
    """A sweep's jobs in one process read a trace file once: the same requests again, each
    load its own copies (read-only token arrays); a changed file is read anew."""
    path = write_lines(tmp_path / "t.jsonl", {"prompt": [1, 2, 3], "output": [4]},
                       {"prompt": [1, 2], "output": [5, 6]})
    reads = []
    monkeypatch.setitem(LOADERS, "tokens", lambda p: reads.append(p) or load_tokens(p))
    first = load_trace(path)
    first[0].priority = 7  # a run's change stays its own
    second = load_trace(path)
    assert len(reads) == 1 and second[0] is not first[0] and second[0].priority == 0
    assert [r.sequence().tolist() for r in second] == [[1, 2, 3, 4], [1, 2, 5, 6]]
    with pytest.raises(ValueError, match="read-only"):
        second[1].output[0] = 9
    write_lines(path, {"prompt": [8], "output": [9]})  # another size: read again
    assert [r.sequence().tolist() for r in load_trace(path)] == [[8, 9]] and len(reads) == 2


@pytest.mark.parametrize("extra, message", [
    ({"think_time_s": -1}, "'think_time_s' must be a number >= 0"),
    ({"think_time_s": "1"}, "field 'think_time_s' has the wrong type"),
    ({"priority": 1.5}, "field 'priority' has the wrong type (float)"),
    ({"priority": True}, "field 'priority' has the wrong type (bool)"),
])
def test_bad_think_time_or_priority_names_file_line_and_field(tmp_path, extra, message):
    path = write_lines(tmp_path / "t.jsonl", {"prompt": [1], "output": []},
                       {"prompt": [1], "output": [], **extra})
    with pytest.raises(TraceError) as err:
        load_tokens(path)
    assert f"{path}:2: " in str(err.value) and message in str(err.value)


# --- bailian --------------------------------------------------------------------------------------

def test_bailian_blocks_become_16_tokens_and_the_last_block_is_cut(tmp_path):
    path = write_lines(tmp_path / "b.jsonl",
                       chat(10, ts=0.5, n_in=20, n_out=3, hash_ids=[4, 7]),
                       chat(11, ts=1.25, n_in=16, n_out=2, hash_ids=[4]))
    a, b = load_bailian(path)
    assert np.array_equal(a.prompt, np.r_[np.arange(64, 80), np.arange(112, 116)])
    assert np.array_equal(b.prompt, np.arange(64, 80))
    assert (a.id, a.arrival_s, b.id, b.arrival_s) == ("10", 0.5, "11", 1.25)
    # Outputs: fresh ids above every block token (top block 7 -> from 128), unique per request.
    assert a.output.tolist() == [128, 129, 130] and b.output.tolist() == [131, 132]
    assert a.prompt.dtype == np.int32 and a.output.dtype == np.int32


def test_bailian_parent_becomes_after_and_program_is_the_root_chat(tmp_path):
    path = write_lines(tmp_path / "b.jsonl",
                       chat(5), chat(7, parent=5, ts=1), chat(9, parent=7, ts=2),
                       chat(8, ts=3), chat(12, parent=8, ts=4))
    reqs = load_bailian(path)
    assert [(r.id, r.after, r.program) for r in reqs] == [
        ("5", [], "5"), ("7", ["5"], "5"), ("9", ["7"], "5"), ("8", [], "8"), ("12", ["8"], "8")]


def test_bailian_parent_missing_or_later_in_the_file_means_no_dependency(tmp_path):
    path = write_lines(tmp_path / "b.jsonl",
                       chat(3, parent=99), chat(4, parent=6), chat(6), chat(7, parent=3))
    reqs = load_bailian(path)
    assert [(r.id, r.after, r.program) for r in reqs] == [
        ("3", [], "3"), ("4", [], "4"), ("6", [], "6"), ("7", ["3"], "3")]


def test_bailian_duplicate_chat_id_names_file_and_line(tmp_path):
    path = write_lines(tmp_path / "b.jsonl", chat(1), chat(2), chat(1, ts=5))
    with pytest.raises(TraceError, match=r"b\.jsonl:3: duplicate chat_id 1"):
        load_bailian(path)


@pytest.mark.parametrize("record, message", [
    (chat(1, n_in=33, hash_ids=[1, 2]), "2 hash_ids for input_length 33 (expected ceil(33/16))"),
    ({k: v for k, v in chat(1).items() if k != "type"}, "missing field 'type'"),
    (chat(1, turn="1"), "field 'turn' has the wrong type (str)"),
    (chat(1, type=3), "field 'type' has the wrong type (int)"),
    (chat(1, parent=-2), "'parent_chat_id' must be -1 (none) or a chat id, got -2"),
    (chat(-4), "'chat_id' must be >= 0, got -4"),
    (chat(1, ts=-1.0), "'timestamp' must be a number >= 0"),
    (chat(1, n_in=16, n_out=-1), "lengths must be >= 0"),
    (chat(1, hash_ids=[-1]), "hash_ids must be non-negative integers"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_bailian_names_file_line_and_problem(tmp_path, record, message):
    path = write_lines(tmp_path / "b.jsonl", chat(0), record)
    with pytest.raises(TraceError) as err:
        load_bailian(path)
    assert f"{path}:2: " in str(err.value) and message in str(err.value)


def test_bailian_block_ids_too_large_for_32_bit_tokens_are_rejected(tmp_path):
    path = write_lines(tmp_path / "b.jsonl", chat(0, hash_ids=[2**28]))
    with pytest.raises(TraceError, match="too large to map to 32-bit token ids"):
        load_bailian(path)


# --- azure ----------------------------------------------------------------------------------------

def test_azure_arrivals_are_seconds_since_the_first_row_and_lengths_are_kept(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(f"{AZURE_HEADER}\n"
                    "2023-11-16 18:15:46.6805900,3,2\n"
                    "2023-11-16 18:15:50.9951690,1,4\n"
                    "2023-11-16 18:16:46.6805901,2,0\n")
    reqs = load_azure(path)
    assert [r.id for r in reqs] == ["0", "1", "2"]
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 4.314579, 60.0000001], abs=1e-9)
    assert [(len(r.prompt), len(r.output)) for r in reqs] == [(3, 2), (1, 4), (2, 0)]
    # Fresh consecutive ids from 0 across the file, prompt then output: nothing is shared.
    assert all_tokens(reqs).tolist() == list(range(12))
    assert reqs[1].prompt.tolist() == [5] and reqs[1].output.tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("body, line, message", [
    ("time,in,out\n2023-11-16 18:15:46,1,1\n", 1, "expected the header " + AZURE_HEADER),
    ("", 1, "expected the header " + AZURE_HEADER + ", got an empty file"),
    (f"{AZURE_HEADER}\n2023-11-16 18:15:46,1,1\n2023-11-16 18:15:47,1.5,1\n", 3,
     "ContextTokens must be a non-negative integer, got '1.5'"),
    (f"{AZURE_HEADER}\n2023-11-16 18:15:46,1,-1\n", 2,
     "GeneratedTokens must be a non-negative integer, got '-1'"),
    (f"{AZURE_HEADER}\n2023-11-16 18:15:46,1\n", 2, "expected 3 comma-separated fields, got 2"),
    (f"{AZURE_HEADER}\n2023-11-16 18:15:46,1,1\nyesterday,1,1\n", 3,
     "TIMESTAMP 'yesterday' is not a date and time"),
    (f"{AZURE_HEADER}\n2023-11-16 18:15:46,1,1\n2023-11-16 18:15:45,1,1\n", 3,
     "is before the first row's"),
])
def test_malformed_azure_csv_names_file_line_and_problem(tmp_path, body, line, message):
    path = tmp_path / "a.csv"
    path.write_text(body)
    with pytest.raises(TraceError) as err:
        load_azure(path)
    assert f"{path}:{line}: " in str(err.value) and message in str(err.value)


def test_azure_conversation_trace_loads_every_row():
    path = data_file("azure_conv_2023")
    reqs = load_azure(path)
    assert len(reqs) == 19366
    assert (len(reqs[0].prompt), len(reqs[0].output)) == (374, 44)  # the first data row
    assert reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s == pytest.approx(3501.721937)
    assert sum(len(r.prompt) for r in reqs) == 22361870


# --- sharegpt -------------------------------------------------------------------------------------

VOCAB = ["[UNK]", "hi", "hello", "how", "are", "you", "fine", "thanks", "bye", "be", "brief", "ok"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny word-level tokenizer saved as a local HF tokenizer directory (built offline)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(d)
    return str(d)


def ids(text):
    return [VOCAB.index(w) if w in VOCAB else 0 for w in text.split()]


def msg(role, text):
    return {"from": role, "value": text}


def write_sharegpt(path, convs):
    path.write_text(json.dumps(convs, indent=1))
    return path


def test_sharegpt_turn_prompt_extends_the_previous_prompt_and_output(tmp_path, tokenizer_dir):
    path = write_sharegpt(tmp_path / "s.json", [
        {"id": "c1", "conversations": [
            msg("system", "be brief"), msg("human", "hi how are you"), msg("gpt", "fine thanks"),
            msg("human", "ok"), msg("gpt", "bye"), msg("human", "hi"), msg("gpt", "hello you")]},
        {"id": 7, "conversations": [msg("human", "zzz hi"), msg("gpt", "ok")]},
    ])
    reqs = load_sharegpt(path, tokenizer=tokenizer_dir)
    assert [(r.id, r.program, r.after, r.arrival_s) for r in reqs] == [
        ("c1-0", "c1", [], 0.0), ("c1-1", "c1", ["c1-0"], 0.0), ("c1-2", "c1", ["c1-1"], 0.0),
        ("7-0", "7", [], 0.0)]
    t0, t1, t2, u0 = reqs
    assert t0.prompt.tolist() == ids("be brief hi how are you") == [9, 10, 1, 3, 4, 5]
    assert t0.output.tolist() == ids("fine thanks")
    assert t1.prompt.tolist() == ids("be brief hi how are you fine thanks ok")
    assert t1.output.tolist() == ids("bye")
    assert t2.prompt.tolist() == ids("be brief hi how are you fine thanks ok bye hi")
    assert t2.output.tolist() == ids("hello you")
    for prev, cur in ((t0, t1), (t1, t2)):
        assert np.array_equal(cur.prompt[:len(prev.prompt) + len(prev.output)], prev.sequence())
    assert u0.prompt.tolist() == [0, 1] and u0.output.tolist() == [11]  # unknown word -> [UNK]
    assert t0.segments is None and t0.prompt.dtype == np.int32


def test_sharegpt_token_ids_equal_the_tokenizers(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    text = "hello how are you thanks"
    path = write_sharegpt(tmp_path / "s.json",
                          [{"id": "a", "conversations": [msg("human", text), msg("gpt", text)]}])
    (r,) = load_sharegpt(path, tokenizer=tokenizer_dir)
    expected = AutoTokenizer.from_pretrained(tokenizer_dir)(text, add_special_tokens=False)
    assert r.prompt.tolist() == r.output.tolist() == expected["input_ids"] == [2, 3, 4, 5, 7]


def test_sharegpt_skips_conversations_not_opened_by_a_human_and_empty_gpt_messages(
        tmp_path, tokenizer_dir):
    path = write_sharegpt(tmp_path / "s.json", [
        {"id": "g", "conversations": [msg("gpt", "hi"), msg("human", "ok"), msg("gpt", "bye")]},
        {"id": "e", "conversations": []},
        {"id": "h", "conversations": [msg("human", "hi"), msg("gpt", ""), msg("human", "ok"),
                                      msg("gpt", "bye"), msg("human", "trailing")]},
    ])
    reqs = load_sharegpt(path, tokenizer=tokenizer_dir)
    assert [(r.id, r.after) for r in reqs] == [("h-0", [])]
    assert reqs[0].prompt.tolist() == ids("hi ok") and reqs[0].output.tolist() == ids("bye")


def test_load_trace_passes_the_tokenizer_to_sharegpt_only(tmp_path, tokenizer_dir):
    path = write_sharegpt(tmp_path / "s.json",
                          [{"id": "a", "conversations": [msg("human", "hi"), msg("gpt", "ok")]}])
    (r,) = load_trace(path, "sharegpt", tokenizer=tokenizer_dir)
    assert (r.id, r.prompt.tolist(), r.output.tolist()) == ("a-0", [1], [11])
    tokens = write_lines(tmp_path / "t.jsonl", {"prompt": [1], "output": [2]})
    assert load_trace(tokens, "tokens", tokenizer=None)[0].prompt.tolist() == [1]


def test_sharegpt_without_a_tokenizer_directory_is_a_clear_error(tmp_path):
    path = write_sharegpt(tmp_path / "s.json", [])
    message = ("workload.tokenizer must name a local HF tokenizer directory for "
               "workload.format=sharegpt")
    with pytest.raises(ValueError, match=message):
        load_trace(path, "sharegpt")
    with pytest.raises(ValueError, match="workload.tokenizer: no such directory"):
        load_sharegpt(path, tokenizer=str(tmp_path / "missing"))


def test_load_trace_rejects_unknown_options(tmp_path):
    with pytest.raises(ValueError, match="unknown trace option"):
        load_trace(tmp_path / "x", "tokens", tokeniser="x")


@pytest.mark.parametrize("text, line, message", [
    ('{"id": "a"}', 1, "expected a JSON list of conversations"),
    # (a file that merely ends inside the list is read up to the cut: test_data_packages.py)
    ('[\n {"id": "a", "conversations": []},\n {"id": "b",\n oops}\n]', 4, "not valid JSON"),
    ('[\n {"id": "a", "conversations": []}\n {"id": "b"}]', 3, "expected ',' or ']'"),
    ('[\n {"id": "a", "conversations": []},\n 5\n]', 3, "conversation 1: expected a JSON object"),
    ('[\n {"conversations": []}\n]', 2, "conversation 0: missing field 'id'"),
    ('[\n {"id": [1], "conversations": []}\n]', 2, "'id' must be a string or an integer"),
    ('[\n {"id": "a", "conversations": {}}\n]', 2,
     "conversation 0 (id 'a'): 'conversations' must be a list"),
    ('[\n {"id": "a",\n  "conversations": [{"from": "user", "value": "hi"}]}\n]', 2,
     "message 0: 'from' must be one of human, gpt, system; got 'user'"),
    ('[\n {"id": "a", "conversations": [{"from": "human", "value": 3}]}\n]', 2,
     "message 0: 'value' must be a string"),
    ('[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n'
     ' {"id": "a", "conversations": [{"from": "human", "value": "ok"}]}\n]', 3,
     "duplicate id (also the conversation on line 2)"),
    ('[]\n[]', 2, "extra data after the list"),
])
def test_malformed_sharegpt_names_file_line_and_problem(tmp_path, text, line, message):
    path = tmp_path / "s.json"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        load_sharegpt(path, tokenizer=str(tmp_path))  # structure is checked before the tokenizer
    assert f"{path}:{line}: " in str(err.value) and message in str(err.value)


@pytest.mark.parametrize("loader", [load_bailian, load_azure, load_tokens])
def test_missing_trace_file_is_a_clear_error(tmp_path, loader):
    with pytest.raises(TraceError, match="workload.path: no such file"):
        loader(tmp_path / "nope")
