"""SGLang's own scheduling code, loaded from its wheel, with stand-ins for what it names.

`fetch` downloads a release's wheel once (``pip download --no-deps``) into
``~/.cache/radix-testbed/sglang-RELEASE/`` (`wheel_dir`) and unzips its ``sglang/`` sources into
``src/``; `load` imports from there what the checks drive, in the way the release needs
(`LOADERS`), the package ``__init__``s (the whole frontend and runtime) skipped either way:

- **0.4.10** (`load_listed`): ``managers/schedule_policy.py`` (SchedulePolicy, PrefillAdder),
  ``mem_cache/radix_cache.py`` (RadixCache) and ``global_config.py`` (the new-token-ratio and
  retraction constants), every other ``sglang`` module they import real, but for those imported
  only for type hints, ``isinstance`` checks of features we leave off, or KV-event records we
  never enable: stand-ins (`STAND_INS`). ``schedule_batch.Req`` is `stand_ins.Req0410`.
- **0.5.23** (`load_hooked`): its ``schedule_policy.py`` imports some forty modules (allocators for
  hybrid models, the unified cache, disaggregation, dLLM, ...) that our path never reaches, so an
  import hook (`placeholders.Finder`) serves every ``sglang`` module but `REAL` as a placeholder.
  The real ones: the policy, the radix cache, the eviction strategies and what they call to match
  and insert (``mem_cache/common.py``, ``base_prefix_cache.py``, ``utils.py``,
  ``cache_init_params.py``), ``environ.py`` (the environment switches, read with their defaults),
  the prefill budget and the allocator base (whole batches), and the unified tree's core (T-LRU's
  bookkeeping, `eviction.tlru_bookkeeping`). The runtime context the policy and
  ``mem_cache/common.py`` ask for is set to a default server's (`runtime`).

Either way the radix cache's ``time.monotonic`` is a logical clock (`Clock`), so that LRU order
never ties (two nodes touched within one clock tick) and runs repeat.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

from experiments.validation.sglang import placeholders
from experiments.validation.sglang.stand_ins import Req0410

RELEASES = ("0.5.23", "0.4.10")  # those the checks know; the first is the default
CACHE_ROOT = Path.home() / ".cache" / "radix-testbed"  # the wheel of release V in sglang-V/

# 0.4.10: imported by the two modules but unused on our path: (module, names it must offer, why).
STAND_INS = [
    ("sglang.srt.managers.schedule_batch", ("Req", "ScheduleBatch"), "type hints only"),
    ("sglang.srt.mem_cache.allocator", ("BaseTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator"),
     "type hint; isinstance check for SWA models"),
    ("sglang.srt.mem_cache.memory_pool", ("ReqToTokenPool",), "type hint only"),
    ("sglang.srt.disaggregation.kv_events", ("AllBlocksCleared", "BlockRemoved", "BlockStored"),
     "records built only with enable_kv_cache_events"),
]
# 0.5.23: the modules imported from the wheel; every other sglang module is a placeholder.
REAL = {
    "sglang.srt.environ", "sglang.srt.managers.schedule_policy",
    "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.evict_policy",
    "sglang.srt.mem_cache.base_prefix_cache", "sglang.srt.mem_cache.common",
    "sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.cache_init_params",
    "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    # for whole batches (`release_loops.Loop0523`): the adder's budget and the allocator's eviction
    "sglang.srt.mem_cache.prefill_budget", "sglang.srt.mem_cache.allocator.base",
}


def wheel_dir(release: str) -> Path:
    """Where release ``release``'s wheel is kept (and unzipped, in ``src/``)."""
    return CACHE_ROOT / f"sglang-{release}"


