"""`ModelShape`: the one model shape the engine and the simulator share."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from testbed.config.model_shape import ModelShape

REPO = Path(__file__).resolve().parents[1]
TINY = ModelShape("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=256, dtype_bytes=4)


def hf_config(**extra):
    """A stand-in for a `transformers` LlamaConfig of the tiny preset's shape."""
    return SimpleNamespace(**{
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 256, "rms_norm_eps": 1e-5,
        "name_or_path": "/ckpts/tiny", "dtype": "float32", **extra})


def test_the_group_and_a_checkpoint_config_give_one_shape():
    """The tiny preset read as the simulator reads it equals the same model read as the engine
    reads a checkpoint, but for the constants the group leaves to the engine."""
    group = yaml.safe_load((REPO / "conf/model/tiny.yaml").read_text())
    from_group = ModelShape.from_group(group)
    from_hf = ModelShape.from_hf(hf_config(eos_token_id=[2, 7]))
    assert from_group == TINY
    assert from_hf == replace(TINY, rms_norm_eps=1e-5, eos_token_ids=(2, 7))
    assert from_hf.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_from_hf_reads_names_dtypes_and_rope_settings():
    assert ModelShape.from_hf(hf_config(name_or_path="", dtype=None)).name == "llama"
    assert ModelShape.from_hf(hf_config(dtype="bfloat16")).dtype_bytes == 2
    scaled = ModelShape.from_hf(hf_config(rope_theta=5e5, rope_scaling={"type": "linear",
                                                                        "factor": 4.0}))
    assert (scaled.rope_theta, scaled.rope_scaling) == (5e5, {"rope_type": "linear", "factor": 4.0})


@pytest.mark.parametrize("change, message", [
    ({"num_layers": 0}, "model.num_layers must be >= 1, got 0"),
    ({"tp": 0}, "model.tp must be >= 1, got 0"),
    ({"dtype_bytes": 3}, "model.dtype_bytes must be one of 1, 2, 4; got 3"),
    ({"num_kv_heads": 3}, r"model.num_heads \(4\) must be a multiple of model.num_kv_heads \(3\)"),
    ({"tp": 3}, r"model.tp must divide model.num_heads \(4\), got 3"),
    ({"num_heads": 6, "num_kv_heads": 3, "tp": 2},
     r"model.tp must divide model.num_kv_heads \(3\) or be a multiple of it, got 2"),
    ({"head_dim": 15}, "model.head_dim must be even for RoPE, got 15"),
    ({"rope_scaling": {"rope_type": "yarn"}},
     "model.rope_scaling type must be one of default, linear, llama3; got 'yarn'"),
])
def test_a_bad_shape_is_refused_on_construction_naming_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        replace(TINY, **change)


def test_a_shape_keys_a_dict_even_with_rope_scaling():
    scaled = replace(TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert {TINY: 1, scaled: 2}[scaled] == 2


def test_the_shape_and_the_simulator_import_no_torch():
    code = ("import sys, testbed.config.model_shape, testbed.sim.specs, testbed.sim.cost_model; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
