"""Model configs and weights: HF checkpoints, random tiny models, the project's ``model`` group.

Weights are mapped from HF names by one explicit table (`weight_table`): each HF tensor fills a
block of rows of one of our parameters (Q, K and V share ``qkv_proj``; gate and up share
``gate_up_proj``). Every shape is checked, and a checkpoint with a tensor missing or one the table
does not know is refused with the tensor's name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from testbed.engine.model import LlamaModel
from testbed.errors import BadInput, check_choice
from testbed.config.model_group import check_preset, checkpoint_shape, resolve_model_group
from testbed.config.model_shape import ModelShape

#: tensors some checkpoints carry that are not weights (old Llama exports)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    check_choice("dtype", name, DTYPES)
    return DTYPES[name]


# ---------------------------------------------------------------------------- the name table
def weight_table(c: ModelShape) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter, first row, end row) it fills."""
    q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    table = {"model.embed_tokens.weight": ("embed_tokens.weight", 0, c.vocab_size),
             "model.norm.weight": ("norm.weight", 0, c.hidden_size)}
    if not c.tie_word_embeddings:
        table["lm_head.weight"] = ("lm_head.weight", 0, c.vocab_size)
    for i in range(c.num_layers):
        hf, ours = f"model.layers.{i}", f"layers.{i}"
        attn_params = ["weight"] + (["bias"] if c.qkv_bias else [])
        for p in attn_params:
            table[f"{hf}.self_attn.q_proj.{p}"] = (f"{ours}.self_attn.qkv_proj.{p}", 0, q)
            table[f"{hf}.self_attn.k_proj.{p}"] = (f"{ours}.self_attn.qkv_proj.{p}", q, q + kv)
            table[f"{hf}.self_attn.v_proj.{p}"] = (f"{ours}.self_attn.qkv_proj.{p}", q + kv, q + 2 * kv)
        for p in ["weight"] + (["bias"] if c.o_bias else []):
            table[f"{hf}.self_attn.o_proj.{p}"] = (f"{ours}.self_attn.o_proj.{p}", 0, c.hidden_size)
        for p in ["weight"] + (["bias"] if c.mlp_bias else []):
            table[f"{hf}.mlp.gate_proj.{p}"] = (f"{ours}.mlp.gate_up_proj.{p}", 0, inter)
            table[f"{hf}.mlp.up_proj.{p}"] = (f"{ours}.mlp.gate_up_proj.{p}", inter, 2 * inter)
            table[f"{hf}.mlp.down_proj.{p}"] = (f"{ours}.mlp.down_proj.{p}", 0, c.hidden_size)
        table[f"{hf}.input_layernorm.weight"] = (f"{ours}.input_layernorm.weight", 0, c.hidden_size)
        table[f"{hf}.post_attention_layernorm.weight"] = (
            f"{ours}.post_attention_layernorm.weight", 0, c.hidden_size)
    return table


def load_weights(model: LlamaModel, tensors: Iterable[tuple[str, torch.Tensor]],
                 where: str = "the state dict") -> None:
    """Copy HF-named ``(name, tensor)`` pairs into ``model`` (casting to its dtype and device).

    Raises BadInput for a tensor the table does not know, a shape mismatch or a weight that never
    came (``where`` names the checkpoint).
    """
    table = weight_table(model.config)
    params = dict(model.named_parameters())
    ours_total = {name: 0 for name in params}
    seen: set[str] = set()
    for name, tensor in tensors:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name not in table:
            if name == "lm_head.weight" and model.config.tie_word_embeddings:
                continue  # a tied checkpoint that also stored the head: the embedding is used
            raise BadInput(f"unexpected tensor {name!r} in {where}: not a weight of this "
                           f"{model.config.num_layers}-layer model")
        param_name, start, end = table[name]
        target = params[param_name].data[start:end]
        if tuple(tensor.shape) != tuple(target.shape):
            raise BadInput(f"tensor {name!r} in {where} has shape {tuple(tensor.shape)}, "
                           f"expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        seen.add(name)
        ours_total[param_name] += end - start
    missing = sorted(set(table) - seen, key=list(table).index)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise BadInput(f"missing tensor {missing[0]!r}{more} in {where}")
    unfilled = [n for n, rows in ours_total.items() if rows != params[n].shape[0]]
    assert not unfilled, f"weight table leaves rows of {unfilled} unfilled"  # a table bug


def load_state_dict(model: LlamaModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load an in-memory HF state dict (e.g. ``LlamaForCausalLM.state_dict()``)."""
    load_weights(model, state_dict.items())


# ---------------------------------------------------------------------------- checkpoints
def load_hf_config(path: str | Path) -> Any:
    """The checkpoint's config.json as a `transformers` config (never touches the hub)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise BadInput(f"model.path: no config.json in {path}")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def safetensors_files(path: str | Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / f for f in dict.fromkeys(weight_map.values())]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise BadInput(f"model.path: {index} is not a safetensors index (a JSON object with "
                           f"a weight_map of tensor name -> file; {type(e).__name__}: {e})"
                           ) from None
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise BadInput(f"model.path: no model.safetensors or model.safetensors.index.json "
                   f"in {path} (only safetensors checkpoints are supported)")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu") -> LlamaModel:
    """A model built from a local HF checkpoint directory, weights straight onto ``device``."""
    config = ModelShape.from_hf(load_hf_config(path))
    with torch.device("meta"):
        model = LlamaModel(config, dtype=parse_dtype(dtype))
    model = model.to_empty(device=device)
    load_weights(model, iter_safetensors(safetensors_files(path)), where=str(path))
    return model.eval()


# ---------------------------------------------------------------------------- random models
def tiny_config(**overrides: Any) -> Any:
    """A small `LlamaConfig` (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256) for tests and
    CPU runs; no BOS/EOS, so generation never stops early."""
    from transformers import LlamaConfig

    settings = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
                    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)
    settings.update(overrides)
    return LlamaConfig(**settings)


