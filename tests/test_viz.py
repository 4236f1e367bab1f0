"""The radix tree, drawn (`python -m testbed.viz`): the tree read after chosen requests of a
replay, evicted nodes kept as ghosts where they were, the tidy layout, the picture and the command
line. The nine steps of `examples/radix_steps.jsonl` (examples/README.md) are checked node by
node."""

from pathlib import Path

import pytest

from testbed.cache import RadixCache
from testbed.backends.replay import replay
from testbed.viz.__main__ import main
from testbed.viz.layout import tidy_layout
from testbed.viz.snapshot import outline, replay_panels, shorten
from testbed.workloads.request import Request
from testbed.workloads.traces import load_tokens
from tests.conftest import toks

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "radix_steps.jsonl"
CAPACITY = 26
STEPS = [0, 1, 2, 3, 4, 5, 7, 8, 10]
# the designed trees insert once per request, as SGLang 0.4.10 (and the RadixAttention paper) do;
# 0.5.23's checkpoint would also split each prompt off its output (tests/test_radix_checkpoint.py)
RELEASE = "0.4.10"

# The tree after each of the nine steps: "size [tokens]", ghosts of nodes evicted since the
# previous step marked "evicted" under the node they hung from.
NINE_STEPS = [
    # (1) the empty tree
    """root""",
    # (2) chat A, turn 1: system prompt + question + answer, one node
    """root
  8 [1 2 3 4 10 11 12 13]""",
    # (3) chat A, turn 2 hits all 8 and adds its question and a long answer below
    """root
  8 [1 2 3 4 10 11 12 13]
    12 [14 15 16 17 18 19 20 21 22 23 24 25]""",
    # (4) chat B shares only the system prompt: the edge splits after it
    """root
  4 [1 2 3 4]
    4 [10 11 12 13]
      12 [14 15 16 17 18 19 20 21 22 23 24 25]
    4 [30 31 32 33]""",
    # (5) chat B, turn 2 needs 4 slots with 2 free: LRU evicts A's answer, the oldest leaf
    """root
  4 [1 2 3 4]
    4 [10 11 12 13]
      12 [14 15 16 17 18 19 20 21 22 23 24 25] evicted
    4 [30 31 32 33]
      4 [34 35 36 37]""",
    # (6) a few-shot question shares nothing: a new child of the root
    """root
  4 [1 2 3 4]
    4 [10 11 12 13]
    4 [30 31 32 33]
      4 [34 35 36 37]
  6 [40 41 42 43 50 51]""",
    # (7) two more questions with the same examples: split after them; the tree is full
    """root
  4 [1 2 3 4]
    4 [10 11 12 13]
    4 [30 31 32 33]
      4 [34 35 36 37]
  4 [40 41 42 43]
    2 [50 51]
    2 [52 53]
    2 [54 55]""",
    # (8) a 13-token self-consistency sample: LRU evicts both chats and then the system prompt
    """root
  4 [1 2 3 4] evicted
    4 [10 11 12 13] evicted
    4 [30 31 32 33] evicted
      4 [34 35 36 37] evicted
  4 [40 41 42 43]
    2 [50 51]
    2 [52 53]
    2 [54 55]
  13 [60 61 62 63 64 65 66 67 68 69 70 71 72]""",
    # (9) two more samples fork after the question; the last needs room: the two oldest
    # few-shot answers go, the shared examples stay (a leaf goes before its parent)
    """root
  4 [40 41 42 43]
    2 [50 51] evicted
    2 [52 53] evicted
    2 [54 55]
  10 [60 61 62 63 64 65 66 67 68 69]
    3 [70 71 72]
    3 [73 74 75]
    3 [76 77 78]""",
]


def nine_steps():
    return replay_panels(load_tokens(EXAMPLE), RadixCache(CAPACITY, sglang=RELEASE), STEPS)


def test_the_nine_steps_have_the_designed_trees():
    panels = nine_steps()
    assert [p.served for p in panels] == STEPS
    for i, (panel, expected) in enumerate(zip(panels, NINE_STEPS), 1):
        assert outline(panel) == expected, f"step ({i})"


