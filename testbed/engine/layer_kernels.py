"""The decoder layer's fused elementwise steps, in two implementations of one contract.

A decode layer is bound by how many kernels it launches, not by their arithmetic, so the steps
between the matmuls are fused (vLLM's and SGLang's layer shape):

- ``add_rmsnorm(x, residual, weight, eps) -> (out, residual)``: the residual stream gains ``x``
  (none at the first layer: the stream starts as ``x``), then HF Llama's RMSNorm of it (fp32
  inside, cast to the activations' dtype, times the weight in that dtype);
- ``silu_and_mul(gate_up) -> out``: ``silu(gate) * up`` of the fused gate-up projection;
- ``rope_store(qkv, cos, sin, slots, k_buf, v_buf, num_heads, num_kv_heads) -> q``: RoPE on the
  fused QKV projection's queries and keys, the keys and values written into the layer's KV
  buffers at ``slots``, the rotated queries returned ``[T, heads, dim]``.

`TORCH_KERNELS` are their torch references (`radix_kernels.reference`: a few torch ops each);
`triton_kernels()` the Triton kernels of `radix_kernels` (one launch each), which compute
the same roundings (docs/design.md §4 "Decoder-layer kernels"); on the CPU in fp32 the C
functions of `testbed.engine.cpu_layers` (one call each, ``engine.cpu_kernels=native``). The
runner picks the family of its attention backend and device (`kernels_for`): Triton with
``triton`` attention, the native family on the CPU where asked for, torch otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from radix_kernels import reference


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``x * cos + rotate_half(x) * sin`` for ``x [T, heads, D]``, with ``sin`` given
    sign-folded (`testbed.engine.model.rope_tables`): ``rotate_half(x) * sin`` is
    ``roll(x, D/2) * [-sin, sin]``, the same products (a sign flip is exact), in two ops
    instead of four."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


@dataclass(frozen=True)
class LayerKernels:
    name: str
    add_rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_store: Callable[..., torch.Tensor]


TORCH_KERNELS = LayerKernels("torch", reference.fused_add_rmsnorm, reference.silu_and_mul,
                             reference.rope_store_kv)


def triton_kernels() -> LayerKernels:
    import radix_kernels

    return LayerKernels("triton", radix_kernels.fused_add_rmsnorm, radix_kernels.silu_and_mul,
                        radix_kernels.rope_store_kv)


def kernels_for(attention_name: str, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[LayerKernels, str | None]:
    """The layer kernels that go with an attention backend (its ``name``), and why not the
    Triton ones where they were meant but failed a smoke test on ``device`` in ``dtype`` (a
    Triton release that cannot compile one, say): then the torch references run instead, and
    the reason is reported (a slower engine, never a wrong one). The CPU's native family is
    `testbed.engine.cpu_layers.native_or_torch`'s."""
    if attention_name != "triton":
        return TORCH_KERNELS, None
    kernels = triton_kernels()
    try:
        smoke_test(kernels, torch.device(device), dtype)
    except Exception as e:  # noqa: BLE001 - any failure means: not these kernels here
        return TORCH_KERNELS, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return kernels, None


def smoke_test(kernels: LayerKernels, device: torch.device, dtype: torch.dtype) -> None:
    """Each kernel once on a small step (4 tokens, 2 query heads per KV head, head_dim 16),
    against its torch reference within the dtype's rounding."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    t, heads, kv_heads, dim = 4, 4, 2, 16
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    x, residual, weight = rand(t, 64), rand(t, 64), rand(64)
    for got, want in zip(kernels.add_rmsnorm(x, residual, weight, 1e-6),
                         TORCH_KERNELS.add_rmsnorm(x, residual, weight, 1e-6)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    gate_up = rand(t, 64)
    torch.testing.assert_close(kernels.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up),
                               atol=tol, rtol=tol)
    qkv = rand(t, (heads + 2 * kv_heads) * dim)
    cos, sin = rand(t, 1, dim), rand(t, 1, dim)
    slots = torch.tensor([3, 1, 4, 2], device=device)
    bufs = [torch.zeros(6, kv_heads, dim, dtype=dtype, device=device) for _ in range(4)]
    q = kernels.rope_store(qkv, cos, sin, slots, bufs[0], bufs[1], heads, kv_heads)
    want = TORCH_KERNELS.rope_store(qkv, cos, sin, slots, bufs[2], bufs[3], heads, kv_heads)
    torch.testing.assert_close(q, want, atol=tol, rtol=tol)
    torch.testing.assert_close(bufs[0], bufs[2], atol=tol, rtol=tol)
