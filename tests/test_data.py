"""Public traces on demand (`testbed.data`): downloads are checked against the pinned SHA-256
before they land, failures leave nothing behind and say in one line what to do, and
``workload.path=data:NAME`` replays exactly as the file's own path does.

Downloads are served by an HTTP server on 127.0.0.1 started in the test; nothing here reaches
another machine. Tests that need the real traces read them from the data folder (`make test`
fetches them there), else from ../shared/traces, else skip saying how to fetch them."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from testbed.data import (FOLDERS, PACKAGE_FILES, TRACES, DataError, data_dir, download,
                          resolve_folder, resolve_trace, sha256_of)
from tests.conftest import data_file, vidur_profile

REPO = Path(__file__).resolve().parents[1]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


@contextmanager
def http_server(folder: Path):
    """Serve ``folder`` on 127.0.0.1 (a free port) until the block ends; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler,
                                                                      directory=str(folder)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused): the offline case."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def shared(name: str) -> Path:
    """The real trace ``name`` (`tests.conftest.data_file`)."""
    return data_file(name)


def cli(*args: str, data: Path, mirror: str | None = None, module: str = "testbed.data"):
    env = {**os.environ, "TESTBED_DATA": str(data)}
    env.pop("TESTBED_DATA_MIRROR", None)
    if mirror:
        env["TESTBED_DATA_MIRROR"] = mirror
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_download_with_the_right_hash_lands_under_its_name(tmp_path):
    (tmp_path / "site").mkdir()
    body = b"".join(b'{"n": %d}\n' % i for i in range(5000))
    (tmp_path / "site" / "t.jsonl").write_bytes(body)
    dest = tmp_path / "data" / "t.jsonl"
    with http_server(tmp_path / "site") as url:
        got = download(f"{url}/t.jsonl", dest, hashlib.sha256(body).hexdigest(), len(body))
    assert got == hashlib.sha256(body).hexdigest() and dest.read_bytes() == body
    assert os.listdir(dest.parent) == ["t.jsonl"]  # the temporary file was renamed, not copied


def test_a_wrong_hash_is_refused_in_one_line_and_leaves_no_file(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "t.jsonl").write_bytes(b"not the pinned bytes\n")
    actual = hashlib.sha256(b"not the pinned bytes\n").hexdigest()
    dest = tmp_path / "data" / "t.jsonl"
    with http_server(tmp_path / "site") as url, pytest.raises(DataError) as e:
        download(f"{url}/t.jsonl", dest, "0" * 64)
    assert str(e.value) == (f"{url}/t.jsonl: sha256 mismatch, expected {'0' * 64}, "
                            f"got {actual}; the download was discarded")
    assert os.listdir(dest.parent) == []


def test_offline_the_error_names_the_url_and_where_to_put_the_file(tmp_path):
    url = f"{closed_port_url()}/t.jsonl"
    dest = tmp_path / "data" / "t.jsonl"
    with pytest.raises(DataError) as e:
        download(url, dest, None)
    message = str(e.value)
    assert message.startswith(f"could not download {url} (")
    assert message.endswith(f"; put the file there by hand: {dest}") and "\n" not in message
    assert os.listdir(dest.parent) == []


def test_a_missing_file_on_the_server_is_the_same_one_line_error(tmp_path):
    (tmp_path / "site").mkdir()
    with http_server(tmp_path / "site") as url, pytest.raises(DataError) as e:
        download(f"{url}/absent.csv", tmp_path / "data" / "absent.csv", None)
    assert "(HTTP 404 File not found); put the file there by hand" in str(e.value)


def test_the_data_folder_is_testbed_data_else_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TESTBED_DATA", raising=False)
    assert data_dir() == tmp_path / "home" / ".cache" / "radix-testbed" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_dir() == tmp_path / "xdg" / "radix-testbed" / "data"
    monkeypatch.setenv("TESTBED_DATA", str(tmp_path / "mine"))
    assert data_dir() == tmp_path / "mine"


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(DataError) as e:
        resolve_trace("data:mooncake")
    assert str(e.value) == ("data:mooncake: unknown name; known: "
                            + ", ".join([*TRACES, *PACKAGE_FILES, *FOLDERS])
                            + " (python -m testbed.data list)")


def test_data_names_set_the_format_and_refuse_another(monkeypatch):
    path = shared("azure_code_2023")
    monkeypatch.setenv("TESTBED_DATA", str(path.parent))
    assert resolve_trace("data:azure_code_2023") == (path, "azure")
    assert resolve_trace("data:azure_code_2023", "azure") == (path, "azure")
    with pytest.raises(DataError, match=r"^workload.format=mooncake does not fit "
                                        r"data:azure_code_2023 \(format azure\); set "
                                        r"workload.format=azure or leave it unset$"):
        resolve_trace("data:azure_code_2023", "mooncake")
    assert resolve_trace("some/file.jsonl", None) == (Path("some/file.jsonl"), None)


