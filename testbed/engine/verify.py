"""Speculative verification on the engine: a verification step's logits to its verified tokens.

A verification entry (`testbed.scheduler.spec_steps`) ran ``1 + k`` queries, its request's last
token then its ``k`` drafts, causal among themselves against the whole prefix (the extend path of
either attention backend), and every query's logits came back (`ModelRunner.step`). Query ``i``'s
logits are the model's distribution of the token after draft ``i`` (after the last token for
``i = 0``), exactly what plain decoding would have computed there if the drafts before it are
the tokens it produced. So (docs/design.md §4, "Speculative decoding"):

- greedy: the longest prefix of drafts equal to the argmax of the query before each, then the
  bonus, the argmax after the last accepted one: the tokens plain greedy decoding gives;
- with temperature: the standard rejection rule for a drafter that proposes one token with
  probability 1 (n-gram lookup): draft ``d`` at query ``i`` is accepted with probability
  ``p_i(d)``; the first rejected one is replaced by a sample of ``p_i`` without ``d``
  (renormalized), which leaves each emitted token distributed as plain sampling's;
- replaying the workload's output (``engine.forced``): the drafts equal to the output's next
  tokens, and the output's tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from testbed.scheduler.batch import Batch
from testbed.scheduler.spec_steps import replayed_tokens


def greedy_accept(predicted: Sequence[int], draft: Sequence[int]) -> tuple[int, ...]:
    """``predicted[i]``: the argmax at query ``i`` (``len(draft) + 1`` of them)."""
    j = 0
    while j < len(draft) and int(draft[j]) == int(predicted[j]):
        j += 1
    return tuple(int(t) for t in predicted[: j + 1])


def tree_greedy_accept(predicted: Sequence[int], draft: Sequence[int],
                       branches: Sequence[int]) -> tuple[int, ...]:
    """A token tree's greedy result: each branch ``b`` (its drafts ``draft[s_b : s_b + n_b]``,
    its queries rows ``1 + s_b ..``, all hanging from row 0, the last token) accepted as a
    chain; the branch with the most accepted drafts wins (the first of equals). Branches
    differ in their first draft, so at most one accepts any."""
    best: tuple[int, ...] = (int(predicted[0]),)
    start = 0
    for n in branches:
        rows = [predicted[0], *predicted[1 + start : 1 + start + n]]
        got = greedy_accept(rows, draft[start : start + n])
        if len(got) > len(best):
            best = got
        start += n
    return best


def tree_positions(context: int, branches: Sequence[int]) -> np.ndarray:
    """Positions of a tree entry's queries: the last token at ``context``, each branch's
    drafts at ``context + 1 ..``."""
    return np.concatenate([[context], *(context + 1 + np.arange(n) for n in branches)])


def tree_mask(context: int, branches: Sequence[int]) -> np.ndarray:
    """``[1 + Σn, context + 1 + Σn]``: query ``i`` sees the whole prefix, the last token, and
    the drafts of its own branch up to itself (causal within each branch, nothing across)."""
    q = 1 + sum(branches)
    mask = np.zeros((q, context + q), dtype=bool)
    mask[:, : context + 1] = True
    start = 1
    for n in branches:
        for i in range(n):
            mask[start + i, context + start : context + start + i + 1] = True
        start += n
    return mask


def rejection_accept(probs: torch.Tensor, draft: Sequence[int],
                     generator: torch.Generator | None) -> tuple[int, ...]:
    """``probs [len(draft) + 1, vocab]``: the sampling distribution at each query."""
    out = []
    for i, d in enumerate(int(t) for t in draft):
        u = torch.rand(1, generator=generator, device=probs.device).item()
        if u < probs[i, d].item():
            out.append(d)
            continue
        rest = probs[i].clone()
        rest[d] = 0.0
        if rest.sum() <= 0:  # p_i was all on d: it is accepted with probability 1 anyway
            out.append(d)
            continue
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)))
        return tuple(out)
    last = probs[len(out)]
    out.append(int(torch.multinomial(last, 1, generator=generator)))
    return tuple(out)


def verified_tokens(batch: Batch, logits: torch.Tensor, temperature: float,
                    generator: torch.Generator | None, forced: bool
                    ) -> tuple[list[tuple[int, ...] | None], int, int]:
    """Each entry's verified tokens (None where it makes none) from ``logits [T, vocab]``, one
    row per query in batch order; and, replaying, how many tokens were imposed and how many of
    them the model's argmax agreed with."""
    predicted = logits.argmax(dim=-1).tolist()
    probs = None
    if temperature > 0:
        probs = torch.softmax(logits.float() / temperature, dim=-1)
    out: list[tuple[int, ...] | None] = []
    imposed = agreed = 0
    at = 0
    for e in batch.entries:
        rows = slice(at, at + e.new)
        at += e.new
        if not e.makes_output:
            out.append(None)
        elif forced and not e.req.request.generates:
            tokens = replayed_tokens(e)
            imposed += len(tokens)
            agreed += sum(t == p for t, p in zip(tokens, predicted[rows]))
            out.append(tokens)
        elif e.branches is not None:
            out.append(tree_greedy_accept(predicted[rows], e.draft, e.branches))
        elif probs is None:
            out.append(greedy_accept(predicted[rows], e.draft))
        else:
            out.append(rejection_accept(probs[rows], e.draft, generator))
    return out, imposed, agreed

