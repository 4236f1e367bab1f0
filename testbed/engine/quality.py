"""Quality of approximate KV reuse, per request, against exact recomputation of the same prompt.

A request is *approximate* once one of its prefill entries reused donor KV (a non-empty ``reuse``,
`testbed.engine.blend`). `QualityMonitor` records, for every output token such a request
produces, the log-probabilities of the approximate model state (``log_softmax`` of the step's
logits, fp32, on the host), and when the request's last token is produced computes the exact
reference on the side with a scratch KV cache of its own (never the engine's pool) and plain
torch attention. The executor calls it after it has taken the step's time, so none of this is
counted in the measured step time (it does occupy the device between steps).

For output positions ``i = 0 .. n−1`` (``n`` output tokens ``o``, prompt ``p``), let ``A_i`` be
the approximate request's next-token distribution at position ``i`` (the logits of the step that
produced ``o_i``, conditioned on ``p`` with reused KV and on ``o_<i``) and ``E_i`` the exact one:
one uncached forward over ``p + o_<n−1`` read at positions ``|p|−1 .. |p|+n−2``, i.e.
conditioned on the same tokens.

- ``kl_mean`` = mean over recorded ``i`` of ``KL(E_i ‖ A_i) = Σ_v E_i(v) (log E_i(v) − log
  A_i(v))`` (nats; rounding can leave a value within ~1e-7 of 0 slightly negative). In forced
  mode ``o`` is the workload's tokens; in generate mode the request's own.
- ``token_agreement``: the fraction of recorded ``i`` at which the approximate greedy token
  ``argmax A_i`` equals the exact reference token: in generate mode the ``i``-th token of the
  exact greedy continuation of ``p`` (decoded freely from ``p``, not fed ``o``: once the two
  diverge, later positions compare different continuations); in forced mode ``argmax E_i``
  (both conditioned on the workload's tokens, since neither continues freely). With greedy
  sampling in generate mode ``argmax A_i = o_i``; with sampling the metric still compares argmaxes.

Memory: ``vocab × 4`` bytes a recorded token on the host until its request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from testbed.engine.attention import TorchAttention
from testbed.engine.kv_cache import KVCache
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.model import LlamaModel
from testbed.scheduler.batch import Batch
from testbed.scheduler.request_state import Req


def _step(model: LlamaModel, kv: KVCache, ids: Sequence[int], start: int, every_row: bool
          ) -> torch.Tensor:
    """Positions ``start .. start + len(ids) − 1`` of one sequence held at slots ``1 ..`` of the
    scratch ``kv``: logits of every new position (``every_row``) or of the last."""
    t, device = len(ids), model.device
    end = start + t
    meta = AttentionMetadata.build([t], [end], np.arange(1, end + 1), device)
    attention = TorchAttention(model.config.num_kv_heads)
    meta.plan = attention.plan(meta)
    if every_row:
        meta.last_token_index = torch.arange(t, device=device)
    ids_d = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)
    return model(ids_d, torch.arange(start, end, device=device), meta, kv, attention)


@torch.inference_mode()
def exact_logits(model: LlamaModel, tokens: Sequence[int]) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` of every position: one uncached forward."""
    kv = KVCache.for_model(model.config, len(tokens), model.dtype, model.device)
    return _step(model, kv, tokens, 0, every_row=True)


@torch.inference_mode()
def greedy_continuation(model: LlamaModel, prompt: Sequence[int], n: int) -> list[int]:
    """The ``n`` tokens exact greedy decoding appends to ``prompt`` (argmax, first on ties)."""
    kv = KVCache.for_model(model.config, len(prompt) + max(n - 1, 0), model.dtype, model.device)
    out: list[int] = []
    if n < 1:
        return out
    out.append(int(_step(model, kv, prompt, 0, every_row=False)[0].argmax()))
    for i in range(1, n):
        out.append(int(_step(model, kv, out[-1:], len(prompt) + i - 1, every_row=False)[0]
                       .argmax()))
    return out


