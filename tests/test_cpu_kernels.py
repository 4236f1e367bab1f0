"""The engine's CPU kernels (issue 46): oneDNN linear layers on weights prepared once, and the
decode attention that reads the KV pool in place (a C kernel built once); each equals what it
replaces, and where it cannot run the engine falls back to torch's and says why."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from experiments.benchmarks.decode_batches import decode_batch
from testbed.engine import cpu_attention, linear
from testbed.engine.attention import decode, make_attention
from testbed.engine.executor import EngineExecutor
from testbed.engine.loader import build_model, tiny_config
from testbed.engine.metadata import AttentionMetadata
from testbed.engine.model import LlamaModel
from testbed.engine.runner import ModelRunner
from testbed.engine_config import EngineConfig
from testbed.errors import BadInput

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


def test_the_kernel_is_built_once_into_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cpu_attention.build()
    assert first.parent == tmp_path / "radix-testbed" / "kernels" and first.exists()
    built = first.stat().st_mtime_ns
    assert cpu_attention.build() == first and first.stat().st_mtime_ns == built
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no build leftovers


def test_loading_the_kernel_leaves_the_processs_subnormal_floats_alone(tmp_path, monkeypatch):
    # a -ffast-math link would turn on flush-to-zero for the whole process when it loads
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu_attention.DecodeKernel(cpu_attention.build())
    tiny = float(np.finfo(np.float64).tiny)
    assert tiny / 4 > 0.0 and np.float32(np.finfo(np.float32).tiny) / np.float32(4) > 0


def test_without_a_compiler_the_engine_gathers_and_says_why(monkeypatch):
    def no_compiler():
        raise RuntimeError("no C compiler (cc, gcc or $CC) on the PATH")

    monkeypatch.setattr(cpu_attention, "compiler", no_compiler)
    monkeypatch.setattr(cpu_attention, "kernel_dir", lambda: cpu_attention.Path("/nonexistent"))
    cpu_attention.load_kernel.cache_clear()
    try:
        runner = ModelRunner(tiny_model(), 64, attention="cascade")
    finally:
        cpu_attention.load_kernel.cache_clear()
    assert runner.attention.kernel is None
    assert runner.decode_kernel_error == "RuntimeError: no C compiler (cc, gcc or $CC) on the PATH"
    summary = EngineExecutor(runner).graph_summary()
    assert summary["decode_kernel_error"] == runner.decode_kernel_error
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


def test_an_unknown_cpu_kernels_value_names_the_key_and_the_choices():
    with pytest.raises(BadInput, match=r"^engine.cpu_kernels must be one of native, torch, "
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
