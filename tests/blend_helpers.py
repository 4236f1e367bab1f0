"""Helpers for the blend-prefill tests: a tiny random Llama, requests with slots, and stand-ins for
the shared side's `ReusedSpan`, `KVCopy` and the batch fields when those are not there yet."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from testbed.cache.base import Lease
from testbed.engine.loader import build_model, tiny_config
from testbed.engine.runner import ModelRunner
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.request_state import Req
from testbed.workloads.request import Request

try:  # the shared side's records, once they exist
    from testbed.scheduler.batch import KVCopy, ReusedSpan
except ImportError:
    @dataclass(frozen=True)
    class ReusedSpan:  # type: ignore[no-redef]
        dst: int
        src_slots: np.ndarray
        src_start: int
        recompute: int

    @dataclass(frozen=True)
    class KVCopy:  # type: ignore[no-redef]
        src_slots: np.ndarray
        dst_slots: np.ndarray
        shift: int


@dataclass
class ReuseEntry(BatchEntry):
    """A `BatchEntry` with ``reuse`` (declared again here: harmless once the real one has it)."""

    reuse: tuple = ()


@dataclass
class CopyBatch(Batch):
    kv_copies: list = field(default_factory=list)


def tiny_model(layers: int = 3, seed: int = 0, **config):
    return build_model(tiny_config(num_hidden_layers=layers, **config), seed=seed).eval()


def make_req(rid: str, prompt, slots, output=(0,), generates: bool = False) -> Req:
    out = np.asarray(output, dtype=np.int32)
    request = Request(rid, np.asarray(prompt, dtype=np.int32),
                      np.zeros(0, np.int32) if generates else out,
                      max_new_tokens=len(out) if generates else None)
    req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=0)
    req.lease = Lease(hit=0, slots=np.asarray(slots, dtype=np.int32))
    return req


def prefill(runner: ModelRunner, req: Req, context: int = 0, new: int | None = None,
            reuse: tuple = (), copies: list = ()) -> torch.Tensor:
    """Logits of one prefill entry of ``req`` (positions context .. context + new − 1)."""
    new = len(req.prompt) - context if new is None else new
    entry = ReuseEntry(req, context, new, produces_token=True, reuse=tuple(reuse))
    return runner.run(CopyBatch("prefill", [entry], kv_copies=list(copies)))[0]


def rag_prompt(seed: int = 0, sys_len: int = 6, doc_len: int = 10, q_len: int = 5):
    """System prompt, two documents, question: (tokens, start of each document)."""
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 256, n) for n in (sys_len, doc_len, doc_len, q_len)]
    return np.concatenate(parts).astype(np.int32), (sys_len, sys_len + doc_len)


def moved_docs(runner: ModelRunner, prompt: np.ndarray, starts, recompute: int,
               doc_len: int = 10, first_slot: int = 100) -> list:
    """Each document of ``prompt`` prefilled alone (positions 0 .. doc_len − 1) into slots of its
    own from ``first_slot`` on: chunk KV computed elsewhere. Returns the spans that reuse them at
    their places in ``prompt``, ``recompute`` tokens each."""
    spans = []
    for i, s in enumerate(starts):
        slots = np.arange(first_slot + i * doc_len, first_slot + (i + 1) * doc_len)
        prefill(runner, make_req(f"doc{i}", prompt[s:s + doc_len], slots))
        spans.append(ReusedSpan(dst=s, src_slots=slots, src_start=0, recompute=recompute))
    return spans
