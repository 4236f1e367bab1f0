"""The grid a calibration measures: synthetic engine steps of the ``calibrate`` shapes, timed.

`grid` turns ``conf/calibrate.yaml``'s lists into step shapes (prefills: batch × new tokens ×
cached context; decodes: batch × context, with ``decode_ragged`` batches of mixed contexts and
``decode_shared`` batches sharing a prefix; speculative verifications: batch × queries ×
context, `verifications`); `synthetic_batch` builds a batch of one shape over
fresh requests whose KV slots are laid out as ``calibrate.slot_layout`` says (`slot_order`);
`measure` times ``calibrate.repeats`` shuffled passes over the grid after a warm-up pass and keeps
each shape's median. `row_knots` says which row counts the fit prices on their own
(``calibrate.row_table``). `testbed.calibrate` fits and writes what this measures.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from testbed.config import group_values
from testbed.cache.base import Lease
from testbed.cache.pool import RUN_SLOTS
from testbed.errors import BadInput, check_choice
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.request_state import Req
from testbed.sim.step_shape import StepShape
from testbed.workloads.request import Request


#: the ``calibrate`` lists that span the grid, and the least value each may hold
GRID_KEYS = {"prefill_batch": 1, "prefill_new": 1, "prefill_context": 0, "decode_batch": 1,
             "decode_context": 0, "verify_batch": 1}


def grid_values(cfg: Any, key: str) -> list[int]:
    """``calibrate.KEY``: a non-empty list of integers, each at least `GRID_KEYS`'s."""
    values, least = cfg.get(key), GRID_KEYS[key]
    if not isinstance(values, Sequence) or isinstance(values, str) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int) or v < least for v in values):
        raise BadInput(f"calibrate.{key} must be a non-empty list of integers >= {least}, "
                       f"got {values!r}")
    return list(values)


def grid(cfg: Any) -> list[StepShape]:
    """The steps to measure: every prefill and decode shape of the ``calibrate`` config."""
    steps = []
    for batch in grid_values(cfg, "prefill_batch"):
        for new in grid_values(cfg, "prefill_new"):
            for context in grid_values(cfg, "prefill_context"):
                steps.append(StepShape(new=(new,) * batch, context=(context,) * batch))
    contexts = grid_values(cfg, "decode_context")
    for batch in grid_values(cfg, "decode_batch"):
        for context in contexts:
            steps.append(StepShape.decode((context,) * batch))
    if group_values.check_setting("calibrate.decode_ragged", bool, cfg.get("decode_ragged")):
        steps += ragged_decodes(grid_values(cfg, "decode_batch"), contexts)
    if group_values.check_setting("calibrate.decode_shared", bool,
                                  cfg.get("decode_shared", False)):
        steps += shared_decodes(grid_values(cfg, "decode_batch"), contexts,
                                shared_contexts(cfg, contexts))
    if row_table_on(cfg) and group_values.check_setting(
            "calibrate.decode_batch_fill", bool, cfg.get("decode_batch_fill", True)):
        steps += filled_decodes(grid_values(cfg, "decode_batch"), contexts)
    return steps + verifications(cfg, contexts)


