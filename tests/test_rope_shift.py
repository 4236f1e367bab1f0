"""RoPE re-rotation of stored keys (`testbed.engine.rope_shift`) on a tiny random Llama, fp32:
a key computed at p and turned by q − p is the key computed at q, for every rope scaling the
engine supports; a shift of 0 copies bit for bit; a batch's KV copies run after its forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

from testbed.engine.rope_shift import copy_kv, rerotate, rotate_keys  # noqa: E402
from testbed.engine.runner import ModelRunner  # noqa: E402
from tests.blend_helpers import KVCopy, make_req, prefill, tiny_model  # noqa: E402

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def layer0_keys(model, tokens, positions) -> torch.Tensor:
    """Layer 0's keys of ``tokens`` at ``positions`` (they depend on nothing else)."""
    with torch.inference_mode():
        h = model.embed_tokens(torch.as_tensor(tokens).long())
        cos, sin = model.rope(torch.as_tensor(positions), h.dtype)
        layer = model.layers[0]
        return layer.self_attn.project(layer.input_layernorm(h), cos, sin)[1]


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("p, q", [(0, 37), (300, 5), (1000, 1999), (17, 17)])
def test_a_key_computed_at_p_and_turned_by_q_minus_p_is_the_key_computed_at_q(scaling, p, q):
    model = tiny_model(layers=1, rope_scaling=SCALINGS[scaling])
    tokens = np.arange(3, 11)
    at_p = layer0_keys(model, tokens, np.arange(p, p + 8))
    at_q = layer0_keys(model, tokens, np.arange(q, q + 8))
    moved = rotate_keys(at_p, q - p, model.inv_freq)
    torch.testing.assert_close(moved, at_q, rtol=0, atol=2e-5)
    if p != q:  # the test can fail: unturned keys differ
        assert (at_p - at_q).abs().max() > 1e-2


def test_per_key_shifts_turn_each_key_by_its_own_delta():
    model = tiny_model(layers=1)
    tokens, p, q = np.arange(5), np.array([0, 4, 9, 50, 2]), np.array([3, 4, 0, 7, 90])
    moved = rotate_keys(layer0_keys(model, tokens, p), torch.as_tensor(q - p), model.inv_freq)
    torch.testing.assert_close(moved, layer0_keys(model, tokens, q), rtol=0, atol=2e-5)


def test_the_pool_copy_moves_a_prompts_first_layer_keys_to_new_positions():
    """Layer 0's K/V of a prompt copied into other slots with shift s equal the layer-0 K/V of
    the same tokens prefilled behind s other tokens (values unchanged, keys turned)."""
    model = tiny_model(layers=2)
    runner = ModelRunner(model, 64)
    tokens = np.arange(20, 32)
    prefill(runner, make_req("a", tokens, np.arange(1, 13)))
    filler = np.full(7, 5)
    prefill(runner, make_req("b", np.concatenate([filler, tokens]), np.arange(30, 49)))
    copy_kv(runner.kv_cache, np.arange(1, 13), np.arange(50, 62), 7, model.inv_freq)
    k, v = runner.kv_cache.k[0], runner.kv_cache.v[0]
    torch.testing.assert_close(k[50:62], k[37:49], rtol=0, atol=2e-5)
    assert torch.equal(v[50:62], v[37:49])


def test_a_shift_of_zero_copies_bit_for_bit_and_turning_back_restores_the_keys():
    model = tiny_model(layers=2)
    runner = ModelRunner(model, 40)
    prefill(runner, make_req("a", np.arange(9), np.arange(1, 10)))
    kv = runner.kv_cache
    before = [k.clone() for k in kv.k]
    copy_kv(kv, np.arange(1, 10), np.arange(20, 29), 0, model.inv_freq)
    rerotate(kv, np.arange(1, 10), 0, model.inv_freq)
    for layer, k in enumerate(kv.k):
        assert torch.equal(k[20:29], before[layer][1:10])
        assert torch.equal(k[1:10], before[layer][1:10])
        assert torch.equal(kv.v[layer][20:29], kv.v[layer][1:10])
    rerotate(kv, np.arange(1, 10), 123, model.inv_freq)
    assert (kv.k[1][1:10] - before[1][1:10]).abs().max() > 1e-2
    rerotate(kv, np.arange(1, 10), -123, model.inv_freq)
    torch.testing.assert_close(kv.k[1][1:10], before[1][1:10], rtol=0, atol=2e-5)


def test_a_batchs_kv_copy_runs_after_its_forward_and_stores_a_chunk_at_local_positions():
    """A chunk at positions 6..13 computed in this step and copied with shift −6 holds the layer-0
    keys of the same tokens computed at 0..7 (the step's fresh KV is what is copied)."""
    model = tiny_model(layers=2)
    runner = ModelRunner(model, 64)
    tokens = np.arange(40, 54)
    chunk = tokens[6:14]
    copy = KVCopy(src_slots=np.arange(7, 15), dst_slots=np.arange(40, 48), shift=-6)
    prefill(runner, make_req("a", tokens, np.arange(1, 15)), copies=[copy])
    prefill(runner, make_req("b", chunk, np.arange(20, 28)))
    kv = runner.kv_cache
    torch.testing.assert_close(kv.k[0][40:48], kv.k[0][20:28], rtol=0, atol=2e-5)
    assert torch.equal(kv.v[0][40:48], kv.v[0][20:28])
    assert torch.equal(kv.v[1][40:48], kv.v[1][7:15])  # later layers: copied as computed


def test_a_kv_copy_needs_as_many_destinations_as_sources():
    model = tiny_model(layers=1)
    runner = ModelRunner(model, 8)
    with pytest.raises(ValueError, match="as many destination slots"):
        copy_kv(runner.kv_cache, [1, 2], [3], 0, model.inv_freq)