def test_the_nine_steps_report_their_requests_hits_and_evictions():
    panels = nine_steps()
    assert [p.request_ids for p in panels] == [
        (), ("chatA-turn1",), ("chatA-turn2",), ("chatB-turn1",), ("chatB-turn2",),
        ("fewshot-q1",), ("fewshot-q2", "fewshot-q3"), ("sc-sample1",),
        ("sc-sample2", "sc-sample3")]
    assert [p.hit_tokens for p in panels] == [0, 0, 8, 4, 8, 0, 8, 0, 20]
    assert [p.evicted_tokens for p in panels] == [0, 0, 0, 0, 12, 0, 0, 16, 4]
    assert [p.cached_tokens for p in panels] == [0, 8, 20, 24, 16, 22, 26, 23, 25]
    assert all(p.capacity == CAPACITY for p in panels)
    # replay unlocks every request's path: only the root holds a lock between requests
    assert all(n.lock_ref == (1 if n.parent is None else 0) for p in panels for n in p.nodes)


def test_states_say_what_happened_since_the_previous_panel():
    panels = nine_steps()
    states = {n.tokens[:2]: n.state for n in panels[3].nodes if n.parent is not None}
    # (4): the split's head is new, the tail it cut was walked through, A's answer was not
    assert states == {(1, 2): "new", (10, 11): "accessed", (14, 15): "unchanged",
                      (30, 31): "new"}
    # (9): the question's split head is new, the first sample's answer (its tail) was walked
    states = {n.tokens[:2]: n.state for n in panels[8].nodes if n.parent is not None}
    assert states == {(40, 41): "unchanged", (50, 51): "evicted", (52, 53): "evicted",
                      (54, 55): "unchanged", (60, 61): "new", (70, 71): "accessed",
                      (73, 74): "new", (76, 77): "new"}


def test_drawing_reads_the_tree_without_changing_the_replay():
    """Panels come from the cache's public views only: the same requests replayed in one go give
    the same hits and evictions and leave the same tree."""
    requests = load_tokens(EXAMPLE)
    whole = RadixCache(CAPACITY)
    records = replay(requests, whole)
    stepped = RadixCache(CAPACITY)
    panels = replay_panels(requests, stepped, list(range(len(requests) + 1)))
    assert [p.hit_tokens for p in panels[1:]] == [r.cached_tokens for r in records]
    assert [p.evicted_tokens for p in panels[1:]] == [r.evicted_tokens for r in records]
    shape = lambda c: sorted((n.id, n.parent.id, tuple(n.key), n.last_access) for n in c.nodes())
    assert shape(stepped) == shape(whole)
    stepped.check_invariants()


def test_a_ghost_hangs_where_it_was_when_its_parent_is_split_later():
    """Y is evicted, then its parent X is split: Y's ghost hangs under X's tail (X keeps the tail
    and its children), and the split's head is new."""
    requests = [Request("x", toks(1, 2, 3, 4), toks(5, 6)),
                Request("y", toks(1, 2, 3, 4, 5, 6, 7, 8), toks(9)),
                Request("other", toks(20, 21, 22), toks(23)),  # evicts the leaf Y
                Request("split", toks(1, 2, 10), toks(11))]   # splits X after 2 tokens
    first, second = replay_panels(requests, RadixCache(12, sglang=RELEASE), [2, 4])
    assert outline(first) == "root\n  6 [1 2 3 4 5 6]\n    3 [7 8 9]"
    assert outline(second) == """root
  2 [1 2]
    4 [3 4 5 6]
      3 [7 8 9] evicted
    2 [10 11]
  4 [20 21 22 23]"""
    states = {n.tokens: n.state for n in second.nodes[1:]}
    assert states == {(1, 2): "new", (3, 4, 5, 6): "accessed", (7, 8, 9): "evicted",
                      (10, 11): "new", (20, 21, 22, 23): "new"}


def test_steps_must_lie_within_the_workload():
    requests = load_tokens(EXAMPLE)
    with pytest.raises(ValueError, match=r"--at 11 is outside 0..10"):
        replay_panels(requests, RadixCache(), [3, 11])
    assert [p.served for p in replay_panels(requests, RadixCache(), [4, 2, 4])] == [2, 4]


def test_shorten_cuts_token_lists_by_count_and_width():
    assert shorten((1, 2, 3), 4) == "1 2 3"
    assert shorten((1, 2, 3, 4, 5), 4) == "1 2 3 4 …"
    assert shorten((27219, 20382, 16356, 8633), 4, max_chars=16) == "27219 20382 …"
    assert shorten((123456789012345678,), 4, max_chars=5) == "123456789012345678"


