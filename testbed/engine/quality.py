"""Quality of approximate KV reuse, per request, against exact recomputation of the same prompt.

A request is *approximate* once one of its prefill entries reused donor KV (a non-empty ``reuse``,
`testbed.engine.blend`). `QualityMonitor` records, for every output token such a request
produces, the approximate model's greedy token (``argmax`` of the step's logits) and, for the
first `KL_POSITIONS` output positions, the step's logits (fp32, on the host); when the request's
last token is produced it computes the exact reference on the side with a scratch KV cache of its
own (never the engine's pool) and plain torch attention. The executor calls it after it has taken
the step's time, so none of this is counted in the measured step time (it does occupy the device
between steps).

For output positions ``i = 0 .. n−1`` (``n`` output tokens ``o``, prompt ``p``), let ``A_i`` be
the approximate request's next-token distribution at position ``i`` (the logits of the step that
produced ``o_i``, conditioned on ``p`` with reused KV and on ``o_<i``) and ``E_i`` the exact one:
one uncached forward over ``p + o_<n−1`` read at positions ``|p|−1 .. |p|+n−2``, i.e.
conditioned on the same tokens. The *reference* token at ``i``: in generate mode the ``i``-th
token of the exact greedy continuation of ``p`` (decoded freely from ``p``, not fed ``o``: once
the two diverge, later positions compare different continuations); in forced mode ``argmax E_i``
(both conditioned on the workload's tokens, since neither continues freely). With greedy
sampling in generate mode ``argmax A_i = o_i``; with sampling the metrics still compare argmaxes.

- ``kl_mean``: mean over the recorded ``i < KL_POSITIONS`` (the first 16 output positions) of
  ``KL(E_i ‖ A_i)`` in nats, computed in float64 and never negative (below).
- ``token_agreement``: the fraction of recorded ``i`` at which ``argmax A_i`` equals the reference.
- ``first_divergence``: the first recorded position (counted from 0 among them) at which they
  differ; the number of positions compared when none does.
- ``rouge_l``: Rouge-L F1 of the approximate greedy tokens against the reference tokens, both as
  token-id sequences (no words: the tokenizer is not needed), from their longest common
  subsequence ``L``: ``2 L / (len(a) + len(b))`` (precision and recall ``L / len``; the two have
  the same length here, so it is ``L / n``).

Why KL is never negative. Rounding in ``Σ_v E(v)(log E(v) − log A(v))`` can leave a tiny negative
sum when ``A ≈ E`` (exact recomputation gave −5e-9 in fp32). Here both log-probability rows are
``log_softmax`` of the logits in float64, and with ``d_v = log A(v) − log E(v)`` the KL is summed
as ``Σ_v E(v)·(expm1(d_v) − d_v)``. Each term is ≥ 0 (``e^d − 1 ≥ d`` for every real d, and
``expm1`` keeps that for small ``|d|`` where ``e^d − 1`` would round), so the sum is ≥ 0 by
construction and exactly 0 when the rows are equal. It equals the textbook KL because
``Σ_v E(v)(e^{d_v} − 1) = Σ_v A(v) − Σ_v E(v) = 0`` for normalized rows, leaving ``Σ_v E(v)(−d_v)``.
For ``d_v > 30`` (``A(v)`` over 1e13 times ``E(v)``) the term is written ``A(v) − E(v)(1 + d_v)``,
the same value without overflowing ``expm1``; it is positive there too.

Memory: ``vocab × 4`` bytes for each of a request's first `KL_POSITIONS` recorded tokens, and one
integer a later token, on the host until the request finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import Sequence

import numpy as np
import torch

from testbed.engine.attention import TorchAttention
from testbed.engine.kv_cache import KVCache
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.model import LlamaModel
from testbed.results.metrics import QUALITY_FIELDS, quality_means
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


KL_POSITIONS = 16  # KL over the first 16 output positions (issue 29); the other metrics: all


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` of ``logits`` in float64 (on the CPU)."""
    return torch.log_softmax(logits.detach().cpu().double(), dim=-1)


