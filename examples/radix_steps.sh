#!/usr/bin/env bash
# Draws docs/radix_steps.png: the nine steps of the RadixAttention walk-through (examples/README.md)
# from examples/radix_steps.jsonl, replayed through a 26-token radix cache with LRU eviction and
# SGLang 0.4.10's insert, once per request (0.5.23's checkpoint would also split each prompt off).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -m testbed.viz examples/radix_steps.jsonl cache.capacity_tokens=26 eviction=lru \
  scheduler.sglang=0.4.10 --at 0,1,2,3,4,5,7,8,10 --out "${1:-docs/radix_steps.png}" \
  --title "RadixAttention step by step: examples/radix_steps.jsonl, capacity 26 tokens, LRU" \
  --caption "the empty tree" \
  --caption "chat A, turn 1: one new node" \
  --caption "chat A, turn 2 extends it" \
  --caption "chat B splits the system prompt off" \
  --caption "chat B, turn 2: LRU evicts A's long answer" \
  --caption "a few-shot question: a new branch" \
  --caption "two more share its examples: a split" \
  --caption "a self-consistency sample: chats evicted" \
  --caption "two more samples fork after the question" \
  "${@:2}"