def assert_tidy(children, positions, sep=1.0):
    levels = {}
    for node, (x, depth) in positions.items():
        levels.setdefault(depth, []).append(x)
        kids = children.get(node, [])
        if kids:
            assert x == pytest.approx((positions[kids[0]][0] + positions[kids[-1]][0]) / 2)
            assert all(positions[k][1] == depth + 1 for k in kids)
            xs = [positions[k][0] for k in kids]
            assert xs == sorted(xs)
    for xs in levels.values():
        xs.sort()
        assert all(b - a >= sep - 1e-9 for a, b in zip(xs, xs[1:]))
    assert min(x for x, _ in positions.values()) == 0


def test_tidy_layout_centres_parents_and_keeps_levels_apart():
    children = {"r": ["a", "b", "c"], "a": ["a1", "a2", "a3"], "b": ["b1"], "c": ["c1", "c2"],
                "b1": ["b11", "b12"], "c2": ["c21"]}
    positions = tidy_layout(children, "r")
    assert_tidy(children, positions)
    assert positions["r"][1] == 0 and positions["c21"][1] == 3


def test_tidy_layout_tucks_a_narrow_subtree_under_a_wide_neighbours_shallow_part():
    # "a" is a single node; "b" has three children: "a" sits next to "b" at one slot, not beside
    # all of b's children (which a leaf-per-slot layout would do)
    children = {"r": ["a", "b"], "b": ["b1", "b2", "b3"]}
    positions = tidy_layout(children, "r")
    assert_tidy(children, positions)
    assert positions["b"][0] - positions["a"][0] == pytest.approx(1.0)


def test_tidy_layout_handles_long_chains_without_recursion():
    n = 5000
    children = {i: [i + 1] for i in range(n)}
    positions = tidy_layout(children, 0)
    assert len(positions) == n + 1 and positions[n] == (0.0, n)


def test_the_command_draws_the_nine_steps_to_a_png(tmp_path, capsys):
    out = tmp_path / "steps.png"
    rc = main([str(EXAMPLE), f"cache.capacity_tokens={CAPACITY}", f"scheduler.sglang={RELEASE}",
               "--at",
               ",".join(map(str, STEPS)), "--out", str(out), "--text"])
    assert rc == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    printed = capsys.readouterr().out
    assert f"wrote {out}: 9 panels, 10 of 10 requests replayed" in printed
    assert "(9) after 10 requests" in printed and "2 [50 51] lock 0 t 26 evicted" in printed


def test_the_docs_picture_is_drawn_from_the_tested_steps():
    script = (REPO / "examples" / "radix_steps.sh").read_text()
    assert f"cache.capacity_tokens={CAPACITY}" in script
    assert f"scheduler.sglang={RELEASE}" in script
    assert f"--at {','.join(map(str, STEPS))}" in script
    assert script.count("--caption ") == len(STEPS)
    assert (REPO / "docs" / "radix_steps.png").stat().st_size > 50_000


def test_the_command_composes_a_generated_workload_with_overrides(tmp_path, capsys):
    out = tmp_path / "chat.svg"
    rc = main(["workload=chat", "workload.num_sessions=2", "workload.turns=2",
               "cache.capacity_tokens=1200", "eviction=fifo", "--at", "2,4", "--out", str(out),
               "--cols", "1"])
    assert rc == 0
    assert out.read_text().lstrip().startswith("<?xml") and out.stat().st_size > 10_000
    assert "2 panels, 4 of 4 requests replayed" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["examples/nope.jsonl", "--at", "1"], "is neither a trace file nor a workload"),
    ([str(EXAMPLE), "--at", "1,99"], "--at 99 is outside 0..10"),
    ([str(EXAMPLE), "--at", "one"], "--at must be request counts"),
    ([str(EXAMPLE), "cache=none", "--at", "1"], "cache must be radix, got 'none'"),
    ([str(EXAMPLE), "cache.host_tokens=100", "--at", "1"], "cache.host_tokens"),
    ([str(EXAMPLE), "cache.capcity=3", "--at", "1"], "cache.capcity"),
    ([str(EXAMPLE), "--at", "1,2", "--caption", "one"], "1 --caption for 2 panels"),
])
def test_bad_input_fails_with_one_line(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "x.png").exists()
