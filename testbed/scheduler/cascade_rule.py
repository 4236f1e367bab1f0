"""When reading a shared prefix once pays: the one rule by which cascade decoding's groups form.

Cascade decoding (`testbed.scheduler.decode_groups`, `testbed.engine.cascade`) reads a prefix
that ``n`` requests share once, in a pass of its own whose partial results merge into each
request's own pass. That saves ``(n - 1) · P`` KV reads, but on a GPU the saving is not free
time: plain split-KV decode spreads every request's keys over the whole device, while the
prefix pass has a grid of its own — one program per part of the group, KV head and chunk of
keys — which a small group or a short prefix leaves mostly idle; and each of its programs writes
partial results that are read back to merge. `sharing_pays` decides, per tree node, whether the
pass beats reading the prefix in every request's own pass; a node that does not pay is left to
its children (deeper, fewer sharers) and, where none pays, read in each request's own pass
(`testbed.cache.shared_prefix.shared_prefix_groups`, called with it by `DecodeGroups`). The
engine plans, and the simulator prices, the groups of that one call, so they agree.

The model, in the spirit of vLLM V1's (``use_cascade_attention`` in its FlashAttention backend:
no cascade below a 256-token common prefix or 8 requests, otherwise waves of thread blocks
compared), with this engine's kernels' geometry (`testbed.engine.cascade`,
`radix_kernels.cascade`), time counted in *tile-times*: one program reading one tile of
``KEY_TILE`` keys of one KV head.

- plain: the members read the prefix in their own passes, ``n · kv_heads · ⌈P / KEY_TILE⌉``
  tiles spread over the device's ``slots`` (split-KV decode fills the grid), no rounding up:
  the least that reading costs, so cascade must beat plain's best case;
- cascade: the prefix pass's programs, ``⌈n · gqa / MAX_QUERY_ROWS⌉`` parts (a program holds
  at most ``MAX_QUERY_ROWS`` query rows) × ``kv_heads`` × ``chunks`` (``⌈P / KEY_TILE⌉``, at
  most ``MAX_PREFIX_SPLITS``), run in ``⌈programs / slots⌉`` waves of ``⌈tiles / chunks⌉``
  tiles each, plus ``MERGE_TILES`` for writing each program's partial result and merging it.

``slots`` is the number of programs the device runs at once (its streaming multiprocessors:
the hardware preset's ``sm_count`` in the simulator, the device's own count in the engine).
Without one (the CPU: one thread runs every program in turn, so fewer reads are always less
time) every shared node pays, as before issue 61; so does ``engine.cascade_rule=always``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from testbed.errors import BadInput, check_choice

#: the ``engine.cascade_rule`` key's values: ``auto`` decides by `sharing_pays` where the device
#: has a grid of programs to fill (a GPU), every shared node elsewhere; ``always`` groups every
#: shared node (the rule before issue 61)
CASCADE_RULES = ("auto", "always")

#: vLLM V1's thresholds (vllm/v1/attention/backends/flash_attn.py, ``use_cascade_attention``):
#: no cascade below a 256-token shared prefix or 8 sharing requests
MIN_SHARED_TOKENS = 256
MIN_SHARERS = 8

#: the geometry of the engine's prefix pass (`testbed.engine.cascade` plans it): a program's
#: query rows (a group's members times the GQA group; a wider group is split, each part reading
#: the prefix once) — more would not fit a program's registers (fp32 accumulators of rows x
#: head_dim); the keys a chunk of the prefix holds (one tile), and at most this many chunks
MAX_QUERY_ROWS = 64
KEY_TILE = 64
MAX_PREFIX_SPLITS = 32

#: tile-times a program of the prefix pass spends beyond its keys: writing its partial result
#: (rows x head_dim fp32, the size of half a tile of bf16 keys and values at 32 rows) and having
#: it read back and merged. An estimate, to be measured (docs/results/engine_gpu.md)
MERGE_TILES = 1


@dataclass(frozen=True)
class CascadeRule:
    """The device and model a step's cascade groups are decided for (`sharing_pays`).

    ``slots``: programs the device runs at once (its SMs); None: a device without a grid to fill
    (the CPU), where every shared node pays. ``kv_heads``: KV heads on one device (each its own
    program of the prefix pass); ``gqa_group``: query heads per KV head.
    """

    slots: int | None = None
    kv_heads: int = 1
    gqa_group: int = 1
    min_shared: int = MIN_SHARED_TOKENS
    min_sharers: int = MIN_SHARERS

    def __post_init__(self) -> None:
        for key in ("kv_heads", "gqa_group", "min_shared", "min_sharers"):
            if getattr(self, key) < 1:
                raise BadInput(f"CascadeRule.{key} must be >= 1, got {getattr(self, key)}")
        if self.slots is not None and self.slots < 1:
            raise BadInput(f"CascadeRule.slots (the device's SMs) must be >= 1 or null, got "
                           f"{self.slots}")

    @classmethod
    def build(cls, mode: str, slots: int | None, num_heads: int, kv_heads: int
              ) -> CascadeRule:
        """The rule ``engine.cascade_rule`` (``mode``) names, for a device of ``slots``
        programs at once (None: no grid) and a model of ``num_heads`` query heads over
        ``kv_heads`` KV heads on that device."""
        check_choice("engine.cascade_rule", mode, CASCADE_RULES)
        return cls(slots=slots if mode == "auto" else None, kv_heads=kv_heads,
                   gqa_group=max(1, num_heads // kv_heads))

    @property
    def every_node(self) -> bool:
        """Whether every shared node pays (no grid to fill): the grouping needs no rule."""
        return self.slots is None

    def pays(self) -> Callable[[int, int], bool] | None:
        """``sharing_pays`` bound to this rule, for `shared_prefix_groups`; None when every
        node pays (nothing to call)."""
        return None if self.every_node else lambda sharers, shared: sharing_pays(
            sharers, shared, self)


def plain_tiles(sharers: int, shared: int, rule: CascadeRule) -> float:
    """Tile-times the members' own passes spend reading the prefix: every tile of every KV
    head once per member, spread evenly over the device's slots (the best plain can do)."""
    return sharers * rule.kv_heads * -(-shared // KEY_TILE) / rule.slots


def prefix_pass_tiles(sharers: int, shared: int, rule: CascadeRule) -> int:
    """Tile-times the prefix pass of one group takes: its waves of programs, each reading its
    chunk's tiles and writing a partial result that is merged (``MERGE_TILES``)."""
    tiles = -(-shared // KEY_TILE)
    parts = -(-sharers * rule.gqa_group // MAX_QUERY_ROWS)
    chunks = min(MAX_PREFIX_SPLITS, tiles)
    waves = -(-parts * rule.kv_heads * chunks // rule.slots)
    return waves * (-(-tiles // chunks) + MERGE_TILES)


def sharing_pays(sharers: int, shared: int, rule: CascadeRule) -> bool:
    """Whether ``sharers`` requests should read their ``shared`` cached tokens once, in the
    prefix pass, rather than each in its own pass.

    >>> h100 = CascadeRule(slots=132, kv_heads=32, gqa_group=1)  # Llama-2-7B on an H100
    >>> sharing_pays(32, 2048, h100), sharing_pays(7, 2048, h100), sharing_pays(32, 255, h100)
    (True, False, False)
    >>> sharing_pays(2, 1, CascadeRule())  # no grid (a CPU): every shared node pays
    True
    """
    if sharers < 2 or shared < 1:
        return False
    if rule.every_node:
        return True
    if sharers < rule.min_sharers or shared < rule.min_shared:
        return False
    return prefix_pass_tiles(sharers, shared, rule) < plain_tiles(sharers, shared, rule)
