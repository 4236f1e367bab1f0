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
HF tensor fills.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from testbed.engine.attention import AttentionBackend
    from testbed.engine.metadata import AttentionMetadata
    from testbed.engine.kv_cache import KVCache

#: HF ``model_type``s this file implements (architecture-wise they are one model).
MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants the model needs, read from a `transformers` config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)  # {} or HF's, with "rope_type"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias (Qwen2 has none on o_proj)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral v0.1: sequences longer than this are refused
    eos_token_ids: tuple[int, ...] = ()  # config.json's eos_token_id: ends a generated request

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling type must be one of {', '.join(ROPE_TYPES)}; "
                             f"got {rope_type!r}")

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Read a `LlamaConfig`, `MistralConfig` or `Qwen2Config` (transformers 4.x or 5.x)."""
        model_type = getattr(hf, "model_type", "llama")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)}; got {model_type!r}")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {act!r}")
        heads = hf.num_attention_heads
        theta, scaling = _rope_settings(hf)
        bias = bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bias or model_type == "qwen2",
            o_bias=bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            sliding_window=window,
            eos_token_ids=_token_ids(getattr(hf, "eos_token_id", None)),
        )


def _token_ids(value: Any) -> tuple[int, ...]:
    """An HF ``*_token_id`` (None, an int or a list of ints) as a tuple."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, (list, tuple)) else (int(value),)


def _rope_settings(hf: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) from ``rope_parameters`` (transformers 5) or ``rope_theta`` +
    ``rope_scaling`` (transformers 4); ``scaling`` is {} for plain RoPE."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        theta = params["rope_theta"]
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = getattr(hf, "rope_theta", 10000.0)
        scaling = dict(getattr(hf, "rope_scaling", None) or {})
    if "type" in scaling and "rope_type" not in scaling:  # the older spelling
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("rope partial_rotary_factor != 1 is not supported")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return float(theta), scaling


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
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


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.qkv_bias,
                                  **factory)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=c.o_bias, **factory)
        self.sm_scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = attention.forward(q, k, v, k_buf, v_buf, meta, self.sm_scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.intermediate_size = c.intermediate_size
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias,
                                      **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = Attention(c, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = MLP(c, **factory)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                v_buf: torch.Tensor, meta: AttentionMetadata,
                attention: AttentionBackend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_buf, v_buf, meta, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
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

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for ``positions [T]`` (computed once per step)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, attention: AttentionBackend) -> torch.Tensor:
        """Logits ``[batch, vocab]`` of each request's last new token.

        ``input_ids``, ``positions``: ``[T]``, the step's new tokens of every request in batch
        order; ``meta`` says which KV slots each request reads and where the new K/V go.
        """
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache.k[i], kv_cache.v[i], meta, attention)
        h = self.norm(h[meta.last_token_index])
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight)