def test_the_registry_pins_the_hashes_and_sizes_of_the_shared_copies():
    for trace in TRACES.values():
        if trace.sha256 is None:
            continue
        path = shared(trace.name)
        assert (sha256_of(path), path.stat().st_size) == (trace.sha256, trace.size), trace.name
        assert trace.url.startswith("https://raw.githubusercontent.com/")


VIDUR = "vidur_a100_codellama34b_tp2"


def test_the_registry_pins_every_file_of_vidurs_profile():
    profile, entry = vidur_profile(), FOLDERS[VIDUR]
    assert [(f, sha256_of(profile / f), (profile / f).stat().st_size) for f, _, _ in entry.files] \
        == list(entry.files)
    assert entry.file_url("mlp.csv") == ("https://raw.githubusercontent.com/microsoft/vidur/"
                                         "acb95f6/data/profiling/a100/mlp.csv")


def test_a_profile_is_fetched_file_by_file_and_then_read_by_cost_model_profile_dir(tmp_path,
                                                                                   monkeypatch):
    """Each file lands verified in the directory NAME; ``data:NAME`` is that directory, and a
    second fetch downloads nothing."""
    profile, data = vidur_profile(), tmp_path / "data"
    with http_server(profile) as mirror:
        first = cli("fetch", VIDUR, data=data, mirror=mirror)
    again = cli("fetch", VIDUR, data=data, mirror=closed_port_url())
    assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
    where = f"{data / VIDUR} (4 files of microsoft/vidur@acb95f6, each sha256 verified)\n"
    assert (first.stdout, again.stdout) == (f"{VIDUR}: fetched into {where}",
                                            f"{VIDUR}: already at {where}")
    assert sorted(os.listdir(data / VIDUR)) == sorted(f for f, _, _ in FOLDERS[VIDUR].files)
    monkeypatch.setenv("TESTBED_DATA", str(data))
    assert resolve_folder(f"data:{VIDUR}", "cost_model.profile_dir") == data / VIDUR
    run = cli("backend=sim", "model=codellama_34b", "hardware=a100", "cost_model=vidur",
              f"cost_model.profile_dir=data:{VIDUR}", "workload.num_problems=1",
              f"hydra.run.dir={tmp_path / 'run'}", data=data, module="testbed.run")
    assert run.returncode == 0, run.stderr


def test_a_profile_offline_names_its_first_file_and_where_to_put_it(tmp_path):
    data = tmp_path / "data"
    mirror = closed_port_url()
    proc = cli("fetch", VIDUR, "mooncake_synthetic", data=data, mirror=mirror)
    assert proc.returncode == 2 and proc.stdout == ""
    first, second = proc.stderr.splitlines()  # each name tried: one failing stops no other
    assert first.startswith(f"error: data:{VIDUR}: could not download {mirror}/mlp.csv (")
    assert first.endswith(f"; run python -m testbed.data fetch {VIDUR} where it is reachable, "
                          f"or put the file there by hand: {data / VIDUR / 'mlp.csv'}")
    assert second.startswith("error: data:mooncake_synthetic: could not download ")
    with pytest.raises(DataError) as e:
        resolve_trace(f"data:{VIDUR}")
    assert str(e.value) == (f"data:{VIDUR} is a directory of files, not a trace; use it as "
                            f"cost_model.profile_dir=data:{VIDUR}")


def test_fetch_downloads_verifies_and_then_finds_the_file_here(tmp_path):
    source = shared("azure_code_2023")
    data = tmp_path / "data"
    with http_server(source.parent) as mirror:
        first = cli("fetch", "azure_code_2023", data=data, mirror=mirror)
        again = cli("fetch", "azure_code_2023", data=data, mirror=closed_port_url())
    dest = data / "azure_llm_inference_2023_code.csv"
    sha = TRACES["azure_code_2023"].sha256
    assert first.returncode == 0, first.stderr
    assert first.stdout == f"azure_code_2023: fetched into {dest} (sha256 {sha}, verified)\n"
    assert dest.read_bytes() == source.read_bytes() and os.listdir(data) == [dest.name]
    assert again.returncode == 0, again.stderr  # no download: the server is gone
    assert again.stdout == f"azure_code_2023: already at {dest} (sha256 {sha}, verified)\n"
    listing = cli("list", data=data).stdout
    assert f"data folder: {data}" in listing
    assert [line.split()[-1] for line in listing.splitlines() if line.startswith("azure_")] == \
        ["no", "yes"]