def kl_per_position(exact_logprobs: torch.Tensor, approx_logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(E_i ‖ A_i)`` per row of two ``[n, vocab]`` log-probability tensors: float64 nats, each
    row a sum of non-negative terms (module docstring)."""
    e, a = exact_logprobs.double(), approx_logprobs.double()
    d = a - e
    p = e.exp()
    small = d.clamp(max=30.0)
    terms = torch.where(d > 30.0, a.exp() - p * (1.0 + d), p * (torch.expm1(small) - small))
    return terms.sum(-1)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index at which ``a`` and ``b`` differ; the shorter length when none does."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def rouge_l(a: Sequence[int], b: Sequence[int]) -> float:
    """Rouge-L F1 of two token sequences: ``2 L / (len(a) + len(b))``, ``L`` the length of their
    longest common subsequence (1.0 for two empty sequences)."""
    if not a and not b:
        return 1.0
    row = [0] * (len(b) + 1)  # row[j]: LCS of the prefix of a read so far and b[:j]
    for x in a:
        diag = 0
        for j, y in enumerate(b, 1):
            diag, row[j] = row[j], diag + 1 if x == y else max(row[j], row[j - 1])
    return 2.0 * row[-1] / (len(a) + len(b))


@dataclass
class QualityRecord:
    """One approximate request's quality against exact recomputation (module docstring)."""

    request_id: str
    tokens: int  # output positions compared
    token_agreement: float
    kl_mean: float  # over the first KL_POSITIONS of them
    first_divergence: int
    rouge_l: float

    def fields(self) -> dict[str, float]:
        """The per-request fields a run writes (`testbed.results.metrics.QUALITY_FIELDS`)."""
        return {key: getattr(self, key) for key in QUALITY_FIELDS}


def measure(model: LlamaModel, prompt: Sequence[int], output: Sequence[int],
            positions: Sequence[int], approx_logits: torch.Tensor, forced: bool,
            request_id: str = "", approx_tokens: Sequence[int] | None = None) -> QualityRecord:
    """The record of a request with ``prompt`` and ``output`` whose approximate greedy tokens
    ``approx_tokens`` were recorded at output ``positions`` (ascending) and its logits (or
    log-probs) ``approx_logits`` at the first ``len(approx_logits)`` of them (at most
    `KL_POSITIONS`); ``approx_tokens`` defaults to the argmax of ``approx_logits`` rows, one per
    position."""
    n, p = len(output), len(prompt)
    approx = log_probs(approx_logits)[:KL_POSITIONS]
    mine = [int(t) for t in (approx.argmax(-1) if approx_tokens is None else approx_tokens)]
    seq = np.concatenate([np.asarray(prompt, dtype=np.int64),
                          np.asarray(output[:n - 1], dtype=np.int64)])
    idx = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    exact_all = exact_logits(model, seq)[p - 1:][idx]
    exact = log_probs(exact_all[:len(approx)])
    if forced:
        reference = exact_all.argmax(-1).tolist()
    else:
        reference = torch.as_tensor(greedy_continuation(model, prompt, n))[idx].tolist()
    agree = np.mean([x == y for x, y in zip(mine, reference)])
    return QualityRecord(request_id=request_id, tokens=len(idx), token_agreement=float(agree),
                         kl_mean=float(kl_per_position(exact, approx).mean()),
                         first_divergence=first_divergence(mine, reference),
                         rouge_l=rouge_l(mine, reference))


class QualityMonitor:
    """Records approximate requests' greedy tokens (and first logits) step by step; measures each
    when it finishes.

    ``observe(batch, logits, tokens)`` after every step (the runner's logits, one row per entry,
    and the tokens the executor returns for them); ``records()`` per request, ``summary()`` the
    means (`testbed.results.metrics.quality_means`; None when no request was approximate)."""

    def __init__(self, model: LlamaModel, forced: bool) -> None:
        self.model = model
        self.forced = forced
        # output position -> (greedy token, logits while among the first KL_POSITIONS recorded)
        self._rows: dict[Req, dict[int, tuple[int, torch.Tensor | None]]] = {}
        self._done: dict[str, QualityRecord] = {}

    def watches(self, batch: Batch) -> bool:
        """Whether `observe` needs ``batch``'s logits (it reuses KV, or follows a request that
        did)."""
        return any(e.reuse or e.req in self._rows for e in batch.entries)

    def observe(self, batch: Batch, logits: torch.Tensor, tokens: Sequence[int | None]) -> None:
        for row, (e, tok) in enumerate(zip(batch.entries, tokens)):
            req = e.req
            if e.reuse:
                self._rows.setdefault(req, {})  # approximate from this prefill on
            if tok is None or req not in self._rows or e.gen != req.preemptions:
                continue  # no token, exact request, or a stale entry whose token is dropped
            rows, i = self._rows[req], len(req.output)
            kept = i < next(iter(rows), i) + KL_POSITIONS  # from the first recorded position
            rows[i] = (int(logits[row].argmax()), logits[row].float().cpu() if kept else None)
            if req.remaining_new_tokens == 1 or tok in req.stop_token_ids:
                self._finish(req, [*req.output, int(tok)])

    def _finish(self, req: Req, output: list[int]) -> None:
        rows = self._rows.pop(req)
        positions = [i for i in sorted(rows) if i < len(output)]
        if not positions:
            return
        forced = self.forced and not req.request.generates  # as the executor decides
        kept = list(takewhile(lambda r: r is not None, (rows[i][1] for i in positions)))
        self._done[req.id] = measure(self.model, req.prompt, output, positions,
                                     torch.stack(kept[:KL_POSITIONS]), forced, req.id,
                                     approx_tokens=[rows[i][0] for i in positions])

    def records(self) -> dict[str, QualityRecord]:
        """Finished approximate requests by id (one still running or aborted is measured over
        the positions recorded so far)."""
        for req in list(self._rows):
            if self._rows[req] and req.output:
                self._finish(req, list(req.output))
        return dict(self._done)

    def summary(self) -> dict[str, float | None]:
        return quality_means([r.fields() for r in self.records().values()])
