"""The self-speculative draft model of ``speculative.method=draft``: the served model's first
``draft_layers`` layers, then its final norm and LM head (docs/design.md §4, "Speculative
decoding").

The scheduler forms a verification step whose entries carry placeholder drafts (their room
taken: ``num_tokens`` slots each, `testbed.scheduler.spec_steps`); before the verification's
forward, `draft` fills them in place, greedily, one token per pass: pass ``j`` runs the entry's
last token and its ``j`` drafts so far (positions ``context .. context + j``) through the first
layers and takes the argmax of the last row. Its KV needs no cache of its own: for the first
layers the served model's KV of the verified prefix is exactly what the truncated model would
compute (the same weights on the same tokens), and what the passes write at the draft positions
the verification's forward then overwrites with every layer's. The verification decides what is
kept, so the tokens are plain decoding's whatever the drafts are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from testbed.scheduler.batch import Batch


@torch.inference_mode()
def draft(runner, batch: Batch, num_layers: int) -> None:
    """Fill each entry's placeholder ``draft`` (all ``-1``) with the draft model's tokens."""
    todo = [e for e in batch.entries if e.draft is not None and len(e.draft)
            and (e.draft < 0).all()]
    longest = max((len(e.draft) for e in todo), default=0)
    for j in range(longest):
        entries = [replace(e, new=1 + j, draft=e.draft[:j]) for e in todo if len(e.draft) > j]
        step = Batch("decode", entries)
        inputs = runner.prepare(step)
        inputs.meta.last_token_index = torch.as_tensor(
            [sum(e.new for e in entries[: i + 1]) - 1 for i in range(len(entries))],
            device=runner.device)
        logits = runner.model(inputs.input_ids, inputs.positions, inputs.meta,
                              runner.kv_cache, runner.attention, runner.kernels,
                              num_layers=num_layers)
        tokens = logits.argmax(dim=-1).tolist()
        for e, token in zip((e for e in todo if len(e.draft) > j), tokens):
            e.draft[j] = token
