"""The ``model`` config group and local HF checkpoints (``model.path=DIR``).

A preset (``conf/model/*.yaml``) states a model's shape; a checkpoint's ``config.json`` states its
own. `resolve_model_group` reconciles them once per run, before any backend reads the group:

- no ``model.path``: the preset, as it is;
- ``model.path=DIR`` and no ``model=`` (the group file ``_default.yaml`` marks its preset
  ``by_default``): the checkpoint's shape replaces the preset's, so the engine, the KV budget and
  the simulator's cost model all see the checkpoint (any supported Llama-family ``model_type``);
- ``model=NAME model.path=DIR``: the preset must agree with the checkpoint, else the run is
  refused with one line naming every key that differs.

``model.path=data:NAME`` names a model of the data registry (`testbed.data`): its converted HF
directory in the data folder, fetched and converted on first use, and from then on the path in
the resolved group. A preset whose model is not in the data folder yet is used as it is when the
checkpoint itself is not needed (``need_checkpoint=False``: the simulator prices the preset's
shape), so a simulator run never downloads a model.

Only ``config.json`` is read here (plain JSON, no transformers), so simulator runs stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from testbed.errors import BadInput, check_choice

#: HF ``model_type``s the engine implements (testbed/engine/model.py)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")

#: group key -> config.json key of the shapes a preset must share with a checkpoint
SHAPE_KEYS = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "intermediate_size": "intermediate_size", "vocab_size": "vocab_size",
}

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def read_config_json(path: str | Path) -> dict[str, Any]:
    config = Path(path) / "config.json"
    if not config.is_file():
        raise BadInput(f"model.path: no config.json in {path}")
    try:
        hf = json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise BadInput(f"model.path: {config}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(hf, dict):
        raise BadInput(f"model.path: {config} must hold a JSON object, got {type(hf).__name__}")
    return hf


def checkpoint_shape(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The group's shape keys from a config.json (or ``PretrainedConfig.to_dict()``)."""
    heads = hf["num_attention_heads"]
    shape = {key: hf.get(hf_key) for key, hf_key in SHAPE_KEYS.items()}
    shape["num_kv_heads"] = shape["num_kv_heads"] or heads
    shape["head_dim"] = shape["head_dim"] or hf["hidden_size"] // heads
    return shape


def require_shape(hf: Mapping[str, Any], path: str | Path) -> None:
    """BadInput unless a checkpoint's config.json states the shapes `checkpoint_shape` reads."""
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "hidden_size",
                           "intermediate_size", "vocab_size") if k not in hf]
    if missing:
        raise BadInput(f"model.path={path}: config.json lacks {', '.join(missing)}")


def checkpoint_group(path: str | Path) -> dict[str, Any]:
    """A ``model`` group for the checkpoint at ``path``: its shape, RoPE base, norm epsilon,
    tied embeddings and dtype (``dtype_bytes``), tp 1, named after the directory."""
    hf = read_config_json(path)
    model_type = hf.get("model_type")
    check_choice(f"model.path={path}: model_type", model_type, SUPPORTED_MODEL_TYPES)
    require_shape(hf, path)
    rope = hf.get("rope_parameters") or {}
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    return {"name": Path(path).resolve().name or str(path), **checkpoint_shape(hf),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "dtype_bytes": DTYPE_BYTES.get(dtype, 2), "tp": 1, "path": str(path),
            "model_type": model_type}


def check_preset(model: Mapping[str, Any], shape: Mapping[str, Any]) -> None:
    """A named preset must have the checkpoint's shapes (the engine loads the checkpoint, the
    cost model prices the preset)."""
    wrong = [f"{key}={model[key]} but the checkpoint has {shape[key]}" for key in SHAPE_KEYS
             if model.get(key) is not None and model.get(key) != shape[key]]
    if wrong:
        raise BadInput(f"model={model.get('name')} does not match "
                       f"model.path={model.get('path')}: " + "; ".join(wrong)
                       + " (pick the model group of this checkpoint, or leave model= out to "
                       "take its shape)")


def resolve_model_group(model: Mapping[str, Any], need_checkpoint: bool = True) -> dict[str, Any]:
    """The group a run uses (module docstring). ``need_checkpoint=False``: a named preset whose
    ``data:NAME`` model is not in the data folder keeps its ``path`` unresolved."""
    model = dict(model)
    path = model.get("path")
    if not path:
        return model
    if str(path).startswith("data:"):
        from testbed.data import is_here, lookup, resolve_model

        if not (need_checkpoint or model.get("by_default") or is_here(lookup(path[5:]))):
            return model
        model["path"] = path = str(resolve_model(path))
    if model.get("by_default"):
        return checkpoint_group(path)
    hf = read_config_json(path)
    require_shape(hf, path)
    check_preset(model, checkpoint_shape(hf))
    return model