def kl_per_position(exact_logprobs: torch.Tensor, approx_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(E_i ‖ A_i)`` per row of two ``[n, vocab]`` log-probability tensors (nats, fp32)."""
    e, a = exact_logprobs.float(), approx_logprobs.float()
    return (e.exp() * (e - a)).sum(-1)


@dataclass
class QualityRecord:
    """One approximate request's quality against exact recomputation (module docstring)."""

    request_id: str
    tokens: int  # output positions compared
    token_agreement: float
    kl_mean: float


def measure(model: LlamaModel, prompt: Sequence[int], output: Sequence[int],
            positions: Sequence[int], approx_logprobs: torch.Tensor, forced: bool,
            request_id: str = "") -> QualityRecord:
    """The record of a request with ``prompt`` and ``output`` whose approximate log-probs
    ``[len(positions), vocab]`` were recorded at output ``positions``."""
    n, p = len(output), len(prompt)
    seq = np.concatenate([np.asarray(prompt, dtype=np.int64),
                          np.asarray(output[:n - 1], dtype=np.int64)])
    idx = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    exact = torch.log_softmax(exact_logits(model, seq)[p - 1:].float(), dim=-1).cpu()[idx]
    approx = approx_logprobs.float().cpu()
    kl = kl_per_position(exact, approx)
    if forced:
        reference = exact.argmax(-1)
    else:
        reference = torch.as_tensor(greedy_continuation(model, prompt, n))[idx]
    agree = (approx.argmax(-1) == reference).double()
    return QualityRecord(request_id=request_id, tokens=len(idx),
                         token_agreement=float(agree.mean()), kl_mean=float(kl.double().mean()))


class QualityMonitor:
    """Records approximate requests' log-probs step by step; measures each when it finishes.

    ``observe(batch, logits, tokens)`` after every step (the runner's logits, one row per entry,
    and the tokens the executor returns for them); ``records()`` per request, ``summary()`` the
    means (``token_agreement_mean``, ``kl_mean``; None when no request was approximate)."""

    def __init__(self, model: LlamaModel, forced: bool) -> None:
        self.model = model
        self.forced = forced
        self._rows: dict[Req, dict[int, torch.Tensor]] = {}  # output position -> log-probs
        self._done: dict[str, QualityRecord] = {}

    def observe(self, batch: Batch, logits: torch.Tensor, tokens: Sequence[int | None]) -> None:
        for row, (e, tok) in enumerate(zip(batch.entries, tokens)):
            req = e.req
            if e.reuse:
                self._rows.setdefault(req, {})  # approximate from this prefill on
            if tok is None or req not in self._rows or e.gen != req.preemptions:
                continue  # no token, exact request, or a stale entry whose token is dropped
            self._rows[req][len(req.output)] = torch.log_softmax(logits[row].float(), -1).cpu()
            if req.remaining_new_tokens == 1 or tok in req.stop_token_ids:
                self._finish(req, [*req.output, int(tok)])

    def _finish(self, req: Req, output: list[int]) -> None:
        rows = self._rows.pop(req)
        positions = [i for i in sorted(rows) if i < len(output)]
        if not positions:
            return
        forced = self.forced and not req.request.generates  # as the executor decides
        self._done[req.id] = measure(self.model, req.prompt, output, positions,
                                     torch.stack([rows[i] for i in positions]), forced, req.id)

    def records(self) -> dict[str, QualityRecord]:
        """Finished approximate requests by id (one still running or aborted is measured over
        the positions recorded so far)."""
        for req in list(self._rows):
            if self._rows[req] and req.output:
                self._finish(req, list(req.output))
        return dict(self._done)

    def summary(self) -> dict[str, float | None]:
        recs = list(self.records().values())
        if not recs:
            return {"token_agreement_mean": None, "kl_mean": None}
        return {"token_agreement_mean": float(np.mean([r.token_agreement for r in recs])),
                "kl_mean": float(np.mean([r.kl_mean for r in recs]))}
