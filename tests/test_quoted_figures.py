"""A figure quoted on more than one page is the same figure everywhere (issue 60): the README and
the results index quote the results pages, and each quote is checked against its source page.

Each row of `QUOTES` names a figure, then the places that state it, the source page first: a file
and a pattern whose groups capture the figure there (several groups: several figures, in order).
A page re-measured gets its new figures; the test then names every quote left behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README, INDEX = "README.md", "docs/results/README.md"
SPEC, GPU, ENGINE = ("docs/results/speculative.md", "docs/results/engine_gpu.md",
                     "docs/results/engine.md")
X = r"([\d.]+)×"  # a ratio
QUOTES: dict[str, list[tuple[str, str]]] = {
    "speculative: copy_text n-gram k=4 over plain, tokens a step": [
        (SPEC, r"\| copy_text \| \*\*ngram k=4\*\* \| \d+ \| \*\*[\d.]+\*\* \| \*\*" + X
         + r"\*\* \|.*\| \*\*([\d.]+)\*\* \| yes \|"),
        (INDEX, r"copy_text " + X + r" tokens/s at k=4 \(([\d.]+) tokens a step\)")],
    "speculative: ShareGPT chat, n-gram k=4 over plain": [
        (SPEC, r"\| sharegpt \| ngram k=4 \| \d+ \| [\d.]+ \| " + X + r" \|"),
        (INDEX, r"ShareGPT chat " + X + r";")],
    "speculative: the draft model (10 layers, k=4) on copy_text": [
        (SPEC, r"\| copy_text \| draft L=10 k=4 \| \d+ \| [\d.]+ \| " + X + r" \|"),
        (INDEX, r"the self-speculative draft model " + X)],
    "speculative: the simulator's makespan error with verification steps (runs 1, 2)": [
        (SPEC, r"\| fresh, with verify \| ngram k=4 \| makespan \|.*\| \*\*(−[\d.]+%)\*\* \| "
               r"\*\*(−[\d.]+%)\*\* \|"),
        (INDEX, r"verification steps in the fit \(makespan (−[\d.]+%) and (−[\d.]+%)\)")],
    "engine_gpu: the plain CUDA-graph decode step over its byte floor": [
        (GPU, r"\| plain \(`engine.attention=triton`\) \|.*\| \*\*" + X + r"\*\* \|"),
        (README, r"within " + X + r" of the time it takes to read"),
        (INDEX, r"\(CUDA graphs: " + X + r"\)")],
    "engine_gpu: radix+lpm over none+fcfs, tree-of-thought and few-shot": [
        (GPU, r"\| tree-of-thought, 12 problems \(CUDA graphs\) \|.*\| \*\*" + X + r"\*\* \|"
              r"(?s:.*)\| few-shot \|.*\| \*\*" + X + r"\*\* \|"),
        (README, r"none\+fcfs " + X + r" on tree-of-thought \(12 problems\) and " + X
                 + r" on\s+few-shot"),
        (INDEX, r"\(tree-of-thought " + X + r", few-shot " + X + r"\)")],
    "engine: SmolLM2 radix+lpm over none+fcfs; radix's cost where nothing is shared": [
        (ENGINE, r"\| tree-of-thought, 6 problems .*?\| \*\*" + X + r"\*\* \|(?s:.*?)"
                 r"\| few-shot arithmetic in text, .*?\| \*\*" + X + r"\*\* \|(?s:.*?)"
                 r"\| the same with 32 shots .*?\| \*\*" + X + r"\*\* \|(?s:.*?)"
                 r"\| ShareGPT chat, .*?\| " + X + r" \|(?s:.*?)"
                 r"radix costs \*\*(\+[\d.]+%)\*\*"),
        (README, r"\*\*" + X + r"\*\* on tree-of-thought\s+\(6 problems\), \*\*" + X
                 + r"\*\* on few-shot arithmetic in text \(8 shots; " + X + r" with 32\), "
                 + X + r" on\s+decode-bound ShareGPT chat, and (\+[\d.]+%) engine time")],
    "routing_live: the simulator within 0.03 of the hit rate, within 10% of the throughput": [
        ("docs/results/routing_live.md",
         r"- The simulator within 0\.03 of the hit rate: (\d+ of \d+) .*?within\s+10% of the "
         r"throughput: (\d+ of \d+) with a fit made beside the study"),
        (INDEX, r"hit rate within 0\.03 in (\d+ of \d+) runs, throughput within 10% in "
                r"(\d+ of \d+) with a fit made beside it")],
    "routing_live: testbed.route below smg's throughput on chat with the drift taken out": [
        ("docs/results/routing_live.md",
         r"[Ww]ith the drift taken out\s+they are ([\d.]+)% and ([\d.]+)% below"),
        (INDEX, r"on chat ([\d.]+)–([\d.]+)% below it with the drift taken out")],
    "cpu_engine: a decode step of 32 requests, before over after (the first host)": [
        ("docs/results/cpu_engine.md", r"\| decode 32 × 448 \| [\d.,]+ \| [\d.,]+ \| [\d.,]+ \| "
                                       + X + r" \|"),
        (README, r"decode step of 32 requests " + X + r" faster")],
    "vllm_latency: the largest held-out error": [
        ("docs/results/vllm_latency.md", r"every held-out cell within (\d+)%"),
        (INDEX, r"every held-out figure within (\d+)%")],
    "vs_vllm_serving: radix + LPM over vLLM, both servers at their default pools": [
        ("docs/results/vs_vllm_serving.md",
         r"\| tree_of_thought \| testbed radix \+ LPM \| 3.27 \(.*?\*\*" + X + r"\*\* \|"
         r"(?s:.*?)\| few_shot_text \| testbed radix \+ LPM \| 9.56 \(.*?\*\*" + X +
         r"\*\* \|(?s:.*?)\| sharegpt_chat \| testbed radix \+ LPM \| 0.446 \(.*?\*\*" + X),
        (INDEX, r"radix \+ LPM " + X + r" vLLM's requests/s on tree-of-thought, " + X +
         r" few-shot, " + X + r" chat")],
    "trace_replay: the loop's speed beside a plain tree, SGLang and Vidur": [
        ("docs/results/trace_replay.md",
         r"\| random_tree, 20,000 requests.*?\(\*\*" + X + r"\*\* ours\) \|.*?\(\*\*" + X
         + r"\*\*\) \|(?s:.*?)\| Mooncake conversation, 12,031 requests, 3M tokens .*?\(\*\*"
         + X + r"\*\*\) \|.*?\(\*\*" + X + r"\*\*\) \|(?s:.*?)decoded in [\d,]+ steps \| "
         r"\*\*([\d.]+ s)\*\* \|(?s:.*?)\*\*" + X + r"\*\* Vidur's speed"),
        (INDEX, r"replay " + X + r" a plain Python tree and " + X + r" SGLang's `RadixCache` "
                r"on random trees \(" + X + r" and " + X + r" on Mooncake\), the Mooncake "
                r"simulation in ([\d.]+ s), the simulation loop " + X + r" Vidur's")],
}


def headline_rows(path: str) -> list[str]:
    """The headline table's rows (workload to speedup) as a page prints them."""
    text = (REPO / path).read_text()
    start = text.index("| workload | hit rate | ideal | makespan radix+lpm")
    return [line for line in text[start:].splitlines()[2:7]]


def figures(path: str, pattern: str) -> tuple[str, ...]:
    found = re.search(pattern, (REPO / path).read_text())
    assert found, f"{path}: the figure's pattern {pattern!r} finds nothing (reworded?)"
    return found.groups()


@pytest.mark.parametrize("name", list(QUOTES))
def test_a_quoted_figure_is_its_source_pages_figure(name):
    (source, pattern), *quotes = QUOTES[name]
    expected = figures(source, pattern)
    for path, quote in quotes:
        assert figures(path, quote) == expected, f"{path} quotes {name} unlike {source}"


def test_the_readmes_headline_table_is_headline_mds():
    rows = headline_rows("docs/results/headline.md")
    assert len(rows) == 5 and all(row.startswith("| ") for row in rows)
    assert headline_rows(README) == rows
