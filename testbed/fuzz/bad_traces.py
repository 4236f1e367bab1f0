"""Malformed token traces for the fuzzer: each kind one way a trace file can be wrong, made by
spoiling a valid trace (`testbed.fuzz.space.write_token_trace`'s). Whatever the rest of the config,
a run of one must be refused in one line that starts with the file's path (``PATH:LINE: ...``, or
``PATH: ...`` where no line is at fault), on every backend (`testbed.workloads.checks`).

The file's name says the kind (``bad{index}_{kind}.jsonl``), so the command that reproduces a
failure says it too, and `malformed_kind` reads it back from the overrides.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

KINDS = ("duplicate_id", "waits_for_itself", "cycle", "after_names_no_call", "other_program",
         "empty_file", "blank_lines", "empty_prompt", "string_token", "token_past_2_31",
         "program_not_a_name")
_NAME = re.compile(r"^workload\.path=.*/bad\d+_(\w+)\.jsonl$")


def bad_trace_path(workdir: Path, index: int, kind: str) -> Path:
    return workdir / f"bad{index}_{kind}.jsonl"


def malformed_kind(overrides: list[str]) -> str | None:
    """The kind of the malformed trace a config runs (None: it runs none)."""
    found = (_NAME.match(o) for o in overrides)
    return next((m.group(1) for m in found if m and m.group(1) in KINDS), None)


def spoil(path: Path, kind: str, rng: np.random.Generator) -> None:
    """Rewrite the valid token trace at ``path`` so that it is wrong in the way ``kind`` says."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if kind in ("empty_file", "blank_lines"):
        path.write_text("" if kind == "empty_file" else "\n  \n\n")
        return
    pick = int(rng.integers(len(lines)))
    line = lines[pick]
    if kind == "duplicate_id":
        if len(lines) == 1:
            lines.append(dict(line))
        else:
            j = int(rng.integers(1, len(lines)))
            lines[j]["id"] = lines[int(rng.integers(j))]["id"]
    elif kind == "waits_for_itself":
        line["after"] = [*line.get("after", []), line["id"]]
    elif kind == "cycle":  # one program, so that no other rule is broken first
        for x in lines:
            x["program"] = "p"
        other = lines[int(rng.integers(len(lines)))]
        line["after"] = [*line.get("after", []), other["id"]]
        other["after"] = [*other.get("after", []), line["id"]]
    elif kind == "after_names_no_call":
        line["after"] = [*line.get("after", []), "no-such-call"]
    elif kind == "other_program":
        lines.append({"id": "elsewhere", "program": "another", "prompt": [1], "output": [1],
                      "after": [line["id"]]})
    elif kind == "empty_prompt":
        line["prompt"] = []
    elif kind == "string_token":
        line["prompt"] = [*line["prompt"], "7"]
    elif kind == "token_past_2_31":
        line["prompt"] = [*line["prompt"], 2**31]
    elif kind == "program_not_a_name":
        line["program"] = [line.get("program")]
    else:
        raise ValueError(f"unknown kind of malformed trace {kind!r}; known: {', '.join(KINDS)}")
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