def verifications(cfg: Any, contexts: list[int]) -> list[StepShape]:
    """Speculative verification steps (`StepShape.verify`): for each ``calibrate.verify_batch``
    and each ``calibrate.verify_new`` q (a request's last token and q − 1 drafts: k + 1 for k
    drafts), every request verifying q tokens on top of each of ``contexts`` (the decode
    contexts: a verification is a decode step that carries drafts). None where ``verify_new`` is
    null or empty (a config from before it).

    A verification is not a prefill of q tokens. The engine runs it as a decode batch that
    verifies (`testbed.engine.runner`): on the CPU with torch attention (and on Triton) the
    extend path, each request's q queries causal among themselves against its KV, not the
    in-place decode kernel (``engine.cpu_kernels`` serves one-query steps only), then the final
    norm and LM head on all q rows (`testbed.engine.verify`), where a prefill computes each
    request's last row only. On the development CPU (SmolLM2-135M, fp32, one thread, CPU time,
    medians of 9, 2026-12-05) a verification of 2 or 3 queries cost what an extend of as many
    tokens did, of 5 queries 2-10% more and of 9 queries 4-7% more, at 256 and 512 tokens of
    context. So the grid measures the batches the engine runs (`batch_on_slots`: drafts that
    it verifies) and the fit prices them apart (kind ``verify``), at their own few rows
    (q × batch), below every prefill the grid measures: priced by the prefill table, a
    verification of 5 rows cost what a prefill of 16 did."""
    queries = cfg.get("verify_new")
    if queries is None or (isinstance(queries, Sequence) and not isinstance(queries, str)
                           and len(queries) == 0):
        return []
    if not isinstance(queries, Sequence) or isinstance(queries, str) \
            or any(isinstance(q, bool) or not isinstance(q, int) or q < 2 for q in queries):
        raise BadInput(f"calibrate.verify_new must be null or a list of integers >= 2 (the last "
                       f"token and at least one draft), got {queries!r}")
    batches = grid_values(cfg, "verify_batch")
    return [StepShape.verification((q,) * batch, (context,) * batch)
            for batch in batches for q in queries for context in contexts]


def filled_decodes(batches: list[int], contexts: list[int]) -> list[StepShape]:
    """A decode of every batch size between the least and the largest of ``batches`` that they
    leave out, at the least context: the row table prices each size on its own, and a CPU
    BLAS's cost is not monotone in the rows, so a size read between two measured ones is a
    guess (on the development machine, one thread, SmolLM2-135M's served decode steps of 3
    requests took 118 ms and of 4 98 ms, of 6 129 ms and of 8 91 ms; read linearly between
    a grid's 1, 4 and 16, a ShareGPT chat's decode steps came out 15% short)."""
    least = min(contexts)
    return [StepShape.decode((least,) * batch)
            for batch in range(min(batches), max(batches) + 1) if batch not in batches]


def shared_contexts(cfg: Any, contexts: list[int]) -> list[int]:
    """``calibrate.decode_shared_context`` (null: the ``decode_context`` values): the contexts of
    the shared decode batches, each above the least ``decode_context``."""
    values = cfg.get("decode_shared_context")
    if values is None:
        return contexts
    least = min(contexts)
    if not isinstance(values, Sequence) or isinstance(values, str) or not values \
            or any(isinstance(v, bool) or not isinstance(v, int) or v <= least for v in values):
        raise BadInput(f"calibrate.decode_shared_context must be null or a non-empty list of "
                       f"integers > the least decode_context ({least}), got {values!r}")
    return list(values)


def shared_decodes(batches: list[int], contexts: list[int], shared: Sequence[int]
                   ) -> list[StepShape]:
    """Decode batches whose requests share a prefix: for each batch size of two or more and each
    context of ``shared`` above the least of ``contexts``, every request at that context, all but
    the least's tokens shared (tree-of-thought's siblings, few-shot's questions): what the others
    read again (`StepShape.reread`), from a CPU's caches."""
    least = min(contexts)
    return [StepShape.decode((context,) * batch, reread=(batch - 1) * (context - least))
            for batch in batches if batch >= 2 for context in shared if context > least]


def ragged_decodes(batches: list[int], contexts: list[int]) -> list[StepShape]:
    """Decode batches of mixed contexts: for each batch size of two or more and each context
    above the least, contexts spread evenly from the least up to that one (a served decode batch
    mixes long and short requests; the longest sets a padded kernel's cost, the sum an unpadded
    one's)."""
    least = min(contexts)
    return [StepShape.decode(tuple(int(round(c)) for c in np.linspace(least, context, batch)))
            for batch in batches if batch >= 2 for context in contexts if context > least]


