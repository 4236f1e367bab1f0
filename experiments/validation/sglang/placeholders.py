"""SGLang 0.5.23's own scheduling and eviction code, loaded from its wheel with generic stand-ins.

0.5.23's ``managers/schedule_policy.py`` imports some forty modules (allocators for hybrid
models, the unified cache, disaggregation, dLLM, ...) that our path never reaches, so instead of
0.4.10's list of stand-ins (`sglang_wheel.STAND_INS`) an import hook serves every ``sglang``
module but `REAL` as an empty module whose every name is a placeholder class (whose attributes and
instances' attributes are placeholders or no-ops). The real ones: the policy, the radix cache, the
eviction strategies and what they call to match and insert (``mem_cache/common.py``,
``base_prefix_cache.py``, ``utils.py``, ``cache_init_params.py``) and ``environ.py`` (the
environment switches, read with their defaults). The runtime context the policy asks for
(``get_disagg``, ``get_memory``) is set to the plain values of a default server with the eviction
policy under test, and the radix cache's ``time.monotonic`` is a logical clock (no ties).

T-LRU lives only in the unified tree (``unified_cache/unified_tree_core.py``), whose nodes keep
the branch depths it reads; `tlru_bookkeeping` applies that module's own
``_set_tlru_lens_and_raise_history`` to the classic RadixCache's new nodes, and copies the depths
on a split as ``unified_tree_core`` does, so that ``TLRUStrategy`` can rank them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from pathlib import Path
from types import SimpleNamespace

from experiments.validation.sglang.wheel import _Clock

REAL = {
    "sglang.srt.environ", "sglang.srt.managers.schedule_policy",
    "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.base_prefix_cache", "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    # for whole batches (`sglang_mirror523`): the adder's budget and the allocator's eviction
    "sglang.srt.mem_cache.prefill_budget", "sglang.srt.mem_cache.allocator.base",
}

# Third-party packages the real modules import at the top but our path never uses (unified_tree_core
# encodes KV events with msgspec): placeholders where they are not installed.
THIRD_PARTY = {"msgspec"}


def _noop(*args, **kwargs) -> None:
    return None


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return placeholder(name)


def placeholder(name: str) -> type:
    """A class standing for an imported name: constructible with anything, every attribute of it
    another placeholder, every attribute of its instances a no-op."""
    return _PlaceholderMeta(name, (), {"__init__": _noop, "__getattr__": lambda self, a: _noop})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = placeholder(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``sglang.*``: the `REAL` modules from the unzipped wheel, placeholders otherwise."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in THIRD_PARTY:
            others = [f for f in sys.meta_path if f is not self]
            if any(f.find_spec(fullname, path, target) for f in others
                   if hasattr(f, "find_spec")):
                return None  # installed: the real one
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        if fullname in REAL:
            folder = self.root / "/".join(fullname.split(".")[:-1])
            return importlib.machinery.PathFinder.find_spec(fullname, [str(folder)])
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def load(root: Path) -> SimpleNamespace:
    """Import 0.5.23's schedule_policy, radix_cache, evict_policy and their helpers from
    ``root`` (the unzipped wheel)."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]  # another release loaded before, in this process
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    sys.meta_path.insert(0, _Finder(root))
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    radix.time = _Clock()
    policy = importlib.import_module("sglang.srt.managers.schedule_policy")
    memory = SimpleNamespace(radix_eviction_policy="lru")
    policy.get_disagg = lambda: SimpleNamespace(disaggregation_mode="null")
    policy.get_memory = lambda: memory
    runtime(policy, importlib.import_module("sglang.srt.mem_cache.common"))
    return SimpleNamespace(
        radix=radix, policy=policy, memory=memory, root=root, version="0.5.23",
        base=importlib.import_module("sglang.srt.mem_cache.base_prefix_cache"),
        common=importlib.import_module("sglang.srt.mem_cache.common"),
        evict=importlib.import_module("sglang.srt.mem_cache.evict_policy"),
        environ=importlib.import_module("sglang.srt.environ"),
        allocator_base=importlib.import_module("sglang.srt.mem_cache.allocator.base"),
        params=importlib.import_module("sglang.srt.mem_cache.cache_init_params"),
        unified=importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_tree_core"))


def runtime(policy, common) -> None:
    """The runtime context and feature probes the adder and ``mem_cache/common.py`` read, as a
    default server on one CUDA GPU sets them: no KV sharding, mamba, DCP, encoder replay, HIP
    tile budget or speculative decoding; the ``lpm``-style policy names of ``get_schedule`` are
    read only for shortest-prefill-first, which the checks do not run."""
    features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
    policy.get_exec = lambda: SimpleNamespace(features=features)
    policy.get_schedule = lambda: SimpleNamespace(schedule_policy="lpm",
                                                  schedule_low_priority_values_first=True)
    policy.page_interleave_shard_size = common.page_interleave_shard_size = lambda alloc: 1
    policy.mamba_prefill_chunk_grid = lambda: 1
    policy._use_exact_chunk_fill = lambda: False  # gfx95 only
    policy._IS_HIP = False
    policy.split_cached_prefix_by_tier = lambda prefix_len, **_: (prefix_len, 0, 0)
    common.get_spec = lambda: SimpleNamespace(speculative_algorithm=None)
    common.get_serving = lambda: SimpleNamespace(strip_thinking_cache=False)


def tlru_bookkeeping(sgl: SimpleNamespace, cache) -> None:
    """Give a classic RadixCache the T-LRU depths the unified tree keeps (module docstring):
    ``_set_tlru_lens_and_raise_history`` for each new node (its parent's depth plus its own
    length), and a split's head taking the parent's depth plus its length and the tail's history
    (``unified_tree_core``'s split)."""
    raise_history = sgl.unified._set_tlru_lens_and_raise_history
    root = cache.root_node
    root._tlru_cached_prefix_len = root._tlru_history_len = 0
    insert_helper, split_node = cache._insert_helper, cache._split_node
    heads: set = set()  # nodes made by splits: they copy depths instead

    def insert(node, key, value, priority=0, inserted_len=0):
        before = set(_nodes(root))
        out = insert_helper(node, key, value, priority, inserted_len)
        for new in _nodes(root):
            if new not in before and new not in heads:
                new._tlru_history_len = 0  # as UnifiedTreeNode starts
                raise_history(new, new.parent)
        return out

    def split(key, child, split_len):
        head = split_node(key, child, split_len)
        heads.add(head)
        head._tlru_cached_prefix_len = head.parent._tlru_cached_prefix_len + split_len
        head._tlru_history_len = child._tlru_history_len
        return head

    cache._insert_helper, cache._split_node = insert, split


def _nodes(root) -> list:
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out
