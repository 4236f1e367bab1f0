"""A workload is checked once, for every backend alike, before anything runs
(`testbed.workloads.checks`): a duplicate id, an ``after`` naming no call or another program's,
a cycle, an empty prompt, and in a token trace an empty file or an item that is no token id, are
refused in one line naming the file and line (a trace) or the call (a generated workload), the
same line on replay, the simulator and the engine; the command line exits 2 with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testbed.errors import BadInput, WorkloadRefused
from testbed.execute import execute
from testbed.workloads.checks import check_workload
from testbed.workloads.request import OutputRef, Request

REPO = Path(__file__).resolve().parents[1]


def line(id: str, prompt=(1, 2, 3), **extra) -> str:
    return json.dumps({"id": id, "prompt": list(prompt), "output": [4], **extra})


# (name, the trace's lines, the message after "PATH:"; {path} stands for the file)
TRACES = [
    ("duplicate id", [line("a"), line("a", (1, 2))],
     "2: duplicate request id 'a' (first at {path}:1); every call needs an id of its own"),
    ("waits for itself", [line("a", after=["a"])],
     "1: request a waits for itself ('after': a → a); no call of a cycle can ever start"),
    ("a cycle of three", [line("x", program="p"), line("a", program="p", after=["b"]),
                          line("b", program="p", after=["c"]),
                          line("c", program="p", after=["a", "x"])],
     "2: request a waits for itself ('after': a → b → c → a); no call of a cycle can ever start"),
    ("a cycle across programs", [line("a", after=["b"]), line("b", after=["a"])],
     "1: request a waits for b ('after') of another program ('b', not 'a'); calls that wait for "
     "each other must share a 'program'"),
    ("after names no call", [line("a"), line("b", after=["zz"])],
     "2: request b waits for 'zz' ('after'), but no request has that id"),
    ("an empty file", [],
     " the trace holds no requests (an empty file, or nothing but blank lines or a header); a "
     "trace needs at least one"),
    ("blank lines only", ["", "  "],
     " the trace holds no requests (an empty file, or nothing but blank lines or a header); a "
     "trace needs at least one"),
    ("an empty prompt", [line("a", ())],
     "1: request a: empty prompt (a call is served by prefilling at least one prompt token)"),
    ("a string token", [line("a", (1, "x"))],
     '1: prompt: token ids must be integers, got "x" at position 1'),
    ("a token id of 2**64", [line("a", (2**64,))],
     "1: prompt: token ids must lie in [0, 2^31), got 18446744073709551616 at position 0"),
    ("a program that is a list", [line("a", program=[1])],
     "1: 'program' must be a string or an integer, got [1]"),
    ("JSON nested too deeply", ["[" * 100_000 + "]" * 100_000],
     "1: not valid JSON (nested too deeply)"),
]


@pytest.mark.parametrize("backend", ["replay", "sim", "engine"])
@pytest.mark.parametrize("lines, message", [t[1:] for t in TRACES], ids=[t[0] for t in TRACES])
def test_a_malformed_trace_is_refused_in_one_line_naming_file_and_line_on_every_backend(
        compose, tmp_path, backend, lines, message):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(f"{x}\n" for x in lines))
    overrides = [f"backend={backend}", "workload=trace", f"workload.path={path}"]
    if backend == "engine":
        overrides += ["model=tiny", "device=cpu"]
    with pytest.raises(WorkloadRefused) as refused:
        execute(compose(*overrides), tmp_path / "run")
    assert str(refused.value) == f"{path}:{message.format(path=path)}"


def test_the_command_line_exits_2_with_the_one_line(tmp_path):
    """The issue's repro: it used to end in SimPy's "No scheduled events left" (exit 1)."""
    path = tmp_path / "trace.jsonl"
    path.write_text(line("a") + "\n" + line("a", (1, 2)) + "\n")
    proc = subprocess.run([sys.executable, "-m", "testbed.run", "backend=sim", "workload=trace",
                           f"workload.path={path}", "workload.format=tokens",
                           f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {path}:2: duplicate request id 'a' (first at "
                                   f"{path}:1); every call needs an id of its own")


def call(id: str, program: str | None = None, after=(), prompt=(1, 2), **extra) -> Request:
    return Request(id, np.asarray(prompt, np.int32), np.asarray([3], np.int32), program=program,
                   after=list(after), **extra)


@pytest.mark.parametrize("calls, message", [
    ([call("a"), call("b"), call("a")],
     "duplicate request id 'a' (first at call 0 of the workload); every call needs an id of its "
     "own"),
    ([call("a", "p"), call("b", "p", after=["c"]), call("c", "p", after=["b"])],
     "request b waits for itself ('after': b → c → b); no call of a cycle can ever start"),
    ([call("a", "p", after=["gone"])],
     "request a waits for 'gone' ('after'), but no request has that id"),
    ([call("a", "p"), call("b", "q", after=["a"])],
     "request b waits for a ('after') of another program ('p', not 'q'); calls that wait for "
     "each other must share a 'program'"),
    ([call("a", prompt=())],
     "request a: empty prompt (a call is served by prefilling at least one prompt token)"),
], ids=["duplicate", "cycle", "dangling", "across programs", "empty prompt"])
def test_a_generated_workload_is_checked_naming_the_call(calls, message):
    with pytest.raises(WorkloadRefused) as refused:
        check_workload(calls)
    assert str(refused.value) == message


def test_a_prompt_made_only_of_a_generated_output_is_left_to_the_engine():
    """Its tokens exist only once the engine generated them (the engine's limits check it)."""
    first = call("a", "p", max_new_tokens=3)
    second = Request("b", np.zeros(0, np.int32), np.asarray([1], np.int32), program="p",
                     after=["a"], segments=(OutputRef("a"),))
    check_workload([first, second])


def test_a_random_tree_with_empty_prompts_is_refused_on_replay_as_in_the_simulator(compose):
    """Replay used to run it (it only counts tokens) where the simulator refused it."""
    from testbed.config.assembly import assemble

    for backend in ("replay", "sim"):
        run = assemble(compose(f"backend={backend}", "workload=random_tree",
                               "workload.num_requests=3", "workload.root_len=0",
                               "workload.segment_len=0", "workload.output_len=1"))
        with pytest.raises(BadInput) as refused:
            run.requests()
        assert str(refused.value) == ("request tree0/n0: empty prompt (a call is served by "
                                      "prefilling at least one prompt token)")
