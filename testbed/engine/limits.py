"""What the engine's model can take, checked before any step runs.

A request the model cannot serve is refused with `WorkloadRefused` (a `BadInput`), in one line
naming the request and the limit, instead of failing deep inside a forward pass (an embedding index out of range, an
empty step) or silently running past the positions the checkpoint was trained for:

- an empty prompt (a prefill computes at least one token);
- a token id outside ``0 .. vocab_size - 1``; replayed outputs too, when forced decoding feeds
  them to the model;
- a prompt plus its output longer than the model's context: ``max_position_embeddings`` in the
  checkpoint's config.json, or the ``model`` group's key for a random model (none stated: no
  limit, as a random model was trained for none).

`check_workload` runs once on the workload's requests. A prompt that splices in earlier calls'
outputs and is rebuilt from the real ones (the engine generating) is checked there on what is
fixed in advance (its literal tokens, their count plus its output bound), and again whole by
`check_submitted` when the call is formed (`testbed.serving.driver.Driver`).

Pure numpy (no torch): `testbed.backends.dispatch` checks a workload with it before the model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from testbed.errors import WorkloadRefused
from testbed.config.model_group import read_config_json
from testbed.workloads.request import OutputRef, Request


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    context: int | None = None  # most positions (prompt + output); None: no limit stated
    context_source: str = ""  # where ``context`` is stated, for the message

    @classmethod
    def for_group(cls, model: Mapping[str, Any], vocab_size: int) -> "ModelLimits":
        """The limits of the ``model`` group's model: ``vocab_size`` as the engine built it; the
        context from ``model.path``'s config.json, else the group's ``max_position_embeddings``."""
        path = model.get("path")
        if path:
            context = read_config_json(path).get("max_position_embeddings")
            source = f"max_position_embeddings in {Path(path) / 'config.json'}"
        else:
            context = model.get("max_position_embeddings")
            source = f"model.max_position_embeddings of model={model.get('name')}"
        return cls(vocab_size, int(context) if context is not None else None, source)

    # ------------------------------------------------------------------ before running
    def check_workload(self, requests: list[Request], rebuilt: bool, forced: bool) -> None:
        """Refuse the first request the model cannot take, before anything runs. ``rebuilt``: a
        prompt with spliced outputs is rebuilt from the real ones at submission (only its
        literal tokens are known now); ``forced``: replayed outputs are fed to the model."""
        spliced = {r.id: len(r.output) for r in requests}  # the workload's own outputs
        for r in requests:
            if rebuilt and r.segments is not None:
                self._check_literal(r, spliced)
            else:
                self.check_prompt(r.id, r.prompt, r.output_limit)
            if forced and not r.generates:
                self._check_ids(r.id, r.output, "output token")

    def _check_literal(self, r: Request, spliced: Mapping[str, int]) -> None:
        """What a rebuilt prompt fixes in advance: its literal tokens' ids (positions as in the
        prompt spelled with the workload's outputs, ``spliced``: their lengths), and their count
        plus the output bound within the context (the spliced outputs can only add to it)."""
        n = offset = 0
        for s in r.segments:
            if isinstance(s, OutputRef):
                offset += spliced.get(s.call, 0)
                continue
            self._check_ids(r.id, s, "token", offset)
            n += len(s)
            offset += len(s)
        if self.context is not None and n + r.output_limit > self.context:
            raise WorkloadRefused(f"request {r.id}: prompt {n} (before its spliced outputs) + output "
                           f"{r.output_limit} tokens exceeds the model's context of "
                           f"{self.context} ({self.context_source})")

    # ------------------------------------------------------------------ one concrete prompt
    def check_prompt(self, request_id: str, prompt: np.ndarray, output_limit: int) -> None:
        """A prompt as the engine will run it: not empty, ids in the vocabulary, and prompt plus
        ``output_limit`` within the context."""
        if len(prompt) == 0:
            raise WorkloadRefused(f"request {request_id}: empty prompt (the model needs at least one "
                           "prompt token)")
        self._check_ids(request_id, prompt, "token")
        if self.context is not None and len(prompt) + output_limit > self.context:
            raise WorkloadRefused(f"request {request_id}: prompt {len(prompt)} + output {output_limit} "
                           f"tokens exceeds the model's context of {self.context} "
                           f"({self.context_source})")

    def check_submitted(self, request: Request, prompt: np.ndarray) -> None:
        """A rebuilt prompt when its call is formed (its spliced outputs are real now)."""
        self.check_prompt(request.id, prompt, request.output_limit)

    def _check_ids(self, request_id: str, ids: np.ndarray, what: str, offset: int = 0) -> None:
        """Every id in ``0 .. vocab_size - 1``; ``offset``: the position of ``ids[0]``."""
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if len(bad):
            i = int(bad[0])
            raise WorkloadRefused(f"request {request_id}: {what} id {int(ids[i])} at position "
                           f"{offset + i} is "
                           f"outside the model's vocabulary of {self.vocab_size} tokens")
