"""SGLang 0.4.10's own scheduling code, loaded from its wheel, with stand-ins for what it names.

`fetch` downloads the wheel once (``pip download --no-deps``) and unzips it; `load` imports
``sglang/srt/managers/schedule_policy.py`` (SchedulePolicy, PrefillAdder) and
``sglang/srt/mem_cache/radix_cache.py`` (RadixCache) from it, plus ``sglang/global_config.py`` for
the new-token-ratio and retraction constants. Their package ``__init__``s (the whole frontend and
runtime) are skipped, and the modules they import only for type hints, ``isinstance`` checks of
features we leave off, or KV-event records we never enable get stand-ins (`STAND_INS`); ``Req``
is `SglReq`, the attributes the policy, the adder and the cache read. The radix cache's
``time.monotonic`` is replaced by a logical clock so that LRU order never ties (two nodes
touched within one clock tick) and runs repeat. `experiments.validation.sglang_mirror` runs
SGLang's event loop around these objects.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import torch

VERSION = "0.4.10"
RELEASES = ("0.5.23", "0.4.10")  # those the differential check knows (0.5.23: `sglang_wheel523`)
# Imported by the two modules but unused on our path: (module, names it must offer, why).
STAND_INS = [
    ("sglang.srt.managers.schedule_batch", ("Req", "ScheduleBatch"), "type hints only"),
    ("sglang.srt.mem_cache.allocator", ("BaseTokenToKVPoolAllocator", "SWATokenToKVPoolAllocator"),
     "type hint; isinstance check for SWA models"),
    ("sglang.srt.mem_cache.memory_pool", ("ReqToTokenPool",), "type hint only"),
    ("sglang.srt.disaggregation.kv_events", ("AllBlocksCleared", "BlockRemoved", "BlockStored"),
     "records built only with enable_kv_cache_events"),
]


def fetch(cache_dir: Path, version: str = VERSION) -> Path:
    """The unzipped wheel's root (holding ``sglang/``), downloading the wheel if it is missing.
    (0.4.10's wheel is pure Python; 0.5.23's is built per platform, e.g.
    ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``: whichever pip picks will do, as only
    its Python sources are read.)"""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        f"sglang=={version}", "-d", str(cache_dir)], check=True)
        wheels = sorted(cache_dir.glob(f"sglang-{version}-*.whl"))
    wheel = wheels[0]
    root = cache_dir / "src"
    if not (root / "sglang/srt/managers/schedule_policy.py").exists():
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/")])
    return root


class _Clock:
    """A stand-in for the ``time`` module inside radix_cache: a strictly increasing counter."""

    def __init__(self) -> None:
        self.t = 0

    def monotonic(self) -> int:
        self.t += 1
        return self.t

    @staticmethod
    def perf_counter() -> float:  # 0.5.23 times its evictions for metrics we leave off
        return 0.0


def load(root: Path) -> SimpleNamespace:
    """Import SGLang's schedule_policy, radix_cache and global_config from ``root`` (another
    release loaded before in this process, and its import hook, are put aside first)."""
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.endswith(".placeholders")]
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
    sys.modules["sglang.srt.managers.schedule_batch"].Req = SglReq
    radix = importlib.import_module("sglang.srt.mem_cache.radix_cache")
    radix.time = _Clock()
    policy = importlib.import_module("sglang.srt.managers.schedule_policy")
    gc = importlib.import_module("sglang.global_config").global_config
    return SimpleNamespace(radix=radix, policy=policy, global_config=gc, root=root,
                           version=VERSION)


class SglReq:
    """Stand-in for ``schedule_batch.Req``: the fields and methods the policy, the adder and the
    radix cache use, for a generation request without logprobs whose outputs are forced."""

    def __init__(self, rid: str, prompt: list[int], outputs: list[int]) -> None:
        self.rid = rid
        self.origin_input_ids = prompt
        self.forced = outputs  # the token each step produces, in order
        self.output_ids: list[int] = []
        self.fill_ids: list[int] = []
        self.sampling_params = SimpleNamespace(max_new_tokens=len(outputs), ignore_eos=False)
        self.return_logprob = False
        self.logprob_start_len = len(prompt) - 1  # handle_generate_request, no logprobs asked
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = self.last_host_node = None
        self.host_hit_length = 0
        self.extend_input_len = 0
        self.is_chunked = 0
        self.req_pool_idx = None
        self.kv_len = 0  # the batch's seq_lens entry for this request
        self.done = False
        self.first_hit: int | None = None  # prefix length at its first prepare_for_extend

    def next_token(self) -> int:
        n = len(self.output_ids)
        return self.forced[n] if n < len(self.forced) else 0  # max_new_tokens=0 still samples one

    def adjust_max_prefix_ids(self) -> list[int]:
        """Req.adjust_max_prefix_ids: the fill minus its last token (no logprobs)."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        return self.fill_ids[: max(len(self.fill_ids) - 1, 0)]

    def init_next_round_input(self, tree_cache=None) -> None:
        """Req.init_next_round_input: re-match the fill when a cache is given."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            (self.prefix_indices, self.last_node, self.last_host_node,
             self.host_hit_length) = tree_cache.match_prefix(key=self.adjust_max_prefix_ids())
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def finished(self) -> bool:
        return self.done

    def check_finished(self) -> None:
        """Req.check_finished, length rule only (no EOS among forced tokens)."""
        self.done = self.done or len(self.output_ids) >= self.sampling_params.max_new_tokens

    def reset_for_retract(self) -> None:
        """Req.reset_for_retract (outputs are kept: the request re-prefills them)."""
        self.prefix_indices, self.last_node, self.extend_input_len = [], None, 0
