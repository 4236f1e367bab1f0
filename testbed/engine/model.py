"""A Llama-family decoder over a flattened batch (Llama 2/3, Mistral, Qwen2).

One readable file of native PyTorch (gpt-fast's style). The forward pass takes the step's new
tokens of every request concatenated (``input_ids [T]``, ``positions [T]``) and the step's
`AttentionMetadata`, built once per step by the `ModelRunner` and handed to every layer; the
attention backend writes each layer's new K/V into the KV buffers at ``meta.out_slots`` and
attends over each request's slots. Only the last new token of each request reaches the LM head,
so the result is ``[batch, vocab]``.

Numerics follow HF transformers' Llama: RMSNorm in fp32 then cast, RoPE in the ``rotate_half``
convention with cos/sin cast to the activations' dtype, GQA with query head ``h`` reading KV head
``h // (num_heads // num_kv_heads)``, SwiGLU MLP. Q/K/V and gate/up projections are fused
(``qkv_proj``, ``gate_up_proj``, as in vLLM); `loader.weight_table` says which rows of them each
HF tensor fills; on the CPU `testbed.engine.linear` swaps the linear layers for ones whose
weights oneDNN prepared once. Between the matmuls the layer runs fused steps
(`testbed.engine.layer_kernels`: add + RMSNorm, RoPE + KV store, SiLU-and-mul), Triton kernels
on a GPU and torch ops elsewhere, with the same roundings as HF's unfused ops. Shapes and constants come from a `testbed.config.model_shape.ModelShape`
(`ModelShape.from_hf` reads a checkpoint's `transformers` config).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radix_kernels.reference import fused_add_rmsnorm
from testbed.engine.layer_kernels import TORCH_KERNELS, LayerKernels, apply_rope
from testbed.config.model_shape import ModelShape

if TYPE_CHECKING:
    from testbed.engine.attention import AttentionBackend
    from testbed.engine.metadata import AttentionMetadata
    from testbed.engine.kv_cache import KVCache


def rope_inv_freq(config: ModelShape) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (fp32), with HF's "linear" or "llama3" scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    s = config.rope_scaling
    rope_type = s.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / s["factor"]
    if rope_type == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth band between
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[T, 1, head_dim]`` for (possibly negative or fractional)
    ``positions [T]``: ``cos(θ)`` twice, and ``[-sin(θ), sin(θ)]`` for `apply_rope`."""
    freqs = (positions.float()[:, None] * inv_freq[None, :].to(positions.device))[:, None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_add_rmsnorm(x, None, self.weight, self.eps)[0]


class Attention(nn.Module):
    def __init__(self, c: ModelShape, **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias,
                                  **factory)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_bias, **factory)
        self.sm_scale = c.head_dim ** -0.5

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, heads, dim]``, k, v ``[T, kv_heads, dim]`` of ``x [T, hidden]``, q and k rotated
        (RoPE) by ``cos``, sign-folded ``sin`` of their positions (`rope`)."""
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # queries and keys take the same rotation: one pass over both heads' runs
        qk = apply_rope(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata, attention: AttentionBackend,
                kernels: LayerKernels) -> torch.Tensor:
        """The projections, RoPE and the KV store (one fused step), attention, the output
        projection."""
        q = kernels.rope_store(self.qkv_proj(x), cos, sin, meta.out_slots, k_buf, v_buf,
                               self.num_heads, self.num_kv_heads)
        o = attention.forward(q, k_buf, v_buf, meta, self.sm_scale)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelShape, **factory: Any) -> None:
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias,
                                      **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, **factory)

    def forward(self, x: torch.Tensor, kernels: LayerKernels = TORCH_KERNELS) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelShape, **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = Attention(c, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = MLP(c, **factory)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                meta: AttentionMetadata, attention: AttentionBackend, kernels: LayerKernels
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the previous layer's output, not yet added to the ``residual`` stream (None at
        the first layer, whose input is the embedding): vLLM's layer shape, where each norm
        adds what came before it. Returns this layer's MLP output and the stream."""
        x, residual = kernels.add_rmsnorm(h, residual, self.input_layernorm.weight,
                                          self.input_layernorm.eps)
        h = self.self_attn(x, cos, sin, k_buf, v_buf, meta, attention, kernels)
        x, residual = kernels.add_rmsnorm(h, residual, self.post_attention_layernorm.weight,
                                          self.post_attention_layernorm.eps)
        return self.mlp(x, kernels), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelShape, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = c = config
        factory = {"dtype": dtype, "device": device}
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(c, **factory) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.lm_head = (None if c.tie_word_embeddings else
                        nn.Linear(c.hidden_size, c.vocab_size, bias=False, **factory))
        self.inv_freq = rope_inv_freq(c)  # fp32 always (not a buffer: `.to(bf16)` leaves it alone)
        # the LM head's weight prepared for the CPU's matmul (`testbed.engine.linear`); None:
        # torch's linear on the embedding (tied) or lm_head weight
        self.head: nn.Module | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope_tables` of ``positions [T]`` (once per step)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        return rope_tables(positions, self.inv_freq, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, attention: AttentionBackend,
                kernels: LayerKernels = TORCH_KERNELS, num_layers: int | None = None
                ) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of each request's last new token.

        ``input_ids``, ``positions``: ``[T]``, the step's new tokens of every request in batch
        order; ``meta`` says which KV slots each request reads and where the new K/V go;
        ``kernels``: the fused layer steps (`testbed.engine.layer_kernels`). ``num_layers``:
        only the first that many layers, then the final norm and the LM head (a self-speculative
        draft model, `testbed.engine.draft_model`; None: all).
        """
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers[:num_layers]):
            h, residual = layer(h, residual, cos, sin, kv_cache.k[i], kv_cache.v[i], meta,
                                attention, kernels)
        if meta.last_token_index is not None:  # a prefill: only each request's last token
            h, residual = h[meta.last_token_index], residual[meta.last_token_index]
        h, _ = kernels.add_rmsnorm(h, residual, self.norm.weight, self.norm.eps)
        return self.lm_head_of(h)

    def lm_head_of(self, h: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(h)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and the LM head: logits ``[n, vocab]`` of hidden states ``[n, hidden]``
        (the model's last step, for callers that run the layers themselves: the blend prefill)."""
        return self.lm_head_of(self.norm(h))
