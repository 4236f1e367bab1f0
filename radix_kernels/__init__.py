"""Triton kernels for the engine (extend/prefill and decode attention over paged KV, KV store,
and the decoder layer's fused norm, activation and RoPE).

Named ``radix_kernels``: the bare name ``kernels`` is a different PyPI package that transformers
requires and imports, which a folder of that name at the repository root would shadow.

Public API (Triton; imported lazily on first use, so ``import radix_kernels`` never needs
Triton):

- ``store_kv(k_buf, v_buf, slots, k, v)``
- ``extend_attention(q, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, sm_scale=None, ...)``
- ``decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, sm_scale=None, ...)``
- ``merge_states(o_a, lse_a, o_b, lse_b) -> (o, lse)``
- ``cascade_decode_attention(q, k_buf, v_buf, suffix_indptr, suffix_indices, prefix_indptr,
  prefix_indices, gather, places, grouped, ...)`` (cascade decoding in two launches: both passes
  in one grid, the merge in the split-KV reduction)
- ``copy_kv_rotated(k_buf, v_buf, src, dst, shift, inv_freq)`` (KV moved to other positions,
  keys re-rotated: RoPE)
- ``fused_add_rmsnorm(x, residual, weight, eps) -> (out, residual_out)`` (residual add and
  RMSNorm; ``residual=None`` in the first layer)
- ``silu_and_mul(gate_up) -> out`` (SwiGLU's ``silu(gate) * up``)
- ``rope_store_kv(qkv, cos, sin, out_slots, k_buf, v_buf, num_heads, num_kv_heads) -> q`` (RoPE
  on the fused projection's q and k, k and v stored)

``radix_kernels.reference`` holds the torch references with the same signatures (torch only);
``triton_available()`` says whether the Triton versions can be imported here. Kernel modules:
``store``, ``extend``, ``decode``, ``merge``, ``cascade``, ``rope_copy``, ``norm``, ``activation``,
``rope_store`` (named apart from the functions so that importing a module never shadows the
function of the same name on the package). On a GPU machine,
``python -m radix_kernels.gpu_check --out FILE.json`` checks model-sized shapes and times them.
"""

from __future__ import annotations

import importlib

from . import reference

__all__ = ["store_kv", "extend_attention", "decode_attention", "merge_states",
           "cascade_decode_attention", "copy_kv_rotated",
           "fused_add_rmsnorm", "silu_and_mul", "rope_store_kv", "reference", "triton_available"]

_LAZY = {
    "store_kv": "store",
    "extend_attention": "extend",
    "decode_attention": "decode",
    "merge_states": "merge",
    "cascade_decode_attention": "cascade",
    "copy_kv_rotated": "rope_copy",
    "fused_add_rmsnorm": "norm",
    "silu_and_mul": "activation",
    "rope_store_kv": "rope_store",
}


def triton_available() -> bool:
    """Whether Triton imports here (it does not on macOS, for example)."""
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else
        return False
    return True


def __getattr__(name: str):
    """Import a Triton kernel module on first access of its public function (PEP 562)."""
    if name in _LAZY:
        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ImportError as e:  # AttributeError keeps hasattr() usable as a capability probe
            raise AttributeError(f"radix_kernels.{name} needs Triton, which did not import "
                                 f"({e}); radix_kernels.reference has torch versions") from e
        fn = getattr(module, name)
        globals()[name] = fn
        return fn
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