def test_fetch_refuses_a_file_that_is_not_the_pinned_one(tmp_path, monkeypatch):
    site, data = tmp_path / "site", tmp_path / "data"
    site.mkdir()
    (site / "azure_llm_inference_2023_code.csv").write_text("TIMESTAMP,ContextTokens,"
                                                           "GeneratedTokens\n")
    actual = sha256_of(site / "azure_llm_inference_2023_code.csv")
    with http_server(site) as mirror:
        proc = cli("fetch", "azure_code_2023", data=data, mirror=mirror)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: data:azure_code_2023: {mirror}/azure_llm_inference_2023_code"
                           f".csv: sha256 mismatch, expected {TRACES['azure_code_2023'].sha256}, "
                           f"got {actual}; the download was discarded\n")
    assert os.listdir(data) == []
    # the same file put there by hand is refused too, on use
    shutil.copy(site / "azure_llm_inference_2023_code.csv", data)
    monkeypatch.setenv("TESTBED_DATA", str(data))
    with pytest.raises(DataError, match=f"has sha256 {actual}, expected"):
        resolve_trace("data:azure_code_2023")


def test_an_unpinned_trace_is_fetched_and_its_hash_reported_as_unverified(tmp_path):
    assert TRACES["mooncake_toolagent"].sha256 is None
    site, data = tmp_path / "site", tmp_path / "data"
    site.mkdir()
    body = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
    (site / "mooncake_toolagent_trace.jsonl").write_text(body)
    with http_server(site) as mirror:
        proc = cli("fetch", "mooncake_toolagent", data=data, mirror=mirror)
    assert proc.returncode == 0, proc.stderr
    sha = hashlib.sha256(body.encode()).hexdigest()
    assert proc.stdout == (f"mooncake_toolagent: fetched into {data / 'mooncake_toolagent_trace'}"
                           f".jsonl (sha256 {sha}, UNVERIFIED: the registry pins no hash for it)\n")


def test_offline_fetch_and_run_fail_with_one_line(tmp_path):
    data = tmp_path / "data"
    mirror = closed_port_url()
    where = f"put the file there by hand: {data / 'mooncake_synthetic_trace.jsonl'}"
    fetch = cli("fetch", "mooncake_synthetic", data=data, mirror=mirror)
    run = cli("backend=replay", "workload=trace", "workload.path=data:mooncake_synthetic",
              f"hydra.run.dir={tmp_path / 'run'}", data=data, mirror=mirror, module="testbed.run")
    for proc, prefix in ((fetch, "error: "), (run, "error: ")):
        assert proc.returncode == 2
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"{prefix}data:mooncake_synthetic: could not download "
                                   f"{mirror}/mooncake_synthetic_trace.jsonl (")
        assert lines[0].endswith(where)
    assert os.listdir(data) == []


def test_a_data_name_replays_exactly_as_the_plain_path(tmp_path):
    path = shared("mooncake_synthetic")
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(path, data)
    common = ["backend=replay", "workload=trace", "cache=radix", "cache.capacity_tokens=300000"]
    by_name = cli(*common, "workload.path=data:mooncake_synthetic",
                  f"hydra.run.dir={tmp_path / 'name'}", data=data, module="testbed.run")
    by_path = cli(*common, f"workload.path={path}", "workload.format=mooncake",
                  f"hydra.run.dir={tmp_path / 'path'}", data=data, module="testbed.run")
    assert by_name.returncode == 0, by_name.stderr
    assert by_path.returncode == 0, by_path.stderr
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("name", "path"))
    keys = ["num_requests", "prompt_tokens", "cached_tokens", "hit_rate", "ideal_hit_rate",
            "evicted_tokens", "uncached_requests"]
    assert [a[k] for k in keys] == [b[k] for k in keys]
    assert a["num_requests"] == 3993 and 0 < a["hit_rate"] < a["ideal_hit_rate"]
    assert a["config"]["workload"]["format"] is None and b["config"]["workload"]["format"] == \
        "mooncake"
    assert (tmp_path / "name" / "requests.jsonl").read_bytes() == \
        (tmp_path / "path" / "requests.jsonl").read_bytes()


def test_a_plain_trace_file_is_read_as_tokens_when_no_format_is_given(tmp_path):
    from testbed.workloads import build_workload

    (tmp_path / "t.jsonl").write_text('{"prompt": [1, 2, 3], "output": [4]}\n')
    (request,) = build_workload({"name": "trace", "path": str(tmp_path / "t.jsonl"),
                                 "format": None})
    assert request.prompt.tolist() == [1, 2, 3] and request.output.tolist() == [4]
