"""`StepShape`: one scheduler step as the cost models see it.

Per request of the batch, ``new`` tokens computed on top of ``context`` tokens already in its KV;
for cascade decoding the groups that read a shared prefix once (``shared``); for reuse beyond
exact prefixes the KV moved after the forward pass (``rotated``, ``copied``, priced as bytes by
`kv_move_bytes`). How each model turns a shape into seconds is `testbed.sim.cost_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from testbed.config.model_shape import ModelShape
from testbed.scheduler.decode_groups import saved_reads


#: the fewest rows a CPU BLAS multiplies as one matrix product (`StepShape.few_row_passes`)
GEMM_MIN_ROWS = 4


class lazy_property:
    """A property computed on first read and kept (`functools.cached_property` without its
    lock, which Python 3.11 takes on every first read: a simulation reads several for each of
    its hundred thousand steps)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.fn(obj)
        return value


@dataclass(frozen=True)
class StepShape:
    """One step's batch: request ``i`` computes ``new[i]`` tokens (≥ 1) on top of ``context[i]``
    tokens (≥ 0) already in its KV.

    ``shared`` (cascade decoding, decode steps only): disjoint groups ``(P, members)`` of two or
    more requests whose first ``P`` cached tokens are the same KV, which the step reads once per
    group (`testbed.scheduler.decode_groups` forms them, for the engine and the simulator alike).
    A member then reads its own suffix, ``context + 1 - P`` tokens, and the step reads
    ``kv_read_context = Σcontext − Σ(members − 1)·P`` cached tokens instead of ``Σcontext``.

    ``verify`` (speculative decoding): the step verifies drafts, and the engine computes the
    logits of every query it runs, not only each request's last (`testbed.engine.verify`): a
    step of more than one new token for some request is then of kind ``verify``, not
    ``prefill`` (one with a new token a request is a decode step either way).

    ``reread`` (decode steps without cascade): of those, the cached tokens a request reads after
    another request of the batch read the same KV: every cached slot once per request that reads
    it after the first (`testbed.scheduler.decode_groups.SharedReads`; for one prefix of ``P``
    tokens that ``n`` requests share, ``(n − 1)·P``). Every request still reads them, from a CPU's
    caches then, which the fitted model may price apart
    (`testbed.sim.cost_model.FittedCostModel`'s ``h``).

    >>> s = StepShape(new=(1, 1, 512), context=(100, 200, 0))
    >>> s.batch, s.num_new, s.num_context, s.is_decode
    (3, 514, 300, False)
    >>> c = StepShape.decode((110, 110, 50), shared=((100, (0, 1)),))
    >>> c.num_context, c.shared_saving, c.kv_read_context
    (270, 100, 170)
    """

    new: tuple[int, ...]
    context: tuple[int, ...]
    shared: tuple[tuple[int, tuple[int, ...]], ...] = ()
    rotated: int = 0  # tokens of reused spans: donor KV copied in, keys re-rotated
    copied: int = 0  # tokens of chunk stores: KV copied (and de-rotated) out
    reread: int = 0  # decode without cascade: cached tokens read again after another request
    verify: bool = False  # speculative verification: every query's logits (kind ``verify``)

    def __post_init__(self) -> None:
        if min(self.rotated, self.copied) < 0:
            raise ValueError(f"StepShape: rotated and copied tokens must be >= 0, got "
                             f"{self.rotated}, {self.copied}")
        new, context = tuple(map(int, self.new)), tuple(map(int, self.context))
        if len(new) != len(context):
            raise ValueError(f"StepShape: {len(new)} new counts but {len(context)} contexts")
        if not new:
            raise ValueError("StepShape: a step needs at least one request")
        if min(new) < 1:
            raise ValueError(f"StepShape: new tokens must be >= 1, got {min(new)}")
        if min(context) < 0:
            raise ValueError(f"StepShape: context must be >= 0, got {min(context)}")
        object.__setattr__(self, "new", new)
        object.__setattr__(self, "context", context)
        object.__setattr__(self, "shared", self._check_shared(self.shared, new, context))
        if self.reread and (max(new) != 1 or not 0 < self.reread <= self.kv_read_context):
            raise ValueError(f"StepShape: reread must be 0, or in a decode step between 1 and "
                             f"the {self.kv_read_context} cached tokens it reads, got "
                             f"{self.reread}")

    @staticmethod
    def _check_shared(shared, new: tuple[int, ...], context: tuple[int, ...]
                      ) -> tuple[tuple[int, tuple[int, ...]], ...]:
        groups = tuple((int(p), tuple(int(m) for m in members)) for p, members in shared)
        if groups and max(new) != 1:
            raise ValueError("StepShape: shared prefixes (cascade) are for decode steps only")
        seen: set[int] = set()
        for p, members in groups:
            if len(members) < 2 or len(set(members)) != len(members):
                raise ValueError(f"StepShape: a shared prefix needs two or more distinct "
                                 f"requests, got {members}")
            if seen & set(members) or min(members) < 0 or max(members) >= len(new):
                raise ValueError(f"StepShape: shared groups must be disjoint indices into the "
                                 f"batch of {len(new)}, got {members}")
            seen |= set(members)
            if p < 1 or p > min(context[m] for m in members):
                raise ValueError(f"StepShape: a shared prefix of {p} tokens must be >= 1 and "
                                 f"cached by every member")
        return groups

    @classmethod
    def decode(cls, contexts: tuple[int, ...] | list[int],
               shared: tuple[tuple[int, tuple[int, ...]], ...] = (), reread: int = 0
               ) -> StepShape:
        """A decode step: one new token per request."""
        return cls(new=(1,) * len(contexts), context=tuple(contexts), shared=shared,
                   reread=reread)

    @classmethod
    def of_decode(cls, contexts: tuple[int, ...]) -> StepShape:
        """`decode` of ``contexts`` without shared prefixes or rereads, made once a step by the
        simulator (`testbed.sim.executor`): when every context is a Python int (their sum is
        one) nothing needs converting, so the checks are the sums' and the shape is written
        whole, Σnew and Σcontext with it; otherwise `decode`'s conversions."""
        total = sum(contexts)
        if type(total) is not int or type(contexts) is not tuple or not contexts \
                or min(contexts) < 0:
            return cls.decode(contexts)
        step = object.__new__(cls)
        step.__dict__.update(new=(1,) * len(contexts), context=contexts, shared=(), rotated=0,
                             copied=0, reread=0, verify=False, num_new=len(contexts),
                             num_context=total, is_decode=True)
        return step

    @classmethod
    def verification(cls, queries: tuple[int, ...] | list[int],
                     contexts: tuple[int, ...] | list[int]) -> StepShape:
        """A speculative verification step: request ``i``'s last token and its drafts,
        ``queries[i]`` tokens, on top of ``contexts[i]``.

        >>> StepShape.verification((5,), (300,)).kind
        'verify'
        """
        return cls(new=tuple(queries), context=tuple(contexts), verify=True)

    @property
    def batch(self) -> int:
        return len(self.new)

    @lazy_property
    def num_new(self) -> int:
        """Σ new: tokens computed this step."""
        return sum(self.new)

    @lazy_property
    def num_context(self) -> int:
        """Σ context: tokens already cached before this step."""
        return sum(self.context)

    @lazy_property
    def shared_saving(self) -> int:
        """Σ (members − 1)·P over the shared groups: cached KV tokens cascade does not read."""
        return saved_reads(self.shared)

    @lazy_property
    def kv_read_context(self) -> int:
        """Cached KV tokens the step reads: ``num_context`` less ``shared_saving``."""
        return self.num_context - self.shared_saving

    @lazy_property
    def new_times_context(self) -> int:
        """Σ new·context: query–key pairs against the cached part (a decode step's: Σcontext)."""
        if self.is_decode:
            return self.num_context
        return sum(n * c for n, c in zip(self.new, self.context))

    @lazy_property
    def attended_pairs(self) -> float:
        """Σ new·(context + (new+1)/2): query–key pairs, the chunk's causal triangle included."""
        triangles = 2 * self.batch if self.is_decode else sum(n * (n + 1) for n in self.new)
        return self.new_times_context + triangles / 2

    @lazy_property
    def padded_decode_area(self) -> int:
        """The cached KV a decode kernel that pads to the longest reads, 0 for a prefill: plainly
        ``batch × max(context)`` (the engine's ``torch`` attention; ``Σcontext`` of it is real,
        the rest padding). In cascade its two parts are padded each to their own longest, as
        the engine plans them: every request's suffix (``context − P``, all of it outside a
        group) to the longest suffix, and each group's prefix to the longest ``P``:
        ``batch × max(suffix) + groups × max(P)``."""
        if not self.is_decode:
            return 0
        if not self.shared:
            return self.batch * max(self.context)
        suffix = list(self.context)
        for p, members in self.shared:
            for m in members:
                suffix[m] -= p
        return self.batch * max(suffix) + len(self.shared) * max(p for p, _ in self.shared)

    @lazy_property
    def few_row_passes(self) -> int:
        """``batch − 1`` when the batch has 2 or 3 requests, else 0: the extra passes over the
        weights of a CPU BLAS that multiplies fewer than `GEMM_MIN_ROWS` rows as one
        matrix–vector product per row (measured on this project's CPU machine: the LM head of
        SmolLM2-135M takes 15, 28 and 42 ms at 1, 2 and 3 rows, 24 ms at 4). Every matmul of a
        decode step has ``batch`` rows, a prefill's LM head too (its last position per request)."""
        return self.batch - 1 if 1 < self.batch < GEMM_MIN_ROWS else 0

    @lazy_property
    def is_decode(self) -> bool:
        """Every request computes exactly one token (a mixed step counts as prefill)."""
        return self.num_new == self.batch

    @property
    def kind(self) -> str:
        """``decode`` (one new token a request), ``verify`` (a speculative verification of
        drafts: every query's logits) or ``prefill`` (the rest)."""
        return "decode" if self.is_decode else "verify" if self.verify else "prefill"


def kv_move_bytes(model: ModelShape, step: StepShape) -> float:
    """HBM bytes one GPU moves for reuse beyond exact prefixes: a reused token's K and V read
    and written (the donor copy) plus its K read and written (re-rotation), a stored chunk
    token's K and V read and written."""
    if not (step.rotated or step.copied):
        return 0.0
    kv = model.kv_bytes_per_token_per_gpu
    return kv * (3 * step.rotated + 2 * step.copied)
