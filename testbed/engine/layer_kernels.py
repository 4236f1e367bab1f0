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

`TORCH_KERNELS` are their torch references (`radix_kernels.reference`: a few torch ops each, the
CPU's); `triton_kernels()` the Triton kernels of `radix_kernels` (one launch each), which compute
the same roundings (docs/design.md §4 "Decoder-layer kernels"). The runner picks the family
of its attention backend (`kernels_for`): Triton with ``triton`` attention, torch otherwise.
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


def kernels_for(attention_name: str) -> LayerKernels:
    """The layer kernels that go with an attention backend (its ``name``)."""
    return triton_kernels() if attention_name == "triton" else TORCH_KERNELS