def row_knots(cfg: Any, steps: Sequence[StepShape]) -> dict[str, list[int]]:
    """``calibrate.row_table`` (default true): per step kind, the row counts (``Σnew``: a decode's
    batch size, a prefill's new tokens, a verification's queries) of ``steps``, each of which the fit then prices on its
    own (``n<K>``, `testbed.sim.fit`); else none."""
    return {kind: sorted({s.num_new for s in steps if s.kind == kind})
            for kind in ("decode", "prefill", "verify")} if row_table_on(cfg) else {}


def row_table_on(cfg: Any) -> bool:
    """``calibrate.row_table``, checked (default true)."""
    return group_values.check_setting("calibrate.row_table", bool, cfg.get("row_table", True))


#: a decode batch size a server fit prices on its own (`server_row_knots`) once this many of its
#: recovered steps are there to fit it
SERVER_KNOT_STEPS = 20


def server_row_knots(cfg: Any, samples: Sequence[tuple[StepShape, float]]
                     ) -> dict[str, list[int]]:
    """``calibrate.row_table`` on a server's recovered steps: the decode batch sizes with at least
    `SERVER_KNOT_STEPS` steps each (a server's rows are what its workload ran, not a grid: a size
    seen a few times would be priced by its noise); prefills keep the linear form (their new
    tokens take hundreds of values)."""
    sizes = [s.batch for s, _ in samples if s.kind == "decode"]
    knots = sorted(k for k in set(sizes) if sizes.count(k) >= SERVER_KNOT_STEPS)
    return {"decode": knots, "prefill": []} if row_table_on(cfg) and knots else {}


#: ``calibrate.slot_layout``: where a synthetic batch's KV sits (see `slot_order`)
SLOT_LAYOUTS = ("runs", "interleaved", "contiguous")


def slot_layout(cfg: Any) -> str:
    """``calibrate.slot_layout``, checked (default ``runs``)."""
    layout = cfg.get("slot_layout", "runs")
    check_choice("calibrate.slot_layout", layout, SLOT_LAYOUTS)
    return layout


