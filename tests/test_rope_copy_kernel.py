"""The Triton KV copy with RoPE re-rotation (`radix_kernels.copy_kv_rotated`) against its torch
reference and against the engine's torch path (`testbed.engine.rope_shift.copy_kv`), in the Triton
interpreter (``TRITON_INTERPRET=1``, set in ``tests/conftest.py``) or, with it off, on CUDA.
Tolerances as in ``tests/test_kernels.py``: fp32 1e-5 (one rotation), fp16 2e-3."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit kernel is defined

import importlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import radix_kernels  # noqa: E402
from radix_kernels import reference as ref  # noqa: E402


def _kernel():
    """(copy function, device) or a reason to skip."""
    if not radix_kernels.triton_available():
        return None, None, "triton is not installed"
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    interpret = bool(triton.knobs.runtime.interpret)
    if isinstance(tl.cdiv, InterpretedFunction) != interpret:
        return None, None, "triton was imported before TRITON_INTERPRET=1 was set"
    mod = importlib.import_module("radix_kernels.rope_copy")
    if isinstance(mod._copy_kv_rotated_kernel, InterpretedFunction) != interpret:
        mod = importlib.reload(mod)
    if not interpret and not torch.cuda.is_available():
        return None, None, "TRITON_INTERPRET is off and there is no CUDA device"
    return mod.copy_kv_rotated, "cpu" if interpret else "cuda", None


COPY, DEVICE, SKIP = _kernel()
pytestmark = pytest.mark.skipif(SKIP is not None, reason=str(SKIP))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def inv_freq(head_dim: int) -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_heads, head_dim", [(2, 16), (3, 64), (1, 128)])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_kernel_equals_the_reference(dtype, kv_heads, head_dim, in_place):
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    shape = (40, kv_heads, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    src = torch.tensor([3, 9, 1, 17, 25, 4], device=DEVICE)
    dst = src.clone() if in_place else torch.tensor([30, 2, 33, 5, 39, 11], device=DEVICE)
    shift = torch.tensor([0, 7, -5, 1000, -300, 64], device=DEVICE)
    want = (k.clone(), v.clone())
    ref.copy_kv_rotated(*want, src, dst, shift, inv_freq(head_dim))
    COPY(k, v, src, dst, shift, inv_freq(head_dim))
    torch.testing.assert_close(k, want[0], rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.equal(v, want[1])
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[dst.cpu()] = False
    assert torch.equal(k[untouched.to(DEVICE)], want[0][untouched.to(DEVICE)])


def test_the_engines_copy_with_the_kernel_equals_its_torch_path():
    from testbed.engine.kv_cache import KVCache
    from testbed.engine.rope_shift import copy_kv

    gen = torch.Generator().manual_seed(0)
    caches = [KVCache(3, 30, 2, 16, device=DEVICE) for _ in range(2)]
    for layer in range(3):
        k, v = (torch.randn(caches[0].k[layer].shape, generator=gen).to(DEVICE) for _ in "kv")
        for c in caches:  # both alike
            c.k[layer].copy_(k)
            c.v[layer].copy_(v)
    src, dst = np.arange(1, 9), np.arange(20, 28)
    for use_triton, cache in zip((False, True), caches):
        copy_kv(cache, src, dst, -6, inv_freq(16), use_triton=use_triton)
        copy_kv(cache, dst[:3], dst[:3], np.array([2, 0, 9]), inv_freq(16), use_triton=use_triton)
    for layer in range(3):
        torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[1].v[layer], caches[0].v[layer])


def test_a_copy_whose_destinations_are_other_tokens_sources_takes_the_torch_path():
    from testbed.engine.kv_cache import KVCache
    from testbed.engine.rope_shift import copy_kv

    gen = torch.Generator().manual_seed(1)
    caches = [KVCache(1, 20, 2, 16, device=DEVICE) for _ in range(2)]
    k, v = (torch.randn(caches[0].k[0].shape, generator=gen).to(DEVICE) for _ in "kv")
    for c in caches:
        c.k[0].copy_(k)
        c.v[0].copy_(v)
    for use_triton, cache in zip((False, True), caches):  # 1..8 -> 5..12: 5..8 are both
        copy_kv(cache, np.arange(1, 9), np.arange(5, 13), 4, inv_freq(16), use_triton=use_triton)
    assert torch.equal(caches[1].k[0], caches[0].k[0])
    assert torch.equal(caches[1].v[0][5:13], v[1:9])


@pytest.mark.skipif(DEVICE != "cpu", reason="the tiny CPU model")
def test_a_blend_prefill_under_the_triton_backend_recomputing_everything_is_exact():
    """The runner with ``attention=triton`` (extend kernel for the donors and the exact run, the
    copy kernel for the donor load, torch attention inside the blend)."""
    from testbed.engine.runner import ModelRunner
    from tests.blend_helpers import make_req, moved_docs, prefill, rag_prompt, tiny_model

    model = tiny_model(layers=3)
    runner = ModelRunner(model, 200, attention="triton")
    assert runner.triton_copies
    prompt, starts = rag_prompt(doc_len=10)
    n = len(prompt)
    exact = prefill(runner, make_req("exact", prompt, np.arange(1, n + 1)))
    spans = moved_docs(runner, prompt, starts, recompute=10)
    logits = prefill(runner, make_req("r", prompt, np.arange(150, 150 + n)), reuse=spans)
    torch.testing.assert_close(logits, exact, rtol=0, atol=1e-4)
