"""The real inference engine: a Llama-family model run step by step on the scheduler's batches.

One idea per module: `model` (the decoder over a flattened batch), `kv_cache` (per-layer KV
buffers indexed by cache slot), `slot_table` (each request's token -> slot row on the device),
`metadata` (a step's attention layout), `attention` (torch and Triton backends), `cascade`
(decode groups that share a prefix read it once), `rope_shift` (KV moved to other positions,
keys re-rotated), `blend` (the prefill that reuses chunks' KV, CacheBlend-style), `quality`
(approximate requests against exact recomputation),
`loader` (HF checkpoints, random and tiny models, the ``model`` config group), `sampler`,
`limits` (requests the model cannot take, refused before any step),
`runner` (`ModelRunner`: a `Batch` in, logits out), `executor` (`EngineExecutor`: the
simulator's `Executor` seam with measured step times) and `host_memory` (steady CPU allocation).
"""

from testbed.engine.attention import ATTENTION_BACKENDS, make_attention
from testbed.engine.executor import EngineExecutor, default_device, make_engine_executor
from testbed.engine.kv_cache import KVCache
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.loader import (build_model, config_from_model_group, load_model,
                                   model_from_group, parse_dtype, save_random_hf_model,
                                   tiny_config)
from testbed.engine.model import LlamaModel
from testbed.engine.runner import ModelRunner
from testbed.engine.sampler import Sampler, sample

__all__ = ["ATTENTION_BACKENDS", "AttentionMetadata", "EngineExecutor", "KVCache", "LlamaModel",
           "ModelRunner", "Sampler", "build_model", "config_from_model_group",
           "default_device", "load_model", "make_attention", "make_engine_executor",
           "model_from_group", "parse_dtype", "sample", "save_random_hf_model", "tiny_config"]