def config_from_model_group(model: Mapping[str, Any]) -> Any:
    """A `LlamaConfig` from the project's ``model`` config group (conf/model/*.yaml) for a random
    model (``model.path`` null). Optional keys: rope_theta, rms_norm_eps, tie_word_embeddings,
    max_position_embeddings (the context the engine holds requests to, `testbed.engine.limits`)."""
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_heads"]
    return tiny_config(
        num_hidden_layers=model["num_layers"], hidden_size=model["hidden_size"],
        num_attention_heads=model["num_heads"], num_key_value_heads=model["num_kv_heads"],
        head_dim=head_dim, intermediate_size=model["intermediate_size"],
        vocab_size=model["vocab_size"], rope_theta=float(model.get("rope_theta", 10000.0)),
        rms_norm_eps=float(model.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(model.get("tie_word_embeddings", False)),
        max_position_embeddings=int(model.get("max_position_embeddings") or 4096))


def check_model_group(model: Mapping[str, Any], hf: Any) -> None:
    """A checkpoint (its `transformers` config) must have the shapes the ``model`` group (and so
    the cost model) assumes: `testbed.config.model_group.check_preset`."""
    check_preset(model, checkpoint_shape(hf.to_dict() if hasattr(hf, "to_dict") else hf))


def build_model(config: Any, seed: int = 0, dtype: torch.dtype | str = torch.float32,
                device: torch.device | str = "cpu") -> LlamaModel:
    """A random model (``config``: a `transformers` config or a `ModelShape`). Small models are
    initialised on the CPU in fp32 from ``torch.manual_seed(seed)``, so their weights do not depend
    on the device; a large one on an accelerator is built there directly (a 7B model would need
    27 GB of host memory and a minute of CPU time otherwise)."""
    c = config if isinstance(config, ModelShape) else ModelShape.from_hf(config)
    torch.manual_seed(seed)
    large = c.num_layers * c.hidden_size * c.hidden_size > 2**28  # ~ a billion parameters or more
    build_on = torch.device(device) if large and torch.device(device).type != "cpu" else "cpu"
    with torch.device(build_on):
        model = LlamaModel(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.to(device=device, dtype=parse_dtype(dtype)).eval()


def model_from_group(model: Mapping[str, Any], seed: int = 0,
                     dtype: torch.dtype | str = torch.float32,
                     device: torch.device | str = "cpu") -> LlamaModel:
    """The engine's model for a ``model`` config group: the checkpoint at ``model.path`` (shapes
    checked against the group, or taking the checkpoint's when no preset was chosen), else a
    random model of the group's shape."""
    model = resolve_model_group(model)
    path = model.get("path")
    if path:
        check_model_group(model, load_hf_config(path))
        return load_model(path, dtype=dtype, device=device)
    return build_model(config_from_model_group(model), seed=seed, dtype=dtype, device=device)


def save_random_hf_model(path: str | Path, config: Any | None = None, seed: int = 0,
                         max_shard_size: str | int | None = None) -> Any:
    """Save a random HF ``*ForCausalLM`` (``LlamaForCausalLM`` for `tiny_config()`) with
    ``save_pretrained`` (safetensors; sharded with ``max_shard_size``); returns the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config if config is not None else tiny_config())
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(str(path), **kwargs)
    return hf.eval()
