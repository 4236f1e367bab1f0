"""The fuzzer's draws of the engine and of speculative decoding: every ``engine.`` key (their old
top-level names too, agreeing or not with the ``engine.`` ones), ``threads`` and ``clock``, the
tiny model's shape (``model=tiny`` with its keys changed, or its HF checkpoint through
``model.path``), and the ``speculative`` block, for the engine and the simulator alike.

Values include what a run must refuse in one line: Triton kernels where no GPU (nor Triton's
interpreter) runs them, ``engine.device=cuda`` on a machine without one, a draft model of more
layers than the model has, a token tree on a paged cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.config.engine_config import ALIASES
from testbed.fuzz.fixtures import Fixtures
from testbed.fuzz.group_space import Table, choice, keys_of, scaled

# Triton's kernels: refused on a CPU (without Triton's interpreter), run on a GPU
ATTENTION = ["null", "torch", "cascade", "cascade_torch"] * 3 + ["triton", "cascade_triton"]
ENGINE_KEYS: Table = (
    ("device", ["cpu"] * 5 + ["null"] * 4 + ["cuda"], 0.4),
    ("dtype", ["null", "float32", "float32", "bfloat16", "float16"], 0.25),
    ("attention", ATTENTION, 0.5),
    ("cascade_min_saved", [0, 4, 64], 0.2),
    ("cascade_rule", ["auto", "always"], 0.3),
    ("cuda_graph", ["true", "false"], 0.15),
    ("cuda_graph_max_batch", [1, 8, 256], 0.15),
    ("cpu_kernels", ["native", "torch"], 0.5),
    ("cpu_kv_cache_gib", [2, 0.01, 0, -1, "lots"], 0.1),  # a server's pool; <= 0: refused
    ("forced", ["true", "false"], 0.3),
    ("temperature", [0.0, 0.0, 0.7], 0.2),
    ("top_p", [1.0, 1.0, 0.5], 0.15))
# the tiny model's attention shapes: (heads, KV heads, head_dim, hidden); the last two are
# refused (KV heads that divide no head group; a head_dim the rotary embedding cannot take)
HEADS = [(4, 2, 16, 64), (4, 4, 16, 64), (2, 1, 32, 64), (8, 2, 8, 64), (4, 1, 16, 48),
         (4, 3, 16, 64), (4, 2, 15, 60)]
TINY_KEYS: Table = (("num_layers", [1, 2, 3], 0.3), ("intermediate_size", [16, 128], 0.2),
                    ("vocab_size", [64, 256], 0.1), ("max_position_embeddings", [24, 4096], 0.1),
                    ("dtype_bytes", [2, 4], 0.1), ("tp", [1, 2], 0.05))
SPECULATIVE_KEYS: Table = (
    ("num_tokens", [1, 2, 4], 0.6), ("tree_width", [1, 1, 2, 3], 0.5),
    ("ngram_min", [1, 2], 0.3), ("ngram_max", [1, 3], 0.3),
    ("acceptance", ["exact", "geometric", "recorded"], 0.5),
    ("accept_rate", [0.0, 0.5, 1.0], 0.4), ("draft_layers", [1, 1, 1, 2, 8], 0.5))


def engine_overrides(rng: np.random.Generator) -> list[str]:
    """The engine's keys; sometimes one under its old top-level name instead (or beside it)."""
    out = keys_of(rng, "engine", ENGINE_KEYS)
    if rng.random() < 0.15:
        key = choice(rng, ALIASES)
        values = next(values for k, values, _ in ENGINE_KEYS if k == key)
        out.append(f"{key}={choice(rng, values)}")
    out += keys_of(rng, "", (("threads", ["null", 1, 2], 0.1),
                             ("clock", ["null", "wall", "cpu"], 0.2)))
    return out


def tiny_model(rng: np.random.Generator, fixtures: Fixtures) -> list[str]:
    """``model=tiny``, its shape changed now and then, or its HF checkpoint (``model.path``)."""
    out = ["model=tiny"]
    if rng.random() < 0.1:
        return out + [f"model.path={fixtures.checkpoint}"]
    if rng.random() < 0.2:
        heads, kv, head_dim, hidden = HEADS[int(rng.integers(len(HEADS)))]
        out += [f"model.num_heads={heads}", f"model.num_kv_heads={kv}",
                f"model.head_dim={head_dim}", f"model.hidden_size={hidden}"]
    return out + keys_of(rng, "model", TINY_KEYS)


def sim_model(rng: np.random.Generator, fixtures: Fixtures) -> list[str]:
    """A preset the simulator prices (its numbers scaled now and then), the tiny model's
    checkpoint, or the default (Llama-2-7B)."""
    u = rng.random()
    if u < 0.1:
        return []
    if u < 0.15:
        return [f"model.path={fixtures.checkpoint}"]
    name = choice(rng, ["tiny", "tiny", "llama3_8b", "llama2_7b", "llama3_70b", "codellama_34b",
                        "smollm2_135m"])
    out = [f"model={name}", *scaled(rng, "model", name, 0.08)]
    if rng.random() < 0.03:  # a preset against the tiny checkpoint: refused unless tiny
        out.append(f"model.path={fixtures.checkpoint}")
    return out


def speculative_overrides(rng: np.random.Generator, backend: str, workdir: Path,
                          index: int) -> list[str]:
    """Speculative decoding for a backend with steps; ``speculative.acceptance=recorded`` reads
    ``accepted{index}.jsonl``, which `testbed.fuzz.space.after_requests` writes."""
    method = choice(rng, ["ngram", "ngram", "draft"])
    out = [f"speculative.method={method}", *keys_of(rng, "speculative", SPECULATIVE_KEYS)]
    if "speculative.acceptance=recorded" in out:
        out.append(f"speculative.acceptance_path={recorded_path(workdir, index)}")
    return out


def recorded_path(workdir: Path, index: int) -> Path:
    return workdir / f"accepted{index}.jsonl"