def fetch(cache_dir: Path, release: str) -> Path:
    """The unzipped wheel's root (holding ``sglang/``), downloading the wheel if it is missing.
    (0.4.10's wheel is pure Python; 0.5.23's is built per platform, e.g.
    ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``: whichever pip picks will do, as only
    its Python sources are read.)"""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob(f"sglang-{release}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        f"sglang=={release}", "-d", str(cache_dir)], check=True)
        wheels = sorted(cache_dir.glob(f"sglang-{release}-*.whl"))
    wheel = wheels[0]
    root = cache_dir / "src"
    if not (root / "sglang/srt/managers/schedule_policy.py").exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/")])
    return root


class Clock:
    """A stand-in for the ``time`` module inside radix_cache: a strictly increasing counter."""

    def __init__(self) -> None:
        self.t = 0

    def monotonic(self) -> int:
        self.t += 1
        return self.t

    @staticmethod
    def perf_counter() -> float:  # 0.5.23 times its evictions for metrics we leave off
        return 0.0


def load(root: Path, release: str) -> SimpleNamespace:
    """Release ``release``'s modules from ``root`` (the unzipped wheel), as `LOADERS` says;
    another release loaded before in this process, and its import hook, are put aside first.
    The namespace holds ``radix``, ``policy``, ``root`` and ``version`` for every release, and
    what else that release's checks read."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, placeholders.Finder)]
    return LOADERS[release](root)


def load_listed(root: Path) -> SimpleNamespace:
    """0.4.10: schedule_policy, radix_cache and global_config, with `STAND_INS`."""
    for pkg in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.mem_cache",
                "sglang.srt.disaggregation"):  # packages without running their __init__
        module = types.ModuleType(pkg)
        module.__path__ = [str(root / pkg.replace(".", "/"))]
        sys.modules[pkg] = module
    for name, attrs, _ in STAND_INS:
        module = types.ModuleType(name)
        for attr in attrs:
            setattr(module, attr, type(attr, (), {}))
        sys.modules[name] = module
    sys.modules["sglang.srt.managers.schedule_batch"].Req = Req0410
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    radix.time = Clock()
    policy = importlib.import_module("sglang.srt.managers.schedule_policy")
    gc = importlib.import_module("sglang.global_config").global_config
    return SimpleNamespace(radix=radix, policy=policy, global_config=gc, root=root,
                           version="0.4.10")


def load_hooked(root: Path) -> SimpleNamespace:
    """0.5.23: `REAL` from the wheel, every other sglang module a placeholder."""
    sys.meta_path.insert(0, placeholders.Finder(root, REAL))
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    radix.time = Clock()
    policy = importlib.import_module("sglang.srt.managers.schedule_policy")
    common = importlib.import_module("sglang.srt.mem_cache.common")
    memory = SimpleNamespace(radix_eviction_policy="lru")
    policy.get_disagg = lambda: SimpleNamespace(disaggregation_mode="null")
    policy.get_memory = lambda: memory
    runtime(policy, common)
    return SimpleNamespace(
        radix=radix, policy=policy, memory=memory, root=root, version="0.5.23", common=common,
        base=importlib.import_module("sglang.srt.mem_cache.base_prefix_cache"),
        evict=importlib.import_module("sglang.srt.mem_cache.evict_policy"),
        environ=importlib.import_module("sglang.srt.environ"),
        allocator_base=importlib.import_module("sglang.srt.mem_cache.allocator.base"),
        params=importlib.import_module("sglang.srt.mem_cache.cache_init_params"),
        unified=importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_tree_core"))


LOADERS = {"0.4.10": load_listed, "0.5.23": load_hooked}


def runtime(policy, common) -> None:
    """0.5.23: the runtime context and feature probes the adder and ``mem_cache/common.py`` read,
    as a default server on one CUDA GPU sets them: no KV sharding, mamba, DCP, encoder replay,
    HIP tile budget, speculative decoding or thinking-stripping; ``ceil_align`` as
    ``utils/common.py`` has it (its module is a placeholder); the ``lpm``-style policy names of
    ``get_schedule`` are read only for shortest-prefill-first, which the checks do not run."""
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
    common.ceil_align = lambda x, y: -(-x // y) * y


def describe(sgl: SimpleNamespace) -> str:
    """One line: which release was loaded from where, what is real and what stands in."""
    if sgl.version == "0.4.10":
        return (f"SGLang 0.4.10 from {sgl.root}: schedule_policy.py, radix_cache.py, "
                "global_config.py imported; stand-ins for "
                + "; ".join(f"{m} ({why})" for m, _, why in STAND_INS))
    return (f"SGLang {sgl.version} from {sgl.root}: "
            + ", ".join(m.rsplit(".", 1)[1] + ".py" for m in sorted(REAL))
            + " imported; every other sglang module a placeholder")