def slot_order(step: StepShape, layout: str) -> list[np.ndarray]:
    """Each request's KV slots (context first, then its new tokens), from 1 up, distinct but for
    a shared prefix.

    ``contiguous``: one run of slots per request. ``runs``: the contexts alternate across the
    batch's requests in runs of `RUN_SLOTS` tokens (tokens 0-31 of every request holding them,
    then 32-63, ...), then each request's new tokens in one run: a served batch's KV as the pool
    lays it out, each request's decoded tokens running on in blocks of their own
    (`KVSlotPool.alloc_after`). ``interleaved``: the same token by token, as the pool laid a
    batch's decoded tokens out before it kept them in runs (one slot per request per step):
    reading rows a batch apart, SmolLM2-135M's decode steps of 4, 8 and 16 requests at 512
    tokens each took 1%, 7% and 9% longer than contiguous on the 2-core development CPU (side by
    side, medians of 12). A decode step with ``reread`` tokens (the grid's shared batches,
    `grid`) has every request begin with the same ``reread / (batch − 1)`` slots, one run, as
    one prefill wrote them; the layout applies to the rest.
    """
    shared = step.reread // (step.batch - 1) if step.reread else 0
    prefix = list(range(1, shared + 1))
    contexts = np.asarray(step.context) - shared
    if layout == "contiguous":
        lengths = contexts + np.asarray(step.new)
        ends = shared + np.cumsum(lengths)
        return [np.asarray(prefix + list(range(end - n + 1, end + 1)), dtype=np.int32)
                for n, end in zip(lengths, ends)]
    run = RUN_SLOTS if layout == "runs" else 1
    # the (token, request) pairs of every context, ordered by run, then request, then token
    token, request = np.nonzero(np.arange(contexts.max(initial=0))[:, None] < contexts[None, :])
    order = np.lexsort((token, request, token // run))
    request = request[order]
    slots = [prefix + list(1 + shared + np.flatnonzero(request == i))
             for i in range(len(contexts))]
    start = 1 + shared + len(token)
    for i, new in enumerate(step.new):
        slots[i] += range(start, start + new)
        start += new
    return [np.asarray(s, dtype=np.int32) for s in slots]


def synthetic_batch(step: StepShape, vocab: int, rng: np.random.Generator,
                    layout: str = "runs") -> Batch:
    """A batch of the given shape over fresh requests holding distinct KV slots, laid out as
    ``layout`` says (`slot_order`)."""
    return batch_on_slots(step, slot_order(step, layout), vocab, rng)


def batch_on_slots(step: StepShape, slots: Sequence[np.ndarray], vocab: int,
                   rng: np.random.Generator, cached: bool = False) -> Batch:
    """A batch of the given shape over fresh requests (random tokens) reading and writing the
    given KV slots, each request's context first, then its new tokens; ``cached``: each
    request's context counts as its cached prefix (its lease's hit), else nothing does. A
    verification step (`StepShape.verify`) is a decode batch whose requests carry
    ``new − 1`` random drafts after their last token, verified as the scheduler's are
    (`testbed.scheduler.spec_steps`)."""
    entries = []
    for i, (new, context, own) in enumerate(zip(step.new, step.context, slots)):
        draft = rng.integers(0, vocab, new - 1, dtype=np.int32) if step.verify else None
        prompt = rng.integers(0, vocab, context + (1 if step.verify else new), dtype=np.int32)
        request = Request(f"cal{i}", prompt, np.zeros(1, dtype=np.int32))
        req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=i)
        req.lease = Lease(hit=context if cached else 0, slots=np.asarray(own, dtype=np.int32))
        entries.append(BatchEntry(req, context, new, produces_token=True, draft=draft))
    return Batch("decode" if step.is_decode or step.verify else "prefill", entries)


def timed_pass(executor: Any, batches: list[Batch], rng: np.random.Generator) -> list[float]:
    """Run every batch once, in a random order, and return the step times in the batches' order.

    A served workload never repeats the step before it, so timing a shape back to back (caches,
    allocator and kernel choice all hot) would measure it faster than the engine ever runs it.
    A step's time is the device's (``gpu_s``: CUDA events; on the CPU, launch's work), where the
    executor splits it: the host's work is priced apart (`testbed.sim.overlap`).
    """
    times = [0.0] * len(batches)
    for i in rng.permutation(len(batches)):
        outcome = executor.execute(batches[i])
        gpu = getattr(outcome, "gpu_s", None)
        times[i] = outcome.duration_s if gpu is None else gpu
    return times


def measure(executor: Any, steps: list[StepShape], repeats: int, vocab: int,
            seed: int = 0, progress: bool = False,
            layout: str = "runs") -> list[tuple[StepShape, float]]:
    """The median of ``repeats`` timed passes over the steps, after one warm-up pass
    (allocator, kernels)."""
    rng = np.random.default_rng(seed)
    batches = [synthetic_batch(step, vocab, rng, layout) for step in steps]
    timed_pass(executor, batches, rng)
    passes = [timed_pass(executor, batches, rng)
              for _ in tqdm(range(repeats), desc="calibrate", unit="pass",
                            disable=None if progress else True)]
    return median_times(steps, passes)


def median_times(steps: list[StepShape],
                 passes: list[list[float]]) -> list[tuple[StepShape, float]]:
    """Each step with the median of its times over ``passes`` (each from `timed_pass`)."""
    return [(step, float(np.median(t))) for step, t in zip(steps, zip(*passes))]


def grid_slots(steps: list[StepShape]) -> int:
    """KV slots the largest synthetic batch of ``steps`` needs (0 for no steps)."""
    return max((sum(n + ctx for n, ctx in zip(s.new, s.context)) for s in steps), default=0)
