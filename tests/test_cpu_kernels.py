"""The engine's CPU kernels (issue 46): oneDNN linear layers on weights prepared once, the decode
and prefill attention that read the KV pool in place and the layer's elementwise steps (C
kernels built once); each equals what it replaces, and where it cannot run the engine falls back
to torch's and says why."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from experiments.benchmarks.decode_batches import decode_batch
from testbed.engine import cpu_attention, cpu_layers, linear, native_build
from radix_kernels import reference
from testbed.calibration.grid import batch_on_slots
from testbed.engine.attention import ExtendLayout, FlatExtend, decode, make_attention
from testbed.engine.executor import EngineExecutor
from testbed.engine.layer_kernels import TORCH_KERNELS
from testbed.engine.loader import build_model, tiny_config
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.model import LlamaModel
from testbed.engine.runner import ModelRunner
from testbed.config.engine_config import EngineConfig
from testbed.errors import BadInput
from testbed.sim.step_shape import StepShape

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    return build_model(tiny_config())


def decode_meta(kv_lens, slots: int = 300, seed: int = 0) -> AttentionMetadata:
    """One new token per request over distinct, shuffled KV slots."""
    rng = np.random.default_rng(seed)
    indices = rng.permutation(np.arange(1, slots + 1))[:sum(kv_lens)].astype(np.int32)
    return AttentionMetadata.build(np.ones(len(kv_lens), dtype=np.int64), np.asarray(kv_lens),
                                   indices, "cpu")


def test_in_place_decode_equals_the_gathered_decode_with_gqa_and_ragged_lengths():
    kernel, error = cpu_attention.load_kernel()
    assert error is None
    g = torch.Generator().manual_seed(1)
    kb, vb = (torch.randn(301, 2, 32, generator=g) for _ in range(2))
    q = torch.randn(4, 6, 32, generator=g)  # 3 query heads per KV head
    outs = []
    for backend in (make_attention("torch", 2), make_attention("torch", 2, kernel=kernel)):
        meta = decode_meta([1, 17, 200, 64])
        meta.plan = backend.plan(meta)
        outs.append(backend.forward(q, kb, vb, meta, 0.2))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_in_place_decode_returns_the_log_sum_exp_the_cascade_merges():
    kernel, _ = cpu_attention.load_kernel()
    g = torch.Generator().manual_seed(2)
    kb, vb = (torch.randn(50, 1, 16, generator=g) for _ in range(2))
    q = torch.randn(2, 1, 3, 16, generator=g)
    indptr, indices = torch.tensor([0, 7, 19]), torch.arange(3, 22, dtype=torch.int32)
    o, lse = kernel(q, kb, vb, indptr, indices, 0.5)
    for i, (a, b) in enumerate(((3, 10), (10, 22))):
        scores = torch.einsum("rd,ld->rl", q[i, 0], kb[a:b, 0]) * 0.5
        torch.testing.assert_close(lse[i, 0], scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o[i, 0], scores.softmax(-1) @ vb[a:b, 0], atol=1e-5,
                                   rtol=1e-5)


def test_in_place_prefill_equals_the_reference_behind_prefixes_with_gqa():
    """Ragged requests (no prefix, a prefix, one new token, more than a tile of keys) over
    shuffled slots; the queries are rows of a wider tensor, as the fused projection gives them."""
    kernel, _ = cpu_attention.load_kernel()
    g = torch.Generator().manual_seed(3)
    kb, vb = (torch.randn(400, 2, 32, generator=g) for _ in range(2))
    qo_lens, kv_lens = [7, 1, 20, 3], [7, 40, 37, 3]
    wide = torch.randn(sum(qo_lens), 6 * 32 + 96, generator=g)
    q = wide[:, :6 * 32].view(-1, 6, 32)  # 3 query heads per KV head, token stride 288
    indices = (torch.randperm(399, generator=g)[:sum(kv_lens)] + 1).int()
    qo_indptr, kv_indptr = (torch.tensor([0, *lens]).cumsum(0) for lens in (qo_lens, kv_lens))
    got = kernel.extend(q, kb, vb, qo_indptr, kv_indptr, indices, 0.3)
    want = reference.extend_attention(q.contiguous(), kb, vb, qo_indptr, kv_indptr, indices, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="fewer keys than new tokens"):
        kernel.extend(q, kb, vb, qo_indptr, torch.tensor([0, 7, 8, 28, 30]), indices, 0.3)


def test_prefill_plans_take_the_kernel_unless_a_token_tree_brings_its_own_mask():
    kernel, _ = cpu_attention.load_kernel()
    backend = make_attention("torch", 2, kernel=kernel)
    meta = AttentionMetadata.build(np.array([3, 2]), np.array([5, 2]),
                                   np.arange(1, 8, dtype=np.int32), "cpu")
    assert isinstance(backend.plan(meta), FlatExtend)
    meta.query_masks = [None, torch.tensor([[True, False], [True, True]])]
    assert isinstance(backend.plan(meta), ExtendLayout)


def test_native_layer_steps_equal_the_torch_references_and_store_only_their_slots():
    native = cpu_layers.load_layer_kernels()[0]
    assert native is not None and native.name == "native"
    g = torch.Generator().manual_seed(4)
    x, residual, weight = (torch.randn(*shape, generator=g) for shape in ((5, 96), (5, 96), (96,)))
    for got, want in zip(native.add_rmsnorm(x, residual, weight, 1e-5),
                         TORCH_KERNELS.add_rmsnorm(x, residual, weight, 1e-5)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(native.add_rmsnorm(x, None, weight, 1e-5)[1], x)
    gate_up = torch.randn(5, 2 * 48, generator=g) * 8
    torch.testing.assert_close(native.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up),
                               atol=1e-6, rtol=1e-6)
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=g)
    angle = torch.randn(5, 1, dim // 2, generator=g)
    cos, sin = torch.cat((angle.cos(),) * 2, -1), torch.cat((-angle.sin(), angle.sin()), -1)
    slots = torch.tensor([9, 2, 7, 4, 1], dtype=torch.int32)
    bufs = [torch.zeros(12, kv_heads, dim) for _ in range(4)]
    q = native.rope_store(qkv, cos, sin, slots, bufs[0], bufs[1], heads, kv_heads)
    want = TORCH_KERNELS.rope_store(qkv, cos, sin, slots, bufs[2], bufs[3], heads, kv_heads)
    torch.testing.assert_close(q, want, atol=1e-6, rtol=1e-6)
    for got, ref in zip(bufs[:2], bufs[2:]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        assert set(got.abs().sum((1, 2)).nonzero().flatten().tolist()) == {1, 2, 4, 7, 9}


def test_native_kernels_give_the_torch_kernels_logits_on_prefill_steps():
    """Four requests computing 1 to 19 new tokens, two of them behind a cached prefix."""
    step = StepShape((5, 19, 1, 8), (0, 12, 30, 0))
    logits = {}
    for kernels in ("torch", "native"):
        runner = ModelRunner(tiny_model(), 128, attention="cascade", cpu_kernels=kernels)
        assert runner.kernels.name == kernels
        slots = np.random.default_rng(5).permutation(np.arange(1, 128))
        own, start = [], 0
        for new, context in zip(step.new, step.context):
            own.append(slots[start:start + new + context])
            start += new + context
        batch = batch_on_slots(step, own, 256, np.random.default_rng(6))
        logits[kernels] = runner.run(batch)
    torch.testing.assert_close(logits["native"], logits["torch"], atol=1e-5, rtol=1e-5)


def test_the_kernel_is_built_once_into_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = native_build.build()
    assert first.parent == tmp_path / "radix-testbed" / "kernels" and first.exists()
    built = first.stat().st_mtime_ns
    assert native_build.build() == first and first.stat().st_mtime_ns == built
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no build leftovers


def test_loading_the_kernel_leaves_the_processs_subnormal_floats_alone(tmp_path, monkeypatch):
    # a -ffast-math link would turn on flush-to-zero for the whole process when it loads
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_build.load_library.cache_clear()  # a fresh build, loaded from tmp_path
    try:
        cpu_attention.AttentionKernels(native_build.load_library())
    finally:
        native_build.load_library.cache_clear()
    tiny = float(np.finfo(np.float64).tiny)
    assert tiny / 4 > 0.0 and np.float32(np.finfo(np.float32).tiny) / np.float32(4) > 0


def test_without_a_compiler_the_engine_gathers_and_says_why(monkeypatch):
    def no_compiler():
        raise RuntimeError("no C compiler (cc, gcc or $CC) on the PATH")

    monkeypatch.setattr(native_build, "compiler", no_compiler)
    monkeypatch.setattr(native_build, "kernel_dir", lambda: native_build.Path("/nonexistent"))
    caches = (native_build.load_library, cpu_attention.load_kernel, cpu_layers.load_layer_kernels,
              linear.panel_kernel)
    for cache in caches:
        cache.cache_clear()
    try:
        runner = ModelRunner(tiny_model(), 64, attention="cascade")
    finally:
        for cache in caches:
            cache.cache_clear()
    assert runner.attention.kernel is None and runner.kernels.name == "torch"
    assert runner.decode_kernel_error == "RuntimeError: no C compiler (cc, gcc or $CC) on the PATH"
    assert runner.kernels_error == runner.decode_kernel_error
    summary = EngineExecutor(runner).graph_summary()
    assert summary["decode_kernel_error"] == runner.decode_kernel_error
    assert summary["layer_kernels_error"] == runner.decode_kernel_error
    assert "linear_error" not in summary  # the linear layers did not fail


def test_the_kernel_is_not_used_where_it_cannot_read_the_kv():
    runner = ModelRunner(build_model(tiny_config(head_dim=8, hidden_size=32)), 64)
    assert runner.attention.kernel is None
    assert runner.decode_kernel_error == ("the in-place decode kernel takes head_dim 16, 32, ... "
                                          "256, not 8")
    runner = ModelRunner(tiny_model().to(torch.float64), 64)
    assert runner.decode_kernel_error == ("the in-place decode kernel is fp32 only, not "
                                          "torch.float64")


def test_native_kernels_give_the_torch_kernels_logits_on_a_decode_step():
    """Both families on one model's weights: decode steps of three requests, a prefix of four
    tokens shared (cascade), at three lengths."""
    logits = {}
    for kernels in ("torch", "native"):
        runner = ModelRunner(tiny_model(), 64, attention="cascade", cpu_kernels=kernels)
        assert runner.linear == ("onednn" if kernels == "native" else "torch")
        assert (runner.attention.kernel is not None) == (kernels == "native")
        logits[kernels] = [runner.run(decode_batch(3, n, 4, 256, seed=n)) for n in (5, 9, 12)]
    for native, plain in zip(logits["native"], logits["torch"]):
        torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)


def test_prepared_linears_replace_every_projection_once():
    model = tiny_model()
    x = torch.randn(5, 64)
    with torch.inference_mode():
        want = [model.layers[0].self_attn.qkv_proj(x), model.lm_head_of(x)]
        assert linear.prepare_linears(model, "onednn") == ("onednn", None)
        layer = model.layers[0]
        packed = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj, model.head]
        assert all(isinstance(p, linear.PackedLinear) for p in packed)
        got = [layer.self_attn.qkv_proj(x), model.lm_head_of(x)]
        assert linear.prepare_linears(model, "onednn") == ("onednn", None)
        assert layer.self_attn.qkv_proj is packed[0] and model.head is packed[4]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert set(dict(model.named_parameters())) >= {"layers.0.self_attn.qkv_proj.weight"}


def test_the_panel_kernel_equals_torchs_linear_at_every_row_count_it_takes():
    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    layer = linear.PackedLinear(w, b)
    assert layer.panels is not None and layer.panels.shape == (3, 40, 32)
    for rows in (*range(1, 10), 16, 17, linear.PANEL_ROWS):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(layer.panel_forward(x), F.linear(x, w, b), atol=1e-5,
                                   rtol=1e-5)
        wide = torch.randn(rows, 56, generator=g)[:, 8:48]  # rows 56 floats apart
        torch.testing.assert_close(layer(wide), F.linear(wide, w, b), atol=1e-5, rtol=1e-5)
    no_bias = linear.PackedLinear(w, None)
    x = torch.randn(3, 40, generator=g)
    torch.testing.assert_close(no_bias(x), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_the_panels_follow_the_weight_and_stay_away_where_they_cannot_run():
    assert linear.PackedLinear(torch.randn(48, 16), None).panels is None  # 48: not 32s
    layer = linear.PackedLinear(nn.Parameter(torch.randn(64, 16), requires_grad=False), None)
    layer.weight.mul_(2)
    layer.repack()
    torch.testing.assert_close(layer.panels[1, 3], layer.weight[32:, 3])
    torch.testing.assert_close(copy.deepcopy(layer).panels, layer.panels)
    assert layer.to(torch.float64).panels is None


def test_linear_layers_stay_torchs_where_onednn_fails_its_smoke_test(monkeypatch):
    def fails(device, dtype):
        raise RuntimeError("mkldnn: no such kernel\nsecond line")

    monkeypatch.setattr(linear, "smoke_test", fails)
    model = tiny_model()
    runner = ModelRunner(model, 64)
    assert (runner.linear, runner.linear_error) == ("torch",
                                                    "RuntimeError: mkldnn: no such kernel")
    assert isinstance(model.layers[0].mlp.down_proj, nn.Linear) and model.head is None
    assert EngineExecutor(runner).graph_summary()["linear_error"] == runner.linear_error


def test_torch_kernels_are_todays_path():
    model = tiny_model()
    runner = ModelRunner(model, 64, cpu_kernels="torch")
    assert (runner.linear, runner.linear_error, runner.decode_kernel_error) == ("torch", None, None)
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear) and model.head is None
    assert runner.attention.kernel is None
    assert (runner.kernels.name, runner.kernels_error) == ("torch", None)


def test_an_unknown_cpu_kernels_value_names_the_key_and_the_choices():
    with pytest.raises(BadInput, match=r"^engine.cpu_kernels must be one of native, torch; "
                                       r"got 'fast'$"):
        EngineConfig.from_config({"engine": {"cpu_kernels": "fast"}})
    with pytest.raises(ValueError, match="cpu_kernels must be one of native, torch"):
        ModelRunner(tiny_model(), 64, cpu_kernels="fast")


def test_decode_helper_reads_the_in_place_plan():
    """`decode` (plain decode of one query per request) through the kernel's flat plan."""
    kernel, _ = cpu_attention.load_kernel()
    backend = make_attention("torch", 1, kernel=kernel)
    meta = decode_meta([3, 4], slots=20)
    part = backend.plan_part(meta.kv, meta.table)
    kb, vb = torch.ones(21, 1, 16), torch.arange(21.0)[:, None, None].expand(21, 1, 16).clone()
    out = decode(backend, torch.zeros(2, 1, 16), kb, vb, part, 1.0)  # equal scores: the mean
    slots = meta.kv.indices(meta.table)
    torch.testing.assert_close(out[:, 0, 0], torch.stack([slots[:3].float().mean(),
                                                          slots[3:].float().mean()]))


def test_a_prepared_model_copies_and_moves_with_its_packed_weights_renewed():
    model = tiny_model()
    x = torch.randn(3, 64)
    ModelRunner(model, 64)
    with torch.inference_mode():
        want = model.layers[0].mlp.gate_up_proj(x)
        copied = copy.deepcopy(model)
        torch.testing.assert_close(copied.layers[0].mlp.gate_up_proj(x), want)
        assert copied.head.weight is copied.embed_tokens.weight or copied.lm_head is not None
        copied.layers[0].mlp.gate_up_proj.weight.mul_(2)  # the copy's own weights
        torch.testing.assert_close(model.layers[0].mlp.gate_up_proj(x), want)
        wide = model.to(torch.float64)  # oneDNN takes no fp64: torch's linear on the new weights
        assert wide.layers[0].mlp.gate_up_proj.packed is None
        torch.testing.assert_close(wide.layers[0].mlp.gate_up_proj(x.double()), want.double(),
                                   atol=1e-5, rtol=1e-5)
