"""One model's shape, shared by the engine and the simulator.

A `ModelShape` is a Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP)
run with tensor parallelism ``tp``: its shapes, the element size of its weights and KV, and the
constants the engine needs to run it (norm epsilon, RoPE base and scaling, biases, tied
embeddings, sliding window, EOS tokens). The engine builds its model from one (`from_hf`, a
checkpoint's `transformers` config); the simulator prices steps and sizes the KV pool from one
(`from_group`, the ``model`` config group, which `testbed.sim.specs.model_spec` calls). Every
invalid shape is refused on construction with one line naming the ``model.`` key.

No torch here: simulator runs import this without the engine's dependencies.

>>> m = ModelShape("llama3_70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
...                head_dim=128, intermediate_size=28672, vocab_size=128256, tp=4)
>>> m.kv_bytes_per_token // 1024, m.kv_bytes_per_token_per_gpu // 1024
(320, 80)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from testbed.config import group_values
from testbed.errors import BadInput, check_choice
from testbed.config.model_group import DTYPE_BYTES, SUPPORTED_MODEL_TYPES

#: RoPE variants the engine implements (``rope_scaling["rope_type"]``; HF's names)
ROPE_TYPES = ("default", "linear", "llama3")

#: the integer shape fields, each >= 1
SHAPE_INTS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder's shape and constants. ``dtype_bytes`` is the size of one weight /
    KV element (2 for bf16/fp16); ``tp`` is the tensor-parallel degree (heads and weights split
    over ``tp`` GPUs; each rank holds ``num_kv_heads / tp`` KV heads, or one replicated head if
    fewer). The fields after ``tp`` are the engine's and default to plain Llama's."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {} or HF's, with "rope_type"; left out of the hash so that a shape can key a dict
    rope_scaling: dict[str, Any] = field(default_factory=dict, hash=False)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias (Qwen2 has none on o_proj)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral v0.1: sequences longer than this are refused
    eos_token_ids: tuple[int, ...] = ()  # config.json's eos_token_id: ends a generated request

    def __post_init__(self) -> None:
        for key in (*SHAPE_INTS, "tp"):
            if getattr(self, key) < 1:
                raise BadInput(f"model.{key} must be >= 1, got {getattr(self, key)}")
        check_choice("model.dtype_bytes", self.dtype_bytes, (1, 2, 4))
        heads, kv_heads, tp = self.num_heads, self.num_kv_heads, self.tp
        if heads % kv_heads:
            raise BadInput(f"model.num_heads ({heads}) must be a multiple of model.num_kv_heads "
                           f"({kv_heads})")
        if heads % tp:
            raise BadInput(f"model.tp must divide model.num_heads ({heads}), got {tp}")
        if kv_heads % tp and tp % kv_heads:
            raise BadInput(f"model.tp must divide model.num_kv_heads ({kv_heads}) or be a "
                           f"multiple of it, got {tp}")
        if self.head_dim % 2:  # RoPE rotates pairs of dimensions
            raise BadInput(f"model.head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        check_choice("model.rope_scaling type", rope_type, ROPE_TYPES)

    # ---- what the simulator prices: parameters, FLOPs and bytes ----

    @property
    def layer_linear_params(self) -> int:
        """Matmul weights of one layer: q, k, v, o projections and the SwiGLU gate, up, down."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    @property
    def linear_params(self) -> int:
        """Parameters multiplied per token: every layer's matmuls plus the LM head (not the
        embedding table, which is a gather)."""
        return self.num_layers * self.layer_linear_params + self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """All parameters: matmuls, embedding table and RMSNorm weights (two per layer and a
        final one). The embedding table is counted apart from the LM head even when
        ``tie_word_embeddings`` (the simulator's weight budget always has)."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.linear_params + self.vocab_size * self.hidden_size + norms

    @property
    def weight_bytes_per_gpu(self) -> int:
        """Bytes of weights each tensor-parallel rank holds (all of them split evenly over tp)."""
        return self.params * self.dtype_bytes // self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across the whole model (all layers, all ranks)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads on one rank: ``num_kv_heads / tp``, or 1 (replicated) when tp exceeds them."""
        return max(1, self.num_kv_heads // self.tp)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """Bytes of K and V one token occupies on each rank (the KV pool is per rank)."""
        return 2 * self.num_layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    # ---- constructors ----

    @classmethod
    def from_group(cls, cfg: Mapping[str, Any]) -> ModelShape:
        """The shape the ``model`` config group (``conf/model/*.yaml``) states: name, shapes,
        ``dtype_bytes`` (default 2) and ``tp`` (default 1). Other keys (``path``, RoPE and norm
        constants) are the engine's, which reads them from the checkpoint or through
        `testbed.engine.loader.config_from_model_group`; here they keep their defaults."""
        g = "model"
        ints = {key: group_values.integer(cfg, key, g, minimum=1) for key in SHAPE_INTS}
        dtype_bytes = group_values.integer(cfg, "dtype_bytes", g, minimum=1, default=2)
        tp = group_values.integer(cfg, "tp", g, minimum=1, default=1)
        return cls(name=group_values.name(cfg, g), dtype_bytes=dtype_bytes, tp=tp, **ints)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        """Read a `LlamaConfig`, `MistralConfig` or `Qwen2Config` (transformers 4.x or 5.x); the
        name is the checkpoint directory's (else the ``model_type``), ``tp`` is 1."""
        model_type = getattr(hf, "model_type", "llama")
        check_choice("model.path: config.json's model_type", model_type, SUPPORTED_MODEL_TYPES)
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise BadInput(f"model.path: config.json's hidden_act must be 'silu' (SwiGLU), "
                           f"got {act!r}")
        heads = hf.num_attention_heads
        theta, scaling = _rope_settings(hf)
        bias = bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None  # Qwen2 states a window it does not use unless told to
        return cls(
            name=Path(getattr(hf, "name_or_path", "") or "").name or model_type,
            num_layers=hf.num_hidden_layers,
            hidden_size=hf.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            intermediate_size=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            dtype_bytes=_dtype_bytes(hf),
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


def _dtype_bytes(hf: Any) -> int:
    """Bytes of the checkpoint's stored dtype (2 when it names none)."""
    # transformers 5 calls it ``dtype``; 4.x's ``torch_dtype`` is read from the instance's own
    # attributes, as 5's property of that name warns that it is deprecated
    dtype = getattr(hf, "dtype", None) or vars(hf).get("torch_dtype")
    return DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)


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
        raise BadInput("model.path: config.json's rope partial_rotary_factor must be 1 (a "
                       "partial rotation is not supported)")
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    return float(theta), scaling
